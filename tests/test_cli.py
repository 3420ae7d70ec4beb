import json
import stat
import subprocess
import sys

import pytest

from veritrain.cli import build_parser


def veritrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "veritrain.cli", *args], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("command", [
    ["keygen"], ["run", "create"], ["ledger", "serve"], ["worker"], ["validator"], ["audit"],
    ["demo"],
])
def test_every_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert "usage: veritrain " + " ".join(command) in text
    assert len(text.splitlines()) > 4


def test_keygen_writes_private_key_and_public_identity(tmp_path):
    out = tmp_path / "v.key"
    result = veritrain("keygen", "--role", "validator", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    pub = json.loads((tmp_path / "v.key.pub.json").read_text())
    assert set(pub) == {"role", "ed25519", "bls", "bls_pop"}
    assert "seed" not in (tmp_path / "v.key.pub.json").read_text()
    again = veritrain("keygen", "--role", "validator", "--out", str(out))
    assert again.returncode != 0
