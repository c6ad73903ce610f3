"""Where xrec keeps its files (`xrec_home`), and directories written whole or not at all."""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["atomic_directory", "xrec_home"]


@contextmanager
def atomic_directory(target: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yields an empty temporary directory beside `target`; on a clean exit it becomes
    `target`, on an exception it is deleted, so a reader never sees a half-written `target`.
    An existing `target` is kept (another writer won the race: its content is the same) unless
    `replace`, which swaps it out."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)   # mkdtemp's 0700 would outlive the rename
    try:
        yield tmp
        if replace and target.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
            target.rename(old / target.name)
            shutil.rmtree(old, ignore_errors=True)
        try:
            tmp.rename(target)
        except OSError:  # target exists: another process wrote it meanwhile
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def xrec_home() -> Path:
    """xrec's own files (the demo model, bench models, datasets): `$XREC_HOME`, else
    `~/.cache/xrec`."""
    return Path(os.environ.get("XREC_HOME") or Path.home() / ".cache" / "xrec")
