"""Dependencies point one way: aggregation knows no network or database, the ledger no torch."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
import sys
import {module}
bad = sorted(m for m in sys.modules if m.split('.')[0] in {forbidden!r})
print(','.join(bad))
"""


@pytest.mark.parametrize(("module", "forbidden"), [
    ("veritrain.aggregation", {"aiohttp", "sqlalchemy", "urllib3", "requests"}),
    ("veritrain.ledger.server", {"torch"}),
    ("veritrain.ledger.audit", {"torch"}),
    ("veritrain.protocol.messages", {"torch", "aiohttp", "sqlalchemy"}),
])
def test_module_does_not_import(module, forbidden):
    out = subprocess.run([sys.executable, "-c", CHECK.format(module=module, forbidden=forbidden)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} imports {out.stdout.strip()}"


def _imports(folder: str) -> set[str]:
    names: set[str] = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0] if not node.module.startswith("veritrain.")
                          else node.module)
    return names


def test_aggregation_sources_import_no_io_modules():
    """torch pulls in socket itself, so the package's own imports are checked statically."""
    found = _imports("aggregation")
    io_modules = {"socket", "http", "asyncio", "aiohttp", "sqlalchemy", "sqlite3", "urllib"}
    assert not found & io_modules
    assert not {m for m in found if m.startswith(("veritrain.ledger", "veritrain.validators"))}


def test_ledger_sources_never_import_torch():
    assert "torch" not in _imports("ledger")
