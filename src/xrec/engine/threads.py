"""Intra-op threads for one pipeline thread only.

`torch.set_num_threads` is process-wide in effect: it stores a global count that
every thread adopts on its first parallel op, and it sets MKL's global thread
count. A pipeline that called it with its share of the cores (1 of 2 with two
pipelines) made every other thread of the process single-threaded too, a user's
own torch work included (docs/decisions.md, Scheduler and executor). Here the two
thread-local settings underneath are set instead: OpenMP's `omp_set_num_threads` (a
per-thread ICV) and MKL's `mkl_set_num_threads_local`, both reached through
libtorch_cpu so that they are the copies torch itself uses.
"""

from __future__ import annotations

import ctypes
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import torch

from xrec.utils.cpu_share import cpu_share

logger = logging.getLogger(__name__)


def use_threads_in_this_thread(num_threads: int) -> None:
    """Run this thread's torch CPU ops on `num_threads` intra-op threads, leaving every
    other thread as it was. Falls back to `torch.set_num_threads` (with a warning) on a
    build without OpenMP/MKL symbols to call."""
    # torch sets a thread's count (from torch.set_num_threads, if anyone called it) on its
    # first parallel op or thread-count query, once per thread; do that first, then override.
    # A 2-element op alone does not: it never reaches parallel_for.
    torch.get_num_threads()
    setters = _thread_local_setters()
    if setters is None:
        logger.warning("no thread-local OpenMP/MKL setters in this torch build; "
                       "torch.set_num_threads(%d) applies process-wide", num_threads)
        torch.set_num_threads(num_threads)
        return
    for setter in setters:
        setter(num_threads)


@cache
def _thread_local_setters() -> tuple | None:
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        torch_cpu = ctypes.CDLL(str(library))
        omp = torch_cpu.omp_set_num_threads      # found in torch's own libgomp
    except (OSError, AttributeError):
        return None
    setters = [omp]
    # the C entry point (mkl.h maps mkl_set_num_threads_local to it; the lower-case
    # symbol is the Fortran one, which takes a pointer)
    mkl = getattr(torch_cpu, "MKL_Set_Num_Threads_Local", None)
    if mkl is not None:
        setters.append(mkl)
    for setter in setters:
        setter.argtypes, setter.restype = [ctypes.c_int], None
    return tuple(setters)


ADAPTIVE_ENV = "XREC_ADAPTIVE_THREADS"


def adaptive_by_default() -> bool:
    """Whether thread counts follow the free cores when not said: yes, unless the
    environment variable XREC_ADAPTIVE_THREADS is 0/false/off (the test suite sets it, so
    that results do not depend on the machine's load)."""
    return os.environ.get(ADAPTIVE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class FollowFreeCores:
    """One thread's intra-op threads, following the cores other processes leave free.

    A team of 2 OpenMP threads on 2 cores, one of them busy with another process, waits at
    every parallel region for its descheduled partner: training steps ran 4x slower than on
    one thread (docs/decisions.md, CPU threads under contention). So before each unit of work
    (a batch, a training step) `follow()` sets this thread's count to `wanted`, or to its
    `sharers`-th part of the free cores when fewer are free, at least 1. `adaptive=False`
    keeps `wanted` whatever the load; None: `adaptive_by_default()`."""

    def __init__(self, wanted: int, sharers: int = 1, adaptive: bool | None = None):
        self.wanted, self.sharers = wanted, sharers
        if adaptive is None:
            adaptive = adaptive_by_default()
        self.share = cpu_share() if adaptive else None
        self.current = 0

    def follow(self) -> int:
        """Set this thread's count for the next unit of work; returns it."""
        count = self.wanted
        if self.share is not None:
            count = min(count, max(1, self.share.free_cores() // self.sharers))
        use_threads_in_this_thread(count)   # always: a loop's own calls may have changed it
        self.current = count
        return count


@contextmanager
def threads_in_this_thread(threads: int | None) -> Iterator[int]:
    """This thread's intra-op threads set to `threads` (None: left as they are) for the
    block, and as before afterwards; yields the count. No other thread's count, nor the
    count a new thread adopts, changes (`torch.set_num_threads` would set both)."""
    previous = torch.get_num_threads()
    if threads:
        use_threads_in_this_thread(threads)
    try:
        yield threads or previous
    finally:
        use_threads_in_this_thread(previous)


@contextmanager
def training_threads(threads: int | None,
                     adaptive: bool | None = None) -> Iterator[FollowFreeCores]:
    """This thread's intra-op threads for a training loop that calls `follow()` before each
    step: `threads` (default: torch's), fewer while other processes take cores (`adaptive`,
    as in `FollowFreeCores`); this thread's count is as before afterwards, and no other
    thread's count changes."""
    with threads_in_this_thread(threads) as count:
        yield FollowFreeCores(count, adaptive=adaptive)
