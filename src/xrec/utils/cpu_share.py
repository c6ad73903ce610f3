"""How many of this process's CPUs other processes leave free, read from the kernel's
counters (Linux `/proc/stat` and `/proc/self/stat`; elsewhere every allowed CPU counts as free).

Over a window of at least `window_s`: the busy time of the CPUs this process may run on,
minus this process's own CPU time, is what others used. That many cores (rounded: a
neighbour that gets half a core or more holds one) are taken; the rest are free, at least 1.
The time of the hypervisor's other guests (`steal`) counts as taken.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

__all__ = ["CpuShare", "cpu_share"]

WINDOW_S = 0.5
# /proc/stat cpuN fields: user nice system idle iowait irq softirq steal (guest is within user)
_BUSY_FIELDS = (0, 1, 2, 5, 6, 7)
_IDLE_FIELDS = (3, 4)


class CpuShare:
    """Free cores of `cpus` (default: this process's affinity), sampled at most every
    `window_s`; thread-safe (one instance may serve every thread of a process)."""

    def __init__(self, cpus: set[int] | None = None, window_s: float = WINDOW_S,
                 proc: str | Path = "/proc", clock=time.monotonic):
        self.cpus = sorted(cpus if cpus is not None else _affinity())
        self.window_s, self.proc, self.clock = window_s, Path(proc), clock
        self._lock = threading.Lock()
        self._free = len(self.cpus)
        self._last = self._sample()
        self._last_at = clock()

    @property
    def readable(self) -> bool:
        """The counters exist here (Linux): `free_cores` follows the load."""
        return self._last is not None

    def free_cores(self) -> int:
        """Cores not taken by other processes over the latest window (between 1 and all)."""
        now = self.clock()
        if self._last is None or now - self._last_at < self.window_s:
            return self._free
        with self._lock:
            if now - self._last_at < self.window_s:   # another thread sampled meanwhile
                return self._free
            sample = self._sample()
            if sample is not None:
                self._free = self._free_between(self._last, sample)
                self._last, self._last_at = sample, now
            return self._free

    def _free_between(self, before: tuple[int, int, int], after: tuple[int, int, int]) -> int:
        busy, total, own = (b - a for a, b in zip(before, after))
        if total <= 0:
            return self._free
        ticks_per_core = total / len(self.cpus)
        others = max(0, busy - own) / ticks_per_core          # cores' worth used by others
        taken = int(others + 0.5)
        return max(1, len(self.cpus) - taken)

    def _sample(self) -> tuple[int, int, int] | None:
        """(busy ticks of `cpus`, all ticks of `cpus`, this process's CPU ticks), or None
        where the counters cannot be read."""
        try:
            lines = (self.proc / "stat").read_text().splitlines()
            own_fields = (self.proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        wanted = {f"cpu{c}" for c in self.cpus}
        busy = total = 0
        for line in lines:
            name, *values = line.split()
            if name in wanted:
                ticks = [int(v) for v in values[:8]] + [0] * (8 - len(values[:8]))
                spent = sum(ticks[i] for i in _BUSY_FIELDS)
                busy += spent
                total += spent + sum(ticks[i] for i in _IDLE_FIELDS)
        # fields after the command: state is [0], utime [11], stime [12] (in clock ticks,
        # the same USER_HZ as /proc/stat)
        own = int(own_fields[11]) + int(own_fields[12])
        return busy, total, own


def _affinity() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:    # not Linux
        return set(range(os.cpu_count() or 1))


_shared: CpuShare | None = None
_shared_lock = threading.Lock()


def cpu_share() -> CpuShare:
    """The process's one `CpuShare` (of its affinity at first use), made on first call."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = CpuShare()
        return _shared
