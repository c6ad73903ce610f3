"""`xrec.utils.files`: files and directories written whole or not at all."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap

import pytest

from xrec.utils.files import atomic_directory, write_file_atomically

# A child that writes `target` with the new content, and kills itself (SIGKILL) at the moment
# the named shutil/os step starts: what is at `target` then is what a crash there leaves.
_KILLED_AT = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from xrec.utils.files import atomic_directory
    target, marker = Path(sys.argv[1]), sys.argv[2]
    real = shutil.rmtree
    def rmtree(path, *args, **kwargs):
        if marker in str(path):
            os.kill(os.getpid(), signal.SIGKILL)
        return real(path, *args, **kwargs)
    shutil.rmtree = rmtree
    with atomic_directory(target, replace=True) as tmp:
        (tmp / "report").write_text("new")
""")


def test_a_replacing_writer_killed_while_deleting_the_old_directory_leaves_the_new_one(tmp_path):
    """The old directory was deleted before the new one was renamed in: a kill in between
    (a `sid build --force`) left nothing at the target."""
    target = tmp_path / "sid"
    with atomic_directory(target) as tmp:
        (tmp / "report").write_text("old")
    proc = subprocess.run([sys.executable, "-c", _KILLED_AT, str(target), "-old-"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert (target / "report").read_text() == "new"


def test_write_file_atomically_replaces_whole_with_the_umasks_mode(tmp_path):
    path = tmp_path / "catalog.bin"
    path.write_bytes(b"old")
    write_file_atomically(path, b"new content")
    assert path.read_bytes() == b"new content"
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~_umask()
    assert [p.name for p in tmp_path.iterdir()] == ["catalog.bin"]


def test_write_file_atomically_keeps_the_old_file_when_the_write_fails(tmp_path):
    path = tmp_path / "catalog.bin"
    path.write_bytes(b"old")
    with pytest.raises(TypeError):
        write_file_atomically(path, "not bytes")  # type: ignore[arg-type]
    assert path.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["catalog.bin"]


def _umask() -> int:
    proc = subprocess.run(["sh", "-c", "umask"], capture_output=True, text=True, check=True,
                          env=os.environ)
    return int(proc.stdout.strip(), 8)
