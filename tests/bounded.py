"""Bounded waits for tests: a broken engine fails the test instead of hanging it."""

from __future__ import annotations

import sys
import threading
import time

import pytest

TIMEOUT_S = 60.0  # no answer within this is a hang, not a slow machine


def recommend_within(engine, requests, timeout: float = TIMEOUT_S):
    """`engine.recommend(requests)` (all submitted together), failing instead of hanging."""
    box: dict = {}

    def target():
        try:
            box["value"] = engine.recommend(requests)
        except BaseException as exc:  # re-raised in the test thread
            box["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        pytest.fail(f"Engine.recommend did not answer {len(requests)} requests within {timeout} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def waits_in_close(thread: threading.Thread) -> bool:
    """Whether `thread` is blocked (in a `threading` wait) inside an engine's `close`: read
    from its stack frames, not from how long it took."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None or not frame.f_code.co_filename.endswith("threading.py"):
        return False
    while frame is not None:
        if frame.f_code.co_name == "close" and "xrec" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def is_alive(pid: int) -> bool:
    """Process `pid` runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout: float = TIMEOUT_S) -> bool:
    """Whether process `pid` is gone within `timeout`."""
    deadline = time.monotonic() + timeout
    while is_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not is_alive(pid)
