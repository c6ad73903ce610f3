"""Leaving a process with work in flight: the pipelines stop cleanly and the process exits
with its own status. Real scripts in real subprocesses (an engine of each isolation with a
batch running, then sys.exit(0), an uncaught exception or Ctrl-C), and a real `xrec serve`
stopped while its model loads. Torch still running on a thread when the interpreter
finalizes aborts the process ("terminate called without an active exception", 134)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator

import pytest

from bounded import wait_gone
from xrec.demo import write_random_model

WAIT_S = 60.0  # bound on every wait: a hang fails the test instead of blocking it
ABORTED = ("terminate called", "SIGABRT", "request(s) pending")

# An engine with a batch running (8 x W=512: about a second on a CPU), then HOW.
SCRIPT = textwrap.dedent("""
    import os, sys, time
    from xrec import Engine, RecRequest
    model_dir, isolation, how = sys.argv[1:]
    engine = Engine.from_pretrained(model_dir, isolation=isolation, device="cpu")
    engine.submit_many([RecRequest(token_ids=[i % 60 for i in range(200)], beam_width=512)
                        for _ in range(8)])
    deadline = time.monotonic() + 60
    while engine.stats().num_pipelines_busy == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    print("busy", engine.stats().num_pipelines_busy, getattr(engine, "pid", os.getpid()), flush=True)
    if how == "exit":
        sys.exit(0)
    if how == "raise":
        raise RuntimeError("the host failed")
    time.sleep(60)   # "sigint": the test sends Ctrl-C
""")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=3, num_items=300)


def _run_script(model_dir, isolation: str, how: str) -> tuple[int, str, int]:
    """(exit status, stderr, pid of the engine's pipelines' process) of SCRIPT."""
    # SIGINT at its default even where the test runner ignores it (a job started with `&`)
    with _reaped([sys.executable, "-c", SCRIPT, str(model_dir), isolation, how],
                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)) as proc:
        line = proc.stdout.readline().split()
        assert line[:1] == ["busy"], proc.communicate(timeout=WAIT_S)
        assert int(line[1]) >= 1, "no batch was running: the exit was not exercised"
        if how == "sigint":
            proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=WAIT_S)
    return proc.returncode, stderr, int(line[2])


@contextlib.contextmanager
def _reaped(command: list[str], **kwargs) -> Iterator[subprocess.Popen]:
    """`command` running with its stdout and stderr piped; killed if still running when the
    block ends (a failed assertion must not leave it behind)."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kwargs)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("isolation", ["thread", "process"])
@pytest.mark.parametrize("how, statuses", [("exit", {0}), ("raise", {1}),
                                           ("sigint", {-signal.SIGINT, 130})])
def test_exit_with_a_batch_running_keeps_the_scripts_status(model_dir, isolation, how, statuses):
    status, stderr, pid = _run_script(model_dir, isolation, how)
    assert status in statuses, stderr
    assert not any(word in stderr for word in ABORTED), stderr
    if how == "raise":
        assert "RuntimeError: the host failed" in stderr
    if how == "sigint":
        assert "KeyboardInterrupt" in stderr
    assert wait_gone(pid)   # the child of isolation="process"


# `xrec serve` whose model "loads" for up to a minute: torch work on the loading thread.
SLOW_LOAD = textwrap.dedent("""
    import sys, time, torch
    import xrec.engine.engine as engine_module
    from xrec.cli import main

    load_parts = engine_module.load_parts

    def slow_load_parts(*args):
        print("loading", flush=True)
        a = torch.randn(256, 256)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            a = torch.tanh(a @ a)
        return load_parts(*args)

    engine_module.load_parts = slow_load_parts
    sys.exit(main(["serve", "--model", sys.argv[1], "--port", "0", "--device", "cpu",
                   "--grace-s", "5"]))
""")


def test_sigterm_while_the_model_loads_exits_0(model_dir, tmp_path):
    env = {**os.environ, "XREC_HOME": str(tmp_path / "home")}
    env.pop("XREC_API_KEY", None)
    with _reaped([sys.executable, "-c", SLOW_LOAD, str(model_dir)], env=env) as proc:
        assert proc.stdout.readline().strip() == "loading", proc.communicate(timeout=WAIT_S)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, stderr
    assert not any(word in stderr for word in ABORTED), stderr
    assert "stopped while the model was loading" in stderr


# A done-callback closes the engine (its close drains on a thread of its own), then the
# script exits while the drain still runs a batch.
CLOSED_FROM_A_CALLBACK = textwrap.dedent("""
    import sys, threading, time
    from xrec import Engine, RecRequest
    engine = Engine.from_pretrained(sys.argv[1], isolation="thread", device="cpu")
    request = RecRequest(token_ids=[i % 60 for i in range(200)], beam_width=512)
    first = engine.submit(request)
    deadline = time.monotonic() + 60
    while engine.stats().num_pipelines_busy == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    queued = [engine.submit(request) for _ in range(8)]     # batches of their own
    closing = threading.Event()
    first.add_done_callback(lambda future: (engine.close(), closing.set()))
    closing.wait(60)
    while engine.executor.num_busy == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    print("busy", engine.executor.num_busy, sum(f.done() for f in queued), flush=True)
    sys.exit(0)
""")


def test_exit_while_a_close_begun_in_a_done_callback_drains_waits_for_it(model_dir):
    """`close()` in a done-callback returns at once and drains on a thread of its own; that
    thread was a daemon and the close had taken the engine's exit hook, so nothing waited
    for the drain at exit: the interpreter finalized with a batch running and the process
    aborted ("terminate called without an active exception", 134). Now the exit waits for
    the close (its grace at most), as a `close()` on the main thread would have."""
    with _reaped([sys.executable, "-c", CLOSED_FROM_A_CALLBACK, str(model_dir)]) as proc:
        line = proc.stdout.readline().split()
        assert line[:1] == ["busy"], proc.communicate(timeout=WAIT_S)
        assert int(line[1]) >= 1, "no batch was running: the exit was not exercised"
        _, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, stderr
    assert not any(word in stderr for word in ABORTED), stderr
