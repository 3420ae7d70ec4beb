"""Admission through a real ledger (SQLite): registrations refused without a valid ticket
or bond, with a clear reason and nothing stored; a caught cheater slashed, with its
evidence, and its replacement key refused; the audit recomputes all of it from the chain
and names a ledger-invented admission or a wrong slash."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import sqlite3
from typing import Any

import pytest
from ledger_harness import key_rate_limited, replay_from, run_api
from ledger_scenarios import (
    HONEST,
    SPOT_FAIL,
    finalize_round,
    make_store,
    quick_run,
    rechain,
    registration,
)
from veritrain.ledger import schema as t
from veritrain.ledger.audit import verify_events
from veritrain.ledger.chain import ChainRow
from veritrain.ledger.client import LedgerClient, fetch_membership
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.membership import (
    AdmissionRevocation,
    AdmissionTicket,
    BondDeposit,
    BondWithdrawal,
)
from veritrain.protocol.messages import sign

from veritrain.synthetic import synthetic_submission


def _start(tmp_path, policy):
    run = quick_run("adm-run", admission=policy)
    store = make_store(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    for data, kind in ((run.dataset, "dataset"), (run.genesis, "model")):
        store.record_blob(hashlib.sha256(data).hexdigest(), len(data), kind, "adm-run")
    store.create_run(run.signed)
    return run, store


def _participants(store) -> int:
    with store.sessions() as s:
        return s.query(t.Participant).filter_by(role="worker").count()


def _rows(path) -> list[ChainRow]:
    with sqlite3.connect(path) as conn:
        return [ChainRow(seq, "adm-run", kind, bytes(body), prev, h, sig)
                for seq, kind, body, prev, h, sig in conn.execute(
                    "SELECT e.seq, e.kind, e.body, e.prev_hash, e.hash, c.signature FROM events"
                    " e LEFT JOIN checkpoints c ON c.run_id = e.run_id AND c.seq = e.seq "
                    "WHERE e.run_id = ? ORDER BY e.seq", ("adm-run",))]


def test_allowlist_refuses_unticketed_expired_and_revoked_keys(tmp_path):
    run, store = _start(tmp_path, {"policy": "allowlist"})
    org = run.organiser
    w = Identity.generate("worker")
    with pytest.raises(RejectedInput, match="no admission ticket") as exc:
        store.register(registration(run, w))
    assert exc.value.reason == "not_admitted" and _participants(store) == 0
    # A ticket signed by the worker itself is no ticket.
    with pytest.raises(RejectedInput):
        store.post_membership(sign(w, AdmissionTicket("adm-run", 0, w.public_key.hex(),
                                                      w.public_key.hex(), 5, 1)))
    ticket = sign(org, AdmissionTicket("adm-run", 0, org.public_key.hex(), w.public_key.hex(),
                                       5, 1))
    assert store.post_membership(ticket)["new"]
    assert not store.post_membership(ticket)["new"]  # an exact resend
    assert store.register(registration(run, w))["new"]
    # Expired: a ticket for round 0 only does not admit a key registering later.
    late = Identity.generate("worker")
    store.post_membership(sign(org, AdmissionTicket("adm-run", 0, org.public_key.hex(),
                                                    late.public_key.hex(), 1, 1)))
    revoked = Identity.generate("worker")
    store.post_membership(sign(org, AdmissionTicket("adm-run", 0, org.public_key.hex(),
                                                    revoked.public_key.hex(), 9, 1)))
    store.post_membership(sign(org, AdmissionRevocation("adm-run", 0, org.public_key.hex(),
                                                        revoked.public_key.hex(), 1)))
    with pytest.raises(RejectedInput, match="revoked"):
        store.register(registration(run, revoked))
    payload = b"payload"
    digest = hashlib.sha256(payload).hexdigest()
    store.record_blob(digest, len(payload), "payload", "adm-run", 0)
    sub = synthetic_submission(run, w, payload)
    store.accept_submission(sub, digest, len(payload))
    finalize_round(store, run, 0, run.spec.genesis_model_hash, {w.public_key.hex(): sub.digest},
                   {w.public_key.hex(): HONEST})
    with pytest.raises(RejectedInput, match="expired") as exc:
        store.register(registration(run, late))
    # No back-dating: a revocation for a round that has closed is refused.
    with pytest.raises(RejectedInput, match="not yet closed"):
        store.post_membership(sign(org, AdmissionRevocation(
            "adm-run", 0, org.public_key.hex(), w.public_key.hex(), 2)))
    store.engine.dispose()
    result = verify_events(_rows(tmp_path / "ledger.sqlite"), store.identity.public_key)
    assert result.ok, result.problem


def test_bond_run_slashes_a_cheater_refuses_its_replacement_and_audits(tmp_path):
    run, store = _start(tmp_path, {"policy": "bond", "min_bond": 10, "slash_share": 0.5,
                                   "unbonding_rounds": 2})
    org = run.organiser
    honest, cheat, fresh = (Identity.generate("worker") for _ in range(3))
    with pytest.raises(RejectedInput, match="bond of 0 units") as exc:
        store.register(registration(run, honest))
    assert exc.value.reason == "not_admitted" and _participants(store) == 0
    # A deposit signed by the worker (not the treasury) is refused.
    with pytest.raises(RejectedInput):
        store.post_membership(sign(honest, BondDeposit(
            "adm-run", 0, honest.public_key.hex(), honest.public_key.hex(), 50, "", 1)))
    for w in (honest, cheat):
        store.post_membership(sign(org, BondDeposit("adm-run", 0, org.public_key.hex(),
                                                    w.public_key.hex(), 16, "paid", 1)))
        store.register(registration(run, w))
    subs = {}
    for w in (honest, cheat):
        payload = f"payload {w.public_key.hex()}".encode()
        digest = hashlib.sha256(payload).hexdigest()
        store.record_blob(digest, len(payload), "payload", "adm-run", 0)
        sub = synthetic_submission(run, w, payload)
        store.accept_submission(sub, digest, len(payload))
        subs[w.public_key.hex()] = sub.digest
    # A withdrawal while the round is pending its checks is refused.
    with pytest.raises(RejectedInput):
        store.post_membership(sign(honest, BondWithdrawal("adm-run", 2, honest.public_key.hex(),
                                                          16, 1)))
    finalize_round(store, run, 0, run.spec.genesis_model_hash, subs,
                   {honest.public_key.hex(): HONEST, cheat.public_key.hex(): SPOT_FAIL})
    with store.sessions() as s:
        slashes = [decode_canonical(bytes(e.body)) for e in s.query(t.Event).filter_by(
            run_id="adm-run", kind="slash")]
    assert slashes == [{"kind": "slash", "run_id": "adm-run", "round": 0,
                        "worker": cheat.public_key.hex(), "reason": "spot_check_failed",
                        "submission_digest": subs[cheat.public_key.hex()], "amount": 8,
                        "balance": 16}]
    # The same party under a fresh key: refused without a bond of its own.
    with pytest.raises(RejectedInput, match="bond of 0 units"):
        store.register(registration(run, fresh))
    # Withdrawal: not within the unbonding period, fine after it.
    with pytest.raises(RejectedInput, match="rounds ahead"):
        store.post_membership(sign(honest, BondWithdrawal("adm-run", 1, honest.public_key.hex(),
                                                          16, 1)))
    store.post_membership(sign(honest, BondWithdrawal("adm-run", 3, honest.public_key.hex(),
                                                      16, 1)))
    store.engine.dispose()
    rows = _rows(tmp_path / "ledger.sqlite")
    result = verify_events(rows, store.identity.public_key)
    assert result.ok, result.problem
    # A ledger that rewrites the slash (and re-signs its chain) is named by the audit.
    i = next(k for k, r in enumerate(rows) if r.kind == "slash")
    body = decode_canonical(rows[i].body)
    body["amount"] = 2
    tampered = rechain([*rows[:i], dataclasses.replace(rows[i], body=encode_canonical(body)),
                        *rows[i + 1:]], store.identity)
    bad = verify_events(tampered, store.identity.public_key)
    assert not bad.ok and bad.first_bad_seq == rows[i].seq and "slash" in bad.problem
    # One that leaves a proven fault unslashed is named at the row after the slashes; one
    # that slashes a fault twice, at the second slash.
    def renumbered(edited: list) -> list:
        first = edited[0].seq
        return rechain([dataclasses.replace(r, seq=first + k) for k, r in enumerate(edited)],
                       store.identity)

    dropped = verify_events(renumbered([*rows[:i], *rows[i + 1:]]), store.identity.public_key)
    assert not dropped.ok and dropped.first_bad_seq == rows[i].seq  # the next row, renumbered
    assert "without a slash" in dropped.problem and rows[i + 1].kind == "round_opened"
    twice = verify_events(renumbered([*rows[:i + 1], rows[i], *rows[i + 1:]]),
                          store.identity.public_key)
    assert not twice.ok and twice.first_bad_seq == rows[i].seq + 1
    assert "second slash" in twice.problem


def test_audit_names_a_registration_the_ledger_admitted_on_its_own(tmp_path):
    run, store = _start(tmp_path, {"policy": "bond", "min_bond": 10})
    w = Identity.generate("worker")
    with store.sessions.begin() as s:  # the ledger skips its own door
        store._append(s, "adm-run", "registration", registration(run, w).encode())
    store.engine.dispose()
    rows = _rows(tmp_path / "ledger.sqlite")
    result = verify_events(rows, store.identity.public_key)
    assert not result.ok and result.first_bad_seq == rows[-1].seq
    assert "admission policy" in result.problem


def test_registration_over_http_says_why_and_the_rows_are_served(tmp_path):
    run = quick_run("http-adm", admission={"policy": "allowlist"})
    org = run.organiser
    w = Identity.generate("worker")

    async def scenario(api):
        assert (await api.create_run(run))[0] == 201
        refused = await api.register(run, w)
        ticket = sign(org, AdmissionTicket("http-adm", 0, org.public_key.hex(),
                                           w.public_key.hex(), 5, 1))
        posted = await api.post_json("/v1/runs/http-adm/membership", ticket.to_wire())
        accepted = await api.register(run, w)
        served = await api.get("/v1/runs/http-adm/membership")
        return refused, posted, accepted, served

    refused, posted, accepted, served = run_api(tmp_path, scenario)
    assert refused[0] == 403 and refused[1]["reason"] == "not_admitted"
    assert "no admission ticket" in refused[1]["detail"]
    assert posted[0] == 200 and accepted[0] == 200 and accepted[1]["new"]
    assert served[1]["admission"] == {"policy": "allowlist"}
    assert [r["kind"] for r in served[1]["rows"]] == ["admission_ticket"]


def test_membership_rows_are_served_in_pages_and_fetched_whole(tmp_path):
    """Five tickets (interleaved with registrations, which are not membership rows): pages
    of two follow ``next_after`` in chain order, the last page says null, and
    ``fetch_membership`` assembles exactly the unpaged list; a page that goes backwards
    or skips past its last row is refused."""
    run = quick_run("paged-adm", admission={"policy": "allowlist"})
    org = run.organiser
    workers = [Identity.generate("worker") for _ in range(5)]

    async def scenario(api):
        assert (await api.create_run(run))[0] == 201
        for w in workers:
            ticket = sign(org, AdmissionTicket("paged-adm", 0, org.public_key.hex(),
                                               w.public_key.hex(), 5, 1))
            assert (await api.post_json("/v1/runs/paged-adm/membership",
                                        ticket.to_wire()))[0] == 200
            assert (await api.register(run, w))[0] == 200
        whole = (await api.get("/v1/runs/paged-adm/membership"))[1]
        pages, after = [], -1
        while after is not None:
            page = (await api.get(f"/v1/runs/paged-adm/membership?after={after}&limit=2"))[1]
            pages.append(page)
            after = page["next_after"]
        bad = await api.get("/v1/runs/paged-adm/membership?after=x")
        async with LedgerClient(api.url) as client:
            fetched = await fetch_membership(client, "paged-adm", page=2)
        return whole, pages, bad, fetched

    whole, pages, bad, fetched = run_api(tmp_path, scenario)
    seqs = [r["seq"] for r in whole["rows"]]
    assert len(seqs) == 5 and seqs == sorted(seqs) and whole["next_after"] is None
    assert [len(p["rows"]) for p in pages] == [2, 2, 1]
    assert [p["next_after"] for p in pages] == [seqs[1], seqs[3], None]
    assert [r for p in pages for r in p["rows"]] == whole["rows"]
    assert fetched["rows"] == whole["rows"] and fetched["admission"] == {"policy": "allowlist"}
    assert bad[0] == 400

    class Served:
        def __init__(self, replies):
            self.replies = iter(replies)

        async def get_json(self, path):
            return next(self.replies)

    row = whole["rows"]
    backwards = [{"rows": row[2:4], "next_after": row[3]["seq"]},
                 {"rows": row[1:2], "next_after": None}]
    skipping = [{"rows": row[:2], "next_after": row[3]["seq"]}]
    for replies in (backwards, skipping, [{"rows": "none"}]):
        with pytest.raises(RejectedInput, match="membership") as caught:
            asyncio.run(fetch_membership(Served(replies), "paged-adm"))
        assert caught.value.reason == "malformed"


def test_a_copied_membership_row_does_not_spend_the_organisers_budget(tmp_path):
    """Membership rows are public: a copy posted from another address is answered as
    stored and throttles only its sender; the organiser's next ticket goes through."""
    run = quick_run("copy-adm", admission={"policy": "allowlist"})
    org = run.organiser
    w1, w2 = Identity.generate("worker"), Identity.generate("worker")

    def ticket(w: Identity) -> Any:
        return sign(org, AdmissionTicket("copy-adm", 0, org.public_key.hex(),
                                         w.public_key.hex(), 5, 1)).to_wire()

    async def scenario(api):
        assert (await api.create_run(run))[0] == 201  # the organiser's first write
        first = await api.post_json("/v1/runs/copy-adm/membership", ticket(w1))  # second
        copies = await replay_from(api, "127.0.0.2", "/v1/runs/copy-adm/membership",
                                   ticket(w1), 30)
        own = await api.post_json("/v1/runs/copy-adm/membership", ticket(w2))  # third
        rows = (await api.get("/v1/runs/copy-adm/membership"))[1]["rows"]
        return first, copies, own, rows, await key_rate_limited(api)

    first, copies, own, rows, limited = run_api(tmp_path, scenario, key_rate=0.001,
                                                key_burst=3, ip_rate=1000.0, ip_burst=1000.0)
    assert first[0] == 200 and first[1]["new"] is True
    assert copies[0] == 200 and 429 in copies
    assert own[0] == 200 and own[1]["new"] is True, own
    assert limited == 0 and len(rows) == 2


def test_report_worker_history_and_web_page_show_bonds_and_slashes(tmp_path):
    from veritrain.ledger import queries
    from veritrain.ledger.detail_pages import render_worker
    from veritrain.ledger.tables import format_report, format_worker
    from veritrain.ledger.web_page import page_data, render_run

    run, store = _start(tmp_path, {"policy": "bond", "min_bond": 10, "slash_share": 0.5})
    org = run.organiser
    honest, cheat = Identity.generate("worker"), Identity.generate("worker")
    subs = {}
    for w in (honest, cheat):
        store.post_membership(sign(org, BondDeposit("adm-run", 0, org.public_key.hex(),
                                                    w.public_key.hex(), 16, "paid", 1)))
        store.register(registration(run, w))
    for w in (honest, cheat):
        payload = f"payload {w.public_key.hex()}".encode()
        digest = hashlib.sha256(payload).hexdigest()
        store.record_blob(digest, len(payload), "payload", "adm-run", 0)
        sub = synthetic_submission(run, w, payload)
        store.accept_submission(sub, digest, len(payload))
        subs[w.public_key.hex()] = sub.digest
    finalize_round(store, run, 0, run.spec.genesis_model_hash, subs,
                   {honest.public_key.hex(): HONEST, cheat.public_key.hex(): SPOT_FAIL})
    c, h = cheat.public_key.hex(), honest.public_key.hex()
    with store.sessions() as s:
        report = queries.run_report(s, "adm-run")
        history = queries.worker_page(s, "adm-run", c)
        page = render_run(page_data(s, "adm-run"))
    assert report["admission"]["policy"] == "bond"
    bond = {w["worker"]: w["bond"] for w in report["workers"]}
    assert bond[c]["bond"] == 8 and bond[c]["slashed"] == 8 and bond[c]["deposited"] == 16
    assert bond[c]["slashes"] == [{"round": 0, "amount": 8}] and not bond[c]["admitted"]
    assert bond[h]["bond"] == 16 and bond[h]["slashes"] == [] and bond[h]["admitted"]
    table = format_report(report)
    line = next(x for x in table.splitlines() if x.startswith(c[:12]) and "r0: -8" in x)
    assert line.split()[1:4] == ["8", "16", "8"]
    assert history["bond"]["bond"] == 8
    assert "slashed 8 units" in format_worker(history)
    assert 'class="data bonds"' in page and f'data-worker="{c}"' in page
    html = render_worker(history)
    assert "slashed 8 units" in html and "not admitted" in html
