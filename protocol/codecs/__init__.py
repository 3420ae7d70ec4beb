"""Payload codecs: how pseudo-gradients are compressed for the wire.

Byte layouts, limits and determinism rules: ``specs/codecs.md``.
"""

from .base import HEADER_SIZE, MAX_NUMEL, BaseCodec, Codec, OversizedPayloadError, params_digest
from .blockwise import Int4Codec, Int8Codec
from .cocktail import CocktailCodec
from .error_feedback import ErrorFeedback
from .float import Bf16Codec, Fp16Codec, Fp32Codec
from .lloyd import LloydCodec
from .lowrank import MODEL_LAYOUT, LowRankCodec, layout_for
from .registry import CODEC_NAMES, DEFAULT_CODEC, DEFAULT_CODEC_PARAMS, default_codec, get_codec
from .topk import TopKCodec

__all__ = [
    "CODEC_NAMES",
    "DEFAULT_CODEC",
    "DEFAULT_CODEC_PARAMS",
    "HEADER_SIZE",
    "MAX_NUMEL",
    "BaseCodec",
    "Bf16Codec",
    "CocktailCodec",
    "Codec",
    "ErrorFeedback",
    "Fp16Codec",
    "Fp32Codec",
    "Int4Codec",
    "Int8Codec",
    "LloydCodec",
    "MODEL_LAYOUT",
    "LowRankCodec",
    "OversizedPayloadError",
    "TopKCodec",
    "default_codec",
    "get_codec",
    "layout_for",
    "params_digest",
]
