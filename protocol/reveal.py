"""The reveal file: what a worker sends to open its commitments for a round's checks.

Once a round's beacon is fixed, every worker in the sealed list has checks (section 5.5
of specs/protocol.md): each challenged segment j (steps jk+1 .. (j+1)k), and the binding
of its payload to its final state. It answers with one file, whose layout follows from
public values alone (the model size, k, the challenged segments, the chunk counts, the
codec), so a validator parses it strictly and a ledger can bound its size:

| tensor | shape | when |
| --- | --- | --- |
| ``s{j}.start_params`` | [D] float32 | j > 0: the start parameters, whole |
| ``s{j}.start_moments`` | [2, D] float32 | j > 0 and k > 1: the start moments, whole |
| ``s{j}.start_leaves`` | [2, n, 32] uint8 | j > 0 and k = 1: leaf lists of the start moments |
| ``s{j}.start_chunks`` | [2, C, CHUNK] float32 | j > 0 and k = 1: start moments at the opened chunks |
| ``s{j}.end_leaves`` | [3, n, 32] uint8 | leaf lists of the end state |
| ``s{j}.end_chunks`` | [3, C, CHUNK] float32 | end params and moments at the opened chunks |
| ``final.leaves`` | [3, n, 32] uint8 | leaf lists of the final state (trail[-1]) |
| ``final.ef_leaves`` | [n, 32] uint8 | leaf list of the error-feedback residual |
| ``final.chunks`` | [2, C_b, CHUNK] float32 | local codecs: final params and residual at the binding chunks |
| ``final.params``, ``final.ef`` | [D] float32 | codecs without regions: both whole |
| ``payload`` | [bytes] uint8 | masked runs: the payload the ledger never stored |

(n = chunks of a vector, C = ``opened_chunks`` and C_b = ``binding_chunks`` of the run's
verification settings, at most n; the last chunk is zero-padded to CHUNK.)

The file is a safetensors file written canonically: the header is compact JSON with
sorted keys, the tensors named in sorted order with contiguous data offsets in that
order, padded with spaces to a multiple of 8 bytes. It is written straight to a file
(:func:`write_reveal`), so a worker never holds it in memory, and read as views of
the received bytes (:func:`parse_reveal`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch

from .challenges import ChallengePolicy
from .commitments import CHUNK, LEAF, chunk_count
from .errors import PayloadError
from .runtime import RunContext
from .tensors import all_finite

_DTYPES = {"F32": (torch.float32, 4), "U8": (torch.uint8, 1)}
#: A reveal's header is small: a few entries per challenged segment.
MAX_HEADER = 1 << 20


@dataclass(frozen=True)
class RevealLayout:
    """The tensors a reveal holds, in file order: (name, dtype tag, shape)."""

    entries: tuple[tuple[str, str, tuple[int, ...]], ...]

    @classmethod
    def for_checks(cls, *, numel: int, trail_every: int, segments: Sequence[int],
                   opened_chunks: int, binding_chunks: int, binding_local: bool | None,
                   payload_bytes: int | None = None) -> RevealLayout:
        """``binding_local``: the binding check opens chunks (True), whole vectors (False),
        or is off (None)."""
        n = chunk_count(numel)
        c, cb = min(opened_chunks, n), min(binding_chunks, n)
        out: list[tuple[str, str, tuple[int, ...]]] = []
        for j in sorted(set(segments)):
            if j > 0:
                out.append((f"s{j}.start_params", "F32", (numel,)))
                if trail_every > 1:
                    out.append((f"s{j}.start_moments", "F32", (2, numel)))
                else:
                    out.append((f"s{j}.start_leaves", "U8", (2, n, LEAF)))
                    out.append((f"s{j}.start_chunks", "F32", (2, c, CHUNK)))
            out.append((f"s{j}.end_leaves", "U8", (3, n, LEAF)))
            out.append((f"s{j}.end_chunks", "F32", (3, c, CHUNK)))
        if binding_local is not None:
            out.append(("final.leaves", "U8", (3, n, LEAF)))
            out.append(("final.ef_leaves", "U8", (n, LEAF)))
        if binding_local:
            out.append(("final.chunks", "F32", (2, cb, CHUNK)))
        elif binding_local is not None:
            out.append(("final.params", "F32", (numel,)))
            out.append(("final.ef", "F32", (numel,)))
        if payload_bytes is not None:
            out.append(("payload", "U8", (payload_bytes,)))
        return cls(tuple(sorted(out)))

    def header(self) -> bytes:
        """The canonical header (with its 8-byte length prefix)."""
        meta: dict[str, object] = {}
        offset = 0
        for name, dtype, shape in self.entries:
            size = math.prod(shape) * _DTYPES[dtype][1]
            meta[name] = {"data_offsets": [offset, offset + size], "dtype": dtype,
                          "shape": list(shape)}
            offset += size
        raw = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return len(raw).to_bytes(8, "little") + raw

    def size(self) -> int:
        """The file's exact size in bytes."""
        return len(self.header()) + sum(math.prod(shape) * _DTYPES[dtype][1]
                                        for _, dtype, shape in self.entries)


#: Writes one tensor's bytes (in row-major order) to the file; called once per entry.
Producer = Callable[[BinaryIO], None]


def write_reveal(out: BinaryIO, layout: RevealLayout, producers: Mapping[str, Producer]
                 ) -> None:
    """Write the reveal file: the header, then each tensor's bytes from its producer."""
    if set(producers) != {name for name, _, _ in layout.entries}:
        raise ValueError("producers must cover exactly the layout's tensors")
    out.write(layout.header())
    for name, dtype, shape in layout.entries:
        start = out.tell()
        producers[name](out)
        written = out.tell() - start
        if written != math.prod(shape) * _DTYPES[dtype][1]:
            raise ValueError(f"{name}: wrote {written} bytes for shape {shape}")


def parse_reveal(data: bytes | memoryview, layout: RevealLayout) -> dict[str, torch.Tensor]:
    """The reveal's tensors as views of ``data``, after checking the file is exactly the
    layout's (header byte for byte, hence names, dtypes, shapes and offsets, and size);
    float32 tensors must be finite. Raises :class:`PayloadError` otherwise."""
    view = memoryview(data).cast("B")
    if view.readonly:  # torch wants a writable buffer; the views are only read
        view = memoryview(bytearray(view))
    expected = layout.header()
    if len(view) != layout.size():
        raise PayloadError(f"reveal is {len(view)} bytes, its checks need {layout.size()}")
    if bytes(view[:len(expected)]) != expected:
        raise PayloadError("reveal header differs from the layout its checks imply")
    out: dict[str, torch.Tensor] = {}
    offset = len(expected)
    for name, dtype, shape in layout.entries:
        torch_dtype, width = _DTYPES[dtype]
        count = math.prod(shape)
        if count == 0:
            out[name] = torch.empty(shape, dtype=torch_dtype)
            continue
        piece = view[offset:offset + count * width]
        tensor = torch.frombuffer(piece, dtype=torch_dtype).view(shape)
        if torch_dtype == torch.float32 and not all_finite(tensor):
            raise PayloadError(f"reveal tensor {name} holds NaN or Inf")
        out[name] = tensor
        offset += count * width
    return out


def reveal_layout(run: RunContext, segments: list[int], *, masked_payload: int | None = None
                  ) -> RevealLayout:
    """The layout of a worker's reveal for these challenged segments."""
    policy = ChallengePolicy.of_run(run.spec)
    return RevealLayout.for_checks(
        numel=run.numel, trail_every=run.inner.trail_every, segments=segments,
        opened_chunks=policy.opened_chunks, binding_chunks=policy.binding_chunks,
        binding_local=binding_is_local(run) if policy.binding else None,
        payload_bytes=masked_payload)


def binding_is_local(run: RunContext) -> bool:
    """Whether the run's codec encodes the binding chunks independently of the rest."""
    unit = run.codec.region_unit()
    return unit is not None and CHUNK % unit == 0
