"""Canonical tensor files and flat parameter vectors.

Models, optimizer states and update payloads travel as safetensors files
(never pickle). A model's content hash is ``sha256`` of its canonical file:
tensors stored as contiguous little-endian float32 under their parameter
names with no metadata, so the same weights give the same bytes and the same
hash on every machine. Decoding is bounded: the file size is checked before
parsing, and the names, shapes and dtypes must match what the run spec
expects; nothing is taken on trust from the file.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence

import torch

from .errors import NonFiniteError, OversizedError, PayloadError

ParamShapes = Sequence[tuple[str, tuple[int, ...]]]

#: Upper bound on a safetensors header; real headers are a few KiB.
MAX_HEADER_BYTES = 1 << 20



#: Elements per slice of :func:`all_finite`'s exact scan (4 MiB of float32).
_FINITE_SCAN = 1 << 20


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite, with no temporary of ``t``'s size.

    A finite sum means finite elements (NaN and Inf propagate through it); only a sum
    that is not finite (a NaN or Inf, or finite terms overflowing) needs the exact scan,
    made in slices. ``torch.isfinite(t).all()`` on a whole model allocates 6 bytes per
    element (``abs`` and two boolean masks): 0.5 GB at 85M parameters, at the end of
    every worker's round.
    """
    flat = t.reshape(-1)
    if bool(torch.isfinite(flat.sum())):
        return True
    return all(bool(torch.isfinite(flat[i:i + _FINITE_SCAN]).all())
               for i in range(0, flat.numel(), _FINITE_SCAN))

def param_shapes(model: torch.nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of the trainable parameters, in module order."""
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]


def numel_of(shapes: ParamShapes) -> int:
    """Total element count of a parameter layout."""
    return sum(math.prod(shape) for _, shape in shapes)


def flatten_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one float32 CPU vector, in ``param_shapes`` order."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def load_flat_params(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector (as made by :func:`flatten_params`) into ``model``."""
    offset = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[offset : offset + n].view_as(p).to(p.dtype))
            offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} elements, model needs {offset}")


def split_flat(flat: torch.Tensor, shapes: ParamShapes) -> dict[str, torch.Tensor]:
    """View a flat vector as named tensors of the given shapes."""
    out: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in shapes:
        n = math.prod(shape)
        out[name] = flat[offset : offset + n].view(shape)
        offset += n
    if offset != flat.numel():
        raise ValueError(f"flat vector has {flat.numel()} elements, layout needs {offset}")
    return out


def join_flat(tensors: Mapping[str, torch.Tensor], shapes: ParamShapes) -> torch.Tensor:
    """Concatenate named tensors into one flat float32 vector in layout order."""
    return torch.cat([tensors[name].reshape(-1).float() for name, _ in shapes])


def _header(shapes: ParamShapes) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The safetensors header of float32 tensors laid out by ``shapes`` exactly as
    ``safetensors.torch.save`` writes it (tensors sorted by name, data in that order, each
    entry's keys dtype, shape, data_offsets; padded with spaces to a multiple of 8), with
    each tensor's (name, flat offset, data offset) in file order."""
    offsets: dict[str, int] = {}
    position = 0
    for name, shape in shapes:
        offsets[name] = position
        position += math.prod(shape)
    order = sorted(dict(shapes).items())
    entries, places, data = [], [], 0
    for name, shape in order:
        size = 4 * math.prod(shape)
        dims = ",".join(str(d) for d in shape)
        entries.append(f'{json.dumps(name)}:{{"dtype":"F32","shape":[{dims}],'
                       f'"data_offsets":[{data},{data + size}]}}')
        places.append((name, offsets[name], data))
        data += size
    raw = ("{" + ",".join(entries) + "}").encode()
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw, places


def encode_flat(flat: torch.Tensor, shapes: ParamShapes) -> bytes:
    """Canonical safetensors bytes of a flat float32 vector laid out by ``shapes``: the
    bytes ``safetensors.torch.save`` writes for the named tensors, built with one copy."""
    vec = flat.detach().to(torch.float32).cpu().reshape(-1).contiguous()
    if vec.numel() != numel_of(shapes):
        raise ValueError(f"flat vector has {vec.numel()} elements, layout needs {numel_of(shapes)}")
    header, places = _header(shapes)
    sizes = {name: math.prod(shape) for name, shape in shapes}
    data = memoryview(vec.numpy()).cast("B")
    return header + b"".join(data[4 * start:4 * (start + sizes[name])]
                             for name, start, _ in places)


def hash_flat(flat: torch.Tensor, shapes: ParamShapes) -> str:
    """``sha256_hex(encode_flat(flat, shapes))`` without building the file."""
    vec = flat.detach().to(torch.float32).cpu().reshape(-1).contiguous()
    header, places = _header(shapes)
    sizes = {name: math.prod(shape) for name, shape in shapes}
    data = memoryview(vec.numpy()).cast("B")
    h = hashlib.sha256(header)
    for name, start, _ in places:
        h.update(data[4 * start:4 * (start + sizes[name])])
    return h.hexdigest()


def decode_flat(data: bytes, shapes: ParamShapes, *, max_bytes: int) -> torch.Tensor:
    """Parse a canonical tensor file into a flat float32 vector.

    Refuses files over ``max_bytes``, headers over :data:`MAX_HEADER_BYTES`,
    any name, shape or dtype that differs from ``shapes``, and non-finite
    values. The header must be the canonical one byte for byte (so the file is
    exactly what :func:`encode_flat` writes); the values are copied once.
    """
    if len(data) > max_bytes:
        raise OversizedError(f"tensor file of {len(data)} bytes exceeds limit {max_bytes}")
    if len(data) < 8:
        raise PayloadError("tensor file shorter than its header length")
    header_len = int.from_bytes(data[:8], "little")
    if header_len > MAX_HEADER_BYTES or 8 + header_len > len(data):
        raise PayloadError(f"tensor file header length {header_len} out of bounds")
    expected_bytes = 8 + header_len + 4 * numel_of(shapes)
    if len(data) != expected_bytes:
        raise PayloadError(f"tensor file is {len(data)} bytes, layout needs {expected_bytes}")
    header, places = _header(shapes)
    if data[:len(header)] != header:
        raise PayloadError("tensor file names, shapes or dtypes differ from the run's "
                           "parameter layout")
    sizes = {name: math.prod(shape) for name, shape in shapes}
    flat = torch.empty(numel_of(shapes), dtype=torch.float32)
    out = memoryview(flat.numpy()).cast("B")
    body = memoryview(data)[len(header):]
    for name, start, at in places:
        n = 4 * sizes[name]
        out[4 * start:4 * start + n] = body[at:at + n]
    if not all_finite(flat):
        raise NonFiniteError("tensor file holds NaN or Inf")
    return flat


def canonical_safetensors(data: bytes) -> bytes:
    """``data``, a safetensors file as ``safetensors.save`` wrote it, with its header
    written canonically: sorted keys, no spaces, padded with spaces to a multiple of 8
    bytes. safetensors orders ``__metadata__`` differently in every process, so without
    this the same content has another hash after a restart."""
    n = int.from_bytes(data[:8], "little")
    header = json.dumps(json.loads(data[8:8 + n]), sort_keys=True, separators=(",", ":"),
                        ensure_ascii=True).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data[8 + n:]


def sha256_hex(data: bytes) -> str:
    """Content hash used for every blob: lowercase hex sha256."""
    return hashlib.sha256(data).hexdigest()
