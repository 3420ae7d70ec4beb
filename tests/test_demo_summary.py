"""The demo's verdict on a finished run, from the ledger's report: who was caught, whether
an honest worker was rejected, and in a bond run what each proven fault cost."""

from __future__ import annotations

from pathlib import Path

from veritrain.protocol.identity import Identity

from veritrain.demo import bonds_line, summarize


def _bond(deposited: int, slashes: list[dict[str, int]], minimum: int = 10) -> dict:
    held = deposited - sum(s["amount"] for s in slashes)
    return {"bond": held, "deposited": deposited, "slashes": slashes,
            "admitted": held >= minimum}


def test_a_bond_run_summary_names_each_slash_and_flags_an_honest_one():
    workers = [(Path(f"w{i}.key"), Identity.generate("worker")) for i in range(4)]
    keys = [ident.public_key.hex() for _, ident in workers]
    attacks = {2: "free_rider", 3: "sign_flip"}
    report = {"workers": [
        {"worker": keys[0], "rejected": [], "score": 40.0, "bond": _bond(16, [])},
        {"worker": keys[1], "rejected": [], "score": 38.0,
         "bond": _bond(16, [{"round": 1, "amount": 8}])},
        {"worker": keys[2], "rejected": [{"round": 0, "reason": "missing_reveal"}],
         "score": 0.0, "bond": _bond(16, [{"round": 0, "amount": 8}])},
        {"worker": keys[3], "rejected": [{"round": 1, "reason": "spot_check_failed"}],
         "score": 3.0, "bond": _bond(16, [{"round": 1, "amount": 8}])},
    ]}
    summary = summarize(report, workers, attacks)
    flip = summary["cheaters"]["sign_flip"]
    assert flip["caught_in_round"] == 1 and flip["reason"] == "spot_check_failed"
    assert bonds_line(flip) == "; slashed 8 units in round 1: bond 16 -> 8 (out of the run)"
    assert summary["cheaters"]["free_rider"]["bond"]["slashes"] == [{"round": 0, "amount": 8}]
    # An honest worker slashed is a failure the demo reports, though it was never rejected.
    assert summary["honest_rejections"] == []
    assert summary["honest_slashes"] == [{"worker": keys[1][:12],
                                          "slashes": [{"round": 1, "amount": 8}]}]
    assert bonds_line(report["workers"][0]) == "; bond 16, never slashed"
    assert bonds_line({"worker": keys[0]}) == ""  # an open run's report has no bonds


def test_an_honest_worker_excluded_with_its_bucket_is_not_counted_rejected():
    workers = [(Path(f"w{i}.key"), Identity.generate("worker")) for i in range(3)]
    keys = [ident.public_key.hex() for _, ident in workers]
    dropped = {"round": 4, "reason": "bucket_dropped", "detail": "bucket 0: ..."}
    report = {"workers": [
        {"worker": keys[0], "rejected": [], "excluded": [dropped], "score": 40.0},
        {"worker": keys[1], "rejected": [{"round": 4, "reason": "spot_check_failed"}],
         "excluded": [], "score": 0.0},
        {"worker": keys[2], "rejected": [], "score": 40.0},  # a report before "excluded"
    ]}
    summary = summarize(report, workers, {1: "free_rider"})
    assert summary["honest_rejections"] == []
    assert summary["honest_excluded"] == [{"worker": keys[0][:12], **dropped}]
