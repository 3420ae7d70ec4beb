"""The lowrank codec: layouts, round trips, error bounds, determinism, hostile payloads."""

from __future__ import annotations

import hashlib
import struct

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from veritrain.protocol.codecs import HEADER_SIZE, ErrorFeedback, get_codec, layout_for
from veritrain.protocol.codecs.bitpack import pack_bits, unpack_bits
from veritrain.protocol.codecs.lowrank import MAX_DIM, LowRankCodec, parse_layout
from veritrain.protocol.errors import NonFiniteError, PayloadError

FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])

LAYOUT = "40x24,24,24x56,8,16x16"  # 960 + 24 + 1344 + 8 + 256 = 2592 elements
LAYOUT_NUMEL = 2592


def rand(numel: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed))


def low_rank(rows: int, cols: int, rank: int, seed: int, decay: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(rows, rank, generator=g, dtype=torch.float64)
    v = torch.randn(rank, cols, generator=g, dtype=torch.float64)
    s = torch.tensor([decay**i for i in range(rank)], dtype=torch.float64)
    return ((u * s) @ v).float()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def pattern(numel: int) -> torch.Tensor:
    """Platform-independent input: exact float32 arithmetic on integers only."""
    i = np.arange(numel, dtype=np.int64)
    a = ((i * 7919) % 10007 - 5003).astype(np.float32) / np.float32(1024)
    scale = (2.0 ** ((i // 1000) % 7 - 3)).astype(np.float32)
    return torch.from_numpy(a * scale)


# -- layout ------------------------------------------------------------------


def test_parse_layout_and_layout_for() -> None:
    assert parse_layout("") == ()
    assert parse_layout("256x128,64,3x1") == ((256, 128), (64,), (3, 1))
    shapes = [("w", (256, 128)), ("b", (128,)), ("g", (128,)), ("c", (2, 3, 4)), ("s", ()),
              ("big", (MAX_DIM + 1, 1))]
    assert layout_for(shapes) == f"256x128,256,2x12,{1 + MAX_DIM + 1}"
    assert sum(int(np.prod(d)) for d in parse_layout(layout_for(shapes))) == 256 * 128 + 256 + 24 + 1 + MAX_DIM + 1


def test_model_layout_binds_to_the_run_model_and_codes_like_the_explicit_one() -> None:
    shapes = [("emb", (40, 24)), ("b", (24,)), ("proj", (24, 56)), ("g", (8,)), ("out", (16, 16))]
    assert layout_for(shapes) == LAYOUT
    unbound = get_codec("lowrank", {"layout": "model", "rank": 3})
    with pytest.raises(ValueError, match="model shapes"):
        unbound.encode(rand(LAYOUT_NUMEL))
    bound = unbound.bind_model(shapes)
    explicit = get_codec("lowrank", {"layout": LAYOUT, "rank": 3})
    assert bound.params() == unbound.params() and bound.params()["layout"] == "model"
    assert explicit.bind_model(shapes) is explicit
    x = rand(LAYOUT_NUMEL, 3)
    a, b = bound.encode(x), explicit.encode(x)
    assert a[HEADER_SIZE:] == b[HEADER_SIZE:]  # same factors; the header digest says "model"
    assert a[:HEADER_SIZE] != b[:HEADER_SIZE]
    assert torch.equal(bound.decode(a, LAYOUT_NUMEL), explicit.decode(b, LAYOUT_NUMEL))
    with pytest.raises(PayloadError, match="digest"):
        explicit.decode(a, LAYOUT_NUMEL)
    # Much deeper than a written layout may be: no length limit.
    deep = [(f"w{i}", (64, 48)) for i in range(2000)]
    assert len(layout_for(deep)) > 4000
    codec = unbound.bind_model(deep)
    assert codec.max_encoded_size(64 * 48 * 2000) < 64 * 48 * 2000 * 4 // 10


def test_run_context_binds_a_model_layout() -> None:
    from veritrain.protocol.identity import Identity
    from veritrain.protocol.organiser import build_run
    from veritrain.protocol.presets import run_preset
    from veritrain.protocol.runtime import RunContext

    settings = run_preset("tiny")
    settings["codec"] = {"name": "lowrank", "params": {"layout": "model", "rank": 2}}
    bundle = build_run(Identity.generate("organiser"), "lowrank-run", settings,
                       [Identity.generate("validator").public])
    run = RunContext.build(bundle.signed.message, bundle.dataset)
    assert isinstance(run.codec, LowRankCodec)
    assert run.codec.layout_dims == parse_layout(layout_for(run.shapes))
    assert any(len(d) == 2 for d in run.codec.layout_dims)
    x = rand(run.numel, 5)
    payload = run.codec.encode(x)
    assert len(payload) < run.numel  # far below 4 bytes per value: the matrices are factored
    assert run.codec.decode(payload, run.numel).shape == x.shape


@pytest.mark.parametrize(
    ("layout", "match"),
    [("0x5", "bad layout"), ("05", "bad layout"), ("3x", "bad layout"), ("3 x4", "bad layout"),
     ("1,,2", "bad layout"), ("2x3x4", "bad layout"), ("-1", "bad layout"), ("x", "bad layout"),
     (f"{MAX_DIM + 1}x2", "side above"), ("9" * 13 + "x" + "9" * 13, "side above"),
     ("1" * 4001, "at most")],
)
def test_invalid_layouts(layout: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_codec("lowrank", {"layout": layout})


@pytest.mark.parametrize(
    ("params", "match"),
    [({"rank": 0}, "rank"), ({"rank": 65}, "rank"), ({"bits": 1}, "bits"), ({"bits": 9}, "bits"),
     ({"iters": 0}, "iters"), ({"vec_bits": 1}, "vec_bits"), ({"vec_block": 0}, "vec_block"),
     ({"rank": True}, "must be int"), ({"layout": 5}, "must be str")],
)
def test_invalid_params(params: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        get_codec("lowrank", params)


def test_params_canonical_and_digest_covers_layout() -> None:
    codec = get_codec("lowrank", {"layout": LAYOUT, "rank": 3})
    params = codec.params()
    assert list(params) == sorted(params)
    assert get_codec("lowrank", params) == codec
    other = get_codec("lowrank", {"layout": "40x24,24,24x56,8,256", "rank": 3})
    assert isinstance(codec, LowRankCodec) and isinstance(other, LowRankCodec)
    assert codec.digest != other.digest


def test_layout_larger_than_numel_is_a_caller_bug() -> None:
    codec = get_codec("lowrank", {"layout": LAYOUT})
    with pytest.raises(ValueError, match="layout covers more"):
        codec.encode(rand(LAYOUT_NUMEL - 1))
    with pytest.raises(ValueError, match="layout covers more"):
        codec.decode(b"\0" * 100, LAYOUT_NUMEL - 1)


# -- sizes and round trips -------------------------------------------------------


def test_exact_size_formula() -> None:
    codec = get_codec("lowrank", {"layout": LAYOUT, "rank": 3, "bits": 5, "vec_bits": 3,
                                  "vec_block": 10})
    numel = LAYOUT_NUMEL + 7
    mats = [(40, 24), (24, 56), (16, 16)]
    n_f = sum(3 * (r + c) for r, c in mats)
    n_vec = 24 + 8 + 7
    want = 4 * 3 + (9 * 4 + 7) // 8 + (n_f * 5 + 7) // 8 + 4 * 4 + (n_vec * 3 + 7) // 8
    assert codec.max_encoded_size(numel) == HEADER_SIZE + want
    assert len(codec.encode(rand(numel))) == HEADER_SIZE + want


@FAST
@given(
    rows=st.integers(1, 40), cols=st.integers(1, 40), rank=st.integers(1, 6),
    extra=st.integers(0, 50), seed=st.integers(0, 2**31),
    scale_exp=st.integers(-30, 30),
)
def test_roundtrip_any_shape(rows: int, cols: int, rank: int, extra: int, seed: int,
                             scale_exp: int) -> None:
    codec = get_codec("lowrank", {"layout": f"{rows}x{cols}", "rank": rank})
    numel = rows * cols + extra
    x = rand(numel, seed) * 2.0**scale_exp
    payload = codec.encode(x)
    assert len(payload) == codec.max_encoded_size(numel)
    y = codec.decode(payload, numel)
    assert y.dtype == torch.float32 and y.shape == (numel,)
    assert bool(torch.isfinite(y).all())
    # the rank-r part never adds energy beyond a quantisation margin
    m, mh = x[: rows * cols], y[: rows * cols]
    assert float(mh.double().norm()) <= 1.3 * float(m.double().norm()) + 1e-30


@FAST
@given(seed=st.integers(0, 2**31), rank=st.integers(1, 5), scale_exp=st.integers(-40, 40))
def test_matrix_of_rank_r_is_recovered(seed: int, rank: int, scale_exp: int) -> None:
    m = low_rank(48, 32, rank, seed) * 2.0**scale_exp
    codec = get_codec("lowrank", {"layout": "48x32", "rank": rank, "bits": 8, "iters": 2})
    y = codec.decode(codec.encode(m.reshape(-1)), m.numel())
    # only 8-bit quantisation of the two factors remains
    assert rel(y, m.reshape(-1)) < 0.03


@FAST
@given(seed=st.integers(0, 2**31))
def test_error_close_to_best_rank_r(seed: int) -> None:
    """With a spectrum decaying by 2x per component, iters=6 and 8-bit factors come within
    10% (+ quantisation) of the truncated SVD (Eckart-Young optimum)."""
    g = torch.Generator().manual_seed(seed)
    u, _ = torch.linalg.qr(torch.randn(64, 24, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(48, 24, generator=g, dtype=torch.float64))
    sv = torch.tensor([0.5**i for i in range(24)], dtype=torch.float64)  # exact spectrum
    m = ((u * sv) @ v.T).float() + 0.001 * rand(64 * 48, seed + 1).view(64, 48)
    r = 4
    s = torch.linalg.svdvals(m.double())
    best = float((s[r:] ** 2).sum().sqrt() / (s**2).sum().sqrt())
    codec = get_codec("lowrank", {"layout": "64x48", "rank": r, "bits": 8, "iters": 6})
    y = codec.decode(codec.encode(m.reshape(-1)), m.numel())
    assert rel(y, m.reshape(-1)) <= 1.1 * best + 0.02


@FAST
@given(x=st.lists(st.floats(-(2.0**100), 2.0**100, width=32), min_size=1, max_size=200),
       bits=st.integers(2, 8), block=st.integers(1, 70))
def test_vector_part_error_within_half_step(x: list[float], bits: int, block: int) -> None:
    v = torch.tensor(x, dtype=torch.float32)
    codec = get_codec("lowrank", {"vec_bits": bits, "vec_block": block})
    y = codec.decode(codec.encode(v), v.numel())
    qmax = (1 << (bits - 1)) - 1
    n = v.numel()
    pad = torch.zeros(-(-n // block) * block)
    pad[:n] = v.abs()
    step = (pad.view(-1, block).amax(dim=1) / qmax).repeat_interleave(block)[:n]
    # Plus one float32 subnormal: a block of subnormals has a step that underflows to 0.
    tiny = 2.0**-149  # the smallest float32 subnormal
    assert bool(((y.double() - v.double()).abs() <= step.double() * 0.5000001 + tiny).all())


def test_zero_and_tiny_inputs() -> None:
    codec = get_codec("lowrank", {"layout": LAYOUT, "rank": 3})
    for x in (torch.zeros(LAYOUT_NUMEL), torch.full((LAYOUT_NUMEL,), 1e-45)):
        y = codec.decode(codec.encode(x), LAYOUT_NUMEL)
        assert bool(torch.isfinite(y).all())
        assert float((y - x).abs().max()) <= 1e-44


def test_rank_deficient_and_rank_above_shape() -> None:
    m = torch.zeros(10, 8)
    m[:, 0] = torch.arange(10.0)  # rank 1, rank asked 8 (> rank, = cols)
    codec = get_codec("lowrank", {"layout": "10x8", "rank": 8, "bits": 8})
    y = codec.decode(codec.encode(m.reshape(-1)), 80)
    assert rel(y, m.reshape(-1)) < 0.01


def test_error_feedback_sum_identity() -> None:
    codec = get_codec("lowrank", {"layout": LAYOUT, "rank": 2, "bits": 4})
    ef = ErrorFeedback(LAYOUT_NUMEL)
    true = torch.zeros(LAYOUT_NUMEL, dtype=torch.float64)
    sent = torch.zeros(LAYOUT_NUMEL, dtype=torch.float64)
    for step in range(12):
        delta = rand(LAYOUT_NUMEL, step)
        _, dec = ef.step(codec, delta)
        true += delta.double()
        sent += dec.double()
    assert float((true - sent - ef.residual.double()).abs().max()) < 1e-3
    assert ef.norm() < float(true.norm())


# -- determinism -----------------------------------------------------------------


def test_deterministic_and_thread_independent() -> None:
    layout = ",".join(["384x128", "384", "128x128", "512x128", "128x512", "640"] * 2)
    numel = sum(int(np.prod(d)) for d in parse_layout(layout)) + 100
    codec = get_codec("lowrank", {"layout": layout, "rank": 6})
    x = rand(numel, 1) * torch.exp(rand(numel, 2))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = codec.encode(x)
        dec_one = codec.decode(one, numel)
        torch.set_num_threads(2)
        two = codec.encode(x)
        dec_two = codec.decode(two, numel)
    finally:
        torch.set_num_threads(before)
    assert one == two == codec.encode(x.clone())
    assert torch.equal(dec_one.view(torch.int32), dec_two.view(torch.int32))


# Pins the byte format and the arithmetic (payload, decoded vector): a change needs a
# format version bump (specs/codecs.md, determinism rules).
GOLDEN = (
    "508497db0496df5753431b2c02f098b1c747063d04f2e9b98864208abe757517",
    "9da43f8f688d5070092cee895e0e8d0d580aa067b38aacd493a75370bd89a2e5",
)


def test_golden_bytes() -> None:
    codec = get_codec("lowrank", {"layout": LAYOUT, "rank": 3, "bits": 4, "iters": 2})
    x = pattern(LAYOUT_NUMEL + 5)
    payload = codec.encode(x)
    out = codec.decode(payload, x.numel())
    assert hashlib.sha256(payload).hexdigest() == GOLDEN[0]
    assert hashlib.sha256(out.numpy().tobytes()).hexdigest() == GOLDEN[1]


# -- hostile payloads ------------------------------------------------------------

NUMEL = LAYOUT_NUMEL + 3
HOSTILE = {"layout": LAYOUT, "rank": 2, "bits": 3, "vec_bits": 4, "vec_block": 16}


def make() -> tuple[LowRankCodec, bytes]:
    codec = get_codec("lowrank", HOSTILE)
    assert isinstance(codec, LowRankCodec)
    return codec, codec.encode(rand(NUMEL, 5))


def sections(codec: LowRankCodec) -> list[int]:
    """Body offsets of the sections: t, k, factor codes, vector scales, vector codes, end."""
    out = [0]
    for size in codec._sections(NUMEL):
        out.append(out[-1] + size)
    return [HEADER_SIZE + o for o in out]


def decode_or_reject(codec: LowRankCodec, payload: bytes) -> None:
    try:
        out = codec.decode(payload, NUMEL)
    except PayloadError:
        return
    assert out.shape == (NUMEL,) and bool(torch.isfinite(out).all())


def test_invalid_length_and_header() -> None:
    codec, payload = make()
    with pytest.raises(PayloadError, match="truncated"):
        codec.decode(payload[:-1], NUMEL)
    with pytest.raises(PayloadError, match="exceeds"):
        codec.decode(payload + b"\0", NUMEL)
    for numel in (NUMEL + 1, NUMEL + 40):
        with pytest.raises(PayloadError, match="numel|truncated"):
            codec.decode(payload, numel)
    bad_id = payload[:5] + b"\x07" + payload[6:]
    with pytest.raises(PayloadError, match="codec id"):
        codec.decode(bad_id, NUMEL)
    other = get_codec("lowrank", {**HOSTILE, "iters": 3})
    with pytest.raises(PayloadError, match="digest"):
        other.decode(payload, NUMEL)


@pytest.mark.parametrize(
    ("bits", "error", "match"),
    [(0x7FC00000, NonFiniteError, "NaN or Inf"), (0x7F800000, NonFiniteError, "NaN or Inf"),
     (0x80000000, PayloadError, "negative"), (0xBF800000, PayloadError, "negative")],
)
def test_invalid_scales(bits: int, error: type[Exception], match: str) -> None:
    codec, payload = make()
    t0, _, _, vs0, _, _ = sections(codec)
    for at in (t0, vs0):
        bad = payload[:at] + struct.pack("<I", bits) + payload[at + 4 :]
        with pytest.raises(error, match=match):
            codec.decode(bad, NUMEL)


def test_invalid_code_field_zero_and_padding() -> None:
    codec, payload = make()
    _, _, f0, vs0, v0, end = sections(codec)
    fields = unpack_bits(payload[f0:vs0], 3, (vs0 - f0) * 8 // 3)
    n_f = 2 * (40 + 24) + 2 * (24 + 56) + 2 * (16 + 16)
    fields = unpack_bits(payload[f0:vs0], 3, n_f).copy()
    fields[5] = 0
    bad = payload[:f0] + pack_bits(fields, 3) + payload[vs0:]
    with pytest.raises(PayloadError, match="factor code field 0"):
        codec.decode(bad, NUMEL)
    n_vec = NUMEL - 960 - 1344 - 256
    vfields = unpack_bits(payload[v0:end], 4, n_vec).copy()
    vfields[-1] = 0
    bad = payload[:v0] + pack_bits(vfields, 4) + payload[end:]
    with pytest.raises(PayloadError, match="vector code field 0"):
        codec.decode(bad, NUMEL)
    if (n_f * 3) % 8:
        bad = payload[: vs0 - 1] + bytes([payload[vs0 - 1] | 0x80]) + payload[vs0:]
        with pytest.raises(PayloadError, match="padding"):
            codec.decode(bad, NUMEL)


def test_huge_scale_overflow_is_non_finite() -> None:
    codec, payload = make()
    t0 = sections(codec)[0]
    bad = payload[:t0] + struct.pack("<f", 3e38) + payload[t0 + 4 :]
    with pytest.raises(NonFiniteError):
        codec.decode(bad, NUMEL)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_body_and_bit_flips(data: st.DataObject) -> None:
    codec, payload = make()
    body_len = len(payload) - HEADER_SIZE
    body = data.draw(st.binary(min_size=body_len, max_size=body_len))
    decode_or_reject(codec, payload[:HEADER_SIZE] + body)
    flips = data.draw(st.lists(st.integers(HEADER_SIZE * 8, len(payload) * 8 - 1), max_size=8))
    buf = bytearray(payload)
    for bit in flips:
        buf[bit // 8] ^= 1 << (bit % 8)
    decode_or_reject(codec, bytes(buf))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=600))
def test_fuzz_random_bytes(data: bytes) -> None:
    codec, _ = make()
    decode_or_reject(codec, data)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_extreme_magnitudes_stay_finite(bits: int) -> None:
    codec = get_codec("lowrank", {"layout": LAYOUT, "rank": 6, "bits": bits})
    big = torch.finfo(torch.float32).max
    for x in (torch.full((LAYOUT_NUMEL,), big), rand(LAYOUT_NUMEL, 3).clamp(-1, 1) * big,
              rand(LAYOUT_NUMEL, 4) * 1e-38):
        y = codec.decode(codec.encode(x), LAYOUT_NUMEL)
        assert bool(torch.isfinite(y).all())
