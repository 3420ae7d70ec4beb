"""A run as every node sees it: spec, task, dataset and the derived rules.

Workers, validators and the in-process swarm build one :class:`RunContext`
from the signed run spec and the dataset blob, and get from it the data
assignment, the inner configuration, the codec and its per-submission seed,
and the model file encoding, so all of them apply the same rules.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import torch

from .beacon import derive_seed
from .codecs import Codec, get_codec
from .data import get_data_assignment
from .errors import RejectedInput
from .messages import RunSpec
from .outer import OuterState, outer_step
from .tasks import Task, load_task
from .tensors import ParamShapes, decode_flat, encode_flat, flatten_params, numel_of, param_shapes
from .training import InnerConfig, LocalTrainResult, StateSink, evaluate, local_train


def inner_config_from_spec(inner: dict[str, Any]) -> InnerConfig:
    """The run spec's ``inner`` block as the training loop's config."""
    return InnerConfig(
        steps=inner["steps"],
        batch_size=inner["batch_size"],
        lr=inner["lr"],
        betas=(inner["beta1"], inner["beta2"]),
        eps=inner["eps"],
        weight_decay=inner["weight_decay"],
        grad_clip=inner["grad_clip"],
        trail_every=inner["trail_every"],
    )


@dataclass
class RunContext:
    spec: RunSpec
    task: Task
    dataset: Any
    shapes: ParamShapes
    inner: InnerConfig
    codec: Codec

    @classmethod
    def build(cls, spec: RunSpec, dataset_blob: bytes) -> RunContext:
        if hashlib.sha256(dataset_blob).hexdigest() != spec.dataset_hash:
            raise RejectedInput("dataset blob does not match the run spec", "payload_mismatch")
        task = load_task(spec.task["name"], spec.task["params"])
        shapes = param_shapes(task.make_model())
        if numel_of(shapes) != spec.num_params:
            raise RejectedInput(
                f"task builds {numel_of(shapes)} parameters, the spec says {spec.num_params}",
                "malformed",
            )
        return cls(
            spec=spec,
            task=task,
            dataset=task.load_dataset(dataset_blob),
            shapes=shapes,
            inner=inner_config_from_spec(spec.inner),
            codec=get_codec(spec.codec["name"], spec.codec["params"]).bind_model(shapes),
        )

    @property
    def numel(self) -> int:
        return self.spec.num_params

    @property
    def max_model_bytes(self) -> int:
        return 4 * self.numel + (1 << 20)

    def encode_model(self, flat: torch.Tensor) -> bytes:
        return encode_flat(flat, self.shapes)

    def decode_model(self, data: bytes) -> torch.Tensor:
        return decode_flat(data, self.shapes, max_bytes=self.max_model_bytes)

    def decode_base(self, model: bytes, outer: bytes | None) -> tuple[torch.Tensor, OuterState]:
        """A round's base parameters and outer state from their files (no outer-state file:
        round 0, zero momentum)."""
        flat = self.decode_model(model)
        if outer is None:
            return flat, OuterState.zeros(self.numel)
        return flat, OuterState.from_bytes(outer, self.numel)

    def genesis_flat(self) -> torch.Tensor:
        return flatten_params(self.task.make_model())

    def assignment(self, round_index: int, worker_hex: str) -> torch.Tensor:
        """The worker's [steps, batch] example indices for this round."""
        return get_data_assignment(
            self.spec.seed,
            round_index,
            bytes.fromhex(worker_hex),
            num_examples=self.task.num_train_examples(self.dataset),
            steps=self.inner.steps,
            batch_size=self.inner.batch_size,
        )

    def codec_seed(self, round_index: int, worker_hex: str) -> int:
        """Seed for a codec's random choices, so a payload re-derives exactly."""
        return derive_seed(bytes.fromhex(self.spec.seed), "codec", round_index, worker_hex)

    def train(
        self,
        base_flat: torch.Tensor,
        round_index: int,
        worker_hex: str,
        *,
        device: str = "cpu",
        progress: Callable[[int, float], None] | None = None,
        sink: StateSink | None = None,
        pool: Executor | None = None,
    ) -> LocalTrainResult:
        return local_train(
            self.task,
            self.dataset,
            base_flat,
            self.assignment(round_index, worker_hex),
            self.inner,
            device=device,
            progress=progress,
            sink=sink,
            pool=pool,
        )

    def update_seed(self, round_index: int) -> int:
        """Seed for encoding round ``round_index``'s broadcast aggregate."""
        return derive_seed(bytes.fromhex(self.spec.seed), "update", round_index)

    def apply_update(self, params: torch.Tensor, momentum: torch.Tensor, payload: bytes,
                     round_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """theta', m' from the round's broadcast update payload: the canonical outer step."""
        sent = self.codec.decode(payload, self.numel, seed=self.update_seed(round_index))
        outer = self.spec.outer
        return outer_step(params, momentum, sent, lr=outer["lr"], mu=outer["momentum"],
                          nesterov=outer["nesterov"])

    def evaluate(self, flat: torch.Tensor, *, device: str = "cpu") -> float:
        return evaluate(self.task, self.dataset, flat, device=device)
