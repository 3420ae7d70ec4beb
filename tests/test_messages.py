import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import EncodingError, SignatureError
from veritrain.protocol.identity import Identity
from veritrain.protocol.messages import (
    Receipt,
    Registration,
    RunSpec,
    Submission,
    decode_signed,
    open_signed,
    sign,
)
from veritrain.protocol.signing import compute_signing_root

from veritrain.synthetic import make_synthetic_run

WORKER = Identity.generate("worker")
OTHER = Identity.generate("worker")

hex32 = st.binary(min_size=32, max_size=32).map(bytes.hex)
submissions = st.builds(
    Submission,
    run_id=st.from_regex(r"[a-z0-9][a-z0-9-]{2,20}", fullmatch=True),
    round=st.integers(0, 10**6),
    worker=st.just(WORKER.public_key.hex()),
    base_model_hash=hex32,
    payload_hash=hex32,
    payload_bytes=st.integers(0, 10**9),
    codec=st.just({"name": "fp16", "params": {}}),
    samples=st.integers(0, 10**6),
    trail=st.lists(hex32, max_size=8),
    ef_hash=hex32,
    loss_first=st.floats(-100, 100, allow_nan=False),
    loss_last=st.floats(-100, 100, allow_nan=False),
    created_at=st.integers(0, 2**40 - 1),
)


@settings(max_examples=40)
@given(submissions)
def test_signed_submission_round_trips(sub):
    signed = sign(WORKER, sub)
    back = decode_signed(signed.encode(), Submission)
    assert back.message == sub
    assert back.digest == signed.digest


@settings(max_examples=40)
@given(submissions, st.data())
def test_invalid_any_field_change_breaks_the_signature(sub, data):
    wire = sign(WORKER, sub).to_wire()
    field = data.draw(st.sampled_from(sorted(wire["body"])))
    value = wire["body"][field]
    if isinstance(value, bool) or field == "worker":
        return
    if isinstance(value, int):
        wire["body"][field] = value + 1
    elif isinstance(value, float):
        wire["body"][field] = value + 1.0
    elif isinstance(value, str):
        wire["body"][field] = ("0" if value[0] != "0" else "1") + value[1:]
    elif isinstance(value, list):
        wire["body"][field] = [*value, "ab" * 32]
    else:
        wire["body"][field] = {"name": "int8", "params": {}}
    with pytest.raises(SignatureError):
        open_signed(wire, Submission)


def _sub(**kw):
    base = dict(run_id="run-a", round=3, worker=WORKER.public_key.hex(), base_model_hash="0" * 64,
                payload_hash="1" * 64, payload_bytes=10, codec={"name": "fp16", "params": {}},
                samples=80, trail=["2" * 64], ef_hash="3" * 64, loss_first=2.0, loss_last=1.5, created_at=1)
    base.update(kw)
    return Submission(**base)


def test_invalid_signature_from_another_key():
    wire = sign(WORKER, _sub()).to_wire()
    wire["signer"] = OTHER.public_key.hex()
    with pytest.raises(SignatureError):
        open_signed(wire, Submission)


def test_invalid_replay_as_another_kind_is_refused():
    """A registration's signature must not verify as anything else."""
    reg = Registration(run_id="run-a", round=0, participant=WORKER.public_key.hex(),
                       role="worker", created_at=1)
    wire = sign(WORKER, reg).to_wire()
    wire["kind"] = "submission"
    with pytest.raises(EncodingError):
        open_signed(wire, Submission)
    with pytest.raises(EncodingError):
        open_signed(wire, Receipt)


def test_signing_roots_separate_domains_runs_and_rounds():
    body = encode_canonical({"x": 1})
    roots = {
        compute_signing_root("submission", "run-a", 1, body),
        compute_signing_root("registration", "run-a", 1, body),
        compute_signing_root("submission", "run-b", 1, body),
        compute_signing_root("submission", "run-a", 2, body),
    }
    assert len(roots) == 4


@pytest.mark.parametrize("mutate", [
    lambda b: b.pop("trail"),
    lambda b: b.update(extra=1),
    lambda b: b.update(round=-1),
    lambda b: b.update(round=True),
    lambda b: b.update(payload_hash="XYZ"),
    lambda b: b.update(loss_first="1.0"),
    lambda b: b.update(trail=["00" * 32] * 5000),
    lambda b: b.update(run_id="Bad Run"),
])
def test_invalid_malformed_bodies_are_refused(mutate):
    wire = sign(WORKER, _sub()).to_wire()
    mutate(wire["body"])
    with pytest.raises(EncodingError):
        open_signed(wire, Submission)


def test_invalid_non_canonical_bytes_are_refused():
    raw = sign(WORKER, _sub()).encode()
    spaced = raw.replace(b'","', b'", "', 1)
    with pytest.raises(EncodingError):
        decode_signed(spaced, Submission)
    assert decode_canonical(raw)


def test_messages_are_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        _sub().round = 4  # type: ignore[misc]


def _spec_with_verification(**changes):
    run = make_synthetic_run("compat-run", [Identity.generate("validator")])
    verification = {**run.spec.verification, **changes}
    for key in [k for k, v in changes.items() if v is None]:
        del verification[key]
    body = {**run.spec.to_body(), "verification": verification}
    return run, sign(run.organiser, RunSpec.from_body(body))


def test_run_spec_signed_before_the_probe_filter_still_opens_unchanged():
    _run, old = _spec_with_verification(probe_examples=None, probe_factor=None)
    wire = old.encode()
    opened = decode_signed(wire, RunSpec)
    assert "probe_examples" not in opened.message.verification
    assert opened.message.probe == (0, 0.0)  # no probe filter for such runs
    assert opened.encode() == wire  # the body stays as signed: no field filled in
    _run, new = _spec_with_verification(probe_examples=16, probe_factor=5.0)
    assert decode_signed(new.encode(), RunSpec).message.probe == (16, 5.0)


def test_invalid_run_spec_fields_other_than_the_late_ones_are_still_required():
    _run, good = _spec_with_verification()
    body = good.message.to_body()
    for key in ("tolerance", "norm_factor"):
        broken = {**body, "verification": {k: v for k, v in body["verification"].items()
                                           if k != key}}
        with pytest.raises(EncodingError, match=f"missing fields \\['{key}'\\]"):
            RunSpec.from_body(broken)
    extra = {**body, "verification": {**body["verification"], "probe_bias": 1}}
    with pytest.raises(EncodingError, match="unexpected fields"):
        RunSpec.from_body(extra)
    wrong = {**body, "verification": {**body["verification"], "probe_factor": -1}}
    with pytest.raises(EncodingError, match="probe_factor"):
        RunSpec.from_body(wrong)


def test_run_spec_feedback_decay_is_optional_and_bounded():
    run = make_synthetic_run("decay-run", [Identity.generate("validator")])
    body = run.spec.to_body()
    assert "feedback_decay" not in body["inner"]
    old = sign(run.organiser, RunSpec.from_body(body))
    opened = decode_signed(old.encode(), RunSpec)
    assert opened.message.feedback_decay == 1.0 and opened.encode() == old.encode()
    new = RunSpec.from_body({**body, "inner": {**body["inner"], "feedback_decay": 0.5}})
    assert decode_signed(sign(run.organiser, new).encode(), RunSpec).message.feedback_decay == 0.5
    for bad in (1.5, -0.1, "0.5"):
        with pytest.raises(EncodingError, match="feedback_decay"):
            RunSpec.from_body({**body, "inner": {**body["inner"], "feedback_decay": bad}})


@pytest.mark.parametrize("n,quorum,ok", [(1, 1, True), (3, 2, True), (4, 3, True),
                                         (4, 2, False), (2, 1, False), (3, 4, False),
                                         (3, 0, False)])
def test_a_quorum_must_be_a_majority_of_the_validators(n, quorum, ok):
    """Two disjoint quorums would certify two states of one round (or fix two seeds from
    two boards): a spec needs ``n / 2 < quorum <= n``, and its inboxes are read back."""
    validators = [Identity.generate("validator") for _ in range(n)]
    run = make_synthetic_run("quorum-run", validators)
    body = run.spec.to_body()
    body["validators"] = [{**v, "inbox": f"http://127.0.0.1:{9000 + i}"}
                          for i, v in enumerate(body["validators"])]
    spec = RunSpec.from_body({**body, "quorum": quorum}) if quorum >= 1 else dataclasses.replace(
        RunSpec.from_body(body), quorum=quorum)
    assert (spec.quorum_problem() is None) == ok, spec.quorum_problem()
    assert spec.validator_inboxes() == {v["ed25519"]: f"http://127.0.0.1:{9000 + i}"
                                        for i, v in enumerate(body["validators"])}
    with pytest.raises(EncodingError):  # an inbox is an http(s) URL, nothing else
        RunSpec.from_body({**body, "validators": [
            {**body["validators"][0], "inbox": "file:///etc/passwd"}]})
