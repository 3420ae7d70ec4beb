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

import numpy as np
import torch
from veritrain.protocol.codecs import ErrorFeedback

from .evidence import DirStore


def _atomic_write(path: Path, data: bytes | memoryview) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class StoredErrorFeedback(ErrorFeedback):
    """A worker's residual that lives in its file: read each time it is used, so it takes
    no memory in between (a model's size, during training)."""

    def __init__(self, path: Path, numel: int) -> None:  # noqa: D107 (no residual held)
        self.path = path
        self.numel = numel

    @property  # type: ignore[override]
    def residual(self) -> torch.Tensor:
        if not self.path.exists():
            return torch.zeros(self.numel, dtype=torch.float32)
        return ErrorFeedback.from_bytes(self.path.read_bytes(), self.numel).residual


class WorkerState:
    """What a worker must remember across restarts, kept as files."""

    def __init__(self, root: Path, run_id: str, numel: int) -> None:
        self.dir = root / run_id
        (self.dir / "receipts").mkdir(parents=True, exist_ok=True)
        (self.dir / "model").mkdir(exist_ok=True)
        self.numel = numel
        self.error_feedback = StoredErrorFeedback(self.dir / "error_feedback.safetensors",
                                                  numel)

    def keep_model(self, round_index: int, model_hash: str, params: torch.Tensor,
                   momentum: torch.Tensor) -> None:
        """Keep the base model of ``round_index`` and the outer momentum on disk: the next
        round's base is this plus the round's small broadcast update."""
        for name, vec in (("params", params), ("momentum", momentum)):
            _atomic_write(self.dir / "model" / f"{name}.f32",
                          memoryview(vec.detach().float().contiguous().numpy()).cast("B"))
        _atomic_write(self.dir / "model" / "meta.json", json.dumps(
            {"round": round_index, "model_hash": model_hash}).encode())

    def model_meta(self) -> dict[str, Any] | None:
        path = self.dir / "model" / "meta.json"
        return json.loads(path.read_bytes()) if path.exists() else None

    def model_vector(self, name: str) -> torch.Tensor:
        """The kept ``params`` or ``momentum`` as a tensor (read from its file)."""
        return torch.from_numpy(np.fromfile(self.dir / "model" / f"{name}.f32", dtype="<f4"))

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

    def record_claim(self, r: int, claim: dict[str, Any]) -> None:
        """Keep the reveal's claim (envelope and receipt) to hand to validator inboxes."""
        _atomic_write(self.dir / "receipts" / f"{r}.claim.json",
                      json.dumps(claim, sort_keys=True).encode())

    def claim(self, r: int) -> dict[str, Any] | None:
        path = self.dir / "receipts" / f"{r}.claim.json"
        return json.loads(path.read_bytes()) if path.exists() else None

    def record_handed(self, r: int, held_by: set[str], refused_by: set[str] | None = None
                      ) -> None:
        """The validators whose inboxes hold round ``r``'s claim, and those whose inbox
        refused it for good (workers/disputes.py ``FINAL_REFUSALS``: not asked again)."""
        _atomic_write(self.dir / "receipts" / f"{r}.handed.json", json.dumps(
            {"held": sorted(held_by), "refused": sorted(refused_by or ())}).encode())

    def _handed(self, r: int) -> dict[str, list[str]]:
        path = self.dir / "receipts" / f"{r}.handed.json"
        kept = json.loads(path.read_bytes()) if path.exists() else {}
        return {"held": kept} if isinstance(kept, list) else kept  # a list: held only

    def handed(self, r: int) -> set[str]:
        """The validators whose inboxes hold round ``r``'s claim."""
        return set(self._handed(r).get("held", ()))

    def refused(self, r: int) -> set[str]:
        """The validators whose inboxes refused round ``r``'s claim for good."""
        return set(self._handed(r).get("refused", ()))

    def receipts(self, r: int) -> list[Any]:
        """The ledger's signed receipts kept for round ``r`` (submission, then reveal)."""
        out = []
        for name in (f"{r}.json", f"{r}.reveal.json"):
            path = self.dir / "receipts" / name
            if path.exists():
                wire = json.loads(path.read_bytes())
                if isinstance(wire, dict) and "body" in wire:  # not a refusal note
                    out.append(wire)
        return out

    def submitted(self, r: int) -> bool:
        return (self.dir / "receipts" / f"{r}.json").exists()

    def record(self, r: int, receipt: dict[str, Any] | None, error_feedback: ErrorFeedback) -> None:
        """Persist the residual first, then the receipt that marks the round done."""
        _atomic_write(self.dir / "error_feedback.safetensors", error_feedback.to_bytes())
        _atomic_write(self.dir / "receipts" / f"{r}.json",
                      json.dumps(receipt, sort_keys=True).encode())
