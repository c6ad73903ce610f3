"""Keeping freed host memory mapped for the next batch (glibc malloc), for CPU engines.

A CPU step allocates its activations afresh, tens of tensors of 0.1–30 MB per
round. glibc serves a block above its mmap threshold (128 KiB, adapting up to
32 MiB) with a fresh mapping that it unmaps on free, and gives the heap's top
back to the kernel past twice that, so each batch faulted its activations in
again page by page: ~11,000 minor faults and ~20 ms of kernel time in a ~100 ms
step (W=128, L=256, 16 requests). With both thresholds raised, freed blocks stay
in the heap for the next batch: no faults, steps ~10% faster. The cost is the
one PyTorch's CUDA caching allocator makes too: the process's resident memory
stays near its peak instead of shrinking between batches.

The setting is process-wide (it is malloc's); `EngineOptions.retain_host_memory`
turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import threading

logger = logging.getLogger(__name__)

MMAP_THRESHOLD = 256 << 20   # blocks up to this size come from the heap and are reused
TRIM_THRESHOLD = 256 << 20   # free heap top kept mapped up to this size (per arena)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3   # mallopt parameters (malloc.h)
_lock = threading.Lock()
_is_done = False


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process. False where libc is
    not glibc (or refuses), in which case malloc is left as it was."""
    global _is_done
    with _lock:
        if _is_done:
            return True
        try:
            mallopt = ctypes.CDLL("libc.so.6").mallopt
        except (OSError, AttributeError):
            logger.info("not glibc: host memory is managed by the platform's malloc as is")
            return False
        mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        _is_done = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                        and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        if not _is_done:
            logger.warning("mallopt refused the thresholds: host memory is not retained")
        return _is_done
