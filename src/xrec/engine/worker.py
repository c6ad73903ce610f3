"""The child process of an engine with `isolation="process"`.

    python -m xrec.engine.worker SOCKET_FD ARENA_FD ARENA_BYTES

or `serve`, in a child the fork server forked (`zygote.py`). It builds an ordinary
in-process `Engine` and serves the owner's messages (see `isolated.py` for the protocol)
until the owner asks it to close, closes the socket or dies. The model loads on a thread
that ends, so that no OpenMP team outlives the load: the pipelines are this process's only
parallel torch work.
"""

from __future__ import annotations

import logging
import os
import queue
import select
import sys
import threading
import time
from concurrent.futures import Future
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from xrec.engine.transport import Arena, dumps, loads
from xrec.errors import Internal

if TYPE_CHECKING:
    from xrec.api_types import ValidRequest
    from xrec.catalog import ItemCatalog
    from xrec.engine.engine import Engine

PARENT_POLL_S = 0.2
logger = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    socket_fd, arena_fd, arena_bytes = (int(a) for a in argv)
    return serve(socket_fd, arena_fd, arena_bytes, None)


def serve(socket_fd: int, arena_fd: int, arena_bytes: int, owner_pidfd: int | None) -> int:
    """Load the engine the owner asks for and serve it; the exit code. `owner_pidfd`: a pidfd
    of the process that owns the engine (None: the parent process)."""
    conn, arena = Connection(socket_fd), Arena(arena_fd, arena_bytes)
    _exit_with_owner(owner_pidfd)
    model_dir, catalog, catalog_extended, options, log_level = loads(conn.recv_bytes(), None)
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s [child] %(message)s")
    loaded: list[Engine | BaseException] = []
    loader = threading.Thread(target=_load, args=(model_dir, catalog, catalog_extended, options,
                                                  loaded),
                              name="xrec-load")
    loader.start()
    loader.join()
    if isinstance(loaded[0], BaseException):
        conn.send_bytes(dumps(("failed", _picklable(loaded[0])), None)[0])
        return 1
    engine = loaded[0]
    engine.own_process()   # this process exists to serve it
    conn.send_bytes(dumps(("ready", engine.describe()), None)[0])
    Child(engine, conn, arena).serve()
    return 0


def _load(model_dir: str, catalog: str | ItemCatalog | None, catalog_extended: bool | None,
          options: dict[str, Any], out: list[Engine | BaseException]) -> None:
    from xrec.config import EngineOptions
    from xrec.engine.engine import Engine, load_parts
    try:
        out.append(Engine(*load_parts(model_dir, catalog, EngineOptions.from_kwargs(**options),
                                      catalog_extended), answers_as_data=True))
    except BaseException as exc:
        out.append(exc)


class Child:
    """Serves one parent: submissions, cancels, calls. Answers are sent by the thread that
    has them (a pipeline, as its batch ends): one short socket write, no extra hop. The
    answers that arise on the serving loop's own thread (a cancel's "cancelled", a refused
    submission's errors) go through `outbox` and a writer thread instead: the loop must
    never wait on the parent's socket. The parent's receiver may be sending itself (a
    done-callback cancelling or submitting), and then both sides waited on each other's
    full socket for good."""

    def __init__(self, engine: Engine, conn: Connection, arena: Arena):
        self.engine, self.conn, self.arena = engine, conn, arena
        self.futures: dict[int, Future] = {}
        self.send_lock = threading.Lock()
        self.outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self.reader = threading.current_thread()
        self.writer = threading.Thread(target=self._write_outbox, name="xrec-child-send")
        self.writer.start()

    def serve(self) -> None:
        try:
            self._serve()
        finally:
            self.outbox.put(None)   # the writer sends what is queued, then ends
            self.writer.join()

    def _serve(self) -> None:
        while True:
            try:
                message = loads(self.conn.recv_bytes(), self.arena)
            except (EOFError, OSError):  # the parent closed the socket or died: nobody to answer
                os._exit(0)
            kind = message[0]
            if kind == "submit":
                self._submit(message[1], message[2])
            elif kind == "cancel":
                future = self.futures.get(message[1])
                if future is not None:
                    future.cancel()
            elif kind in ("hold", "release", "reports"):
                try:
                    self._control(kind)
                except Exception:   # a misuse the parent let through ends no serving loop
                    logger.exception("%r from the parent failed", kind)
            elif kind == "call":
                threading.Thread(target=self._call, args=message[1:], daemon=True).start()
            elif kind == "close":
                self.engine.close(message[1])   # every answer is sent when this returns
                return

    def _control(self, kind: str) -> None:
        if kind == "hold":
            self.engine.hold_wakeups()
        elif kind == "release":
            self.engine.release_wakeups()
        else:
            self.engine.add_report_hook(lambda report: self.send(("report", report)))

    def _submit(self, items: list[tuple[int, ValidRequest]], arrived_at: float) -> None:
        """Queue the parent's requests; their deadlines count from the parent's submission
        (`arrived_at`, `time.monotonic()` seconds: the same clock in both processes)."""
        try:
            futures = self.engine.submit_valid_many([valid for _, valid in items],
                                                    arrived_at=arrived_at)
        except Exception as exc:  # refused as a whole (closed engine): each gets the error
            for seq, _ in items:
                self.send(("error", seq, _picklable(exc)))
            return
        for (seq, _), future in zip(items, futures):
            self.futures[seq] = future
            future.add_done_callback(lambda f, seq=seq: self._answer(seq, f))

    def _answer(self, seq: int, future: Future) -> None:
        self.futures.pop(seq, None)
        if future.cancelled():
            self.send(("cancelled", seq))
        elif future.exception() is not None:
            self.send(("error", seq, _picklable(future.exception())))
        else:
            self.send(("result", seq, future.result()))

    def _write_outbox(self) -> None:
        while (message := self.outbox.get()) is not None:
            self.send(message)

    def _call(self, seq: int, name: str, args: tuple | None) -> None:
        """The engine's method `name(*args)`, or its attribute `name` when `args` is None."""
        try:
            value = getattr(self.engine, name)
            self.send(("return", seq, value if args is None else value(*args)))
        except Exception as exc:
            self.send(("error", seq, _picklable(exc)))

    def send(self, message: tuple) -> None:
        if threading.current_thread() is self.reader:
            self.outbox.put(message)
            return
        data = dumps(message, None)[0]
        try:
            with self.send_lock:
                self.conn.send_bytes(data)
        except (OSError, ValueError):
            os._exit(0)  # the parent is gone


def _picklable(exc: BaseException) -> BaseException:
    """`exc` when it survives pickling with its class, else INTERNAL naming it."""
    import pickle
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return Internal(f"{type(exc).__name__}: {exc}")


def _exit_with_owner(owner_pidfd: int | None) -> None:
    """No orphans: exit when the owner is gone, even mid-batch. The owner is the parent
    (re-parented: gone), or the process of `owner_pidfd` (readable once it has exited)."""
    parent = os.getppid()

    def watch() -> None:
        if owner_pidfd is None:
            while os.getppid() == parent:
                time.sleep(PARENT_POLL_S)
        else:
            poller = select.poll()
            poller.register(owner_pidfd, select.POLLIN)
            poller.poll()
        os._exit(0)
    threading.Thread(target=watch, name="xrec-owner-watch", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
