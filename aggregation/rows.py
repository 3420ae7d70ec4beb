"""Row sources: N update rows read by column ranges, from memory or from a file.

A streamed rule (``centered_clip.centered_clip_rows``, ``streamed.py``) never holds the N rows at
once: it reads columns ``lo..hi`` of every row into a small [N, hi - lo]
buffer, does its work on them and moves on, so its extra memory is
O(N * chunk) whatever D.  ``TensorRows`` wraps an [N, D] tensor (the
in-process swarm, tests, benchmarks); ``FileRows`` reads a row-major file of
float32 values with ``os.preadv`` into the caller's buffer (a validator's
decoded updates).  Not a memory map: mapped file pages count in the process's
resident memory, which is what the file is there to avoid.

Both give the rule the same contiguous buffers, so a streamed rule computes
the same bytes from either.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from ._inputs import check_updates
from .errors import AggregationInputError

__all__ = ["FileRows", "RowFile", "RowList", "RowStore", "Rows", "TensorRows"]

#: Bytes per value of a row file (float32, native byte order).
_ITEM = 4


@runtime_checkable
class Rows(Protocol):
    """N rows of D values, read by column ranges.

    ``read(lo, hi, out)`` returns columns ``lo..hi`` of every row as an
    [N, hi - lo] tensor of ``dtype``; with ``out`` (contiguous, that shape and
    dtype) it fills and returns ``out``.
    """

    @property
    def n_rows(self) -> int: ...

    @property
    def numel(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def read(self, lo: int, hi: int, out: Tensor | None = None) -> Tensor: ...


def _check_range(rows: Rows, lo: int, hi: int, out: Tensor | None) -> None:
    if not 0 <= lo <= hi <= rows.numel:
        raise AggregationInputError(f"columns [{lo}, {hi}) outside [0, {rows.numel})")
    if out is not None and (
        out.shape != (rows.n_rows, hi - lo) or out.dtype != rows.dtype or not out.is_contiguous()
    ):
        raise AggregationInputError(
            f"out must be a contiguous [{rows.n_rows}, {hi - lo}] {rows.dtype} tensor, "
            f"got {tuple(out.shape)} {out.dtype}"
        )


class TensorRows:
    """The rows of an in-memory [N, D] float32/float64 tensor (CPU or accelerator).

    ``read`` without ``out`` returns a view; with ``out`` a copy into it.
    """

    def __init__(self, updates: Tensor) -> None:
        self.updates = check_updates(updates)

    @property
    def n_rows(self) -> int:
        return int(self.updates.shape[0])

    @property
    def numel(self) -> int:
        return int(self.updates.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.updates.dtype

    @property
    def device(self) -> torch.device:
        return self.updates.device

    def read(self, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        _check_range(self, lo, hi, out)
        view = self.updates[:, lo:hi]
        return view if out is None else out.copy_(view)


class FileRows:
    """Rows of a row-major float32 file holding ``rows_in_file`` rows of ``numel`` values.

    ``rows`` (default all) picks which rows, in which order: row k of this
    source is row ``rows[k]`` of the file.  Reads use ``os.preadv`` into the
    buffer (no memory map, no file offset shared between threads).
    """

    def __init__(
        self, path: str | Path, rows_in_file: int, numel: int, rows: Sequence[int] | None = None
    ) -> None:
        self.path = Path(path)
        if numel < 1 or rows_in_file < 1:
            raise AggregationInputError(
                f"a row file needs rows and columns, got {rows_in_file} x {numel}"
            )
        size = self.path.stat().st_size
        if size != rows_in_file * numel * _ITEM:
            raise AggregationInputError(
                f"{self.path} holds {size} bytes, not {rows_in_file} x {numel} float32 values"
            )
        picked = list(range(rows_in_file)) if rows is None else [int(r) for r in rows]
        if not picked or any(not 0 <= r < rows_in_file for r in picked):
            raise AggregationInputError(
                f"rows {picked} must be non-empty and in [0, {rows_in_file})"
            )
        self.rows_in_file = rows_in_file
        self._numel = numel
        self.rows = tuple(picked)

    @property
    def n_rows(self) -> int:
        return len(self.rows)

    @property
    def numel(self) -> int:
        return self._numel

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    def read(self, lo: int, hi: int, out: Tensor | None = None) -> Tensor:
        _check_range(self, lo, hi, out)
        if out is None:
            out = torch.empty(self.n_rows, hi - lo, dtype=torch.float32)
        if hi == lo:
            return out
        buf = out.numpy().view(np.uint8).reshape(self.n_rows, (hi - lo) * _ITEM)
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for k, r in enumerate(self.rows):
                _pread_exactly(fd, memoryview(buf[k]), (r * self._numel + lo) * _ITEM)
        finally:
            os.close(fd)
        return out


def _pread_exactly(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise OSError(f"row file ended at byte {offset + done}")
        done += got


class RowStore(Protocol):
    """Rows kept one at a time: ``append(row) -> index``, ``row(index)``, ``rows(picked)``."""

    numel: int

    def append(self, row: Tensor) -> int: ...

    def row(self, index: int) -> Tensor: ...

    def rows(self, picked: Sequence[int] | None = None) -> Rows: ...


def _check_row(row: Tensor, numel: int) -> Tensor:
    if row.shape != (numel,) or row.dtype != torch.float32:
        raise AggregationInputError(
            f"a row must be float32 [{numel}], got {row.dtype} {tuple(row.shape)}"
        )
    return row.detach().cpu().contiguous()


class RowFile:
    """A ``RowStore`` in a file: rows appended in order, read back by ``FileRows``.

    Only the caller's row is in memory; ``row(i)`` reads one back.
    """

    def __init__(self, path: str | Path, numel: int) -> None:
        self.path = Path(path)
        self.numel = numel
        self.count = 0
        self.path.write_bytes(b"")

    def append(self, row: Tensor) -> int:
        data = _check_row(row, self.numel).numpy()
        with self.path.open("ab") as f:
            f.write(memoryview(data).cast("B"))
        self.count += 1
        return self.count - 1

    def row(self, index: int) -> Tensor:
        return self.rows([index]).read(0, self.numel)[0]

    def rows(self, picked: Sequence[int] | None = None) -> FileRows:
        return FileRows(self.path, self.count, self.numel, picked)


class RowList:
    """A ``RowStore`` in memory (the in-process swarm, tests): ``rows`` stacks the picked
    rows into ``TensorRows``, so memory grows with N."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self._rows: list[Tensor] = []

    def append(self, row: Tensor) -> int:
        self._rows.append(_check_row(row, self.numel))
        return len(self._rows) - 1

    def row(self, index: int) -> Tensor:
        return self._rows[index]

    def rows(self, picked: Sequence[int] | None = None) -> TensorRows:
        chosen = range(len(self._rows)) if picked is None else picked
        return TensorRows(torch.stack([self._rows[i] for i in chosen]))
