"""Column-chunked work spread over a few Python threads (private).

Rules that make one pass over an [N, D] input split the columns into chunks
and process them with ``torch.get_num_threads()`` Python threads (torch
releases the GIL inside its kernels).  On a machine shared with other work,
this degrades gracefully where one big multi-threaded kernel, or hundreds of
small ones, would each wait for their slowest thread at a barrier.

Every chunk is computed the same way whichever thread runs it, and results
come back in chunk order, so reductions over chunks are done in a fixed order:
the bytes do not depend on the thread count.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

__all__ = ["map_chunks"]

S = TypeVar("S")
R = TypeVar("R")


def map_chunks(
    work: Callable[[int, int, S], R],
    d: int,
    chunk: int,
    *,
    device: torch.device,
    make_state: Callable[[], S],
) -> list[R]:
    """``[work(a, b, state) for each column range [a, b)]``, in column order.

    ``make_state()`` is called once per thread (scratch buffers); accelerators
    get a single thread, since their kernels are asynchronous anyway.
    """
    starts = list(range(0, d, chunk))
    workers = 1 if device.type != "cpu" else max(1, min(torch.get_num_threads(), len(starts)))
    if threading.current_thread().name.startswith(_POOL_PREFIX):
        workers = 1  # already inside the pool (a rule run per chunk): never wait on the pool
    results: list[R | None] = [None] * len(starts)

    def run(first: int) -> None:
        state = make_state()
        for k in range(first, len(starts), workers):
            a = starts[k]
            results[k] = work(a, min(a + chunk, d), state)

    if workers == 1:
        run(0)
    else:
        for future in [_pool(workers).submit(run, k) for k in range(workers)]:
            future.result()  # re-raises the first exception of a worker
    return results  # type: ignore[return-value]  # every slot was filled


_POOL_PREFIX = "veritrain-aggregation"
_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


def _pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool that grows to the largest ``workers`` asked for.

    Starting threads per call cost about 1 ms each, as much as a tenth of a
    16 x 4M pass on a loaded machine.  Shared by concurrent callers: their
    chunks queue behind each other, which is what their kernels would do anyway.
    """
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or workers > _POOL_SIZE:
            old = _POOL
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix=_POOL_PREFIX)
            _POOL_SIZE = workers
            if old is not None:
                old.shutdown(wait=False)  # its queued work still runs
        return _POOL
