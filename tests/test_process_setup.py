"""What xrec leaves on the threads it runs on.

- Loading an in-thread engine runs its torch work (weights, the float32 library's
  measurement, the catalog) in a thread that ends: the caller's thread keeps no OpenMP
  team, which would make libgomp throttle the pipelines' teams (docs/decisions.md,
  "Loading in a thread that ends").
- `in_fresh_thread` (where that loading runs) lets Ctrl-C in only once its thread is done.

Each check runs in a fresh interpreter: OpenMP teams and signal handlers are process state.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from xrec.demo import write_random_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=3, num_items=300)


def _python(script: str, **env: str) -> str:
    environ = {**os.environ, **env}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env=environ,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="an OpenMP team needs 2 cores")
def test_loading_leaves_no_openmp_team_on_the_callers_thread(model_dir):
    """Native threads that are not Python threads, before and after `from_pretrained`:
    the same count (OpenMP's worker threads are such threads). The float32 library is
    measured at load (`XREC_CPU_GEMM=auto`): parallel products, so a load on this thread
    would leave a team here. A parallel op on this thread afterwards does make one."""
    counts = _python(f"""
        import os, threading, time
        import torch
        from xrec import Engine

        def foreign():   # native threads that Python did not start
            return len(os.listdir("/proc/self/task")) - threading.active_count()

        before = foreign()
        engine = Engine.from_pretrained({str(model_dir)!r}, isolation="thread", device="cpu",
                                        dtype="float32", num_threads=2)
        time.sleep(0.5)   # the load thread's team ends with it
        loaded = foreign()
        torch.ones(1024, 1024) @ torch.ones(1024, 1024)
        print(before, loaded, foreign())
        engine.close()
    """, XREC_CPU_GEMM="auto", OMP_NUM_THREADS="2")
    before, loaded, after_own_op = map(int, counts.split())
    assert loaded == before
    assert after_own_op > before    # the check sees a team when there is one


def test_ctrl_c_waits_for_the_fresh_thread_then_is_raised():
    """SIGINT while `in_fresh_thread` runs: the function finishes first (an interpreter
    that exits under running torch work aborts), then KeyboardInterrupt reaches the
    caller."""
    out = _python("""
        import os, signal, threading, time
        from xrec.utils.fresh_thread import in_fresh_thread

        done = []
        def work():
            time.sleep(1.0)
            done.append(True)
            return "value"

        # Python's own handler: a shell that starts a job in the background (as CI may)
        # leaves SIGINT ignored, and then Python installs none
        signal.signal(signal.SIGINT, signal.default_int_handler)
        threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            in_fresh_thread(work)
            print("returned")
        except KeyboardInterrupt:
            print("interrupted", "after" if done else "before")
    """)
    assert out == "interrupted after"
