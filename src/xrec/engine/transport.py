"""The wire between an engine and its child process: pickled messages over a socket,
large arrays through a shared-memory arena.

`Arena` is one anonymous shared-memory file (`memfd_create`: no name in /dev/shm, so
nothing to leak whoever dies; its pages are allocated on first use), mapped by both
processes. The parent owns its allocator: a message's large buffers
(numpy arrays of `ARENA_MIN_BYTES` or more, found by pickle protocol 5) are copied into
free regions and only their offsets cross the socket; the child unpickles arrays that
view the arena directly (no second copy). The parent frees a request's regions when its
answer arrives, after which the child no longer reads them. A message that does not fit
in the free space sends its buffers in-band instead (slower, never refused).
"""

from __future__ import annotations

import bisect
import mmap
import os
import pickle
import struct
import threading
from typing import Any

ARENA_BYTES = 64 << 20
ARENA_MIN_BYTES = 16 << 10    # smaller buffers travel inside the pickle
ALIGN = 64

Region = tuple[int, int]      # (offset, nbytes)


class Arena:
    """A shared-memory file mapped here; `place`/`free` are the parent's side only."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.view = memoryview(mmap.mmap(fd, size))
        self._free: list[Region] = [(0, size)]       # sorted by offset, coalesced
        self._lock = threading.Lock()

    @classmethod
    def create(cls, size: int = ARENA_BYTES) -> "Arena":
        fd = os.memfd_create("xrec-arena", 0)         # inheritable=False; passed explicitly
        try:
            os.ftruncate(fd, size)
            return cls(fd, size)
        except OSError:
            os.close(fd)
            raise

    def place(self, raw: memoryview) -> int | None:
        """`raw` copied into a free region (first fit): its offset, or None when none is
        free or the arena is closed. The copy is made under the lock `close` takes: a
        sender racing an engine's close sends in-band instead of writing into a released
        view."""
        need = -(-raw.nbytes // ALIGN) * ALIGN
        with self._lock:
            if self.fd < 0:
                return None
            for index, (offset, length) in enumerate(self._free):
                if length >= need:
                    if length == need:
                        del self._free[index]
                    else:
                        self._free[index] = (offset + need, length - need)
                    self.view[offset:offset + raw.nbytes] = raw
                    return offset
        return None

    def free(self, regions: list[Region]) -> None:
        with self._lock:
            for offset, nbytes in regions:
                need = -(-nbytes // ALIGN) * ALIGN
                index = bisect.bisect(self._free, (offset, 0))
                self._free.insert(index, (offset, need))
                if index + 1 < len(self._free) and offset + need == self._free[index + 1][0]:
                    self._free[index] = (offset, need + self._free.pop(index + 1)[1])
                if index > 0:
                    before, length = self._free[index - 1]
                    if before + length == offset:
                        self._free[index - 1] = (before, length + self._free.pop(index)[1])

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free)

    def close(self) -> None:
        """Unmap and close the file; idempotent (a closed fd's number may be reused)."""
        with self._lock:
            if self.fd < 0:
                return
            self.view.release()
            os.close(self.fd)
            self.fd = -1


def dumps(message: Any, arena: Arena | None) -> tuple[bytes, list[Region]]:
    """`message` pickled, behind a header naming the arena regions of its large buffers
    (returned too: the caller frees them once the receiver is done with them)."""
    regions: list[Region] = []

    def place(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if arena is None or raw.nbytes < ARENA_MIN_BYTES:
            return True                                # in-band
        offset = arena.place(raw)
        if offset is None:
            return True
        regions.append((offset, raw.nbytes))
        return False

    payload = pickle.dumps(message, protocol=5, buffer_callback=place)
    header = struct.pack(f"<I{2 * len(regions)}Q", len(regions), *(n for r in regions for n in r))
    return header + payload, regions


def loads(data: bytes, arena: Arena | None) -> Any:
    """The message of `dumps`; its arena arrays view the arena (read them before the
    sender frees their regions)."""
    (count,) = struct.unpack_from("<I", data)
    flat = struct.unpack_from(f"<{2 * count}Q", data, 4)
    buffers = [arena.view[flat[i]:flat[i] + flat[i + 1]] for i in range(0, 2 * count, 2)]
    return pickle.loads(memoryview(data)[4 + 16 * count:], buffers=buffers)
