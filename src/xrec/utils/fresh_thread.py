"""Run a function in a thread that ends with it (no torch here)."""

from __future__ import annotations

import threading
from typing import Any, Callable


def in_fresh_thread(fn: Callable[[], Any]) -> Any:
    """Run `fn` in a new thread that ends with it; its result, or its exception re-raised.

    libgomp throttles the spin-waiting of every OpenMP team once the process holds
    more OpenMP threads than cores, and a long-lived thread that ran a parallel torch
    op keeps its team: one parallel op on the main thread slows xrec's pipeline for the
    rest of the process (docs/decisions.md, Benchmarks). So the bench's own torch
    work (loading, HF, the naive reference, the profiled step) and an in-thread engine's
    loading run in threads that end, leaving xrec's pipelines the only long-lived teams,
    as in `xrec serve`.

    Ctrl-C in the caller waits for `fn` to finish, then is raised: an interpreter that
    exits while torch still runs in another thread aborts. What `fn` returned is
    dropped (an engine is closed when collected).
    """
    box: dict[str, Any] = {}
    finished = threading.Event()

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            box["error"] = exc
        finally:
            finished.set()

    thread = threading.Thread(target=target, name="xrec-fresh-thread")
    thread.start()
    # an Event, not join(): once Ctrl-C interrupts a join(), Python 3.11 takes the thread
    # for stopped although it runs on
    try:
        finished.wait()
    except KeyboardInterrupt:
        finished.wait()
        raise
    thread.join()
    if "error" in box:
        raise box["error"]
    return box.get("value")
