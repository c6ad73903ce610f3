"""ProcessEngine: the engine's pipelines in a child process, the request API here.

Why: libgomp throttles every OpenMP team of a process once the process holds more
OpenMP threads than cores, so one torch op on a host's long-lived thread slows the
in-process pipelines for the rest of the process (docs/decisions.md, Engine isolation).
A child process has its own OpenMP runtime that the host cannot touch.

The edge stays here: requests are validated and prompts tokenized in this process
(the tokenizer is loaded here; the weights only in the child). Messages, pickled over a
socket pair (`transport.py`; large arrays through the shared-memory arena):

    parent -> child   ("submit", [(seq, ValidRequest), ...], arrived_at)   ("cancel", seq)
                      ("hold",) ("release",) ("reports",)
                      ("call", seq, name, args | None: an attribute)
                      ("close", grace_s)
    child -> parent   ("result", seq, ResponseData) ("error", seq, exception)
                      ("cancelled", seq) ("return", seq, value) ("report", BatchReport)

Every submitted seq is answered exactly once by the child (result, error or
cancelled); only then are its arena regions freed. The child's lifetime follows this
object: `close()`, garbage collection and interpreter exit close it; it exits by itself
when this process dies; if it dies, every pending future fails with UNAVAILABLE and the
engine refuses new requests (create a new one). The threads here (receiver, deadline
timer) and the futures' callbacks hold the `_Link`, never the engine, so that dropping
the engine is enough to collect it.

Deadlines count from the submission here (`arrived_at`: a `time.monotonic()` value,
system-wide on Linux, so the child's scheduler and executor use it as it is). If the
child has not answered DEADLINE_MARGIN_S after a request's deadline (stopped, swapped
out, stuck in a long round), this side answers DEADLINE_EXCEEDED itself; the child's
late answer is then dropped (its arena regions are still freed only then). The reads
`stats()` and `catalog_versions()` likewise wait at most READ_TIMEOUT_S for the child; once
the child is gone or the engine closed, `stats()` says so (`is_serving=False`, no load, the
last catalog version this side saw) instead of raising, as a closed in-thread engine's does.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import logging
import os
import select
import signal
import socket
import subprocess
import threading
import time
import weakref
from concurrent.futures import Future, wait as wait_futures
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from xrec.api_types import CatalogVersion, ValidRequest
from xrec.config.engine import checked_grace_s
from xrec.engine.forkserver import STATUS_UNKNOWN, ForkedProcess, start_child
from xrec.engine.frontend import (EngineFrontend, EngineStats, arrival_time as _arrival,
                                  close_once, off_own_threads)
from xrec.engine.requests import BatchReport, notify_cancelled
from xrec.engine.transport import Arena, Region, dumps, loads
from xrec.errors import DeadlineExceeded, Internal, Unavailable

if TYPE_CHECKING:
    from xrec.catalog import ItemCatalog
    from xrec.tokenizer import PromptTokenizer

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0
CLOSE_MARGIN_S = 10.0
DEADLINE_MARGIN_S = 0.05   # the child answers a deadline itself; this side this much later
MAX_TIMER_WAIT_S = 1.0     # the deadline timer looks at the clock at least this often
# stats() and catalog_versions() wait this long for the child: a running child answers in about
# a millisecond, a stopped one never, and /metrics must still answer within a scrape's timeout
# (Prometheus: 10 s by default)
READ_TIMEOUT_S = 2.0
# A message waits this long for room in the child's socket. The child reads it all the time, so
# a socket that stays full means a stopped child; a send that blocked then blocked the caller,
# the server's event loop included, for as long as the child stayed stopped.
SEND_WAIT_S = 5.0


@dataclass
class _Regions:
    """The arena regions of one submit message and how many of its requests are unanswered."""

    remaining: int
    regions: list[Region] | None = None    # None until the message is sent


@dataclass
class _Link:
    """The state the receiver thread shares with the engine (never the engine itself, so
    that the engine can be garbage-collected while the thread runs)."""

    process: subprocess.Popen | ForkedProcess
    conn: Connection
    arena: Arena
    pending: dict[int, tuple[Future, _Regions, bool]] = field(default_factory=dict)  # as_data
    calls: dict[int, Future] = field(default_factory=dict)
    hooks: list[Callable] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    send_lock: threading.Lock = field(default_factory=threading.Lock)
    error: Unavailable | None = None        # set once the child is gone (raised as `refusal()`)
    shut_down: threading.Event = field(default_factory=threading.Event)   # `_shutdown` ended
    num_holds: int = 0                      # hold_wakeups() not yet released, under `lock`
    # (deadline, seq, request_id, timeout_ms) of submitted requests, a heap under `lock`;
    # entries of answered requests are skipped when they come up (or pruned on submit)
    deadlines: list[tuple[float, int, str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.timer_wakeup = threading.Condition(self.lock)

    def add_deadlines(self, entries: list[tuple[float, int, str, float]]) -> None:
        """Caller holds `lock`. Watch these deadlines (the timer wakes if one comes first)."""
        if len(self.deadlines) > 2 * len(self.pending) + 64:    # mostly answered already
            self.deadlines = [e for e in self.deadlines if e[1] in self.pending]
            heapq.heapify(self.deadlines)
        first = self.deadlines[0][0] if self.deadlines else None
        for entry in entries:
            heapq.heappush(self.deadlines, entry)
        if first is None or self.deadlines[0][0] < first:
            self.timer_wakeup.notify()

    def refusal(self) -> Unavailable:
        """`error` as a new exception for one caller to raise (the child gone, whether or not
        this side has noticed yet): the one instance, raised to every caller, chained each
        caller's frames onto its traceback (keeping every refused request's arrays for the
        engine's life), and a request id one caller tagged it with (the server does) named
        every later refusal."""
        return Unavailable("the engine process is gone" if self.error is None
                           else self.error.message)

    def watch_deadlines(self) -> None:
        """The deadline timer thread: fails a request the child has not answered by its
        deadline + DEADLINE_MARGIN_S with DEADLINE_EXCEEDED (also while a close drains);
        ends once the link is closed and nothing is pending."""
        while True:
            expired: list[tuple[Future, str, float]] = []
            with self.lock:
                if self.error is not None and not self.pending:
                    return
                now = time.monotonic()
                while self.deadlines and self.deadlines[0][0] + DEADLINE_MARGIN_S <= now:
                    _, seq, request_id, timeout_ms = heapq.heappop(self.deadlines)
                    entry = self.pending.get(seq)
                    if entry is not None:
                        expired.append((entry[0], request_id, timeout_ms))
                if not expired:
                    wait = MAX_TIMER_WAIT_S if not self.deadlines else \
                        self.deadlines[0][0] + DEADLINE_MARGIN_S - now
                    self.timer_wakeup.wait(min(MAX_TIMER_WAIT_S, max(0.0, wait)))
                    continue
            for future, request_id, timeout_ms in expired:
                _settle(future, DeadlineExceeded(
                    f"no answer from the engine process within the request's {timeout_ms:g} ms "
                    "from its submission", request_id), True)

    def send(self, message: Any, wait_s: float | None = None) -> list[Region]:
        """`message` to the child; `Unavailable` when the child is gone, or (`wait_s`) when
        its socket stays full, or another message's write holds it, for `wait_s` (a stopped
        child): then the message is not sent. Only submissions and cancels give up so
        (`SEND_WAIT_S`): another control message must never be lost (a lost "release" would
        hold the child for good), and a tiny one still fits, since a socket stops polling
        writable while three quarters of it are free. A write that has begun is not bounded:
        a large in-band message (the arena full) to a stopped child blocks its caller until
        the child runs or is killed."""
        data, regions = dumps(message, self.arena)
        deadline = None if wait_s is None else time.monotonic() + wait_s
        if not self.send_lock.acquire(timeout=-1 if wait_s is None else wait_s):
            self.arena.free(regions)
            raise _not_read(wait_s)
        try:
            if deadline is not None and not _writable(self.conn,
                                                      max(0.0, deadline - time.monotonic())):
                self.arena.free(regions)
                raise _not_read(wait_s)
            self.conn.send_bytes(data)
        except (OSError, ValueError):
            self.arena.free(regions)
            raise self.refusal() from None
        finally:
            self.send_lock.release()
        return regions

    def receive(self) -> None:
        """The receiver thread: answers to futures until the child closes the socket."""
        while self.receive_one(None):
            pass

    def receive_one(self, timeout_s: float | None) -> bool:
        """Handle the child's next message, waiting at most `timeout_s` (None: for ever) for
        it; False once the child has closed the socket (every pending future then failed).
        Also run by a read (`ProcessEngine._remote`) made on the receiver thread itself (a
        done-callback, a report hook), whose answer can come only through this thread. Each
        message is handled in a call of its own, so that no future (whose callbacks may
        hold the caller's objects) stays referenced while the thread waits."""
        try:
            if timeout_s is not None and not self.conn.poll(max(0.0, timeout_s)):
                return True
            data = self.conn.recv_bytes()
        except (EOFError, OSError):
            self._child_gone()
            return False
        try:
            self._handle(loads(data, None))
        except Exception:   # a bug here must not end the receiver: every future would hang
            logger.exception("handling a message from the engine process failed")
        return True

    def _handle(self, message: tuple) -> None:
        kind = message[0]
        if kind == "report":
            for hook in self.hooks:
                try:
                    hook(message[1])
                except Exception:
                    logger.exception("report hook failed")
            return
        if kind == "return" or (kind == "error" and message[1] in self.calls):
            with self.lock:
                future = self.calls.pop(message[1], None)
            if future is not None:   # None: the caller stopped waiting (a read's timeout)
                _settle(future, message[2], kind == "error")
            return
        with self.lock:
            entry = self.pending.pop(message[1], None)
            if entry is None:   # failed here already (the child was declared gone)
                return
            future, shared, as_data = entry
            shared.remaining -= 1
            regions = (shared.regions or []) if shared.remaining == 0 else []
        self.arena.free(regions)
        if kind == "result":
            if future.done():      # answered here already (its deadline passed)
                return
            try:
                response = message[2] if as_data else message[2].to_response()
            except Exception as exc:  # a bug here must not stop the receiver
                logger.exception("building a response failed")
                _settle(future, Internal(f"building the response failed: {exc!r}"), True)
            else:
                _settle(future, response, False)
        elif kind == "error":
            _settle(future, message[2], True)

    def _child_gone(self) -> None:
        try:
            code = self.process.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            code = None
        with self.lock:
            pending = [entry[0] for entry in self.pending.values()] + list(self.calls.values())
            self.pending.clear()
            self.calls.clear()
            if self.error is None:
                self.error = Unavailable(f"the engine process exited ({_describe_exit(code)}); "
                                         "create a new engine")
            self.timer_wakeup.notify_all()
        if pending:
            logger.error("engine process exited (%s) with %d request(s) pending",
                         _describe_exit(code), len(pending))
        for future in pending:
            _settle(future, Unavailable(f"the engine process exited ({_describe_exit(code)}) "
                                        "before answering; create a new engine"), True)


class ProcessEngine(EngineFrontend):
    """An `Engine` whose pipelines run in a child process; the same request API.

    >>> engine = Engine.from_pretrained(model_dir, isolation="process")
    """

    def __init__(self, link: _Link, info: dict, tokenizer: PromptTokenizer | None):
        self._link = link
        self.limits, self.options = info["limits"], info["options"]
        self.model_name, self.config = info["model_name"], info["config"]
        self.dtype, self.family = info["dtype"], info["family"]
        self.fused_kernels = info["fused_kernels"]
        self.num_pipelines = info["num_pipelines"]
        self.workspace_per_pipeline = info["workspace_per_pipeline"]
        self._info = info
        # the child's current catalog version as last seen here (at start, in every read and
        # change of it): what stats() names once the child is gone
        self._catalog_version: CatalogVersion | None = info["catalog_version"]
        self.tokenizer = tokenizer
        self._seq = itertools.count()
        self._receiver = threading.Thread(target=link.receive, name="xrec-engine-receive",
                                          daemon=True)
        self._timer = threading.Thread(target=link.watch_deadlines, name="xrec-engine-deadlines",
                                       daemon=True)
        self._receiver.start()
        self._timer.start()
        self._finalizer = weakref.finalize(self, _shutdown_off_own_threads, link,
                                           (self._receiver, self._timer))

    @classmethod
    def start(cls, model_dir: str | os.PathLike, catalog: str | os.PathLike | ItemCatalog | None,
              options: dict[str, Any], catalog_extended: bool | None = None) -> ProcessEngine:
        """Start the child, load the model there; raises what loading raised."""
        from xrec.tokenizer import PromptTokenizer

        tokenizer = PromptTokenizer.from_model_dir(model_dir)    # the edge: here, not in the child
        arena = Arena.create()
        ours, theirs = socket.socketpair()
        try:
            process = start_child(theirs.fileno(), arena)
        except BaseException:
            arena.close()
            ours.close()
            raise
        finally:
            theirs.close()
        conn = Connection(ours.detach())
        link = _Link(process, conn, arena)
        if isinstance(catalog, os.PathLike):
            catalog = str(catalog)
        level = logging.getLogger("xrec").getEffectiveLevel()
        try:
            link.send((str(Path(model_dir)), catalog, catalog_extended, options, level))
            if not conn.poll(START_TIMEOUT_S):
                raise TimeoutError(f"the engine process did not load {model_dir} in {START_TIMEOUT_S} s")
            kind, value = loads(conn.recv_bytes(), None)
        except BaseException as exc:
            _shutdown(link, (), 0.0)
            if isinstance(exc, (EOFError, OSError)):
                raise RuntimeError(f"the engine process exited while loading {model_dir} "
                                   f"({_describe_exit(process.poll())})") from None
            raise
        if kind == "failed":
            _shutdown(link, (), 0.0)
            raise value
        return cls(link, value, tokenizer)

    def describe(self) -> dict:
        """`Engine.describe()` of the child's engine, as it was at start."""
        return dict(self._info)

    # ---- requests ----------------------------------------------------------

    def submit_valid(self, valid: ValidRequest, as_data: bool = False,
                     arrived_at: float | None = None) -> Future:
        return self.submit_valid_many([valid], as_data, arrived_at)[0]

    def submit_valid_many(self, valids: Sequence[ValidRequest], as_data: bool = False,
                          arrived_at: float | None = None) -> list[Future]:
        """Queue validated requests in the child; deadlines count from `arrived_at`
        (`time.monotonic()` seconds; None: now)."""
        link = self._link
        arrival = _arrival(arrived_at)
        items = [(next(self._seq), valid) for valid in valids]
        futures = [Future() for _ in items]
        shared = _Regions(len(items))   # the message's arena regions, freed after its last answer
        deadlines = []
        for seq, valid in items:
            timeout_ms = valid.timeout_ms or self.options.request_timeout_ms
            if timeout_ms is not None:
                deadlines.append((arrival + timeout_ms / 1000.0, seq, valid.request_id, timeout_ms))
        with link.lock:                 # the child's death is noticed under this lock too
            if link.error is not None:
                raise link.refusal()
            for (seq, _), future in zip(items, futures):
                link.pending[seq] = (future, shared, as_data)
        try:
            regions = link.send(("submit", items, arrival), SEND_WAIT_S)
        except BaseException:
            with link.lock:
                for seq, _ in items:
                    link.pending.pop(seq, None)
            raise
        with link.lock:
            shared.regions = regions
            is_answered = shared.remaining == 0
            if deadlines:
                link.add_deadlines(deadlines)
        if is_answered:  # every answer came back before send() returned
            link.arena.free(regions)
        for (seq, _), future in zip(items, futures):
            # the link, not self: a future kept by the caller must not keep the engine alive
            future.add_done_callback(functools.partial(_cancel_in_child, link, seq))
        return futures

    def hold_wakeups(self) -> None:
        with self._link.lock:
            self._link.num_holds += 1
        self._link.send(("hold",))

    def release_wakeups(self) -> None:
        """An unmatched release raises here, as `Engine.release_wakeups` does; in the child
        it would end the serving loop."""
        with self._link.lock:
            if self._link.num_holds < 1:
                raise RuntimeError("release_wakeups() without hold_wakeups()")
            self._link.num_holds -= 1
        self._link.send(("release",))

    def stats(self) -> EngineStats:
        """The child engine's `stats()`; once the child is gone or the engine is closed, no
        load, `is_serving=False` and the catalog version last seen here (as a closed
        in-thread engine names its catalog). `Unavailable` when a running child does not
        answer within READ_TIMEOUT_S (stopped, swapped out)."""
        try:
            stats = self._remote("stats", (), READ_TIMEOUT_S)
        except Unavailable:
            if self._link.error is None:
                raise
            return EngineStats(self.num_pipelines, 0, 0, 0,
                               self.workspace_per_pipeline * self.num_pipelines, 0,
                               self._catalog_version, is_serving=False)
        self._catalog_version = stats.catalog_version
        return stats

    @property
    def is_serving(self) -> bool:
        """The child runs and the engine is not closed: known here, without a round trip (a
        stopped child still counts as serving)."""
        return self._link.error is None

    def add_report_hook(self, hook: Callable[[BatchReport], None]) -> None:
        """Call `hook(BatchReport)` after every batch (on this engine's receiver thread)."""
        with self._link.lock:   # one ("reports",) however many threads add the first hooks
            is_first = not self._link.hooks
            self._link.hooks.append(hook)
        if is_first:
            self._link.send(("reports",))

    def call(self, name: str, *args: Any) -> Any:
        """Run the child engine's method `name(*args)` and return its (picklable) result."""
        return self._remote(name, args)

    def get(self, name: str) -> Any:
        """The child engine's attribute `name` (picklable)."""
        return self._remote(name, None)

    def _remote(self, name: str, args: tuple | None, timeout_s: float | None = None) -> Any:
        """`name(*args)` (None: the attribute `name`) in the child; past `timeout_s` (None: no
        bound) `Unavailable`, and the child's late answer is dropped. On the receiver thread
        (a done-callback, a report hook) it reads the child's messages itself meanwhile:
        there, waiting for the receiver waited for ever (a call) or `timeout_s` (a read)."""
        future: Future = Future()
        seq = next(self._seq)
        with self._link.lock:
            if self._link.error is not None:
                raise self._link.refusal()
            self._link.calls[seq] = future
        self._link.send(("call", seq, name, args))
        wait_s = timeout_s
        if threading.current_thread() is self._receiver:   # a done-callback or a report hook:
            wait_s = 0.0                                    # the answer comes through here
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            while not future.done():
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self._link.receive_one(left):
                    break
        if wait_futures((future,), wait_s).done:
            return future.result()
        with self._link.lock:
            self._link.calls.pop(seq, None)
        raise Unavailable(f"the engine process did not answer {name} within {timeout_s:g} s "
                          "(stopped, or swapped out)")

    # ---- the catalog (hot reload, run in the child) --------------------------

    @property
    def catalog_version(self) -> CatalogVersion | None:
        """Bounded as `catalog_versions()` is."""
        return self.catalog_versions()[0]

    @property
    def previous_catalog_version(self) -> CatalogVersion | None:
        """Bounded as `catalog_versions()` is."""
        return self.catalog_versions()[1]

    def catalog_versions(self) -> tuple[CatalogVersion | None, CatalogVersion | None]:
        """Both versions in one round trip (at most READ_TIMEOUT_S)."""
        versions = self._remote("catalog_versions", (), READ_TIMEOUT_S)
        self._catalog_version = versions[0]
        return versions

    def load_catalog(self, catalog: str | os.PathLike | ItemCatalog,
                     extended: bool | None = None) -> CatalogVersion:
        """`Engine.load_catalog`, in the child (a path is read there)."""
        self._catalog_version = self.call(
            "load_catalog", str(catalog) if isinstance(catalog, os.PathLike) else catalog, extended)
        return self._catalog_version

    def restore_catalog(self) -> CatalogVersion | None:
        self._catalog_version = self.call("restore_catalog")
        return self._catalog_version

    # ---- lifecycle ---------------------------------------------------------

    @property
    def pid(self) -> int:
        return self._link.process.pid

    def close(self, grace_s: float = 30.0) -> None:
        """Finish what is queued and running (up to `grace_s`), then stop the child.
        Idempotent (as `Engine.close`): a second call must not close the arena's file
        descriptor again, whose number this process may have given to another file.
        `grace_s` is checked first (`checked_grace_s`), as `Engine.close` does. Called on
        this engine's receiver thread (a done-callback), it returns at once and the engine
        closes on a thread of its own: the receiver must go on reading the answers of what
        the child drains. A call while another thread's close runs returns once that one
        has ended."""
        close_once(self._finalizer, (self._receiver, self._timer), self._link.shut_down,
                   checked_grace_s(grace_s))


def _not_read(wait_s: float) -> Unavailable:
    return Unavailable(f"the engine process has read none of its messages for {wait_s:g} s "
                       "(stopped, or swapped out)")


def _writable(conn: Connection, timeout_s: float) -> bool:
    """Whether `conn` takes a message within `timeout_s`. A Unix socket polls writable only
    while at most a quarter of its send buffer is queued, so a message then fits without
    blocking (the arena carries the large buffers). poll(), not select(): select refuses a
    descriptor numbered 1024 or more (a host with many files open), and that refusal read as
    writable left a stopped child's full socket blocking the sender for good."""
    try:
        poller = select.poll()
        poller.register(conn.fileno(), select.POLLOUT)
        return bool(poller.poll(1000.0 * timeout_s))   # an error or hang-up: send_bytes says
    except (OSError, ValueError):   # closed: send_bytes names the reason
        return True


def _cancel_in_child(link: _Link, seq: int, future: Future) -> None:
    """A done-callback: a request cancelled here is dropped by the child too. It runs in
    `cancel()` (on an event loop, for `recommend_async`), so it gives up as a submission
    does (SEND_WAIT_S): a lost cancel costs only the child's work, whose answer is dropped."""
    notify_cancelled(future)   # so that wait() and as_completed() see it done
    if future.cancelled() and link.error is None:
        try:
            link.send(("cancel", seq), SEND_WAIT_S)
        except Exception:
            pass  # the child is gone (its pending futures are failed already) or stopped


def _settle(future: Future, value: Any, is_error: bool) -> None:
    if future.cancelled():
        return
    try:
        if is_error:
            future.set_exception(value)
        else:
            future.set_result(value)
    except Exception:  # cancelled meanwhile
        pass


def _shutdown_off_own_threads(link: _Link, threads: tuple[threading.Thread, ...],
                              grace_s: float = 0.0) -> None:
    """`ProcessEngine.close`, and the finalizer (`close(0)` once the engine is collected or
    the interpreter exits). On one of this side's `threads` it shuts down on a new thread:
    the receiver (where done-callbacks run) must keep reading the child's answers while it
    drains, and a cyclic collection runs wherever it is triggered, maybe while that thread
    holds `link.lock`."""
    off_own_threads(threads, _shutdown, link, threads, grace_s)


def _shutdown(link: _Link, threads: tuple[threading.Thread, ...], grace_s: float) -> None:
    """Ask the child to drain and exit; kill it if it does not; fail what is left; end
    this side's threads; then set `link.shut_down`."""
    try:
        _shut_down_child(link, threads, grace_s)
    finally:
        link.shut_down.set()


def _shut_down_child(link: _Link, threads: tuple[threading.Thread, ...], grace_s: float) -> None:
    with link.lock:
        if link.error is None:
            link.error = Unavailable("engine is closed")
        link.timer_wakeup.notify_all()
    process = link.process
    if process.poll() is None:
        deadline = time.monotonic() + grace_s + CLOSE_MARGIN_S
        # bounded: a write to a stopped child may hold the lock until the child is killed
        if link.send_lock.acquire(timeout=grace_s + CLOSE_MARGIN_S):
            try:
                link.conn.send_bytes(dumps(("close", grace_s), None)[0])
            except (OSError, ValueError):
                pass
            finally:
                link.send_lock.release()
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.error("engine process %d did not exit; killing it", process.pid)
            process.kill()
            process.wait()
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join(timeout=CLOSE_MARGIN_S)
    # the socket closes after its last read and write, never under one: a thread still in
    # a call would go on with a closed descriptor, whose number another file may hold by
    # then. With the child gone, a write fails at once; a thread that has not got that far
    # within the margin (starved) leaves the socket to the garbage collector.
    reads_ended = not any(t.is_alive() for t in threads if t is not threading.current_thread())
    if link.send_lock.acquire(timeout=CLOSE_MARGIN_S):
        try:
            if reads_ended:
                link.conn.close()
        finally:
            link.send_lock.release()
    link.arena.close()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code == STATUS_UNKNOWN:
        return "exit status unknown: its fork server is gone"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
