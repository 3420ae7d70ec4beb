"""A node's small JSON state files: what it signed (``board.SignedOnce``) and the newest
certified round it took a base from (``certificates.CertifiedMark``).

Read once at start; rewritten atomically (temporary file, fsync, rename) before the
action they record leaves the node, so a crash leaves either the old file or the new
one. A file that does not hold what its reader expects is refused, never reset: an
empty state would undo the guarantee it keeps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["json_saver", "load_json_state"]


def load_json_state(path: Path, valid: Callable[[dict[str, Any]], bool], what: str
                    ) -> dict[str, Any]:
    """The JSON object in ``path`` ({} when there is no file yet); ``ValueError`` naming
    ``what`` when it is not an object ``valid`` accepts."""
    state = json.loads(path.read_text()) if path.exists() else {}
    if not isinstance(state, dict) or not valid(state):
        raise ValueError(f"{path} does not hold {what}")
    return state


def json_saver(path: Path) -> Callable[[dict[str, Any]], None]:
    """A function writing its argument to ``path`` as JSON, atomically."""

    def save(state: dict[str, Any]) -> None:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(state, fh, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    return save
