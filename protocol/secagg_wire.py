"""Board posts <-> secure-averaging values (specs/secure-averaging.md E.2).

The ledger's board carries hex JSON messages (protocol/messages.py); the
masking library works on bytes and dataclasses (aggregation/secure). These
conversions are shared by the worker, which builds the posts, and the
validators, which parse them back.
"""

from __future__ import annotations

from veritrain.aggregation.secure import (
    BucketContext,
    KeyAdvertisement,
    SealedShares,
    SecureAggregationError,
    Share,
    ShareCommitments,
    ShareReveal,
    WorkerSecrets,
)

from .messages import RunSpec, SecaggDeal, SecaggKeys, SecaggReveal, SecaggView
from .secagg import bucket_threshold


def bucket_context(spec: RunSpec, r: int, index: int, members: list[str],
                   assigned: int) -> BucketContext:
    """The BucketContext of a bucket dealt ``assigned`` workers whose advertisers are
    ``members`` (hex, ascending, at least k of them): Shamir threshold k of
    :func:`bucket_threshold` over the assigned count, whoever advertised."""
    masked = spec.masked
    assert masked is not None
    k = bucket_threshold(masked["max_dropouts"], assigned)
    if len(members) < k:
        raise SecureAggregationError(f"{len(members)} members, fewer than the bucket's k = {k}")
    return BucketContext(spec.run_id, r, index, tuple(bytes.fromhex(w) for w in members),
                         len(members) - k, spec.num_params, float(masked["clip_norm"]))


def view_message(spec: RunSpec, r: int, bucket: int, worker: str, members: list[str],
                 dealers: list[str], survivors: list[str]) -> SecaggView:
    return SecaggView(run_id=spec.run_id, round=r, bucket=bucket, worker=worker,
                      members=list(members), dealers=list(dealers), survivors=list(survivors))


def advert_of(msg: SecaggKeys) -> KeyAdvertisement:
    return KeyAdvertisement(bytes.fromhex(msg.worker), bytes.fromhex(msg.enc_public),
                            bytes.fromhex(msg.mask_public))


def commitments_of(msg: SecaggDeal) -> ShareCommitments:
    return ShareCommitments(bytes.fromhex(msg.dealer), bytes.fromhex(msg.seed_commitment),
                            tuple(bytes.fromhex(c) for c in msg.seed_share_commitments),
                            tuple(bytes.fromhex(c) for c in msg.key_share_commitments))


def reveal_of(ctx: BucketContext, msg: SecaggReveal) -> ShareReveal:
    """A reveal post as ``ShareReveal``; every share at the holder's x-coordinate."""
    x = ctx.index_of(bytes.fromhex(msg.holder))

    def items(rows: list[dict[str, str]]) -> tuple[tuple[bytes, Share, bytes], ...]:
        return tuple((bytes.fromhex(it["dealer"]), Share.from_bytes(x, bytes.fromhex(it["share"])),
                      bytes.fromhex(it["salt"])) for it in rows)

    return ShareReveal(bytes.fromhex(msg.holder), items(msg.seed_shares), items(msg.key_shares))


def sealed_for(msg: SecaggDeal, holder: str) -> SealedShares | None:
    """The shares a deal seals to ``holder``, if any."""
    for item in msg.sealed:
        if item["holder"] == holder:
            return SealedShares(bytes.fromhex(msg.dealer), bytes.fromhex(holder),
                                bytes.fromhex(item["ciphertext"]))
    return None


def keys_message(spec: RunSpec, r: int, bucket: int, secrets: WorkerSecrets) -> SecaggKeys:
    ad = secrets.advertisement()
    return SecaggKeys(run_id=spec.run_id, round=r, bucket=bucket, worker=ad.worker.hex(),
                      enc_public=ad.enc_public.hex(), mask_public=ad.mask_public.hex())


def deal_message(spec: RunSpec, ctx: BucketContext, commitments: ShareCommitments,
                 sealed: dict[bytes, SealedShares]) -> SecaggDeal:
    return SecaggDeal(
        run_id=spec.run_id, round=ctx.round_index, bucket=ctx.bucket,
        dealer=commitments.dealer.hex(), seed_commitment=commitments.seed_commitment.hex(),
        seed_share_commitments=[c.hex() for c in commitments.seed_share_commitments],
        key_share_commitments=[c.hex() for c in commitments.key_share_commitments],
        sealed=[{"holder": h.hex(), "ciphertext": sealed[h].ciphertext.hex()}
                for h in ctx.members])


def reveal_message(spec: RunSpec, ctx: BucketContext, reveal: ShareReveal,
                   view: SecaggView, signatures: list[dict[str, str]]) -> SecaggReveal:
    """A reveal for the signed ``view``, carrying the ``signatures`` it relied on."""
    def items(rows: tuple[tuple[bytes, Share, bytes], ...]) -> list[dict[str, str]]:
        return [{"dealer": d.hex(), "share": sh.value_bytes().hex(), "salt": salt.hex()}
                for d, sh, salt in rows]

    return SecaggReveal(run_id=spec.run_id, round=ctx.round_index, bucket=ctx.bucket,
                        holder=reveal.holder.hex(), survivors=list(view.survivors),
                        seed_shares=items(reveal.seed_shares), key_shares=items(reveal.key_shares),
                        members=list(view.members), dealers=list(view.dealers),
                        view_signatures=list(signatures))

