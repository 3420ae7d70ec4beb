"""synthetic: a tiny classification task for fast tests.

Inputs are Gaussian vectors; labels are the argmax of a fixed random linear
"teacher" plus a little noise, all drawn from ``data_seed`` on the
organiser's machine. The blob stores the generated arrays as a safetensors
file, so workers never regenerate them and the content hash pins the exact
numbers. The model is a one-hidden-layer MLP (under 1k parameters by
default); its eval loss falls visibly within a few rounds of training.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch.nn import functional as F

from ..errors import NonFiniteError, OversizedError, PayloadError
from ..tensors import MAX_HEADER_BYTES
from .base import Param, param_float, param_int, seeded_generator, validate_params

PARAMS: dict[str, Param] = {
    "init_seed": Param("int", 0, 0, 2**63 - 1),
    "data_seed": Param("int", 0, 0, 2**63 - 1),
    "n_features": Param("int", 16, 1, 4096),
    "n_classes": Param("int", 4, 2, 1024),
    "hidden": Param("int", 32, 1, 4096),
    "n_train": Param("int", 2048, 1, 1 << 22),
    "n_eval": Param("int", 512, 1, 1 << 20),
    "label_noise": Param("float", 0.1, 0.0, 100.0),  # std of noise on teacher logits
    "eval_batch_size": Param("int", 256, 1, 1 << 20),
}

PRESETS: dict[str, dict[str, object]] = {
    "tiny": {},
}


@dataclass(frozen=True)
class SyntheticDataset:
    """Generated arrays: float32 inputs ``[N, F]`` and int64 labels ``[N]``."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_eval: torch.Tensor
    y_eval: torch.Tensor


class SyntheticTask:
    """Gaussian inputs, linear-teacher labels, an MLP student."""

    name = "synthetic"

    def __init__(self, params: Mapping[str, object] | None = None) -> None:
        self.params: dict[str, object] = validate_params(self.name, PARAMS, params)
        self.n_features = param_int(self.params, "n_features")
        self.n_classes = param_int(self.params, "n_classes")
        self.n_train = param_int(self.params, "n_train")
        self.n_eval = param_int(self.params, "n_eval")

    def make_model(self) -> nn.Module:
        """MLP ``F -> hidden -> classes`` with LeCun-normal weights from ``init_seed``."""
        hidden = param_int(self.params, "hidden")
        with torch.device("meta"):  # no default init: it would draw from the global generator
            model = nn.Sequential(
                nn.Linear(self.n_features, hidden), nn.Tanh(), nn.Linear(hidden, self.n_classes)
            )
        model = model.to_empty(device="cpu")
        g = seeded_generator(param_int(self.params, "init_seed"))
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
                else:
                    p.zero_()
        return model

    def _generate(self) -> dict[str, torch.Tensor]:
        g = seeded_generator(param_int(self.params, "data_seed"))
        teacher = torch.randn(self.n_features, self.n_classes, generator=g)  # (F, C)
        n = self.n_train + self.n_eval
        x = torch.randn(n, self.n_features, generator=g)  # (N, F)
        noise = param_float(self.params, "label_noise") * torch.randn(
            n, self.n_classes, generator=g
        )
        y = (x @ teacher + noise).argmax(dim=1)  # (N,) int64
        return {
            "x_train": x[: self.n_train].contiguous(),
            "y_train": y[: self.n_train].contiguous(),
            "x_eval": x[self.n_train :].contiguous(),
            "y_eval": y[self.n_train :].contiguous(),
        }

    def _layout(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        return {
            "x_train": (torch.float32, (self.n_train, self.n_features)),
            "y_train": (torch.int64, (self.n_train,)),
            "x_eval": (torch.float32, (self.n_eval, self.n_features)),
            "y_eval": (torch.int64, (self.n_eval,)),
        }

    def pack_dataset(self) -> bytes:
        """The generated arrays as a safetensors file (no metadata)."""
        return st_save(self._generate())

    def load_dataset(self, blob: bytes) -> SyntheticDataset:
        """Parse a blob whose names, dtypes and shapes must match ``params`` exactly."""
        layout = self._layout()
        payload = sum(
            (4 if dt == torch.float32 else 8) * (shape[0] * (shape[1] if len(shape) > 1 else 1))
            for dt, shape in layout.values()
        )
        if len(blob) > payload + 8 + MAX_HEADER_BYTES:
            raise OversizedError(f"synthetic dataset of {len(blob)} bytes exceeds its layout")
        if len(blob) < 8:
            raise PayloadError("synthetic dataset shorter than its header length")
        header_len = int.from_bytes(blob[:8], "little")
        if header_len > MAX_HEADER_BYTES or 8 + header_len + payload != len(blob):
            raise PayloadError("synthetic dataset size does not match its layout")
        try:
            tensors = st_load(blob)
        except Exception as exc:  # the parser reports malformed files with its own types
            raise PayloadError(f"synthetic dataset does not parse: {exc}") from exc
        if set(tensors) != set(layout):
            raise PayloadError("synthetic dataset names differ from the layout")
        for name, (dtype, shape) in layout.items():
            t = tensors[name]
            if t.dtype != dtype or tuple(t.shape) != shape:
                raise PayloadError(f"synthetic tensor {name!r} is {t.dtype} {tuple(t.shape)}")
        for name in ("x_train", "x_eval"):
            if not bool(torch.isfinite(tensors[name]).all()):
                raise NonFiniteError(f"synthetic tensor {name!r} holds NaN or Inf")
        for name in ("y_train", "y_eval"):
            y = tensors[name]
            if bool((y < 0).any()) or bool((y >= self.n_classes).any()):
                raise PayloadError(f"synthetic labels {name!r} out of range")
        return SyntheticDataset(**tensors)

    def num_train_examples(self, dataset: SyntheticDataset) -> int:
        return dataset.x_train.shape[0]

    def make_batch(
        self,
        dataset: SyntheticDataset,
        indices: torch.Tensor,
        *,
        device: torch.device | str = "cpu",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``indices`` of the training arrays, on ``device``."""
        idx = indices.to(torch.int64).cpu()
        return dataset.x_train[idx].to(device), dataset.y_train[idx].to(device)

    def loss(self, model: torch.nn.Module, batch: object) -> torch.Tensor:
        """Mean cross-entropy."""
        x, y = batch  # type: ignore[misc]
        return F.cross_entropy(model(x), y)

    def example_losses(self, model: torch.nn.Module, batch: object) -> torch.Tensor:
        """Cross-entropy of each row, ``[B]``."""
        x, y = batch  # type: ignore[misc]
        return F.cross_entropy(model(x), y, reduction="none")

    def eval_batches(
        self, dataset: SyntheticDataset, *, device: torch.device | str = "cpu"
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The eval arrays in order, in equal batches (a short tail is dropped)."""
        bs = min(param_int(self.params, "eval_batch_size"), self.n_eval)
        return [
            (dataset.x_eval[i : i + bs].to(device), dataset.y_eval[i : i + bs].to(device))
            for i in range(0, self.n_eval - bs + 1, bs)
        ]
