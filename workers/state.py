"""What a worker keeps on disk across restarts: receipts, its error-feedback residual and
each pending round's evidence (workers/evidence.py) until the round is settled.

Every file is written atomically (temporary file, fsync, rename), so a crash leaves
either the old file or the new one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from veritrain.protocol.codecs import ErrorFeedback

from .evidence import DirStore


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class WorkerState:
    """What a worker must remember across restarts, kept as small files."""

    def __init__(self, root: Path, run_id: str, numel: int) -> None:
        self.dir = root / run_id
        (self.dir / "receipts").mkdir(parents=True, exist_ok=True)
        self.numel = numel
        ef_path = self.dir / "error_feedback.safetensors"
        self.error_feedback = (ErrorFeedback.from_bytes(ef_path.read_bytes(), numel)
                               if ef_path.exists() else ErrorFeedback(numel))

    def evidence_store(self, r: int) -> DirStore:
        """Where round ``r``'s evidence lives until the round is settled."""
        return DirStore(self.dir / "evidence" / str(r))

    def pending_rounds(self) -> list[int]:
        root = self.dir / "evidence"
        return sorted(int(p.name) for p in root.iterdir() if p.name.isdigit()) if root.exists() else []

    def settle(self, r: int) -> None:
        """The round is finalized: its evidence is no longer needed."""
        shutil.rmtree(self.dir / "evidence" / str(r), ignore_errors=True)

    def revealed(self, r: int) -> bool:
        return (self.dir / "receipts" / f"{r}.reveal.json").exists()

    def record_reveal(self, r: int, receipt: dict[str, Any]) -> None:
        """Keep the ledger's signed reveal receipt: proof that the reveal arrived in time."""
        _atomic_write(self.dir / "receipts" / f"{r}.reveal.json",
                      json.dumps(receipt, sort_keys=True).encode())

    def submitted(self, r: int) -> bool:
        return (self.dir / "receipts" / f"{r}.json").exists()

    def record(self, r: int, receipt: dict[str, Any] | None, error_feedback: ErrorFeedback) -> None:
        """Persist the residual first, then the receipt that marks the round done."""
        _atomic_write(self.dir / "error_feedback.safetensors", error_feedback.to_bytes())
        self.error_feedback = error_feedback
        _atomic_write(self.dir / "receipts" / f"{r}.json",
                      json.dumps(receipt, sort_keys=True).encode())
