"""Process-wide settings for a process that exists to serve: only `xrec serve`, `xrec batch`,
the child of `isolation="process"` and Ray's replicas and actors call `own_process`; a
library constructor in a host's process changes nothing process-wide (docs/decisions.md,
"Side effects only where asked").

- glibc's malloc thresholds (`retain_freed_memory`, option `retain_host_memory`): a CPU
  step allocates its activations afresh, blocks of 0.1-30 MB per round; glibc serves
  those above its mmap threshold with fresh mappings and unmaps them on free, so every
  batch faulted its activations in again page by page. With both thresholds raised,
  freed blocks stay in the heap for the next batch. The cost, as with PyTorch's CUDA
  caching allocator: resident memory stays near its peak between batches.
- The garbage collector's permanent generation (`gc.freeze`): the objects of start-up
  (torch, the model, the catalog) stop being rescanned by the collections that building
  responses triggers.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import threading

from xrec.config import EngineOptions

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


def own_process(options: EngineOptions, is_cpu: bool) -> None:
    """Take the process-wide settings of a serving process, once its engine is loaded:
    glibc's thresholds on a CPU (unless option `retain_host_memory` is false) and a GC
    freeze of everything start-up made."""
    if is_cpu and options.retain_host_memory is not False:
        retain_freed_memory()
    gc.collect()
    gc.freeze()
