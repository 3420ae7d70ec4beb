"""Hand a receipted reveal's claim to the validators, past the ledger (issue #28).

A ledger that receipts a reveal and then keeps it off its board would have the worker
judged ``missing_reveal`` (banned, its unvested rewards forfeited). So a worker hands its
signed envelope and the ledger's signed receipt (``RevealClaim``) straight to every
validator that names an inbox in the run spec; a validator holding it certifies nothing
for a round whose board does not serve that file (validators/inbox.py). The claim is
two signed messages, a few hundred bytes per validator; the file itself stays on the
ledger, which signed for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Collection

import aiohttp
from veritrain.protocol.messages import RunSpec
from veritrain.protocol.receipts import CLAIM_REFUSALS, FINAL_CLAIM_REFUSALS, RevealClaim

log = logging.getLogger("veritrain.worker")

#: Seconds a validator's inbox gets to answer one claim.
HAND_TIMEOUT_SECONDS = 10.0


async def hand_to_validators(spec: RunSpec, claim: RevealClaim, *,
                             skip: Collection[str] = (),
                             timeout: float = HAND_TIMEOUT_SECONDS) -> dict[str, str]:
    """POST ``claim`` to every validator inbox of ``spec`` at once, but those of the keys
    in ``skip`` (they hold it already, or refused it for good); what each answered, by
    validator key: ``held``, ``refused N: why`` (the inbox's own refusal, in its error
    JSON, of a reason in ``FINAL_CLAIM_REFUSALS``: asking again gets the same), or
    ``retry ...`` (anything else: 429, a 5xx, a proxy's 404 while the validator restarts,
    no answer).
    Never raises: an inbox that is down costs only that validator's copy until the
    worker tries again (workers/node.py)."""
    inboxes = {k: u for k, u in spec.validator_inboxes().items() if k not in skip}
    if not inboxes:
        return {}
    body = claim.to_wire()

    async def hand(session: aiohttp.ClientSession, key: str, url: str) -> tuple[str, str]:
        try:
            async with session.post(f"{url.rstrip('/')}/v1/runs/{spec.run_id}/reveal-receipts",
                                    json=body) as resp:
                if resp.status in (200, 201):
                    return key, "held"
                text = await resp.text()
                why = f"{resp.status}: {text[:200]}"
                return key, f"refused {why}" if _final(resp.status, text) else f"retry {why}"
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            return key, f"retry, unreachable: {exc!r}"[:200]

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        answers = dict(await asyncio.gather(*(hand(session, k, u) for k, u in inboxes.items())))
    missed = {k[:12]: a for k, a in answers.items() if a != "held"}
    if missed:
        log.warning("round %d: %d of %d validator inboxes did not take the reveal receipt: %s",
                    claim.envelope.message.round, len(missed), len(answers), missed)
    return answers


def _final(status: int, text: str) -> bool:
    """Whether an inbox's answer is its own refusal that the same claim would get again:
    its error JSON names a final reason with that reason's status."""
    try:
        body = json.loads(text)
    except ValueError:
        return False
    reason = body.get("error") if isinstance(body, dict) else None
    return (isinstance(reason, str) and reason in FINAL_CLAIM_REFUSALS
            and CLAIM_REFUSALS[reason] == status)


__all__ = ["hand_to_validators"]
