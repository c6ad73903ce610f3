"""Deadlines stop work: a batch whose every request has passed its deadline stops between
rounds (counted with the executor's `num_rounds_run`, never timed); a deadline counts
from the request's arrival at the edge (`arrived_at`, the parent's submission with
isolation="process"); and a parent whose child is stopped answers DEADLINE_EXCEEDED
itself. Real engines, real threads, a real child process."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time

import pytest

from xrec import DeadlineExceeded, Engine, InvalidArgument, RecRequest
from xrec.demo import write_random_model

WAIT_S = 60.0  # bound on every wait: a broken engine fails the test instead of hanging it
ROUND_S = 10.0  # the test clock: each round the executor starts moves it this far


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=3, num_items=300)


@pytest.fixture(scope="module")
def engine(model_dir):
    """In-thread, one request per batch, its executor on a clock that moves ROUND_S per
    round run (an hour ahead of the scheduler's, so nothing expires while waiting)."""
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu",
                                max_seqs_per_batch=2) as engine:
        executor = engine.executor
        start = time.monotonic() + 3600.0
        executor.clock = lambda: start + ROUND_S * executor.num_rounds_run
        yield engine


def _run_with_deadlines(engine, rounds_left: dict[str, float | None]) -> tuple[int, dict]:
    """One batch of a request per key, each given the deadline `rounds_left` rounds after
    its batch starts (None: no deadline): (rounds the batch ran, each request's future)."""
    executor = engine.executor

    def fault(batch):
        now = executor.clock()
        for request in batch.requests:
            left = rounds_left[request.request_id]
            request.deadline = None if left is None else now + ROUND_S * left
    executor.fault = fault
    before = executor.num_rounds_run
    futures = dict(zip(rounds_left, engine.submit_many(
        [RecRequest(token_ids=[1, 2, 3], beam_width=8, request_id=name, timeout_ms=60_000)
         for name in rounds_left])))
    for future in futures.values():
        future.exception(WAIT_S)
    return executor.num_rounds_run - before, futures


def test_a_batch_whose_every_deadline_passed_stops_between_rounds(engine):
    num_rounds, futures = _run_with_deadlines(engine, {"a": 1.5, "b": 0.5})
    assert num_rounds == 2     # of 3: round 2 ends after both deadlines
    for name, future in futures.items():
        with pytest.raises(DeadlineExceeded, match="stopped before round 3 of 3") as info:
            future.result(0)
        assert info.value.request_id == name


def test_a_deadline_passed_before_the_first_round_runs_none(engine):
    num_rounds, futures = _run_with_deadlines(engine, {"a": -0.5})
    assert num_rounds == 0
    with pytest.raises(DeadlineExceeded, match="stopped before round 1 of 3"):
        futures["a"].result(0)


def test_a_batch_with_a_request_still_in_time_runs_every_round(engine):
    """One late request does not stop its batch's other requests; it still gets
    DEADLINE_EXCEEDED when the batch ends, the others their results."""
    num_rounds, futures = _run_with_deadlines(engine, {"late": 0.5, "none": None})
    assert num_rounds == 3
    with pytest.raises(DeadlineExceeded, match="after its deadline"):
        futures["late"].result(0)
    assert futures["none"].result(0).results
    num_rounds, futures = _run_with_deadlines(engine, {"a": 5.0, "b": 3.0})
    assert num_rounds == 3 and all(f.result(0).results for f in futures.values())


@pytest.mark.parametrize("isolation", ["thread", "process"])
def test_a_deadline_counts_from_the_arrival_given(model_dir, isolation):
    """`arrived_at` (time.monotonic() seconds, the edge's clock) starts the deadline; the
    child of isolation="process" uses the parent's (whichever side then answers first)."""
    with Engine.from_pretrained(model_dir, isolation=isolation, device="cpu") as engine:
        valid = engine.validate(RecRequest(token_ids=[1, 2, 3], beam_width=8, timeout_ms=5_000))
        late = engine.submit_valid(valid, arrived_at=time.monotonic() - 10.0)
        with pytest.raises(DeadlineExceeded,
                           match="waiting queue" if isolation == "thread" else None):
            late.result(WAIT_S)
        [in_time] = engine.submit_valid_many([valid], arrived_at=time.monotonic())
        assert in_time.result(WAIT_S).results
        with pytest.raises(InvalidArgument, match="arrived_at"):
            engine.submit_valid(valid, arrived_at=float("nan"))


def test_a_stopped_child_gets_its_deadline_answered_by_the_parent(model_dir):
    """The child is stopped (SIGSTOP): the parent answers DEADLINE_EXCEEDED once the
    deadline has passed; the child's own answer, after SIGCONT, is dropped, and the
    engine goes on serving."""
    with Engine.from_pretrained(model_dir, isolation="process", device="cpu") as engine:
        assert engine.recommend(RecRequest(token_ids=[1, 2], beam_width=8))[0].results
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            future = engine.submit(RecRequest(token_ids=[1, 2], beam_width=8, timeout_ms=500,
                                              request_id="stopped"))
            with pytest.raises(DeadlineExceeded, match="no answer from the engine process") as info:
                future.result(WAIT_S)
            assert info.value.request_id == "stopped"
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        assert engine.recommend(RecRequest(token_ids=[1, 2], beam_width=8))[0].results
        assert isinstance(future.exception(0), DeadlineExceeded)


def test_over_http_a_deadline_counts_from_the_arrival_of_the_head(model_dir):
    """A real server: the request's head arrives, its body only after its whole timeout_ms;
    it is answered 504 DEADLINE_EXCEEDED (the deadline started at the edge, not when the body
    was parsed), and the same body sent at once is 200."""
    from test_server import ServerThread

    from xrec.server.app import create_app

    body = json.dumps({"token_ids": [1, 2, 3], "beam_width": 8, "timeout_ms": 1_000}).encode()
    head = (b"POST /v1/rec/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        server = ServerThread(create_app(engine))
        try:
            statuses = []
            for pause_s in (0.0, 2.0):   # the head alone, then the body after the deadline
                with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as sock:
                    sock.sendall(head)
                    time.sleep(pause_s)
                    sock.sendall(body)
                    response = http.client.HTTPResponse(sock)
                    response.begin()
                    answer = json.loads(response.read())
                    statuses.append((response.status, answer.get("error", {}).get("code")))
        finally:
            server.stop()
    assert statuses == [(200, None), (504, "DEADLINE_EXCEEDED")]
