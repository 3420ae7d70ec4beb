import os
import stat

import pytest
from fakes import make_fake_run
from veritrain.protocol import bls
from veritrain.protocol.certificates import InvalidCertificate, verify_certificate
from veritrain.protocol.identity import Identity, read_key_file, write_key_file
from veritrain.protocol.messages import CertifiedState


def test_key_file_is_private_and_round_trips(tmp_path):
    ident = Identity.generate("validator")
    path = tmp_path / "v.key"
    write_key_file(path, ident)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    back = read_key_file(path)
    assert back.public == ident.public
    assert back.public.bls is not None
    assert bls.verify_possession(bytes.fromhex(back.public.bls), bytes.fromhex(back.public.bls_pop))


def test_invalid_readable_key_file_is_refused(tmp_path):
    path = tmp_path / "w.key"
    write_key_file(path, Identity.generate("worker"))
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError):
        read_key_file(path)


def test_invalid_existing_key_file_is_never_overwritten(tmp_path):
    path = tmp_path / "w.key"
    write_key_file(path, Identity.generate("worker"))
    with pytest.raises(FileExistsError):
        write_key_file(path, Identity.generate("worker"))


def test_workers_have_no_bls_key():
    ident = Identity.generate("worker")
    assert ident.public.bls is None
    with pytest.raises(ValueError):
        ident.sign_bls(b"x")


def test_bls_verifiers_return_false_on_garbage():
    assert bls.verify(b"\x00" * 48, b"m", b"\x00" * 96) is False
    assert bls.verify(b"short", b"m", b"sig") is False
    assert bls.verify_possession(b"\x01" * 48, b"\x02" * 96) is False
    assert bls.fast_aggregate_verify([], b"m", b"\x00" * 96) is False


def test_invalid_rogue_key_proof_of_possession():
    """A proof of possession made with one key does not vouch for another key."""
    a, b = Identity.generate("validator"), Identity.generate("validator")
    assert not bls.verify_possession(bytes.fromhex(a.public.bls), bytes.fromhex(b.public.bls_pop))


def _certificate(run, signers, state=None, signer_keys=None):
    state = state or CertifiedState(run_id=run.spec.run_id, round=1, model_hash="a" * 64,
                                    outer_state_hash="b" * 64, update_hash="e" * 64, verdicts_hash="c" * 64,
                                    scores_hash="d" * 64, eval_loss=2.5)
    keys = signer_keys or [run.validators[i] for i in signers]
    sig = bls.aggregate([k.sign_bls(state.signing_root()) for k in keys])
    return {"certified": state.to_body(), "signers": signers, "signature": sig.hex()}


def test_quorum_certificate_verifies():
    run = make_fake_run("cert-run", n_validators=3, quorum=2)
    state = verify_certificate(_certificate(run, [0, 2]), run.spec, base_of_round=1)
    assert state.model_hash == "a" * 64


@pytest.mark.parametrize("case", ["missing", "duplicated", "foreign", "wrong_round", "outside"])
def test_invalid_certificates_are_refused(case):
    run = make_fake_run("cert-run", n_validators=3, quorum=2)
    if case == "missing":
        cert = _certificate(run, [1])
    elif case == "duplicated":
        cert = _certificate(run, [1, 1])
    elif case == "foreign":
        cert = _certificate(run, [0, 1], signer_keys=[run.validators[0],
                                                      Identity.generate("validator")])
    elif case == "outside":
        cert = _certificate(run, [0, 7], signer_keys=run.validators[:2])
    else:
        cert = _certificate(run, [0, 1])
    with pytest.raises(InvalidCertificate):
        verify_certificate(cert, run.spec, base_of_round=2 if case == "wrong_round" else 1)
