"""Thread counts that follow the cores other processes leave free (issue 23, item 5):
`utils/cpu_share.CpuShare` on kernel counters (real /proc-format files in a directory, and
the machine's own /proc with a real spinning neighbour), `engine/threads.FollowFreeCores`,
the engine's pipelines and the training loops. Never timed."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from xrec import Engine, RecRequest
from xrec.demo import write_random_model
from xrec.engine.threads import (
    FollowFreeCores,
    adaptive_by_default,
    training_threads,
    use_threads_in_this_thread,
)
from xrec.utils.cpu_share import CpuShare

SPIN = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"
CPUS = sorted(os.sched_getaffinity(0))
needs_two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason="a neighbour takes one of 2+ CPUs")


class ProcFiles:
    """A directory laid out like /proc: `stat` (per-CPU tick counters) and `self/stat`."""

    def __init__(self, root: Path):
        self.root = root
        (root / "self").mkdir(parents=True)

    def write(self, cpus: dict[int, tuple[int, ...]], own_utime: int, own_stime: int) -> None:
        """`cpus`: cpu -> (user, nice, system, idle, iowait, irq, softirq, steal) ticks."""
        total = [sum(t[i] for t in cpus.values()) for i in range(8)]
        lines = ["cpu  " + " ".join(map(str, total)) + " 0 0"]
        lines += [f"cpu{c} " + " ".join(map(str, t)) + " 0 0" for c, t in sorted(cpus.items())]
        lines += ["intr 1 2 3", "ctxt 100"]
        (self.root / "stat").write_text("\n".join(lines) + "\n")
        # pid (comm with a space and a paren) state ppid ... utime stime: fields 14 and 15
        fields = ["S"] + ["0"] * 10 + [str(own_utime), str(own_stime)] + ["0"] * 30
        (self.root / "self" / "stat").write_text("4242 (python (x) y) " + " ".join(fields) + "\n")


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _share(tmp_path, cpus=(0, 1)) -> tuple[CpuShare, ProcFiles, Clock]:
    files, clock = ProcFiles(tmp_path / "proc"), Clock()
    files.write({c: (0, 0, 0, 1000, 0, 0, 0, 0) for c in cpus}, 0, 0)
    return CpuShare(set(cpus), window_s=0.5, proc=files.root, clock=clock), files, clock


def test_a_neighbour_on_one_core_takes_it(tmp_path):
    share, files, clock = _share(tmp_path)
    assert share.readable and share.free_cores() == 2
    # 100 ticks per CPU pass: cpu1 busy all of it, none of it ours
    files.write({0: (0, 0, 0, 1100, 0, 0, 0, 0), 1: (90, 0, 10, 1000, 0, 0, 0, 0)}, 0, 0)
    clock.now += 1.0
    assert share.free_cores() == 1


def test_own_time_is_not_a_neighbours(tmp_path):
    share, files, clock = _share(tmp_path)
    # both CPUs busy, 190 of the 200 busy ticks this process's own threads
    files.write({0: (100, 0, 0, 1000, 0, 0, 0, 0), 1: (95, 0, 5, 1000, 0, 0, 0, 0)}, 150, 40)
    clock.now += 1.0
    assert share.free_cores() == 2


def test_half_a_core_or_more_holds_it_and_steal_counts(tmp_path):
    share, files, clock = _share(tmp_path)
    # others: 40 ticks of 100 on cpu0 -> 0.4 of a core: not taken
    files.write({0: (40, 0, 0, 1060, 0, 0, 0, 0), 1: (0, 0, 0, 1100, 0, 0, 0, 0)}, 0, 0)
    clock.now += 1.0
    assert share.free_cores() == 2
    # next window: 60 ticks stolen by the hypervisor on cpu1 -> 0.6 of a core: taken
    files.write({0: (40, 0, 0, 1160, 0, 0, 0, 0), 1: (0, 0, 0, 1140, 0, 0, 0, 60)}, 0, 0)
    clock.now += 1.0
    assert share.free_cores() == 1


def test_at_least_one_core_and_a_window_between_samples(tmp_path):
    share, files, clock = _share(tmp_path, cpus=(0, 1, 2, 3))
    files.write({c: (100, 0, 0, 1000, 0, 0, 0, 0) for c in range(4)}, 0, 0)  # all taken
    clock.now += 0.2                 # within the window: the previous figure stands
    assert share.free_cores() == 4
    clock.now += 0.4
    assert share.free_cores() == 1
    # only the CPUs of the set count: a busy cpu7 outside it changes nothing
    files.write({**{c: (100, 0, 0, 1100, 0, 0, 0, 0) for c in range(4)},
                 7: (500, 0, 0, 0, 0, 0, 0, 0)}, 0, 0)
    clock.now += 1.0
    assert share.free_cores() == 4


def test_unreadable_counters_leave_every_core_free(tmp_path):
    share = CpuShare({0, 1, 2}, proc=tmp_path / "nothing")
    assert not share.readable and share.free_cores() == 3


@needs_two_cpus
def test_a_real_spinning_neighbour_is_seen_on_this_machine():
    share = CpuShare(window_s=0.3)
    neighbour = subprocess.Popen([sys.executable, "-c", SPIN, str(CPUS[-1])])
    try:
        time.sleep(0.2)
        share.free_cores()       # starts a window with the neighbour running
        time.sleep(1.0)
        assert share.free_cores() <= len(CPUS) - 1
    finally:
        neighbour.kill()
        neighbour.wait()


def _in_thread(fn):
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    thread.join()
    return out[0]


def test_follow_sets_this_threads_count_from_the_free_cores(tmp_path):
    share, files, clock = _share(tmp_path)
    files.write({0: (0, 0, 0, 1100, 0, 0, 0, 0), 1: (100, 0, 0, 1000, 0, 0, 0, 0)}, 0, 0)
    clock.now += 1.0

    def follow(wanted, sharers, adaptive):
        cores = FollowFreeCores(wanted, sharers, adaptive)
        if adaptive:
            cores.share = share
        return cores.follow(), torch.get_num_threads()

    before = torch.get_num_threads()
    assert _in_thread(lambda: follow(2, 1, True)) == (1, 1)     # one of 2 cores taken
    assert _in_thread(lambda: follow(2, 1, False)) == (2, 2)    # fixed: whatever the load
    assert _in_thread(lambda: follow(1, 2, True)) == (1, 1)     # never below 1
    assert torch.get_num_threads() == before                    # this thread untouched


def test_the_environment_turns_it_off(monkeypatch):
    monkeypatch.setenv("XREC_ADAPTIVE_THREADS", "0")
    assert not adaptive_by_default()
    assert FollowFreeCores(2).share is None
    monkeypatch.setenv("XREC_ADAPTIVE_THREADS", "1")
    assert adaptive_by_default() and FollowFreeCores(2).share is not None
    monkeypatch.delenv("XREC_ADAPTIVE_THREADS")
    assert adaptive_by_default()


def test_training_threads_are_as_before_afterwards():
    def run():
        before = torch.get_num_threads()
        wanted = 2 if before == 1 else 1    # another count than before: a change shows
        with training_threads(wanted, adaptive=False) as cores:
            inside = (cores.follow(), torch.get_num_threads())
        return before, wanted, inside, torch.get_num_threads()

    before, wanted, inside, after = _in_thread(run)
    assert inside == (wanted, wanted) and after == before


def test_training_threads_leave_other_threads_counts_alone():
    """A thread whose own count differs from the process's (a pipeline's, say) trains on 2
    threads; afterwards it has its own count back and a new thread still adopts the
    process's (restoring with torch.set_num_threads made the thread's count everyone's)."""
    default = torch.get_num_threads()
    torch.set_num_threads(3)     # the process's count: neither the thread's nor the loop's

    def run():
        use_threads_in_this_thread(1)
        with training_threads(2, adaptive=False) as cores:
            inside = (cores.follow(), torch.get_num_threads())
        return inside, torch.get_num_threads()

    try:
        inside, after = _in_thread(run)
        fresh = _in_thread(torch.get_num_threads)
    finally:
        torch.set_num_threads(default)
    assert inside == (2, 2) and after == 1 and fresh == 3


@needs_two_cpus
def test_engine_pipelines_take_fewer_threads_beside_a_busy_neighbour(tmp_path):
    """A real engine (2 threads, adaptive) runs its batches on 1 thread while a spinning
    process holds one of the CPUs, and says so in its stats; with the option off it keeps 2."""
    model_dir = write_random_model(tmp_path / "tiny", "tiny", seed=3, num_items=300)
    requests = [RecRequest(token_ids=[5, 6, 7, 8], beam_width=8)] * 2
    neighbour = subprocess.Popen([sys.executable, "-c", SPIN, str(CPUS[-1])])
    try:
        for adaptive, expected in ((True, 1), (False, 2)):
            with Engine.from_pretrained(model_dir, isolation="thread", device="cpu",
                                        num_threads=2, adaptive_threads=adaptive) as engine:
                seen: list[int] = []
                engine.executor.fault = lambda batch, seen=seen: seen.append(
                    torch.get_num_threads())
                deadline = time.monotonic() + 30
                while (not seen or seen[-1] != expected) and time.monotonic() < deadline:
                    engine.recommend(requests)
                    time.sleep(0.1)
                assert seen[-1] == expected
                assert engine.stats().cpu_threads == expected
    finally:
        neighbour.kill()
        neighbour.wait()
