"""``check_submission``'s round rule says which round is open, or that none is."""

from __future__ import annotations

import pytest
from fakes import make_fake_run, make_submission
from veritrain.protocol.errors import RejectedInput
from veritrain.protocol.identity import Identity
from veritrain.protocol.rules import SubmissionContext, check_submission


def context(run, open_round: int) -> SubmissionContext:
    return SubmissionContext(spec=run.spec, round=open_round,
                             base_model_hash=run.spec.genesis_model_hash,
                             worker_registered=True, worker_banned=False)


def test_a_submission_for_the_open_round_passes_the_round_rule():
    run = make_fake_run("rules-run")
    signed = make_submission(run, Identity.generate("worker"), b"update")
    check_submission(signed, context(run, 0))


@pytest.mark.parametrize(("open_round", "says"), [
    (2, "the open round is 2"),
    (-1, "no round is open"),
])
def test_a_submission_for_another_round_is_refused_saying_which_is_open(open_round, says):
    run = make_fake_run("rules-run")
    signed = make_submission(run, Identity.generate("worker"), b"update")
    with pytest.raises(RejectedInput) as err:
        check_submission(signed, context(run, open_round))
    assert err.value.reason == "wrong_round"
    assert "submission is for round 0" in str(err.value) and says in str(err.value)
