"""The fork server (xrec.engine.forkserver, zygote.py): a process-isolated engine's child is
forked from it, with this process's working directory, output and xrec variables as they
are at the start; a variable read at import sends the start to a fresh interpreter; the fork
server exits with its owner; one killed is replaced, and a child it can no longer reap is
said to have an unknown exit status."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from bounded import is_alive, wait_gone
from xrec import Engine, RecRequest, Unavailable
from xrec.demo import write_random_model
from xrec.engine import forkserver

WAIT_S = 60.0
REQUEST = RecRequest(token_ids=[5, 17, 9], beam_width=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=3, num_items=300)


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("\nPPid:\t")[1].split()[0])


def _start(model_dir, **options) -> Engine:
    return Engine.from_pretrained(model_dir, isolation="process", device="cpu", **options)


def test_a_child_is_forked_with_the_directory_output_and_variables_of_its_start(
        model_dir, monkeypatch, capfd):
    """A relative model path from the working directory of the start, the child's log on
    this process's stderr of the moment, an XREC_ variable set after the fork server
    started: all reach the forked child, which answers as an in-thread engine."""
    with _start(model_dir) as first:      # the fork server runs from here on
        server = forkserver._shared
        assert server is not None and _parent_of(first.pid) == server.process.pid
        assert first.dtype == "float32"
    monkeypatch.chdir(model_dir.parent)
    monkeypatch.setenv("XREC_CPU_AUTO_DTYPE", "bfloat16")       # read when the model loads
    monkeypatch.setattr(logging.getLogger("xrec"), "level", logging.INFO)
    capfd.readouterr()
    with _start(model_dir.name) as engine, \
            Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as in_thread:
        assert forkserver._shared is server and _parent_of(engine.pid) == server.process.pid
        assert engine.dtype == "bfloat16" and in_thread.dtype == "bfloat16"
        assert engine.recommend([REQUEST])[0].results == in_thread.recommend([REQUEST])[0].results
    assert "[child] engine ready" in capfd.readouterr().err


def test_a_start_from_a_removed_working_directory_still_forks(model_dir, monkeypatch, tmp_path):
    with _start(model_dir):
        server = forkserver._shared
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    with _start(model_dir) as engine:
        assert forkserver._shared is server and _parent_of(engine.pid) == server.process.pid
        assert engine.recommend([REQUEST])[0].results


def test_engines_started_from_many_threads_share_one_fork_server(model_dir):
    with _start(model_dir):
        server = forkserver._shared
    with ThreadPoolExecutor(4) as pool:
        engines = list(pool.map(lambda _: _start(model_dir), range(4)))
    try:
        assert forkserver._shared is server and len({e.pid for e in engines}) == 4
        assert {_parent_of(e.pid) for e in engines} == {server.process.pid}
        answers = [e.recommend([REQUEST])[0].results for e in engines]
        assert all(a == answers[0] for a in answers) and answers[0]
    finally:
        for engine in engines:
            engine.close()


def test_a_variable_read_at_import_starts_a_fresh_interpreter(model_dir, monkeypatch):
    with _start(model_dir):
        pass
    monkeypatch.setenv("OMP_NUM_THREADS", str(int(os.environ.get("OMP_NUM_THREADS", "1")) + 1))
    with _start(model_dir) as engine:
        assert _parent_of(engine.pid) == os.getpid()
        assert engine.recommend([REQUEST])[0].results
    monkeypatch.undo()
    monkeypatch.setenv(forkserver.FORK_SERVER_ENV, "off")
    with _start(model_dir) as engine:
        assert _parent_of(engine.pid) == os.getpid()


def test_a_killed_fork_server_is_replaced_and_its_childs_exit_is_unknown(model_dir):
    with _start(model_dir) as orphan:
        old = forkserver._shared
        old.process.kill()
        old.process.wait()
        assert orphan.recommend([REQUEST])[0].results      # its children serve on
        with _start(model_dir) as engine:    # the next start: a new fork server
            assert forkserver._shared is not old
            assert _parent_of(engine.pid) == forkserver._shared.process.pid
            assert engine.recommend([REQUEST])[0].results
        os.kill(orphan.pid, signal.SIGKILL)
        assert wait_gone(orphan.pid)
        deadline = time.monotonic() + WAIT_S
        while orphan.is_serving and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(Unavailable, match="exit status unknown: its fork server is gone"):
            orphan.submit(REQUEST)


def test_a_fork_server_that_does_not_answer_fails_the_start_instead_of_a_second_child(
        model_dir, monkeypatch):
    """Once the request is sent, a child may have the engine's socket: a fresh interpreter
    on the same socket would share its messages, so the start fails; the next one runs a
    new fork server."""
    with _start(model_dir):
        stopped = forkserver._shared
    monkeypatch.setattr(forkserver, "ANSWER_TIMEOUT_S", 1.0)
    os.kill(stopped.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(OSError, match="the fork server did not answer .*timed out.*the "
                                          "engine did not start"):
            _start(model_dir)
    finally:
        if stopped.process.poll() is None:
            os.kill(stopped.process.pid, signal.SIGCONT)
    assert stopped.process.returncode == -signal.SIGKILL     # stopped, so killed
    with _start(model_dir) as engine:
        assert forkserver._shared is not stopped
        assert _parent_of(engine.pid) == forkserver._shared.process.pid
        assert engine.recommend([REQUEST])[0].results


def test_the_fork_server_and_its_children_exit_with_their_owner(model_dir):
    script = textwrap.dedent(f"""
        import time
        from xrec import Engine
        from xrec.engine import forkserver
        engines = [Engine.from_pretrained({str(model_dir)!r}, isolation="process", device="cpu")
                   for _ in range(2)]
        print(forkserver._shared.process.pid, *(e.pid for e in engines), flush=True)
        time.sleep(600)
    """)
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in owner.stdout.readline().split()]
        assert len(pids) == 3 and all(is_alive(pid) for pid in pids)
        assert {_parent_of(pid) for pid in pids[1:]} == {pids[0]}
    finally:
        owner.kill()
        owner.wait()
    assert all(wait_gone(pid) for pid in pids)
