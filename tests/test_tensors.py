"""Canonical tensor files: the lean encoder writes exactly safetensors' bytes, the decoder
takes exactly that layout back and refuses anything else."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save
from veritrain.protocol.errors import NonFiniteError, OversizedError, PayloadError
from veritrain.protocol.tensors import decode_flat, encode_flat, hash_flat, sha256_hex, split_flat

NAMES = st.from_regex(r"[a-z][a-z0-9_]{0,6}(\.[a-z0-9_]{1,6}){0,3}", fullmatch=True)
SHAPES = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)


@st.composite
def layouts(draw) -> list[tuple[str, tuple[int, ...]]]:  # type: ignore[no-untyped-def]
    names = draw(st.lists(NAMES, min_size=1, max_size=6, unique=True))
    return [(name, draw(SHAPES)) for name in names]


@settings(max_examples=200, deadline=None)
@given(layout=layouts(), seed=st.integers(0, 2**31))
def test_encode_flat_writes_safetensors_bytes_and_decodes_back(layout, seed):
    numel = sum(math.prod(shape) for _, shape in layout)
    flat = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    named = {name: t.clone().contiguous() for name, t in split_flat(flat, layout).items()}
    data = encode_flat(flat, layout)
    assert data == st_save(named)
    assert torch.equal(decode_flat(data, layout, max_bytes=len(data)), flat)
    assert hash_flat(flat, layout) == sha256_hex(data)


def test_invalid_tensor_files_are_refused():
    layout = [("b", (2, 3)), ("a", (4,))]
    flat = torch.arange(10, dtype=torch.float32)
    good = encode_flat(flat, layout)
    with pytest.raises(OversizedError):
        decode_flat(good, layout, max_bytes=len(good) - 1)
    for bad in (good[:-4], good + b"\0\0\0\0", good[:7], b""):
        with pytest.raises(PayloadError):
            decode_flat(bad, layout, max_bytes=1 << 20)
    with pytest.raises(PayloadError):  # another layout of the same size
        decode_flat(good, [("a", (6,)), ("b", (4,))], max_bytes=1 << 20)
    nan = flat.clone()
    nan[3] = float("nan")
    with pytest.raises(NonFiniteError):
        decode_flat(encode_flat(nan, layout), layout, max_bytes=1 << 20)
    with pytest.raises(ValueError):
        encode_flat(flat[:9], layout)
