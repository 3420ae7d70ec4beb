"""The codec interface, the common payload header and input checks.

Every payload is ``header || body``. The header (:data:`HEADER`, 32 bytes,
little-endian) is the same for all codecs::

    offset size field
    0      4    magic b"VTCP"
    4      1    format version (1)
    5      1    codec id (see each codec's ``codec_id``)
    6      2    reserved, must be 0
    8      8    numel (u64), must equal the numel the caller takes from the run spec
    16     8    seed (u64): the caller's seed for seeded codecs, 0 for the others
    24     8    params digest: sha256(canonical JSON of name and params())[:8]

Every codec's body size is a pure function of ``numel`` and its params, so
:meth:`BaseCodec.max_encoded_size` is the exact size and a payload of any
other length is refused before anything is parsed or allocated.
"""

from __future__ import annotations

import hashlib
import json
import struct
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Protocol, runtime_checkable

import numpy as np
import torch

from ..errors import NonFiniteError, OversizedError, PayloadError
from ..tensors import all_finite

__all__ = [
    "FORMAT_VERSION",
    "HEADER",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_NUMEL",
    "MAX_SEED",
    "BaseCodec",
    "Codec",
    "OversizedPayloadError",
    "ParamValue",
    "check_f32_scales",
    "check_numel",
    "check_seed",
    "check_update",
    "params_digest",
]

MAGIC = b"VTCP"
FORMAT_VERSION = 1
HEADER = struct.Struct("<4sBBHQQ8s")
HEADER_SIZE = HEADER.size  # 32
#: Largest vector a codec accepts (2^40 elements, 4 TiB of float32).
MAX_NUMEL = 1 << 40
#: Seeds are unsigned 64-bit integers.
MAX_SEED = (1 << 64) - 1
#: Bit pattern of +inf in float32: a finite non-negative float32 has bits below it.
F32_EXP_MASK = 0x7F800000

ParamValue = int | float | str | bool


class OversizedPayloadError(PayloadError, OversizedError):
    """A payload longer than its codec's bound for the run's numel.

    Both a :class:`PayloadError` (the payload cannot be decoded) and an
    :class:`OversizedError` (it breaks a size limit).
    """

    reason = "oversized"


@runtime_checkable
class Codec(Protocol):
    """What the rest of veritrain calls; see ``specs/codecs.md``."""

    name: str

    def params(self) -> dict[str, ParamValue]:
        """Canonical parameters, recorded in the signed submission envelope."""
        ...

    def max_encoded_size(self, numel: int) -> int:
        """Upper bound (for these codecs: the exact size) of a payload, in bytes."""
        ...

    def encode(self, update: torch.Tensor, *, seed: int = 0) -> bytes:
        """Compress a 1-D float32 CPU vector into deterministic bytes."""
        ...

    def decode(self, payload: bytes, numel: int, *, seed: int = 0) -> torch.Tensor:
        """Parse a payload into a 1-D float32 vector of ``numel`` elements."""
        ...

    def bind_model(self, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> Codec:
        """This codec for a run whose model has these ``param_shapes`` (in flat order)."""
        ...

    def region_unit(self) -> int | None:
        """u when the encoding splits into independent regions of u values (aligned at
        multiples of u), so that encoding a vector that is zero outside some regions gives
        the same codes inside them; None when it does not split."""
        ...


def params_digest(name: str, params: Mapping[str, ParamValue]) -> bytes:
    """First 8 bytes of sha256 over the sorted-key compact JSON of name and params."""
    doc = json.dumps({"codec": name, "params": dict(params)}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(doc.encode("utf-8")).digest()[:8]


def check_numel(numel: object) -> int:
    """The caller's element count (from the run spec): an int in [1, MAX_NUMEL]."""
    if isinstance(numel, bool) or not isinstance(numel, int):
        raise ValueError(f"numel must be an int, got {type(numel).__name__}")
    if not 1 <= numel <= MAX_NUMEL:
        raise ValueError(f"numel {numel} outside [1, {MAX_NUMEL}]")
    return numel


def check_seed(seed: object) -> int:
    """A seed: an int in [0, 2^64)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {type(seed).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed {seed} outside [0, 2^64)")
    return seed


def check_update(update: object) -> torch.Tensor:
    """A producer-side input: 1-D, float32, CPU, non-empty, finite. Returns it contiguous.

    A bad update is the caller's bug, not a peer's fault, so this raises
    ``ValueError`` rather than a :class:`PayloadError`.
    """
    if not isinstance(update, torch.Tensor):
        raise ValueError(f"update must be a torch.Tensor, got {type(update).__name__}")
    if update.dtype != torch.float32 or update.dim() != 1 or update.device.type != "cpu":
        raise ValueError(
            f"update must be a 1-D float32 CPU tensor, got {update.dtype} "
            f"shape {tuple(update.shape)} on {update.device}"
        )
    check_numel(update.numel())
    x = update.detach().contiguous()
    if not all_finite(x):
        raise ValueError("update holds NaN or Inf")
    return x


def check_f32_scales(bits: np.ndarray, what: str) -> None:
    """Refuse float32 scales (given as their uint32 bit patterns) that are NaN, Inf or negative."""
    if bits.size == 0:
        return
    if bool(((bits & F32_EXP_MASK) == F32_EXP_MASK).any()):
        raise NonFiniteError(f"{what} holds NaN or Inf")
    if bool((bits >= 0x80000000).any()):
        raise PayloadError(f"{what} holds a negative value (sign bit set)")


class BaseCodec(ABC):
    """Header handling and checks shared by every codec; subclasses write the body."""

    name: str
    codec_id: ClassVar[int]
    #: Whether the body depends on the seed (then the header records it).
    uses_seed: ClassVar[bool] = False

    # -- what subclasses provide ---------------------------------------------

    @abstractmethod
    def params(self) -> dict[str, ParamValue]:
        """Canonical parameters: every parameter, defaults included, sorted by name."""

    @abstractmethod
    def body_size(self, numel: int) -> int:
        """Exact body size in bytes for ``numel`` elements."""

    @abstractmethod
    def _encode_body(self, x: torch.Tensor, seed: int) -> bytes:
        """Body bytes for a checked, contiguous input."""

    @abstractmethod
    def _decode_body(self, body: memoryview, numel: int, seed: int) -> torch.Tensor:
        """Parse a body of exactly ``body_size(numel)`` bytes; raise PayloadError subclasses."""

    # -- the Codec interface -------------------------------------------------

    @classmethod
    def from_params(cls, params: Mapping[str, object]) -> BaseCodec:
        """Build from a params mapping, checking names and types (ranges: ``__post_init__``)."""
        defaults: dict[str, Any] = cls().params()  # type: ignore[call-arg]
        unknown = sorted(set(params) - set(defaults))
        if unknown:
            raise ValueError(
                f"codec {cls.name!r}: unknown params {unknown}; known: {sorted(defaults)}"
            )
        kwargs: dict[str, Any] = {}
        for key, value in params.items():
            want = type(defaults[key])
            ok = isinstance(value, want) and (want is bool or not isinstance(value, bool))
            if not ok:
                raise ValueError(
                    f"codec {cls.name!r}: param {key!r} must be {want.__name__}, "
                    f"got {type(value).__name__} {value!r}"
                )
            kwargs[key] = value
        return cls(**kwargs)

    def bind_model(self, shapes: Sequence[tuple[str, tuple[int, ...]]]) -> BaseCodec:
        """Codecs that read the model's shapes (``lowrank``) override this; the rest
        work on the flat vector alone."""
        return self

    def region_unit(self) -> int | None:
        """See :meth:`Codec.region_unit`; a codec that splits overrides this."""
        return None

    @property
    def digest(self) -> bytes:
        """The 8-byte params digest written in every header."""
        return params_digest(self.name, self.params())

    def max_encoded_size(self, numel: int) -> int:
        return HEADER_SIZE + self.body_size(check_numel(numel))

    def encode(self, update: torch.Tensor, *, seed: int = 0) -> bytes:
        x = check_update(update)
        check_seed(seed)
        numel = x.numel()
        hseed = seed if self.uses_seed else 0
        header = HEADER.pack(MAGIC, FORMAT_VERSION, self.codec_id, 0, numel, hseed, self.digest)
        body = self._encode_body(x, seed)
        if len(body) != self.body_size(numel):  # our bug, never a peer's
            raise AssertionError(
                f"{self.name}: body of {len(body)} bytes, expected {self.body_size(numel)}"
            )
        return header + body

    def decode(self, payload: bytes, numel: int, *, seed: int = 0) -> torch.Tensor:
        body = self._open(payload, numel, seed)
        out = self._decode_body(body, numel, seed)
        if not all_finite(out):
            raise NonFiniteError(f"{self.name} payload decodes to NaN or Inf")
        return out

    def _open(self, payload: bytes, numel: int, seed: int) -> memoryview:
        """Check length and header before anything is parsed; return the body."""
        check_numel(numel)
        check_seed(seed)
        if not isinstance(payload, bytes | bytearray | memoryview):
            raise PayloadError(f"payload must be bytes, got {type(payload).__name__}")
        try:
            view = memoryview(payload).cast("B")
        except TypeError as exc:
            raise PayloadError(f"payload buffer is not contiguous bytes: {exc}") from exc
        size = self.max_encoded_size(numel)
        if view.nbytes > size:
            raise OversizedPayloadError(
                f"{self.name} payload of {view.nbytes} bytes exceeds {size} bytes for numel {numel}"
            )
        if view.nbytes < size:
            raise PayloadError(
                f"{self.name} payload of {view.nbytes} bytes is truncated: {size} bytes for numel {numel}"
            )
        magic, version, codec_id, reserved, p_numel, p_seed, digest = HEADER.unpack_from(view, 0)
        if magic != MAGIC:
            raise PayloadError(f"bad payload magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise PayloadError(f"unsupported payload format version {version}")
        if codec_id != self.codec_id:
            raise PayloadError(
                f"payload codec id {codec_id}, expected {self.codec_id} ({self.name})"
            )
        if reserved != 0:
            raise PayloadError(f"payload reserved header field is {reserved}, must be 0")
        if p_numel != numel:
            raise PayloadError(f"payload declares numel {p_numel}, run spec says {numel}")
        want_seed = seed if self.uses_seed else 0
        if p_seed != want_seed:
            raise PayloadError(f"payload seed {p_seed} differs from expected {want_seed}")
        if digest != self.digest:
            raise PayloadError(
                f"payload params digest {digest.hex()} differs from {self.digest.hex()}"
            )
        return view[HEADER_SIZE:]

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({inner})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.params() == self.params()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((self.name, tuple(self.params().items())))
