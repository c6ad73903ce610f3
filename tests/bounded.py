"""Bounded waits for tests: a broken engine fails the test instead of hanging it."""

from __future__ import annotations

import threading

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
