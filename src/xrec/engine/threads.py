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
from functools import cache
from pathlib import Path

import torch

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
