"""charlm: a byte-level causal transformer language model (nanoGPT-style).

The model is a small GPT: token and position embeddings, pre-norm blocks of
causal self-attention and an MLP, a final LayerNorm and a weight-tied output
head. Tokens are raw bytes (vocabulary 256), so there is no tokenizer to
version and every machine encodes the corpus the same way.

Data: the organiser packs a text corpus into one blob (see
:func:`pack_corpus`); by default the Python standard library's own ``.py``
files, which exist offline on every machine that runs veritrain. The last
``eval_fraction`` of the bytes is held out. Training example ``i`` is the
window ``train[i*seq_len : i*seq_len + seq_len + 1]``: inputs are its first
``seq_len`` bytes, targets the last ``seq_len``.
"""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from torch.nn import functional as F

from ..errors import OversizedError, PayloadError
from .base import (
    Param,
    TaskError,
    canonical_json,
    param_float,
    param_int,
    seeded_generator,
    validate_params,
)

# --- the model ------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the transformer. Defaults are the ``demo`` preset."""

    block_size: int = 64  # = seq_len: the longest context the position table covers
    vocab_size: int = 256  # bytes, no tokenizer: identical encoding on every machine
    n_layer: int = 3
    n_head: int = 4
    n_embd: int = 64
    bias: bool = True  # nanoGPT default; biases are cheap at this size
    # No dropout: the inner loop must be exactly recomputable, and at these
    # sizes a few hundred steps per round do not overfit a 4 MB corpus.


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(
            config.n_embd, 3 * config.n_embd, bias=config.bias
        )  # q, k, v at once
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head = config.n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, time, channels (n_embd)
        q, k, v = self.c_attn(x).split(C, dim=2)  # each (B, T, C)
        hs = C // self.n_head
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # heads side by side again: (B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    """Position-wise feed-forward layer, 4x wide as in GPT-2."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))  # (B, T, 4C) inside, (B, T, C) out


class Block(nn.Module):
    """Pre-norm transformer block: residual attention, then residual MLP."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The byte-level language model; ``forward(idx)`` returns logits ``(B, T, 256)``.

    Build it with :func:`build_gpt`, which initialises every weight from a
    private seeded generator; the constructor alone leaves memory unset.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the input embedding with the output head (fewer parameters, as in GPT-2)."""
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.size()
        if self.config.block_size < T:
            raise ValueError(f"sequence of {T} bytes exceeds block size {self.config.block_size}")
        pos = torch.arange(0, T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (B, T, C) + (T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)  # (B, T, vocab_size)


def build_gpt(config: GPTConfig, seed: int) -> GPT:
    """A GPT on CPU with GPT-2 initialisation drawn from ``seed`` alone.

    The module is built on the meta device (so the default initialisers never
    draw from torch's global generator), then every parameter is filled in
    ``named_parameters`` order from one private generator.
    """
    with torch.device("meta"):
        model = GPT(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()  # to_empty may have given the two modules separate tensors
    g = seeded_generator(seed)
    std_proj = 0.02 / math.sqrt(2 * config.n_layer)  # GPT-2: scale residual projections by depth
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_proj.weight"):
                p.normal_(0.0, std_proj, generator=g)
            elif name.endswith(".weight") and p.dim() >= 2:  # linear and embedding matrices
                p.normal_(0.0, 0.02, generator=g)
            elif name.endswith(".weight"):  # LayerNorm gains
                p.fill_(1.0)
            else:  # biases
                p.zero_()
    return model


# --- the corpus blob ------------------------------------------------------------------

#: First bytes of every corpus blob.
CORPUS_MAGIC = b"VTCORPUS"
#: Value of the header's "format" field.
CORPUS_FORMAT = "veritrain/v1/charlm-corpus"
#: Largest header a blob may carry.
MAX_CORPUS_HEADER = 4096
#: Directory names never entered when packing the standard library.
STDLIB_SKIP_DIRS = frozenset({"test", "tests", "idlelib", "site-packages", "__pycache__"})


def stdlib_source_files(root: Path) -> list[Path]:
    """The standard library's ``.py`` files, sorted by relative POSIX path.

    Skips the :data:`STDLIB_SKIP_DIRS` directories at any depth (tests,
    IDLE, installed third-party packages) and does not follow symlinks.
    """
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS]
        for fn in filenames:
            if fn.endswith(".py"):
                path = Path(dirpath) / fn
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def directory_files(root: Path, suffix: str) -> list[Path]:
    """Regular files under ``root`` whose name ends with ``suffix``, sorted by relative POSIX path."""
    found = [(p.relative_to(root).as_posix(), p) for p in root.rglob(f"*{suffix}") if p.is_file()]
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def encode_corpus(text: bytes, *, file_count: int, source: str) -> bytes:
    """The blob: magic, u32 LE header length, canonical JSON header, raw text bytes."""
    header = canonical_json(
        {
            "file_count": file_count,
            "format": CORPUS_FORMAT,
            "source": source,
            "text_bytes": len(text),
        }
    )
    return CORPUS_MAGIC + struct.pack("<I", len(header)) + header + text


def pack_corpus(files: list[Path], cap: int, *, source: str) -> bytes:
    """Concatenate ``files`` (raw bytes, in order) up to ``cap`` bytes into a corpus blob.

    The last file included may be cut short; ``file_count`` counts every file
    that contributed at least one byte.
    """
    parts: list[bytes] = []
    total = 0
    for path in files:
        if total >= cap:
            break
        data = path.read_bytes()[: cap - total]
        if data:
            parts.append(data)
            total += len(data)
    return encode_corpus(b"".join(parts), file_count=len(parts), source=source)


def decode_corpus(blob: bytes, *, max_text_bytes: int) -> tuple[bytes, dict[str, object]]:
    """Parse a corpus blob into (text, header), refusing anything off-format.

    Raises :class:`PayloadError` on a bad magic, an out-of-bounds or
    non-canonical header, wrong fields or a length mismatch, and
    :class:`OversizedError` if the text exceeds ``max_text_bytes``.
    """
    if len(blob) > len(CORPUS_MAGIC) + 4 + MAX_CORPUS_HEADER + max_text_bytes:
        raise OversizedError(f"corpus blob of {len(blob)} bytes exceeds the task's limit")
    if len(blob) < len(CORPUS_MAGIC) + 4 or not blob.startswith(CORPUS_MAGIC):
        raise PayloadError("not a charlm corpus blob (bad magic)")
    (header_len,) = struct.unpack_from("<I", blob, len(CORPUS_MAGIC))
    start = len(CORPUS_MAGIC) + 4
    if header_len > MAX_CORPUS_HEADER or start + header_len > len(blob):
        raise PayloadError(f"corpus header length {header_len} out of bounds")
    raw = blob[start : start + header_len]
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PayloadError(f"corpus header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or set(header) != {
        "file_count",
        "format",
        "source",
        "text_bytes",
    }:
        raise PayloadError("corpus header fields differ from the format")
    if header["format"] != CORPUS_FORMAT or not isinstance(header["source"], str):
        raise PayloadError("corpus header has a wrong format or source")
    for key in ("file_count", "text_bytes"):
        v = header[key]
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise PayloadError(f"corpus header {key} must be a non-negative integer")
    try:
        canonical = canonical_json(header)
    except ValueError as exc:
        raise PayloadError(f"corpus header does not re-encode: {exc}") from exc
    if canonical != raw:
        raise PayloadError("corpus header is not in canonical JSON")
    text = blob[start + header_len :]
    if header["text_bytes"] != len(text):
        raise PayloadError(f"corpus says {header['text_bytes']} text bytes, blob holds {len(text)}")
    if len(text) > max_text_bytes:
        raise OversizedError(f"corpus text of {len(text)} bytes exceeds limit {max_text_bytes}")
    return text, header


# --- the task -------------------------------------------------------------------------

PARAMS: dict[str, Param] = {
    "init_seed": Param("int", 0, 0, 2**63 - 1),
    "seq_len": Param("int", 64, 2, 4096),
    "n_layer": Param("int", 3, 1, 64),
    "n_head": Param("int", 4, 1, 64),
    "n_embd": Param("int", 64, 4, 8192),
    "bias": Param("bool", True),
    # Organiser side only: where pack_dataset reads text (None = the stdlib's .py files).
    "corpus_path": Param("str", None),
    "corpus_suffix": Param("str", ".py", max_len=32),  # which files of a corpus_path directory
    # Cap on packed text bytes; load_dataset refuses larger blobs with it too.
    "corpus_bytes": Param("int", 4_000_000, 1024, 1 << 30),
    "eval_fraction": Param("float", 0.05, 0.001, 0.5),  # the tail of the corpus held out
    "eval_windows": Param("int", 64, 1, 1 << 20),  # held-out windows per evaluation
    "eval_batch_size": Param("int", 32, 1, 1 << 16),
}

#: Named parameter sets; step times on one CPU thread are in specs/tasks.md.
PRESETS: dict[str, dict[str, object]] = {
    # ~35k parameters: unit and integration tests, seconds per round on CPU.
    "tiny": {"seq_len": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, "corpus_bytes": 1_000_000},
    # ~170k parameters: the demo swarm, ~6 single-thread workers on 2 cores.
    "demo": {"seq_len": 64, "n_layer": 3, "n_head": 4, "n_embd": 64},
    # ~1M parameters: the reference benchmark scale.
    "bench": {"seq_len": 64, "n_layer": 5, "n_head": 4, "n_embd": 128},
}


@dataclass(frozen=True)
class CharLMDataset:
    """A loaded corpus: train and held-out bytes (uint8 CPU tensors) and its header."""

    train: torch.Tensor
    eval: torch.Tensor
    file_count: int
    source: str
    seq_len: int

    @property
    def num_train_windows(self) -> int:
        """Windows of seq_len+1 bytes starting every seq_len bytes of the train split."""
        return (self.train.numel() - 1) // self.seq_len

    @property
    def num_eval_windows(self) -> int:
        """Windows of the held-out split, laid out as in training."""
        return (self.eval.numel() - 1) // self.seq_len


class CharLMTask:
    """The built-in byte-level language modelling task."""

    name = "charlm"

    def __init__(self, params: Mapping[str, object] | None = None) -> None:
        self.params: dict[str, object] = validate_params(self.name, PARAMS, params)
        if param_int(self.params, "n_embd") % param_int(self.params, "n_head") != 0:
            raise TaskError("task 'charlm': n_embd must be a multiple of n_head")
        self.config = GPTConfig(
            block_size=param_int(self.params, "seq_len"),
            n_layer=param_int(self.params, "n_layer"),
            n_head=param_int(self.params, "n_head"),
            n_embd=param_int(self.params, "n_embd"),
            bias=bool(self.params["bias"]),
        )
        self.seq_len: int = self.config.block_size

    def make_model(self) -> GPT:
        """A fresh GPT initialised from ``init_seed``."""
        return build_gpt(self.config, param_int(self.params, "init_seed"))

    def pack_dataset(self) -> bytes:
        """Pack ``corpus_path`` (a file, or a directory's ``corpus_suffix`` files) or the stdlib."""
        cap = param_int(self.params, "corpus_bytes")
        path = self.params["corpus_path"]
        if path is None:
            root = Path(sysconfig.get_paths()["stdlib"])
            version = ".".join(str(v) for v in sys.version_info[:3])
            return pack_corpus(stdlib_source_files(root), cap, source=f"python-stdlib-{version}")
        target = Path(str(path))
        if target.is_dir():
            files = directory_files(target, str(self.params["corpus_suffix"]))
        elif target.is_file():
            files = [target]
        else:
            raise FileNotFoundError(f"corpus_path {target} is neither a file nor a directory")
        return pack_corpus(files, cap, source=f"path:{target.name}")

    def load_dataset(self, blob: bytes) -> CharLMDataset:
        """Parse and split a corpus blob; it must hold at least one train and one eval window."""
        text, header = decode_corpus(blob, max_text_bytes=param_int(self.params, "corpus_bytes"))
        n_eval = max(
            math.floor(len(text) * param_float(self.params, "eval_fraction")), self.seq_len + 1
        )
        n_train = len(text) - n_eval
        if n_train < self.seq_len + 1:
            raise PayloadError(
                f"corpus of {len(text)} bytes is too small for seq_len {self.seq_len}"
            )
        data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        return CharLMDataset(
            train=data[:n_train],
            eval=data[n_train:],
            file_count=param_int(header, "file_count"),
            source=str(header["source"]),
            seq_len=self.seq_len,
        )

    def num_train_examples(self, dataset: CharLMDataset) -> int:
        return dataset.num_train_windows

    def _windows(
        self, data: torch.Tensor, indices: torch.Tensor, device: torch.device | str
    ) -> tuple[torch.Tensor, torch.Tensor]:
        starts = indices.to(torch.int64).cpu() * self.seq_len  # (B,)
        offsets = torch.arange(self.seq_len + 1, dtype=torch.int64)  # (T+1,)
        windows = data[starts[:, None] + offsets].long()  # (B, T+1)
        x = windows[:, :-1].contiguous()  # (B, T): inputs
        y = windows[:, 1:].contiguous()  # (B, T): the next byte at each position
        return x.to(device), y.to(device)

    def make_batch(
        self, dataset: CharLMDataset, indices: torch.Tensor, *, device: torch.device | str = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets ``(B, seq_len)`` for train windows ``indices``."""
        if indices.numel() and (
            int(indices.min()) < 0 or int(indices.max()) >= dataset.num_train_windows
        ):
            raise IndexError("training example index out of range")
        return self._windows(dataset.train, indices, device)

    def loss(self, model: torch.nn.Module, batch: object) -> torch.Tensor:
        """Mean next-byte cross-entropy in nats."""
        x, y = batch  # type: ignore[misc]
        logits = model(x)  # (B, T, 256)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1))

    def example_losses(self, model: torch.nn.Module, batch: object) -> torch.Tensor:
        """Mean next-byte cross-entropy of each window, ``[B]``."""
        x, y = batch  # type: ignore[misc]
        logits = model(x)  # (B, T, 256)
        per_token = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1),
                                    reduction="none")
        return per_token.view(y.shape).mean(dim=1)

    def eval_batches(
        self, dataset: CharLMDataset, *, device: torch.device | str = "cpu"
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``eval_windows`` held-out windows spread evenly over the eval split, in batches.

        Window ``j`` of ``m`` is eval window ``floor(j * W / m)`` of the ``W``
        available; the last batch is dropped if short, so batches are equal.
        """
        total = dataset.num_eval_windows
        m = min(param_int(self.params, "eval_windows"), total)
        bs = min(param_int(self.params, "eval_batch_size"), m)
        picks = (torch.arange(m, dtype=torch.int64) * total) // m
        return [
            self._windows(dataset.eval, picks[i : i + bs], device) for i in range(0, m - bs + 1, bs)
        ]
