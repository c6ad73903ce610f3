"""Where xrec keeps its files (`xrec_home`), files and directories written whole or not at
all, and reading a file that must be a regular one (`read_regular_file`)."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["LONE_SURROGATE", "FileRefused", "atomic_directory", "check_regular_file", "fsync_path",
           "new_file_mode", "read_regular_file", "write_file_atomically", "xrec_home"]


@contextmanager
def atomic_directory(target: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yields an empty temporary directory beside `target`; on a clean exit it becomes
    `target`, on an exception it is deleted, so a reader never sees a half-written `target`.
    An existing `target` is kept (another writer won the race: its content is the same) unless
    `replace`, which swaps it out."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o777 & ~_umask())   # mkdtemp's 0700 would outlive the rename
    old = None
    try:
        yield tmp
        if replace and target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
            target.rename(old / target.name)
        try:
            tmp.rename(target)
        except OSError:  # target exists: another process wrote it meanwhile
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:  # deleted only once the new target is in place
            shutil.rmtree(old, ignore_errors=True)


def write_file_atomically(path: str | Path, data: bytes) -> None:
    """Writes `data` to `path` whole or not at all: a temporary file beside it, synced, then
    renamed over it, so a failed or killed write (a full disk, SIGKILL) leaves the old file
    as it was and a reader never sees a part of the new one. The file gets the mode a plain
    open would give it (the umask's)."""
    path = Path(path)
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(handle, "wb") as file:
            os.fchmod(file.fileno(), new_file_mode())  # mkstemp's 0600 would outlive the rename
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
        fsync_path(path.parent)   # the rename itself survives a power loss
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def fsync_path(path: str | Path) -> None:
    """Make a file's content, or the names just renamed into a directory, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def new_file_mode() -> int:
    """The mode `open()` gives a new file: 0666 less the umask (0644 with umask 022)."""
    return 0o666 & ~_umask()


def _umask() -> int:
    """The process's umask, read where Linux shows it: setting it to read it back (the only
    portable way) would, for that moment, give other threads' new files the wrong mode."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def xrec_home() -> Path:
    """xrec's own files (the demo model, bench models, datasets): `$XREC_HOME`, else
    `~/.cache/xrec`."""
    return Path(os.environ.get("XREC_HOME") or Path.home() / ".cache" / "xrec")


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


LONE_SURROGATE = ("the path holds a lone UTF-16 surrogate (U+D800-U+DFFF), which no file "
                  "name can hold")


class FileRefused(ValueError):
    """A file that `read_regular_file` will not read. The message names the problem only
    (never the path, never the content): callers say which file."""


def _checked(status: os.stat_result, max_bytes: int | None) -> os.stat_result:
    if not stat.S_ISREG(status.st_mode):
        kind = next((name for is_kind, name in _KINDS if is_kind(status.st_mode)), "special")
        raise FileRefused(f"not a regular file ({kind})")
    if max_bytes is not None and status.st_size > max_bytes:
        raise FileRefused(f"{status.st_size} bytes, over the limit of {max_bytes} bytes")
    return status


def _open_regular(path: str | os.PathLike, max_bytes: int | None) -> tuple[int, os.stat_result]:
    """An open descriptor of `path` and its status, checked twice: stat before opening (a
    device or FIFO is never opened), fstat after (what was opened is what was checked).
    O_NONBLOCK: a FIFO swapped in between the two never blocks the open."""
    if "\0" in os.fsdecode(path):
        raise FileRefused("the path holds a NUL character")
    try:
        _checked(os.stat(path), max_bytes)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise FileRefused(exc.strerror or str(exc)) from None
    except UnicodeEncodeError:
        raise FileRefused(LONE_SURROGATE) from None
    try:
        return fd, _checked(os.fstat(fd), max_bytes)
    except BaseException:
        os.close(fd)
        raise


def check_regular_file(path: str | os.PathLike, max_bytes: int | None = None) -> os.stat_result:
    """The status of `path` when `read_regular_file` would read it; else `FileRefused`."""
    fd, status = _open_regular(path, max_bytes)
    os.close(fd)
    return status


def read_regular_file(path: str | os.PathLike, max_bytes: int | None = None) -> bytes:
    """The bytes of `path`, a regular file (symlinks followed) of at most `max_bytes`;
    `FileRefused` for anything else (missing, unreadable, a directory, FIFO, device or
    socket, too big). At most the size seen at open is read, so a file that grows meanwhile
    cannot make the read unbounded."""
    fd, status = _open_regular(path, max_bytes)
    try:
        file = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with file:
        try:
            return file.read(status.st_size)  # loops until that size or the end of the file
        except OSError as exc:
            raise FileRefused(exc.strerror or str(exc)) from None
