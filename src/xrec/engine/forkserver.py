"""The child process of a process-isolated engine: forked from a fork server where it can be.

A fresh interpreter pays for `import torch` and the engine's modules before it loads a model:
a tiny engine's `from_pretrained` took 2.8 s so against 0.36 s forked from a process that
has imported them (2-core Zen 1; `xrec bench embedded` measures it; docs/decisions.md,
"Engine children from a fork server"). So the first process-isolated engine of a process starts a fork server
(`zygote.py`: those imports and nothing else run), and every engine's child, that one's
included, is forked from it: a later engine, and a new one after a child died, start in a
fraction of the time.

The fork server is one per process (its owner), shared by every thread: a lock keeps one
request at a time on its socket, held only for the fork and the answer (milliseconds),
never for a model's load. A child is not this process's child but the fork server's, so
`ForkedProcess` shows it as `subprocess.Popen` does (pid, `poll`, `wait`, `kill`) through a
pidfd (immune to pid reuse) and a pipe on which the fork server writes its return code.

A fresh interpreter (`python -m xrec.engine.worker`) starts the child instead when:

- `XREC_FORK_SERVER=off`;
- the environment differs from the one the fork server started with in a variable that
  `PER_CALL_VARIABLES` does not name: what torch or libgomp read at import (OMP_NUM_THREADS,
  ...) would not reach the child. The variables it names (xrec's own, read when used) are
  set in the child as they are here at the fork;
- the fork server could not start in this process (no pidfd: Linux before 5.3; the imports
  failed), said once in the log; one that died is started again at the next engine.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref

from xrec.engine.transport import Arena

logger = logging.getLogger(__name__)

FORK_SERVER_ENV = "XREC_FORK_SERVER"
READY = b"ready"          # the fork server's first message: its imports are done
READY_TIMEOUT_S = 120.0   # the fork server's imports (3 s on 2 idle cores)
ANSWER_TIMEOUT_S = 30.0   # a fork and its answer (milliseconds)
# variables read when used, never at import: a change to them reaches a forked child. xrec's
# own; and pytest's, which names the running test (a test suite's engines never forked else)
PER_CALL_VARIABLES = ("XREC_", "PYTEST_CURRENT_TEST")
# ForkedProcess.returncode once the child has exited after its fork server: nobody reaped it
STATUS_UNKNOWN = -(1 << 16)


def start_child(engine_fd: int, arena: Arena) -> subprocess.Popen | ForkedProcess:
    """A child process serving the engine on `engine_fd` (a socket) and `arena`."""
    server = _shared_server()
    changes = None if server is None else server.environment_changes()
    if changes is not None:
        try:
            return server.fork(engine_fd, arena, changes)
        except NotSent as exc:   # nobody has the engine's socket: a fresh interpreter may
            logger.warning("the fork server failed (%s); starting the engine's child afresh",
                           exc.__cause__)
            server.stop()
        except OSError as exc:   # a child may have it: a second one would read its messages
            server.stop()
            raise OSError(f"the fork server did not answer ({exc}); the engine did not start "
                          "(the next start runs a new fork server)") from exc
    return subprocess.Popen([sys.executable, "-m", "xrec.engine.worker", str(engine_fd),
                             str(arena.fd), str(arena.size)],
                            pass_fds=(engine_fd, arena.fd), stdin=subprocess.DEVNULL)


class NotSent(OSError):
    """The fork server failed before it had the request: no child has the engine's socket."""


class ForkedProcess:
    """A child of the fork server, with `subprocess.Popen`'s pid, returncode, `poll()`,
    `wait(timeout)` and `kill()`. Its descriptors close when it is collected, never before:
    a `kill()` must not signal through a number another file has taken."""

    def __init__(self, pid: int, pidfd: int, status_fd: int):
        self.pid, self.returncode = pid, None
        self._pidfd, self._status_fd = pidfd, status_fd
        self._has_status = True       # False once the fork server closed the pipe unwritten
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, pidfd, status_fd)

    def poll(self) -> int | None:
        return self._wait(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"engine process {self.pid}", timeout)
        return code

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _wait(self, timeout: float | None) -> int | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            return self.returncode
        try:
            if self.returncode is None and self._has_status:
                if not _readable(self._status_fd, _left(deadline)):
                    return None
                data = os.read(self._status_fd, 4)
                if len(data) == 4:
                    self.returncode = struct.unpack("<i", data)[0]
                    return self.returncode
                self._has_status = False          # the fork server is gone, the code with it
            if self.returncode is None and _readable(self._pidfd, _left(deadline)):
                self.returncode = STATUS_UNKNOWN
            return self.returncode
        finally:
            self._lock.release()


class ForkServer:
    """The fork server of this process (`zygote.py`), started with this environment."""

    def __init__(self) -> None:
        self.owner, self.environ = os.getpid(), dict(os.environ)
        self.lock = threading.Lock()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "xrec.engine.zygote", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.control = ours
        try:
            ours.settimeout(READY_TIMEOUT_S)
            ready = ours.recv(len(READY))
        except BaseException:
            self.stop()
            raise
        if ready != READY:
            self.stop()
            raise OSError(f"the fork server exited while starting ({_exit_of(self.process)})")

    @property
    def is_running(self) -> bool:
        return self.process.poll() is None

    def environment_changes(self) -> dict[str, str | None] | None:
        """This process's environment against the fork server's: the variables to set in a
        child (None: to remove), or None when one of them is not in `PER_CALL_VARIABLES`."""
        now = dict(os.environ)
        changes = {name: now.get(name) for name in now.keys() | self.environ.keys()
                   if now.get(name) != self.environ.get(name)}
        if any(not name.startswith(PER_CALL_VARIABLES) for name in changes):
            return None
        return changes

    def fork(self, engine_fd: int, arena: Arena,
             environment: dict[str, str | None]) -> ForkedProcess:
        """A child serving the engine on `engine_fd` and `arena`, with this process's working
        directory, stdout and stderr as they are now, and `environment`'s changes to the fork
        server's. `NotSent` when the fork server fails before it has the request, OSError
        when it fails after (a child may have been forked: it exits once the engine's socket
        closes)."""
        status_fd, status_w = os.pipe()
        targets = [fd for fd in (1, 2) if _is_open(fd)]
        try:
            cwd: str | None = os.getcwd()
        except OSError:       # removed: the child keeps the fork server's, as it cannot follow
            cwd = None
        request = pickle.dumps((cwd, arena.size, targets, environment))
        try:
            with self.lock:
                try:
                    self.control.settimeout(ANSWER_TIMEOUT_S)
                    socket.send_fds(self.control, [request],
                                    [engine_fd, arena.fd, status_w, *targets])
                except OSError as exc:     # one SOCK_SEQPACKET message: sent whole or not at all
                    raise NotSent(str(exc)) from exc
                data, fds, _, _ = socket.recv_fds(self.control, 8, 1)
        except BaseException:
            os.close(status_fd)
            raise
        finally:
            os.close(status_w)
        if len(data) != 8 or len(fds) != 1:
            _close_all(status_fd, *fds)
            raise OSError(f"the fork server is gone ({_exit_of(self.process)})")
        return ForkedProcess(struct.unpack("<q", data)[0], fds[0], status_fd)

    def stop(self) -> None:
        """Close its socket (it exits; the children it forked serve on) and reap it. Under
        the lock: another thread's exchange (bounded by ANSWER_TIMEOUT_S) ends first, and
        never goes on with a closed descriptor whose number another file may hold by then."""
        with self.lock:
            self.control.close()
        try:
            self.process.wait(ANSWER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


_lock = threading.Lock()
_shared: ForkServer | None = None
_failed_in: int | None = None     # the pid of a process whose fork server could not start


def _shared_server() -> ForkServer | None:
    """This process's fork server (started at the first call), or None where a fresh
    interpreter must start the child (the module's docstring says when)."""
    global _shared, _failed_in
    if os.environ.get(FORK_SERVER_ENV, "on").lower() in ("off", "0", "false"):
        return None
    with _lock:
        if _shared is not None and (_shared.owner != os.getpid() or not _shared.is_running):
            if _shared.owner == os.getpid():
                _shared.stop()
            _shared = None     # another process's (this one forked) or gone: start another
        if _shared is None and _failed_in != os.getpid():
            try:
                _shared = ForkServer()
            except Exception as exc:
                _failed_in = os.getpid()
                logger.warning("no fork server in this process (%s): engine children start "
                               "as fresh interpreters", exc)
        return _shared


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _readable(fd: int, timeout_s: float | None) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(None if timeout_s is None else 1000.0 * timeout_s))


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _exit_of(process: subprocess.Popen) -> str:
    code = process.poll()
    return "running" if code is None else f"exit code {code}"


def _close_all(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
