"""isolation="process": the pipelines in a real child process, the request API here.

Results equal in-thread execution; the child's lifetime follows the engine (close, garbage
collection, the parent's SIGKILL); a child killed mid-batch fails exactly the pending
requests; errors keep their classes; arrays cross the shared-memory arena bit-identical."""

from __future__ import annotations

import dataclasses

import gc
import hashlib
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor, as_completed, wait

import numpy as np
import pytest

from bounded import is_alive, recommend_within, wait_gone, waits_in_close
from xrec import DeadlineExceeded, Engine, InvalidArgument, RecRequest, Unavailable
from xrec.demo import write_random_model
from xrec.engine.isolated import ProcessEngine
from xrec.engine.frontend import EngineStats
from xrec.engine.responses import ResponseData
from xrec.engine.transport import ARENA_MIN_BYTES, Arena, dumps, loads
from xrec.model.loader import CheckpointError

WAIT_S = 60.0  # bound on every wait: a broken engine fails the test instead of hanging it


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=3, num_items=300)


@pytest.fixture(scope="module")
def engine(model_dir):
    with Engine.from_pretrained(model_dir, device="cpu") as engine:   # the default: process
        yield engine


def _requests(num: int, width: int = 8) -> list[RecRequest]:
    return [RecRequest(token_ids=[(7 * i + j) % 60 for j in range(3 + i % 5)], beam_width=width,
                       request_id=f"r{i}") for i in range(num)]


def _embedding_requests(d_model: int, num: int) -> list[RecRequest]:
    rng = np.random.default_rng(5)
    return [RecRequest(sparse_embedding=rng.standard_normal((1 + 40 * i, d_model), dtype=np.float32),
                       decoder_context_embedding=rng.standard_normal((2, d_model), dtype=np.float32)
                       if i % 2 else None, beam_width=16, num_return_sequences=5, request_id=f"e{i}")
            for i in range(num)]


def test_results_equal_in_thread_execution(model_dir, engine):
    requests = _requests(6) + _embedding_requests(engine.limits.d_model, 4)
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as in_thread:
        expected = in_thread.recommend(requests)
        # answers as arrays (what the HTTP server asks for), from both kinds of engine
        as_data = [e.submit_valid_many([e.validate(r) for r in requests], as_data=True)
                   for e in (in_thread, engine)]
        as_data = [[f.result(WAIT_S) for f in futures] for futures in as_data]
    got = engine.recommend(requests)
    # tokens, scores, log-probs, items, ids and usage, bit for bit (timings differ)
    assert [(r.request_id, r.results, r.usage) for r in got] == \
        [(r.request_id, r.results, r.usage) for r in expected]
    for answers in as_data:
        assert all(isinstance(a, ResponseData) for a in answers)
        assert [(a.to_response().results, a.usage) for a in answers] == \
            [(r.results, r.usage) for r in expected]
    assert isinstance(engine, ProcessEngine) and engine.pid != os.getpid() and is_alive(engine.pid)


def test_edge_errors_are_raised_here_and_child_errors_keep_their_class(model_dir, engine):
    with pytest.raises(InvalidArgument, match="beam_width"):        # validated in this process
        engine.submit(RecRequest(token_ids=[1, 2], beam_width=10**6))
    late = engine.submit(RecRequest(token_ids=[1, 2], beam_width=4, timeout_ms=1e-3,
                                    request_id="late"))
    with pytest.raises(DeadlineExceeded) as info:                   # raised in the child
        late.result(WAIT_S)
    assert info.value.request_id == "late" and info.value.code == "DEADLINE_EXCEEDED"
    (model_dir.parent / "broken").mkdir(exist_ok=True)
    broken = model_dir.parent / "broken"
    for name in os.listdir(model_dir):
        target = broken / name
        if not target.exists():
            target.symlink_to(model_dir / name)
    os.unlink(broken / "model.safetensors")
    (broken / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(CheckpointError):                            # raised while loading there
        Engine.from_pretrained(broken, isolation="process")


def test_cancel_report_hooks_and_bursts(engine):
    reports = []
    engine.add_report_hook(reports.append)
    engine.hold_wakeups()
    futures = engine.submit_many(_requests(8))
    assert futures[-1].cancel()            # the child drops it or finishes it; nobody waits for it
    engine.release_wakeups()
    done, _ = wait(futures[:-1], WAIT_S)
    assert len(done) == 7 and all(f.result().results for f in futures[:-1])
    deadline = time.monotonic() + WAIT_S
    while not reports and time.monotonic() < deadline:
        time.sleep(0.01)
    assert reports and reports[0].num_requests >= 1


def test_a_cancelled_request_is_done_for_wait_and_as_completed(engine):
    """A cancelled future counts as done for `concurrent.futures.wait` and `as_completed`
    only once notified (`set_running_or_notify_cancel`). Before, the caller's future of a
    cancelled request never was: `wait` on it waited its whole timeout and `as_completed`
    for ever."""
    engine.hold_wakeups()       # queued in the child, not running, when it is cancelled
    try:
        futures = engine.submit_many(_requests(2))
        assert futures[1].cancel()
    finally:
        engine.release_wakeups()
    done, _ = wait(futures, WAIT_S)
    assert done == set(futures), "wait() does not see the cancelled request as done"
    assert set(as_completed(futures, WAIT_S)) == set(futures)
    assert futures[0].result().results


def test_a_done_callback_cancelling_many_requests_leaves_the_engine_answering(model_dir):
    """Done-callbacks run on the receiver thread. One that cancelled the rest of 1,500
    queued requests (the first answer wins) filled the child's socket with cancels, while
    the child's reading loop, which sent each "cancelled" itself, blocked on this side's
    full socket: each waited on the other for good, and the engine answered nothing again.
    The child's reading loop now never writes to the socket."""
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu",
                                    max_seqs_per_batch=1, request_queue_size=2000)
    rest: list = []
    ready, cancelled = threading.Event(), threading.Event()

    def cancel_the_rest(_):
        ready.wait(WAIT_S)
        for future in rest:
            future.cancel()
        cancelled.set()
    try:
        os.kill(engine.pid, signal.SIGSTOP)     # so that the callback runs on the receiver
        first = engine.submit(RecRequest(token_ids=[1, 2, 3], beam_width=2))
        first.add_done_callback(cancel_the_rest)
        os.kill(engine.pid, signal.SIGCONT)
        rest.extend(engine.submit_many(_requests(1500, width=2)))
        ready.set()
        assert cancelled.wait(WAIT_S), "cancelling from a done-callback wedged the engine"
        assert all(f.done() for f in rest)
        assert recommend_within(engine, _requests(1))[0].results
    finally:
        ready.set()
        if not cancelled.is_set():
            os.kill(engine.pid, signal.SIGKILL)     # unwedge this side's send
        engine.close()


def test_reads_and_calls_from_a_report_hook_answer(model_dir):
    """Report hooks (and done-callbacks) run on the receiver thread, the one the child's
    answers come through: `stats()` there waited READ_TIMEOUT_S and raised `Unavailable`
    (holding every other answer back meanwhile), and a call (`get`, `load_catalog`) waited
    for ever, and with it every request of the engine."""
    with Engine.from_pretrained(model_dir, isolation="process", device="cpu") as engine:
        seen, called = [], threading.Event()

        def read_and_call(report):
            if called.is_set():
                return
            for read in (engine.stats, lambda: engine.get("num_pipelines")):
                try:
                    seen.append(read())
                except Exception as exc:
                    seen.append(exc)
            called.set()
        engine.add_report_hook(read_and_call)
        assert engine.recommend(_requests(1))[0].results
        assert called.wait(WAIT_S), "a call from a report hook never returned"
        assert engine.recommend(_requests(2))[1].results    # the receiver serves on
        assert isinstance(seen[0], EngineStats) and seen[0].is_serving, seen
        assert seen[1] == engine.num_pipelines, seen


def test_unmatched_release_raises_here_and_the_child_serves_on(engine):
    """As in-thread: an unmatched `release_wakeups()` raises to its caller. Before, it
    returned here and ended the child's serving loop (every pending request UNAVAILABLE)."""
    pid = engine.pid
    with pytest.raises(RuntimeError, match="without hold_wakeups"):
        engine.release_wakeups()
    engine.hold_wakeups()
    engine.release_wakeups()
    assert engine.recommend(_requests(2))[0].results
    assert is_alive(pid)


def test_an_answer_for_no_pending_request_leaves_the_receiver_running(engine):
    """The receiver popped pending entries without a default: a stray answer ended its
    thread, and every later request would have waited forever."""
    link = engine._link
    link._handle(("result", -1, None))
    link._handle(("error", -2, RuntimeError("stray")))
    assert engine._receiver.is_alive()
    assert engine.recommend(_requests(1))[0].results


def test_stats_come_from_the_child_in_the_in_process_shape(model_dir, engine):
    """`stats()` (what /metrics reads) is the child engine's snapshot: the same EngineStats
    as an in-process engine of the same options, idle after its answers."""
    assert all(f.result(WAIT_S).results for f in engine.submit_many(_requests(3)))
    deadline = time.monotonic() + WAIT_S
    while (stats := engine.stats()).num_batches_running and time.monotonic() < deadline:
        time.sleep(0.01)
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as local:
        want = local.stats()
    assert isinstance(stats, EngineStats)
    same_catalog = dataclasses.replace(want.catalog_version, loaded_at=stats.catalog_version.loaded_at)
    assert stats == dataclasses.replace(want, catalog_version=same_catalog)   # idle, same budget
    assert stats.num_pipelines == 1 and stats.workspace_bytes_total > 0
    assert stats.catalog_version.num_items == 300


def test_catalog_hot_reload_runs_in_the_child(model_dir, engine, tmp_path):
    from xrec.catalog import random_catalog
    from xrec.errors import InvalidArgument as Invalid

    first = engine.catalog_version
    random_catalog(50, engine.limits.vocab_size, 9).write(tmp_path / "new.bin")
    loaded = engine.load_catalog(tmp_path / "new.bin")
    assert engine.catalog_version == loaded and loaded.num_items == 50
    assert engine.previous_catalog_version == first
    response = engine.recommend(_requests(1))[0]
    assert response.catalog_version == loaded.content_hash
    assert engine.restore_catalog() == first and engine.catalog_version == first
    (tmp_path / "bad.bin").write_bytes(b"not a catalog")
    with pytest.raises(Invalid):                    # the child's error class, here
        engine.load_catalog(tmp_path / "bad.bin")
    assert engine.catalog_version == first


def test_child_killed_mid_batch_fails_exactly_the_pending_requests(model_dir):
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu",
                                    max_seqs_per_batch=1)
    answered = engine.recommend(_requests(2))
    pending = [engine.submit(RecRequest(token_ids=[i % 60 for i in range(200)], beam_width=256))
               for _ in range(4)]
    os.kill(engine.pid, signal.SIGKILL)
    outcomes = []
    for future in pending:   # each answered exactly once: a result, or the child's death
        try:
            outcomes.append(bool(future.result(WAIT_S).results))
        except Unavailable as e:
            assert "killed by SIGKILL" in str(e) and "create a new engine" in str(e)
            outcomes.append("failed")
    assert outcomes[-1] == "failed" and set(outcomes) <= {True, "failed"}
    assert all(r.results for r in answered)
    with pytest.raises(Unavailable, match="create a new engine"):
        engine.submit(RecRequest(token_ids=[1]))
    engine.close()
    with Engine.from_pretrained(model_dir, isolation="process", device="cpu") as again:
        assert again.recommend(_requests(1))[0].results


def test_close_and_garbage_collection_end_the_child(model_dir):
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    futures = engine.submit_many(_requests(4))
    pid = engine.pid
    engine.close(grace_s=WAIT_S)
    assert all(f.result(0).results for f in futures)    # close drains what was queued
    assert wait_gone(pid)
    with pytest.raises(Unavailable):
        engine.submit(RecRequest(token_ids=[1]))
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    pid = engine.pid
    del engine
    gc.collect()
    assert wait_gone(pid)


def test_close_from_a_done_callback_drains_what_was_queued(model_dir):
    """A done-callback runs on the receiver thread; `close` there waited for the child with
    nobody reading its answers, then the receiver found its socket closed: the requests the
    child had drained failed UNAVAILABLE. It now closes on a thread of its own, as
    `Engine.close` and the finalizer do."""
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu",
                                    max_seqs_per_batch=1)
    returned = threading.Event()

    def close_now(future):
        engine.close(grace_s=WAIT_S)
        returned.set()
    futures = engine.submit_many(_requests(5))
    futures[0].add_done_callback(close_now)
    done, _ = wait(futures, WAIT_S)
    assert len(done) == 5
    assert all(f.result(0).results for f in futures)    # close drains what was queued
    assert returned.wait(WAIT_S)
    assert wait_gone(engine.pid)
    with pytest.raises(Unavailable):
        engine.submit(RecRequest(token_ids=[1]))


def test_close_while_another_close_drains_returns_once_that_one_has(model_dir):
    """A second `close()` returned at once while the first still waited for the child to
    drain, with requests unanswered. It now returns once the first has ended. The child is
    stopped (SIGSTOP) while both closes begin, so that nothing is answered before."""
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    pid = engine.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        futures = engine.submit_many(_requests(2))      # in the socket; the child reads later
        first = threading.Thread(target=engine.close, args=(WAIT_S,), daemon=True)
        first.start()
        deadline = time.monotonic() + WAIT_S
        while engine.is_serving and time.monotonic() < deadline:
            time.sleep(0.01)     # the first close has begun
        answered_at_return = []
        second = threading.Thread(target=lambda: (engine.close(WAIT_S), answered_at_return.append(
            all(f.done() for f in futures))), daemon=True)
        second.start()
        while second.is_alive() and not waits_in_close(second) and time.monotonic() < deadline:
            time.sleep(0.01)     # the second returns (before) or waits for the first (now)
    finally:
        os.kill(pid, signal.SIGCONT)
    first.join(WAIT_S)
    second.join(WAIT_S)
    assert not first.is_alive() and not second.is_alive()
    assert answered_at_return == [True], "the second close() returned before the child drained"
    assert all(f.result(0).results for f in futures)


def test_close_twice_leaves_the_hosts_files_alone(model_dir, tmp_path):
    """`close()` then `with`'s own close: the second is a no-op. Before, it closed the
    arena's file descriptor again, by then the number of a file this process had opened."""
    with Engine.from_pretrained(model_dir, isolation="process", device="cpu") as engine:
        assert engine.recommend(_requests(1))[0].results
        engine.close(grace_s=WAIT_S)
        mine = os.open(tmp_path / "mine.txt", os.O_CREAT | os.O_RDWR)
    try:
        assert os.write(mine, b"still open") == 10
    finally:
        os.close(mine)


def test_close_with_an_unbounded_grace_drains_the_child(model_dir):
    """close(inf) overflowed the child's waits: it aborted (SIGABRT) and the queued requests
    failed UNAVAILABLE instead of being answered. A bad grace is refused here first."""
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    with pytest.raises(InvalidArgument, match="grace_s"):
        engine.close(None)
    engine.hold_wakeups()
    futures = engine.submit_many(_requests(6))
    engine.release_wakeups()
    pid = engine.pid
    engine.close(math.inf)
    assert all(f.result(timeout=WAIT_S).results for f in futures)
    assert wait_gone(pid)


def _use_and_drop(model_dir) -> tuple[int, list]:
    """An engine that served a request and one that was never used, dropped: (the used
    one's child pid, the futures of its requests, which the caller keeps)."""
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    assert engine.recommend(_requests(1))[0].results
    futures = engine.submit_many(_requests(2))
    wait(futures, timeout=WAIT_S)
    return engine.pid, futures


def test_a_used_engine_dropped_ends_its_child(model_dir):
    """Nothing the engine leaves behind (the receiver's last message, the futures and their
    callbacks, the deadline timer) keeps it alive: dropping it ends its child."""
    pids = []
    for _ in range(2):
        pid, futures = _use_and_drop(model_dir)
        assert all(f.result(0).results for f in futures)
        pids.append(pid)
    gc.collect()
    assert all(wait_gone(pid) for pid in pids)


def test_parent_killed_leaves_no_child(model_dir):
    script = textwrap.dedent(f"""
        import sys, time
        from xrec import Engine, RecRequest
        engine = Engine.from_pretrained({str(model_dir)!r}, isolation="process", device="cpu")
        engine.submit(RecRequest(token_ids=[i % 60 for i in range(200)], beam_width=512))  # mid-batch
        print(engine.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert is_alive(child)
    finally:
        parent.kill()
        parent.wait()
    assert wait_gone(child)


ECHO = textwrap.dedent("""
    import hashlib, sys
    from multiprocessing.connection import Connection
    from xrec.engine.transport import Arena, loads
    conn, arena = Connection(int(sys.argv[1])), Arena(int(sys.argv[2]), int(sys.argv[3]))
    while True:
        try:
            message = loads(conn.recv_bytes(), arena)
        except EOFError:
            break
        digest = [hashlib.sha256(a.tobytes()).hexdigest() + str(a.dtype) + str(a.shape)
                  for a in (message.sparse_embedding, message.context, message.token_ids)
                  if a is not None]
        conn.send(digest)
""")


def test_every_embedding_shape_crosses_the_arena_bit_identical(model_dir, engine):
    """1,000 requests of every length up to max_input_len, in a real child process; the
    arena is small enough that some messages take the in-band fallback."""
    import socket
    from multiprocessing.connection import Connection

    limits = engine.limits
    arena = Arena.create(1 << 20)
    ours, theirs = socket.socketpair()
    child = subprocess.Popen([sys.executable, "-c", ECHO, str(theirs.fileno()), str(arena.fd),
                              str(arena.size)], pass_fds=(theirs.fileno(), arena.fd))
    theirs.close()
    conn = Connection(ours.detach())
    rng = np.random.default_rng(0)
    kinds = set()
    try:
        for i in range(1000):
            length = 1 + (i * 37) % limits.max_input_len
            request = RecRequest(
                sparse_embedding=rng.standard_normal((length, limits.d_model), dtype=np.float32),
                decoder_context_embedding=None if i % 3 else
                rng.standard_normal((1 + i % 7, limits.d_model), dtype=np.float32))
            valid = engine.validate(request)
            data, regions = dumps(valid, arena)
            kinds.add("arena" if regions else "in-band")
            conn.send_bytes(data)
            expected = [hashlib.sha256(a.tobytes()).hexdigest() + str(a.dtype) + str(a.shape)
                        for a in (valid.sparse_embedding, valid.context, valid.token_ids)
                        if a is not None]
            assert conn.recv() == expected, f"request {i} (length {length})"
            arena.free(regions)
    finally:
        conn.close()
        child.wait(WAIT_S)
    assert arena.free_bytes == arena.size
    assert kinds == {"arena", "in-band"}
    assert limits.max_input_len * limits.d_model * 4 > ARENA_MIN_BYTES


def test_arena_allocator_coalesces_and_refuses_when_full():
    arena = Arena.create(1 << 16)
    big = np.ones(40_000, dtype=np.uint8)
    first = dumps({"a": big}, arena)[1]
    assert first and dumps({"b": big}, arena)[1] == []     # no room: in-band, not refused
    second = dumps({"c": np.ones(20_000, dtype=np.uint8)}, arena)[1]
    arena.free(first)
    arena.free(second)
    assert arena.free_bytes == arena.size and len(arena._free) == 1
    assert loads(dumps({"b": big}, arena)[0], arena)["b"].sum() == big.sum()


def test_a_closed_arena_sends_in_band():
    """A sender that raced an engine's close found the arena's view released: a ValueError
    out of `submit` instead of the engine's Unavailable. A closed arena places nothing."""
    arena = Arena.create(1 << 16)
    arena.close()
    data, regions = dumps({"a": np.arange(8_000)}, arena)
    assert regions == [] and loads(data, None)["a"].sum() == np.arange(8_000).sum()


def test_close_never_closes_the_socket_under_a_write(model_dir, monkeypatch):
    """A write held up inside the socket (its thread starved, as under load) while `close`
    kills the child: `close` closed the socket under it, and the write went on with no
    descriptor (a TypeError out of `submit`) or, had the number been reused by then, into
    another file. Now the socket closes after the write, which fails UNAVAILABLE."""
    import xrec.engine.isolated as isolated

    monkeypatch.setattr(isolated, "CLOSE_MARGIN_S", 0.5)
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    conn, outcomes = engine._link.conn, {}
    writing, closed = threading.Event(), threading.Event()
    send = conn._send

    def held_up_send(buf, *args):
        if threading.current_thread() is writer:
            writing.set()
            closed.wait(WAIT_S)     # starved until `close` has returned
        return send(buf, *args)

    def submit():
        try:
            outcomes["writer"] = engine.submit(RecRequest(token_ids=[1, 2], beam_width=1))
        except Exception as exc:
            outcomes["writer"] = exc
    conn._send = held_up_send
    writer = threading.Thread(target=submit, daemon=True)
    writer.start()
    assert writing.wait(WAIT_S)
    pid = engine.pid
    engine.close(0.0)
    closed.set()
    writer.join(WAIT_S)
    assert isinstance(outcomes["writer"], Unavailable), outcomes
    assert wait_gone(pid)


def test_each_refusal_of_a_closed_engine_is_an_error_of_its_own(model_dir):
    """A closed (or dead) process engine raised its one `Unavailable` to every submission:
    each raise chained the caller's frames onto that error's traceback, so every refused
    request's arrays stayed in memory for the engine's life, and the request id the server
    tags an error with (when it has none) named the first refused request in every later
    refusal. Now each refusal is an error of its own; the refused request is let go."""
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    engine.close()
    arrays, request_ids = [], []
    for index in range(3):
        rows = np.ones((4, engine.limits.d_model), np.float32)
        arrays.append(weakref.ref(rows))
        try:
            engine.submit(RecRequest(sparse_embedding=rows, beam_width=1))
        except Unavailable as exc:
            request_ids.append(exc.request_id)
            exc.request_id = exc.request_id or f"q{index}"     # as the server tags it
        del rows
    with pytest.raises(Unavailable):
        engine.catalog_versions()
    gc.collect()
    assert request_ids == [None, None, None]
    assert not [ref for ref in arrays if ref() is not None], "a refused request was kept"


def test_filters_cross_to_the_child_and_answer_as_in_thread(model_dir, engine):
    """A filtered request in a process-isolated engine: the child resolves it on its
    catalog; the answer equals the in-process engine's, unknown-id count included."""
    from xrec.catalog import ItemCatalog

    ids = ItemCatalog.from_model_dir(model_dir, 64).item_ids.tolist()
    requests = [RecRequest(token_ids=[1, 2, 3 + i], beam_width=8, request_id=f"f{i}",
                           exclude_items=ids[i::3 + i] + [2**62 + 7 + i])   # + an unknown id
                for i in range(3)]
    got = [f.result(WAIT_S) for f in engine.submit_many(requests)]
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as local:
        want = local.recommend(requests)
    for request, g, w in zip(requests, got, want):
        assert g.usage == w.usage and g.usage["excluded_items_unknown"] == 1
        assert not {i.item_id for r in g.results for i in r.items} & set(request.exclude_items)
        assert [(r.tokens, [i.item_id for i in r.items]) for r in g.results] == \
            [(r.tokens, [i.item_id for i in r.items]) for r in w.results]


def _idle_and_not_serving(stats: EngineStats) -> bool:
    return (not stats.is_serving and stats.num_requests_waiting == stats.num_batches_running
            == stats.num_pipelines_busy == stats.workspace_bytes_in_use == 0)


def test_a_dead_childs_stats_and_metrics_name_its_last_catalog(model_dir, tmp_path):
    """A SIGKILLed child's `stats()` said `catalog_version=None` (and /metrics dropped
    `xrec_catalog_info`), while a closed in-thread engine names its catalog: it names the
    version the child served last, with `is_serving=False` (`xrec_ready` 0)."""
    from test_server import ServerThread, metric

    from xrec.catalog import random_catalog
    from xrec.server.app import create_app

    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    random_catalog(40, engine.limits.vocab_size, 4).write(tmp_path / "new.bin")
    server = ServerThread(create_app(engine))
    try:
        started = engine.catalog_version
        loaded = engine.load_catalog(tmp_path / "new.bin")
        assert loaded != started and loaded.num_items == 40
        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + WAIT_S
        while engine.is_serving and time.monotonic() < deadline:   # the death is noticed
            time.sleep(0.01)
        stats = engine.stats()
        assert _idle_and_not_serving(stats) and stats.catalog_version == loaded
        assert metric(server.url, "xrec_ready") == 0
        assert metric(server.url, "xrec_catalog_items") == 40
        assert metric(server.url, "xrec_catalog_info", content_hash=loaded.content_hash,
                      source=loaded.source) == 1
    finally:
        server.stop()
        engine.close()
    closed = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    started = closed.stats().catalog_version
    closed.close()
    assert started is not None and closed.stats().catalog_version == started


def test_stats_after_close_or_the_childs_death_say_not_serving(model_dir):
    """`stats()` raised `Unavailable` once the child was gone or the engine closed (and
    /metrics answered 500), while a closed in-thread engine's says is_serving=False."""
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as local:
        pass
    killed = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    assert killed.stats().is_serving
    os.kill(killed.pid, signal.SIGKILL)
    deadline = time.monotonic() + WAIT_S
    while killed._link.error is None and time.monotonic() < deadline:   # the death is noticed
        time.sleep(0.01)
    stats = killed.stats()
    assert _idle_and_not_serving(stats) and stats.num_pipelines == local.stats().num_pipelines
    killed.close()
    closed = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    closed.close()
    assert _idle_and_not_serving(closed.stats()) and _idle_and_not_serving(local.stats())
    assert not (killed.is_serving or closed.is_serving or local.is_serving)


def test_reads_of_a_stopped_child_are_bounded(model_dir):
    """`stats()` and the catalog versions (both properties as well) waited on a stopped child
    (SIGSTOP) for ever; they raise `Unavailable` after READ_TIMEOUT_S (2 s) now, and the
    child's late answers, once it runs again, are dropped without harm."""
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        os.kill(engine.pid, signal.SIGSTOP)
        reads = [pool.submit(engine.stats), pool.submit(lambda: engine.catalog_versions()),
                 pool.submit(lambda: engine.catalog_version),
                 pool.submit(lambda: engine.previous_catalog_version)]
        for read in reads:   # a hang shows as a timeout here
            assert isinstance(read.exception(timeout=20), Unavailable)
        assert engine.is_serving      # stopped is not gone
        os.kill(engine.pid, signal.SIGCONT)
        assert engine.stats().is_serving and engine._receiver.is_alive()
        assert engine.catalog_versions() == (engine.catalog_version, None)
        assert engine.recommend(_requests(1))[0].results
    finally:
        os.kill(engine.pid, signal.SIGCONT)
        pool.shutdown(wait=False)
        engine.close()


def test_submissions_to_a_stopped_child_give_up_instead_of_blocking(model_dir, monkeypatch):
    """A stopped child (SIGSTOP) reads nothing: once its socket was full, `submit` blocked,
    and with it the caller (the server's event loop) for as long as the child stayed
    stopped. A submission now gives up after SEND_WAIT_S with `Unavailable`; what was sent
    is answered once the child runs again."""
    import xrec.engine.isolated as isolated

    monkeypatch.setattr(isolated, "SEND_WAIT_S", 0.5)
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    sent: list = []
    refused: list = []

    def flood() -> None:
        for _ in range(100_000):
            try:
                sent.extend(engine.submit_many(_requests(1)))
            except Unavailable as exc:
                refused.append(exc)
                return

    try:
        os.kill(engine.pid, signal.SIGSTOP)
        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        flooder.join(60)   # the old code blocks here for good
        assert not flooder.is_alive() and refused, "submit blocked on the stopped child"
        assert "read none of its messages" in str(refused[0]) and sent
        engine.hold_wakeups()    # control messages still go through (a lost release would
        engine.release_wakeups()  # hold the child for good)
        os.kill(engine.pid, signal.SIGCONT)
        done, not_done = wait(sent, timeout=WAIT_S)
        assert not not_done
        assert engine.recommend(_requests(1))[0].results
    finally:
        os.kill(engine.pid, signal.SIGCONT)
        engine.close()


def test_a_send_stuck_on_a_stopped_child_holds_up_neither_submissions_nor_close(model_dir,
                                                                                 monkeypatch):
    """With the arena full, a large request travels in the socket itself; to a stopped child
    (SIGSTOP) its write blocks halfway, holding the socket's lock. Every other submission
    then waited for that lock for as long as the child stayed stopped (SEND_WAIT_S bounded
    only the wait for room), and `close(0)` too, before it could kill the child. Now a
    submission gives up after SEND_WAIT_S and `close` kills the child after its grace and
    CLOSE_MARGIN_S; the stuck write then fails UNAVAILABLE."""
    import xrec.engine.isolated as isolated

    monkeypatch.setattr(isolated, "SEND_WAIT_S", 0.5)
    monkeypatch.setattr(isolated, "CLOSE_MARGIN_S", 1.0)
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    limits = engine.limits
    rows = np.ones((limits.max_input_len, limits.d_model), np.float32)     # 512 KiB
    outcomes: dict = {}

    def attempt(name, action):
        try:
            outcomes[name] = action()
        except Exception as exc:
            outcomes[name] = exc
    pid = engine.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        arena = engine._link.arena
        filler = engine.submit_many([RecRequest(sparse_embedding=rows, beam_width=1)
                                     for _ in range(arena.size // rows.nbytes)])
        assert arena.free_bytes < rows.nbytes       # full: the next one goes in-band
        stuck = threading.Thread(target=attempt, daemon=True, args=(
            "stuck", lambda: engine.submit(RecRequest(sparse_embedding=rows, beam_width=1))))
        stuck.start()
        deadline = time.monotonic() + WAIT_S
        while not engine._link.send_lock.locked() and time.monotonic() < deadline:
            time.sleep(0.01)    # the write has begun (and blocks: the child reads nothing)
        other = threading.Thread(target=attempt, daemon=True, args=(
            "other", lambda: engine.submit(RecRequest(token_ids=[1, 2], beam_width=1))))
        other.start()
        other.join(WAIT_S)
        assert not other.is_alive(), "a submission waited on the stuck write"
        assert isinstance(outcomes["other"], Unavailable), outcomes
        closer = threading.Thread(target=engine.close, args=(0.0,), daemon=True)
        closer.start()
        closer.join(WAIT_S)
        assert not closer.is_alive(), "close(0) waited on the stuck write"
        stuck.join(WAIT_S)
        assert isinstance(outcomes["stuck"], Unavailable), outcomes
        assert all(isinstance(f.exception(WAIT_S), Unavailable) for f in filler)
        assert wait_gone(pid)
    finally:
        if is_alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_cancel_beside_a_send_stuck_on_a_stopped_child_gives_up(model_dir, monkeypatch):
    """`future.cancel()` tells the child in a done-callback, which waited for the socket's
    lock without bound: beside a write stuck on a stopped child (SIGSTOP, the arena full) a
    cancel blocked its caller, an event loop cancelling `recommend_async` included, for as
    long as the child stayed stopped. Now the cancel gives up after SEND_WAIT_S, as a
    submission does (the child would run the request, and its answer be dropped here)."""
    import xrec.engine.isolated as isolated

    monkeypatch.setattr(isolated, "SEND_WAIT_S", 0.5)
    engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
    rows = np.ones((engine.limits.max_input_len, engine.limits.d_model), np.float32)  # 512 KiB
    arena, pid = engine._link.arena, engine.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        filler = engine.submit_many([RecRequest(sparse_embedding=rows, beam_width=1)
                                     for _ in range(arena.size // rows.nbytes)])
        stuck = threading.Thread(daemon=True, target=lambda: wait(engine.submit_many(
            [RecRequest(sparse_embedding=rows, beam_width=1)]), WAIT_S))
        stuck.start()
        deadline = time.monotonic() + WAIT_S
        while not engine._link.send_lock.locked() and time.monotonic() < deadline:
            time.sleep(0.01)    # the write has begun (and blocks: the child reads nothing)
        canceller = threading.Thread(target=filler[0].cancel, daemon=True)
        canceller.start()
        canceller.join(WAIT_S)
        assert not canceller.is_alive(), "cancel() waited on the stuck write"
        assert filler[0].cancelled() and engine.is_serving
    finally:
        os.kill(pid, signal.SIGCONT)
        engine.close(0.0)
    stuck.join(WAIT_S)
    assert not wait(filler, WAIT_S).not_done and not stuck.is_alive()


def test_submissions_give_up_on_a_stopped_child_whatever_the_sockets_number(model_dir,
                                                                             monkeypatch):
    """The wait for room in a stopped child's socket used select(), which refuses a
    descriptor numbered 1024 or more (a host with many files open); the refusal read as
    room, and the submission blocked in the write for as long as the child stayed stopped.
    Now the wait polls, and a submission gives up after SEND_WAIT_S whatever the number."""
    import resource

    import xrec.engine.isolated as isolated

    if resource.getrlimit(resource.RLIMIT_NOFILE)[0] < 1200:
        pytest.skip("needs 1200 open files (ulimit -n)")
    monkeypatch.setattr(isolated, "SEND_WAIT_S", 0.5)
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]    # a busy host's files
    engine = None
    try:
        engine = Engine.from_pretrained(model_dir, isolation="process", device="cpu")
        assert engine._link.conn.fileno() >= 1024
        os.kill(engine.pid, signal.SIGSTOP)
        refused: list = []

        def flood() -> None:
            for _ in range(100_000):
                try:
                    engine.submit(RecRequest(token_ids=[1, 2], beam_width=1))
                except Unavailable as exc:
                    refused.append(exc)
                    return
        flooder = threading.Thread(target=flood, daemon=True)
        flooder.start()
        flooder.join(WAIT_S)
        assert not flooder.is_alive() and refused, "submit blocked on the stopped child"
        assert "read none of its messages" in str(refused[0])
    finally:
        for fd in held:
            os.close(fd)
        if engine is not None:
            os.kill(engine.pid, signal.SIGCONT)
            engine.close(0.0)
