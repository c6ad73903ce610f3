"""Transparent huge pages for PyTorch's CPU buffers, in the processes xrec owns.

PyTorch's CPU allocator asks the kernel for transparent huge pages (`madvise`) on
buffers of 2 MiB or more when the environment variable `THP_MEM_ALLOC_ENABLE` is 1.
It reads the variable once, at its first allocation, so it must be set before torch
allocates anything. xrec sets it (unless already set: 0 keeps huge pages off) at the
start of the `xrec` command and in an isolated engine's child process: processes that
exist to run xrec. A host process that embeds an in-thread engine is the host's to
configure (README, "Embedding the engine").

Measured on an Intel Xeon with AMX, 2 cores (docs/decisions.md, "Huge pages"): the
bfloat16 step of onerec-0.1b (W=128, L=256, 4 requests) 240-245 ms with them against
260-275 ms without, and fewer slow steps; float32 steps did not change.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def ask_for_huge_pages(environ: MutableMapping[str, str] = os.environ) -> MutableMapping[str, str]:
    """Set `THP_MEM_ALLOC_ENABLE=1` in `environ` unless it is set; returns `environ`."""
    environ.setdefault(HUGE_PAGES_ENV, "1")
    return environ
