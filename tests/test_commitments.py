"""Chunked state commitments: the leaves do not depend on how the hashing is split."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from veritrain.protocol.commitments import (
    CHUNK,
    LEAF,
    chunk_count,
    chunk_matches,
    chunk_ranges,
    hash_chunks,
    leaves_of,
)


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_chunk_ranges_cover_every_chunk_once_in_order(n: int, parts: int) -> None:
    ranges = chunk_ranges(n, parts)
    assert all(b > a for a, b in ranges)
    assert [i for a, b in ranges for i in range(a, b)] == list(range(n))
    assert len(ranges) == min(parts, n)
    sizes = [b - a for a, b in ranges]
    assert not sizes or max(sizes) - min(sizes) <= 1  # an even split: no thread waits on one


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5 * CHUNK + 7), st.integers(1, 6), st.integers(0, 2**32 - 1))
def test_leaves_split_over_threads_equal_the_serial_leaves(numel: int, parts: int,
                                                           seed: int) -> None:
    vec = np.random.default_rng(seed).standard_normal(numel).astype("<f4")
    serial = leaves_of(vec.tobytes())
    with ThreadPoolExecutor(parts) as pool:
        split = leaves_of(vec.tobytes(), pool=pool, parts=parts)
    assert split == serial and len(serial) == LEAF * chunk_count(numel)
    joined = b"".join(hash_chunks(memoryview(vec.tobytes()), a, b)
                      for a, b in chunk_ranges(chunk_count(numel), parts))
    assert joined == serial
    last = chunk_count(numel) - 1
    assert chunk_matches(serial, last, vec[last * CHUNK:].tobytes())
    vec[-1] += 1.0  # one value changed: its chunk's leaf changes, no other
    other = leaves_of(vec.tobytes())
    assert other[:LEAF * last] == serial[:LEAF * last] and other[LEAF * last:] != serial[LEAF * last:]


def test_leaves_refuse_bytes_that_are_not_float32_values() -> None:
    with pytest.raises(ValueError, match="float32"):
        leaves_of(b"\x00" * 6)
