"""Canonical byte encoding of protocol messages.

Every message has exactly one encoding: UTF-8 JSON with sorted keys, no
whitespace, ASCII escapes, no NaN or Infinity. A signature covers those bytes,
so a decoder refuses anything that does not re-encode to the same bytes
(duplicate keys, other spacing or key order, non-shortest floats).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .errors import EncodingError, OversizedError

#: Largest message accepted by :func:`decode_canonical` unless told otherwise.
MAX_MESSAGE_BYTES = 1 << 20
#: Deepest nesting of arrays and objects accepted (protocol messages use < 8).
MAX_DEPTH = 32

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_INNERMOST = re.compile(rb"\[\]|\{\}")
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def encode_canonical(value: Any) -> bytes:
    """The one canonical encoding of a JSON value (dicts, lists, str, int, float, bool, None)."""
    try:
        return json.dumps(
            value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        ).encode("ascii")
    except ValueError as exc:
        raise EncodingError(f"value has no canonical encoding: {exc}") from exc


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise EncodingError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise EncodingError(f"{name} is not allowed")


def _check_depth(data: bytes) -> None:
    """Refuse nesting deeper than MAX_DEPTH before the C parser can overflow its stack.

    Strings are removed, only brackets kept, then innermost pairs are peeled
    off once per level: valid JSON is empty after at most its depth passes.
    Data with at most MAX_DEPTH opening brackets in all cannot nest deeper, so
    it skips that (the parser refuses unbalanced brackets): a signed message
    has a handful, and the peeling cost half of decoding one.
    """
    if data.count(b"{") + data.count(b"[") <= MAX_DEPTH:
        return
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKETS)
    for _ in range(MAX_DEPTH):
        if not brackets:
            return
        brackets = _INNERMOST.sub(b"", brackets)
    if brackets:
        raise EncodingError(f"nesting deeper than {MAX_DEPTH} levels, or unbalanced brackets")


def decode_canonical(data: bytes, *, max_bytes: int = MAX_MESSAGE_BYTES) -> Any:
    """Parse canonical bytes; refuse oversized, malformed or non-canonical input."""
    if len(data) > max_bytes:
        raise OversizedError(f"message of {len(data)} bytes exceeds limit {max_bytes}")
    _check_depth(data)
    try:
        text = data.decode("ascii")
        value = json.loads(
            text, object_pairs_hook=_no_duplicate_keys, parse_constant=_reject_constant
        )
    except EncodingError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise EncodingError(f"not valid canonical JSON: {exc}") from exc
    if encode_canonical(value) != data:
        raise EncodingError("message is not in canonical form")
    return value
