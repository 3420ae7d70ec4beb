"""Strict field checkers for decoding received message bodies.

A checker takes a decoded JSON value and a path for error messages and
returns the value, or raises :class:`EncodingError` saying which field is
wrong and why. Message classes declare one checker per field, so the set of
keys, their types and their bounds are all enforced before anything is used.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from .encoding import encode_canonical
from .errors import EncodingError

Checker = Callable[[Any, str], Any]

_HEX = re.compile(r"[0-9a-f]*")


def hex_bytes(nbytes: int) -> Checker:
    """Lowercase hex of exactly ``nbytes`` bytes."""

    def check(value: Any, path: str) -> str:
        if not isinstance(value, str) or len(value) != 2 * nbytes or not _HEX.fullmatch(value):
            raise EncodingError(f"{path}: expected {nbytes} bytes as lowercase hex")
        return value

    return check


HASH = hex_bytes(32)
PUBKEY = hex_bytes(32)
SIGNATURE = hex_bytes(64)
BLS_PUBKEY = hex_bytes(48)
BLS_SIGNATURE = hex_bytes(96)


def integer(lo: int, hi: int) -> Checker:
    def check(value: Any, path: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise EncodingError(f"{path}: expected an integer in [{lo}, {hi}]")
        return value

    return check


def number(lo: float, hi: float) -> Checker:
    """A finite number (int or float) in [lo, hi]."""

    def check(value: Any, path: str) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise EncodingError(f"{path}: expected a number")
        if not math.isfinite(value) or not lo <= value <= hi:
            raise EncodingError(f"{path}: expected a finite number in [{lo}, {hi}]")
        return value

    return check


def boolean(value: Any, path: str) -> bool:
    if not isinstance(value, bool):
        raise EncodingError(f"{path}: expected true or false")
    return value


def string(max_len: int, pattern: str | None = None) -> Checker:
    compiled = re.compile(pattern) if pattern else None

    def check(value: Any, path: str) -> str:
        if not isinstance(value, str) or len(value) > max_len:
            raise EncodingError(f"{path}: expected a string of at most {max_len} characters")
        if compiled is not None and not compiled.fullmatch(value):
            raise EncodingError(f"{path}: {value!r} does not match {pattern}")
        return value

    return check


def one_of(*choices: str) -> Checker:
    def check(value: Any, path: str) -> str:
        if value not in choices:
            raise EncodingError(f"{path}: expected one of {choices}")
        return value

    return check


def optional(inner: Checker) -> Checker:
    def check(value: Any, path: str) -> Any:
        return None if value is None else inner(value, path)

    return check


def list_of(inner: Checker, max_len: int) -> Checker:
    def check(value: Any, path: str) -> list[Any]:
        if not isinstance(value, list) or len(value) > max_len:
            raise EncodingError(f"{path}: expected a list of at most {max_len} items")
        return [inner(item, f"{path}[{i}]") for i, item in enumerate(value)]

    return check


def record(schema: Mapping[str, Checker], *, absent_ok: frozenset[str] = frozenset()) -> Checker:
    """A JSON object with exactly the keys of ``schema``.

    Keys in ``absent_ok`` (fields added in a later revision of the protocol)
    may be missing; they then stay missing in the result, so that the
    re-encoded body, and with it the signature, is the one that was signed.
    Readers take their defaults from the accessor that owns the field.
    """

    def check(value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise EncodingError(f"{path}: expected an object")
        missing = set(schema) - set(value) - absent_ok
        extra = set(value) - set(schema)
        if missing or extra:
            raise EncodingError(
                f"{path}: missing fields {sorted(missing)}, unexpected fields {sorted(extra)}"
            )
        return {
            key: checker(value[key], f"{path}.{key}")
            for key, checker in schema.items()
            if key in value
        }

    return check


def free_params(max_bytes: int = 4096) -> Checker:
    """A flat-ish parameter object (task, codec or aggregator settings), size-bounded."""

    def check(value: Any, path: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise EncodingError(f"{path}: expected an object")
        if len(encode_canonical(value)) > max_bytes:
            raise EncodingError(f"{path}: parameters exceed {max_bytes} bytes")
        return value

    return check
