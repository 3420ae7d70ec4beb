import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from veritrain.protocol.encoding import decode_canonical, encode_canonical
from veritrain.protocol.errors import EncodingError, OversizedError

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=20,
)


@given(json_values)
def test_round_trip_is_exact(value):
    data = encode_canonical(value)
    assert encode_canonical(decode_canonical(data)) == data


@given(st.dictionaries(st.text(max_size=8), st.integers(), min_size=2, max_size=6))
def test_key_order_does_not_change_bytes(d):
    reordered = dict(reversed(list(d.items())))
    assert encode_canonical(d) == encode_canonical(reordered)


@pytest.mark.parametrize("raw", [
    b'{"b":1,"a":2}',          # keys out of order
    b'{"a": 1}',               # whitespace
    b'{"a":1,"a":1}',          # duplicate key
    b'{"a":NaN}',              # NaN
    b'{"a":Infinity}',
    b'{"a":1.50}',             # non-shortest float
    b'\xff\xfe',               # not ASCII
    b'{"a":',                  # truncated
    b'[' * 100_000,            # nesting bomb
])
def test_invalid_non_canonical_input_is_refused(raw):
    with pytest.raises(EncodingError):
        decode_canonical(raw)


def test_invalid_oversized_refused_before_parsing():
    with pytest.raises(OversizedError):
        decode_canonical(b'"' + b"a" * 100 + b'"', max_bytes=50)


def test_invalid_nan_has_no_encoding():
    with pytest.raises(EncodingError):
        encode_canonical({"x": math.nan})
