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
    results: list[R | None] = [None] * len(starts)

    def run(first: int) -> None:
        state = make_state()
        for k in range(first, len(starts), workers):
            a = starts[k]
            results[k] = work(a, min(a + chunk, d), state)

    if workers == 1:
        run(0)
    else:
        with ThreadPoolExecutor(workers) as executor:
            for _ in executor.map(run, range(workers)):
                pass  # re-raises the first exception of a worker
    return results  # type: ignore[return-value]  # every slot was filled
