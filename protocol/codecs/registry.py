"""Codecs by name: the names and parameters recorded in a signed submission envelope."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from .base import BaseCodec, Codec, ParamValue
from .blockwise import Int4Codec, Int8Codec
from .cocktail import CocktailCodec
from .float import Bf16Codec, Fp16Codec, Fp32Codec
from .lloyd import LloydCodec
from .lowrank import LowRankCodec
from .topk import TopKCodec

__all__ = ["CODEC_NAMES", "DEFAULT_CODEC", "DEFAULT_CODEC_PARAMS", "default_codec", "get_codec"]

_CODECS: dict[str, type[BaseCodec]] = {
    cls.name: cls
    for cls in (
        Fp32Codec, Fp16Codec, Bf16Codec, Int8Codec, Int4Codec, TopKCodec, CocktailCodec,
        LowRankCodec, LloydCodec,
    )
}

CODEC_NAMES: tuple[str, ...] = tuple(_CODECS)

DEFAULT_CODEC = "int4"
#: Blockwise int4 with one scale per 64 values: 7.1x smaller than float32. In both
#: directions with error feedback its eval loss on the charlm bench run is within
#: 1% of uncompressed on each of three swarm seeds after 10 rounds (-0.4% on
#: average), 2.6% below it after 30, and below it on three seeds with 16 workers x
#: 20 rounds; lloyd at 3 bits (9.8x) ends 1.3% above it on average (up to 3.8%).
#: No codec at >= 100x is yet: lowrank (110x) is the closest after 10 rounds (+6.0%
#: on average with feedback decay 0.5) but falls behind over longer runs (+19% after
#: 30, +14% with 16 workers x 20 rounds), the sparse ones lose far more
#: (bench/compression.py).
DEFAULT_CODEC_PARAMS: Mapping[str, ParamValue] = MappingProxyType({"block": 64})


def get_codec(name: str, params: Mapping[str, object] | None = None) -> Codec:
    """The codec ``name`` with ``params`` (missing ones take their defaults).

    Raises ``ValueError`` naming the problem for an unknown codec, an unknown
    parameter, a parameter of the wrong type or out of range.
    """
    if not isinstance(name, str) or name not in _CODECS:
        raise ValueError(f"unknown codec {name!r}; known: {', '.join(CODEC_NAMES)}")
    if params is not None and not isinstance(params, Mapping):
        raise ValueError(f"codec params must be a mapping, got {type(params).__name__}")
    return _CODECS[name].from_params(params or {})


def default_codec() -> Codec:
    """The run default: ``get_codec(DEFAULT_CODEC, DEFAULT_CODEC_PARAMS)``."""
    return get_codec(DEFAULT_CODEC, DEFAULT_CODEC_PARAMS)
