"""Hostile payloads: every malformed input is refused with a PayloadError subclass.

Never another exception type, never a crash, never an allocation sized by the
payload.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from veritrain.protocol.codecs import HEADER_SIZE, OversizedPayloadError, get_codec
from veritrain.protocol.codecs.base import BaseCodec
from veritrain.protocol.codecs.bitpack import pack_bits, packed_size, unpack_bits
from veritrain.protocol.codecs.sparse import SparseLayout
from veritrain.protocol.errors import NonFiniteError, OversizedError, PayloadError

FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

CASES = [
    ("fp32", {}),
    ("fp16", {}),
    ("bf16", {}),
    ("int8", {"block": 16}),
    ("int4", {"block": 16}),
    ("topk", {"chunk": 64, "k": 6, "value_bits": 1}),
    ("topk", {"chunk": 100, "k": 7, "value_bits": 3}),
    ("topk", {"chunk": 64, "k": 6, "value_bits": 2, "dct_block": 32}),
    ("cocktail", {"chunk": 60, "sample": 4, "k": 5, "value_bits": 4}),
    ("lloyd", {"bits": 3, "block": 16}),
    ("lowrank", {"layout": "12x9,5,7x20", "rank": 2, "bits": 3, "vec_block": 16}),
]
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(CASES)]
NUMEL = 301
SEED = 77


def make(name: str, params: dict[str, object]) -> tuple[BaseCodec, bytes]:
    codec = get_codec(name, params)
    assert isinstance(codec, BaseCodec)
    x = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    return codec, codec.encode(x, seed=SEED)


def decode_or_reject(codec: BaseCodec, payload: bytes) -> None:
    """The only acceptable outcomes: a finite vector of the right shape, or a PayloadError."""
    try:
        out = codec.decode(payload, NUMEL, seed=SEED)
    except PayloadError:
        return
    assert out.shape == (NUMEL,) and out.dtype == torch.float32
    assert bool(torch.isfinite(out).all())


def with_header(payload: bytes, **fields: int | bytes) -> bytes:
    names = ["magic", "version", "codec_id", "reserved", "numel", "seed", "digest"]
    values = dict(zip(names, struct.unpack_from("<4sBBHQQ8s", payload), strict=True))
    values.update(fields)
    return struct.pack("<4sBBHQQ8s", *(values[n] for n in names)) + payload[HEADER_SIZE:]


def sparse_parts(
    codec: BaseCodec, payload: bytes
) -> tuple[SparseLayout, np.ndarray, np.ndarray, np.ndarray]:
    lay = codec.layout(NUMEL)  # type: ignore[attr-defined]
    idx, codes, scales = lay.unpack(memoryview(payload)[HEADER_SIZE:], "test")
    return lay, idx, codes, scales


def sparse_payload(
    payload: bytes, lay: SparseLayout, idx: np.ndarray, codes: np.ndarray, scales: np.ndarray
) -> bytes:
    return payload[:HEADER_SIZE] + lay.pack(idx, codes, scales)


# -- any codec ----------------------------------------------------------------


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_invalid_truncated(name: str, params: dict[str, object]) -> None:
    codec, payload = make(name, params)
    for cut in (0, 1, 4, HEADER_SIZE - 1, HEADER_SIZE, len(payload) // 2, len(payload) - 1):
        with pytest.raises(PayloadError, match="truncated"):
            codec.decode(payload[:cut], NUMEL, seed=SEED)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_invalid_extended(name: str, params: dict[str, object]) -> None:
    codec, payload = make(name, params)
    for extra in (b"\0", b"x" * 1000):
        with pytest.raises(OversizedPayloadError) as info:
            codec.decode(payload + extra, NUMEL, seed=SEED)
        assert isinstance(info.value, PayloadError) and isinstance(info.value, OversizedError)
        assert info.value.reason == "oversized"


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_invalid_header_fields(name: str, params: dict[str, object]) -> None:
    codec, payload = make(name, params)
    bad = {
        "magic": (with_header(payload, magic=b"PKL\x00"), "magic"),
        "version": (with_header(payload, version=2), "version"),
        "codec": (with_header(payload, codec_id=(codec.codec_id % 7) + 1), "codec id"),
        "reserved": (with_header(payload, reserved=1), "reserved"),
        "numel": (with_header(payload, numel=NUMEL + 1), "numel"),
        "huge numel": (with_header(payload, numel=2**64 - 1), "numel"),
        "digest": (with_header(payload, digest=b"\0" * 8), "digest"),
        "seed": (with_header(payload, seed=SEED + 1 if codec.uses_seed else 5), "seed"),
    }
    for data, match in bad.values():
        with pytest.raises(PayloadError, match=match):
            codec.decode(data, NUMEL, seed=SEED)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_invalid_payload_for_other_params_or_numel(name: str, params: dict[str, object]) -> None:
    codec, payload = make(name, params)
    with pytest.raises(PayloadError):
        codec.decode(payload, NUMEL - 1, seed=SEED)
    for other_name, other_params in CASES:
        other = get_codec(other_name, other_params)
        if other == codec:
            continue
        with pytest.raises(PayloadError):
            other.decode(payload, NUMEL, seed=SEED)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
def test_invalid_huge_declared_size_is_refused_without_allocating(
    name: str, params: dict[str, object]
) -> None:
    codec, payload = make(name, params)
    # a run spec claiming 2^40 elements: the payload is far too short, refused before any allocation
    with pytest.raises(PayloadError, match="truncated"):
        codec.decode(payload, 2**40, seed=SEED)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
@FUZZ
@given(data=st.data())
def test_invalid_random_bytes(name: str, params: dict[str, object], data: st.DataObject) -> None:
    codec, payload = make(name, params)
    junk = data.draw(st.binary(min_size=0, max_size=len(payload) + 8))
    decode_or_reject(codec, junk)
    same_len = data.draw(st.binary(min_size=len(payload), max_size=len(payload)))
    with pytest.raises(PayloadError):  # random headers never pass the magic and digest checks
        codec.decode(same_len, NUMEL, seed=SEED)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
@FUZZ
@given(data=st.data())
def test_invalid_random_body_behind_a_valid_header(
    name: str, params: dict[str, object], data: st.DataObject
) -> None:
    codec, payload = make(name, params)
    body = data.draw(
        st.binary(min_size=len(payload) - HEADER_SIZE, max_size=len(payload) - HEADER_SIZE)
    )
    decode_or_reject(codec, payload[:HEADER_SIZE] + body)


@pytest.mark.parametrize(("name", "params"), CASES, ids=IDS)
@FUZZ
@given(data=st.data())
def test_invalid_bit_flips(name: str, params: dict[str, object], data: st.DataObject) -> None:
    codec, payload = make(name, params)
    buf = bytearray(payload)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(HEADER_SIZE, len(buf) - 1))
        buf[pos] ^= 1 << data.draw(st.integers(0, 7))
    decode_or_reject(codec, bytes(buf))


def test_invalid_payload_types() -> None:
    codec = get_codec("fp32")
    for bad in (None, "text", 12, [1, 2]):
        with pytest.raises(PayloadError, match="bytes"):
            codec.decode(bad, 3)  # type: ignore[arg-type]
    # bytearray and memoryview are accepted
    x = torch.ones(3)
    payload = codec.encode(x)
    assert torch.equal(codec.decode(bytearray(payload), 3), x)  # type: ignore[arg-type]
    assert torch.equal(codec.decode(memoryview(payload), 3), x)  # type: ignore[arg-type]


@pytest.mark.parametrize("numel", [0, -1, True, 2.0, 2**41])
def test_invalid_numel_argument_is_a_caller_bug(numel: object) -> None:
    codec = get_codec("fp32")
    with pytest.raises(ValueError) as info:
        codec.decode(b"", numel)  # type: ignore[arg-type]
    assert not isinstance(info.value, PayloadError)


@pytest.mark.parametrize(
    "update",
    [
        torch.ones(3, dtype=torch.float64),
        torch.ones(2, 2),
        torch.zeros(0),
        torch.tensor([1.0, float("nan")]),
        torch.tensor([float("inf"), 1.0]),
        [1.0, 2.0],
    ],
    ids=["float64", "2d", "empty", "nan", "inf", "list"],
)
def test_invalid_encode_inputs(update: object) -> None:
    for name in ("fp32", "int8", "topk", "cocktail"):
        with pytest.raises(ValueError):
            get_codec(name).encode(update)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [-1, 2**64, True, 1.5])
def test_invalid_seed(seed: object) -> None:
    with pytest.raises(ValueError, match="seed"):
        get_codec("cocktail").encode(torch.ones(8), seed=seed)  # type: ignore[arg-type]


# -- dense codecs: non-finite values ----------------------------------------------


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("fp32", np.array([np.nan], dtype="<f4").tobytes()),
        ("fp32", np.array([-np.inf], dtype="<f4").tobytes()),
        ("fp16", np.array([np.inf], dtype="<f2").tobytes()),
        ("fp16", np.array([0x7E01], dtype="<u2").tobytes()),
        ("bf16", np.array([0x7F80], dtype="<u2").tobytes()),
        ("bf16", np.array([0xFFC1], dtype="<u2").tobytes()),
    ],
)
def test_invalid_non_finite_dense_values(name: str, bad: bytes) -> None:
    codec = get_codec(name)
    payload = bytearray(codec.encode(torch.ones(5)))
    payload[HEADER_SIZE + len(bad) : HEADER_SIZE + 2 * len(bad)] = bad  # element 1
    with pytest.raises(NonFiniteError):
        codec.decode(bytes(payload), 5)


# -- blockwise -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int8", "int4", "lloyd"])
@pytest.mark.parametrize(
    ("scale_bits", "error"),
    [
        (0x7FC00000, NonFiniteError),  # NaN
        (0x7F800000, NonFiniteError),  # +Inf
        (0xFF800000, NonFiniteError),  # -Inf
        (0xBF800000, PayloadError),  # -1.0
        (0x80000000, PayloadError),  # -0.0
        (0x7F7FFFFF, NonFiniteError),  # FLT_MAX: q * scale overflows to Inf
    ],
)
def test_invalid_blockwise_scales(name: str, scale_bits: int, error: type[Exception]) -> None:
    codec = get_codec(name, {"block": 4})
    payload = bytearray(codec.encode(torch.tensor([1.0, -2.0, 3.0, 4.0, 5.0])))
    struct.pack_into("<I", payload, HEADER_SIZE + 4, scale_bits)  # second block's scale
    if name == "lloyd" and scale_bits == 0x7F7FFFFF:  # lloyd saturates instead
        out = codec.decode(bytes(payload), 5)
        assert float(out[4].abs()) == float(torch.finfo(torch.float32).max)
        return
    with pytest.raises(error):
        codec.decode(bytes(payload), 5)


def test_invalid_int8_code_minus_128() -> None:
    codec = get_codec("int8", {"block": 4})
    payload = bytearray(codec.encode(torch.tensor([1.0, -2.0, 3.0])))
    payload[HEADER_SIZE + 4 + 1] = 0x80
    with pytest.raises(PayloadError, match="-128"):
        codec.decode(bytes(payload), 3)


def test_invalid_int4_field_zero_and_padding() -> None:
    codec = get_codec("int4", {"block": 4})
    payload = codec.encode(torch.tensor([1.0, -2.0, 3.0]))  # 3 nibbles + 4 padding bits
    body = HEADER_SIZE + 4
    zero_field = bytearray(payload)
    zero_field[body] &= 0xF0
    with pytest.raises(PayloadError, match="field 0"):
        codec.decode(bytes(zero_field), 3)
    padding = bytearray(payload)
    padding[body + 1] |= 0x80
    with pytest.raises(PayloadError, match="padding"):
        codec.decode(bytes(padding), 3)


# -- sparse codecs ---------------------------------------------------------------

SPARSE = [(n, p) for n, p in CASES if n in ("topk", "cocktail")]
SPARSE_IDS = [f"{n}-{i}" for i, (n, _) in enumerate(SPARSE)]


@pytest.mark.parametrize(("name", "params"), SPARSE, ids=SPARSE_IDS)
def test_invalid_duplicate_and_unsorted_indices(name: str, params: dict[str, object]) -> None:
    codec, payload = make(name, params)
    lay, idx, codes, scales = sparse_parts(codec, payload)
    dup = idx.copy()
    dup[1, 1] = dup[1, 0]
    with pytest.raises(PayloadError, match="strictly increasing"):
        codec.decode(sparse_payload(payload, lay, dup, codes, scales), NUMEL, seed=SEED)
    swapped = idx.copy()
    swapped[0, [0, 1]] = swapped[0, [1, 0]]
    with pytest.raises(PayloadError, match="strictly increasing"):
        codec.decode(sparse_payload(payload, lay, swapped, codes, scales), NUMEL, seed=SEED)
    # unchanged parts re-pack to the original bytes: the mutation alone is refused
    assert sparse_payload(payload, lay, idx, codes, scales) == payload


# where the width is a power of two every index value that fits the bits is in range
RAGGED = [
    (n, p)
    for n, p in SPARSE
    if get_codec(n, p).layout(1).width & (get_codec(n, p).layout(1).width - 1)
]


@pytest.mark.parametrize(("name", "params"), RAGGED, ids=[n for n, _ in RAGGED])
def test_invalid_index_out_of_range(name: str, params: dict[str, object]) -> None:
    codec, payload = make(name, params)
    lay, idx, codes, scales = sparse_parts(codec, payload)
    bad = idx.copy()
    bad[2, -1] = (1 << lay.index_bits) - 1  # fits the bits, beyond the chunk
    with pytest.raises(PayloadError, match="out of range"):
        codec.decode(sparse_payload(payload, lay, bad, codes, scales), NUMEL, seed=SEED)


def test_invalid_index_out_of_range_topk_chunk_100() -> None:
    """Explicitly covered: chunk 100 has 7-bit indices, so 100..127 must be refused."""
    codec, payload = make("topk", {"chunk": 100, "k": 7, "value_bits": 3})
    lay, idx, codes, scales = sparse_parts(codec, payload)
    bad = idx.copy()
    bad[0, -1] = 100
    with pytest.raises(PayloadError, match="out of range"):
        codec.decode(sparse_payload(payload, lay, bad, codes, scales), NUMEL)


@pytest.mark.parametrize(("name", "params"), SPARSE, ids=SPARSE_IDS)
@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (np.nan, NonFiniteError, "NaN"),
        (np.inf, NonFiniteError, "NaN"),
        (-1.0, PayloadError, "negative"),
        (np.float32(3.4e38), None, None),  # legal but huge: overflow is refused, not crashed
    ],
)
def test_invalid_sparse_scales(
    name: str, params: dict[str, object], value: float, error: type[Exception] | None, match: str
) -> None:
    codec, payload = make(name, params)
    lay, idx, codes, scales = sparse_parts(codec, payload)
    bad = scales.copy()
    bad[1, -1] = value
    data = sparse_payload(payload, lay, idx, codes, bad)
    if error is None:
        decode_or_reject(codec, data)
        return
    with pytest.raises(error, match=match):
        codec.decode(data, NUMEL, seed=SEED)


TWO_SCALES = [(n, p) for n, p in SPARSE if p["value_bits"] != 1]


@pytest.mark.parametrize(("name", "params"), TWO_SCALES, ids=[n for n, _ in TWO_SCALES])
def test_invalid_sparse_lo_above_hi(name: str, params: dict[str, object]) -> None:
    codec, payload = make(name, params)
    lay, idx, codes, scales = sparse_parts(codec, payload)
    bad = scales.copy()
    bad[0] = [2.0, 1.0]
    with pytest.raises(PayloadError, match="lo exceeds hi"):
        codec.decode(sparse_payload(payload, lay, idx, codes, bad), NUMEL, seed=SEED)


def test_invalid_sparse_padding_bits() -> None:
    codec, payload = make("topk", {"chunk": 64, "k": 5, "value_bits": 3})
    lay = codec.layout(NUMEL)  # type: ignore[attr-defined]
    assert (lay.rows * lay.k * lay.value_bits) % 8  # the code stream ends mid-byte
    buf = bytearray(payload)
    buf[-1] |= 0x80
    with pytest.raises(PayloadError, match="padding"):
        codec.decode(bytes(buf), NUMEL)


def test_cocktail_wrong_seed_is_refused() -> None:
    codec, payload = make("cocktail", {"chunk": 60, "sample": 4, "k": 5, "value_bits": 4})
    with pytest.raises(PayloadError, match="seed"):
        codec.decode(payload, NUMEL, seed=SEED + 1)


# -- bit packing -------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(bits=st.integers(1, 32), data=st.data())
def test_bitpack_roundtrip(bits: int, data: st.DataObject) -> None:
    values = data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=200))
    arr = np.array(values, dtype=np.int64)
    packed = pack_bits(arr, bits)
    assert len(packed) == packed_size(len(values), bits)
    assert unpack_bits(packed, bits, len(values)).astype(np.int64).tolist() == values
    # the layout: value i at stream bits [i*bits, (i+1)*bits), LSB first
    as_int = int.from_bytes(packed, "little")
    assert [(as_int >> (i * bits)) & ((1 << bits) - 1) for i in range(len(values))] == values


def test_bitpack_large_generic_path() -> None:
    arr = np.arange(200_000, dtype=np.int64) % 4093
    assert np.array_equal(unpack_bits(pack_bits(arr, 12), 12, arr.size), arr)


@pytest.mark.parametrize("bits", [3, 5, 6, 7])
def test_bitpack_odd_widths_match_the_bit_by_bit_layout(bits: int) -> None:
    """The eight-values-per-word path for widths below 8 lays bits out exactly as a
    bit-by-bit packer does (value i at stream bits [i*bits, (i+1)*bits), LSB first)."""
    arr = (np.arange(100_003, dtype=np.int64) * 2654435761 >> 7) % (1 << bits)
    bitmat = (arr[:, None] >> np.arange(bits)) & 1
    expected = np.packbits(bitmat.astype(np.uint8).reshape(-1), bitorder="little").tobytes()
    assert pack_bits(arr.astype(np.uint8), bits) == expected
    assert pack_bits(arr, bits) == expected
    assert np.array_equal(unpack_bits(expected, bits, arr.size), arr)


def test_invalid_bitpack_stream_length_and_padding() -> None:
    with pytest.raises(PayloadError, match="expected"):
        unpack_bits(b"\0\0", 12, 2)
    with pytest.raises(PayloadError, match="padding"):
        unpack_bits(b"\0\x10", 12, 1)
    with pytest.raises(ValueError):
        pack_bits(np.array([8]), 3)
