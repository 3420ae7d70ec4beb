"""Chunked commitments to training states: cheap to compute, opened chunk by chunk.

A worker commits to its training state after every step (the trail). The state is
three float32 vectors of the model's size (parameters, AdamW's two moments), so the
commitment must cost little next to a training step and be checkable without
sending the vectors whole. Each vector is cut into chunks of :data:`CHUNK` floats
(the last one may be short):

    leaf_i      = BLAKE3(float32 LE bytes of chunk i)                      (32 bytes)
    vector_root = SHA-256("veritrain/v1/vector-root" 0x00 || u64be(numel) || u32be(CHUNK)
                          || leaf_0 || ... || leaf_(n-1))
    commitment  = SHA-256("veritrain/v1/state" 0x00 || u64be(step) || u64be(numel)
                          || root(params) || root(exp_avg) || root(exp_avg_sq))

A leaf list (n x 32 bytes, about 0.002 bytes per parameter) plus the chunks a
validator samples prove those chunks against the commitment; a vector sent whole
is checked by hashing it. Leaves hash independently, so they spread over threads
(BLAKE3 releases the GIL) and overlap the next step's forward and backward pass.
The error-feedback residual is committed the same way (its ``vector_root``).

Which chunks a check opens is drawn from the round's beacon, fixed after the
submissions close (:func:`sample_chunks`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import Executor

import blake3

#: Floats per chunk (64 KiB): small enough that a few sampled chunks are cheap to send,
#: large enough that hashing runs at BLAKE3's full speed.
CHUNK = 1 << 14
LEAF = 32
_ROOT_TAG = b"veritrain/v1/vector-root\x00"
_STATE_TAG = b"veritrain/v1/state\x00"


def chunk_count(numel: int) -> int:
    """n = ceil(numel / CHUNK) chunks of a vector of ``numel`` floats."""
    return -(-numel // CHUNK)


def chunk_bounds(numel: int, index: int) -> tuple[int, int]:
    """[start, stop) of chunk ``index`` in a vector of ``numel`` floats."""
    start = index * CHUNK
    return start, min(start + CHUNK, numel)


def hash_chunks(data: memoryview, first: int, last: int) -> bytes:
    """The leaves of chunks ``first .. last - 1`` of a vector given as its bytes."""
    step = 4 * CHUNK
    return b"".join(blake3.blake3(data[i * step:(i + 1) * step]).digest()
                    for i in range(first, last))


def chunk_ranges(n_chunks: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous, non-empty [first, last) ranges covering ``n_chunks`` chunks
    (fewer when there are fewer chunks): how a vector's hashing is spread over threads."""
    parts = max(1, min(parts, n_chunks))
    bounds = [n_chunks * p // parts for p in range(parts + 1)]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True) if b > a]


def float_bytes(data: memoryview | bytes) -> memoryview:
    """``data`` as a byte view, checked to be a whole number of float32 values."""
    view = memoryview(data).cast("B")
    if len(view) % 4:
        raise ValueError("a vector's bytes are a whole number of float32 values")
    return view


def leaves_of(data: memoryview | bytes, *, pool: Executor | None = None, parts: int = 1
              ) -> bytes:
    """The concatenated leaves of a float32 vector given as its little-endian bytes.

    With ``pool`` the chunks are hashed in ``parts`` contiguous ranges on its threads.
    """
    view = float_bytes(data)
    n = chunk_count(len(view) // 4)
    if pool is None or parts <= 1 or n < 2:
        return hash_chunks(view, 0, n)
    futures = [pool.submit(hash_chunks, view, a, b) for a, b in chunk_ranges(n, parts)]
    return b"".join(f.result() for f in futures)


def vector_root(leaves: bytes, numel: int) -> bytes:
    """The root of a vector of ``numel`` floats from its leaf list."""
    if len(leaves) != LEAF * chunk_count(numel):
        raise ValueError(f"{len(leaves)} bytes of leaves for {chunk_count(numel)} chunks")
    return hashlib.sha256(_ROOT_TAG + numel.to_bytes(8, "big") + CHUNK.to_bytes(4, "big")
                          + leaves).digest()


def state_commitment(step: int, numel: int, roots: Sequence[bytes]) -> str:
    """The trail entry (hex) of a state from the roots of params, exp_avg and exp_avg_sq."""
    if len(roots) != 3 or any(len(r) != 32 for r in roots):
        raise ValueError("a state commitment takes three 32-byte roots")
    return hashlib.sha256(_STATE_TAG + step.to_bytes(8, "big") + numel.to_bytes(8, "big")
                          + b"".join(roots)).hexdigest()


def leaf(leaves: bytes, index: int) -> bytes:
    """Leaf ``index`` of a leaf list."""
    return leaves[LEAF * index:LEAF * (index + 1)]


def chunk_matches(leaves: bytes, index: int, chunk: memoryview | bytes) -> bool:
    """Whether ``chunk`` (float32 LE bytes of chunk ``index``) hashes to its leaf."""
    return blake3.blake3(chunk).digest() == leaf(leaves, index)


def sample_chunks(seed: bytes, label: bytes, n_chunks: int, count: int) -> list[int]:
    """``min(count, n_chunks)`` distinct chunk indices, sorted, drawn from ``seed``.

    Draw c = 0, 1, ...: ``u64be(SHA-256(seed || label || u32be(c))[:8]) mod n_chunks``,
    repeats skipped (the bias of the modulus is below n / 2^64).
    """
    want = min(max(0, count), n_chunks)
    chosen: set[int] = set()
    c = 0
    while len(chosen) < want:
        digest = hashlib.sha256(seed + label + c.to_bytes(4, "big")).digest()
        chosen.add(int.from_bytes(digest[:8], "big") % n_chunks)
        c += 1
    return sorted(chosen)


def opened_label(worker: str, segment: int) -> bytes:
    """The draw label of the chunks a challenged segment's check opens."""
    return b"open" + bytes.fromhex(worker) + segment.to_bytes(4, "big")


def binding_label(worker: str) -> bytes:
    """The draw label of the chunks the payload-binding check opens."""
    return b"bind" + bytes.fromhex(worker)
