"""Deterministic data assignment: which training examples a worker uses in a round.

The rule uses only SHA-256 and integer arithmetic, so anyone can recompute a
worker's assignment from public values with any language (see
``specs/tasks.md``, "Data assignment"):

    seed  = sha256("veritrain/v1/data-assignment"
                   || u32be(len(run_seed_utf8)) || run_seed_utf8
                   || u64be(round_index)
                   || u32be(len(worker_key)) || worker_key)
    block = sha256(seed || u64be(counter))         counter = 0, 1, 2, ...
    each block yields four u64be words; a word w is used only if
    w < limit = 2^64 - (2^64 mod num_examples) (rejection sampling, no
    modulo bias), giving the index w mod num_examples.

The j-th accepted index is example ``j`` of the flattened ``[steps,
batch_size]`` assignment (row-major), so a shorter run's assignment is a prefix
of a longer one's and segment ``s`` of ``k`` steps is rows ``s*k .. s*k+k-1``.
Examples are drawn with replacement.
"""

from __future__ import annotations

import hashlib
import struct

import torch

#: Domain tag of the assignment seed.
DATA_ASSIGNMENT_DOMAIN = b"veritrain/v1/data-assignment"
#: Most indices one assignment may hold (bounds work done on request).
MAX_ASSIGNMENT = 1 << 24
#: Largest run seed, in UTF-8 bytes, and largest worker key.
MAX_SEED_BYTES = 1024


def compute_assignment_seed(run_seed: str, round_index: int, worker_key: bytes) -> bytes:
    """The 32-byte seed of one worker's assignment in one round."""
    if not isinstance(run_seed, str):
        raise TypeError("run_seed must be a str")
    seed_bytes = run_seed.encode("utf-8")
    worker_key = bytes(worker_key)
    if len(seed_bytes) > MAX_SEED_BYTES or len(worker_key) > MAX_SEED_BYTES:
        raise ValueError("run seed or worker key too long")
    if not 0 <= round_index < 2**64:
        raise ValueError(f"round index {round_index} out of range")
    h = hashlib.sha256(DATA_ASSIGNMENT_DOMAIN)
    h.update(struct.pack(">I", len(seed_bytes)) + seed_bytes)
    h.update(struct.pack(">Q", round_index))
    h.update(struct.pack(">I", len(worker_key)) + worker_key)
    return h.digest()


def compute_index_stream(seed: bytes, count: int, num_examples: int) -> list[int]:
    """The first ``count`` indices in ``[0, num_examples)`` of the counter-mode stream of ``seed``."""
    if not 1 <= num_examples < 2**63:
        raise ValueError(f"num_examples {num_examples} out of range")
    limit = 2**64 - (2**64 % num_examples)
    out: list[int] = []
    counter = 0
    while len(out) < count:
        block = hashlib.sha256(seed + struct.pack(">Q", counter)).digest()
        counter += 1
        for (w,) in struct.iter_unpack(">Q", block):
            if w < limit:
                out.append(w % num_examples)
                if len(out) == count:
                    break
    return out


def get_data_assignment(
    run_seed: str,
    round_index: int,
    worker_key: bytes,
    *,
    num_examples: int,
    steps: int,
    batch_size: int,
) -> torch.Tensor:
    """Training example indices for each inner step: int64 ``[steps, batch_size]``.

    Same inputs give the same tensor on every machine; see the module
    docstring for the exact rule.
    """
    if steps < 1 or batch_size < 1:
        raise ValueError("steps and batch_size must be positive")
    if steps * batch_size > MAX_ASSIGNMENT:
        raise ValueError(f"assignment of {steps * batch_size} indices exceeds {MAX_ASSIGNMENT}")
    seed = compute_assignment_seed(run_seed, round_index, worker_key)
    indices = compute_index_stream(seed, steps * batch_size, num_examples)
    return torch.tensor(indices, dtype=torch.int64).view(steps, batch_size)
