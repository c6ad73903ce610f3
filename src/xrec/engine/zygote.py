"""The fork server's own process: torch and the engine imported once, a child forked per engine.

    python -m xrec.engine.zygote CONTROL_FD

Started by `forkserver.ForkServer` with its owner's environment. It imports what an engine
child needs (torch, `xrec.engine.engine`) and runs no torch op, so that it holds no OpenMP
team and no CUDA context to copy into a fork, and no thread of its own (OpenBLAS's pool,
which numpy's import starts, stops and restarts around a fork itself). Then it serves its
owner over CONTROL_FD (a SOCK_SEQPACKET socket; the owner's lock keeps one exchange at a
time):

    owner -> zygote   pickled (cwd or None, arena_bytes, targets, environment), with the
                      descriptors [engine socket, arena, status pipe's write end, *outputs]:
                      the owner's open ones among its stdout and stderr, `targets` their
                      numbers; `environment`: the variables to set (None: remove) in the child
    zygote -> owner   the child's pid (8 bytes), with a pidfd of the child

Each child runs `worker.serve` and exits; this process reaps it and writes its return code
(`subprocess.Popen`'s convention: negative for a signal) to its status pipe. It is
single-threaded: its one loop polls the control socket, the owner's pidfd and the children's
pidfds. It exits when the owner closes the control socket or exits; the children watch the
owner themselves (its pidfd, inherited) and exit with it. `ps` shows a child with this
process's command line (`python -m xrec.engine.zygote N`).
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import struct
import sys
import traceback

from xrec.engine.forkserver import READY

MAX_REQUEST_BYTES = 1 << 16


def main(argv: list[str]) -> int:
    control = socket.socket(fileno=int(argv[0]))
    owner_pid = os.getppid()
    owner = os.pidfd_open(owner_pid)
    if os.getppid() != owner_pid:   # the owner died before the pidfd was open
        return 0
    # a terminal's ^C reaches the whole process group: the owner decides what it ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    import xrec.engine.engine  # noqa: F401  (the preload: torch, the model, the search)
    import xrec.engine.worker  # noqa: F401
    if torch.cuda.is_initialized():   # CUDA cannot run in a fork of a process that started it
        print("xrec fork server: CUDA was initialised by an import; not forking", file=sys.stderr)
        return 1
    control.send(READY)
    Zygote(control, owner).serve()
    return 0


class Zygote:
    def __init__(self, control: socket.socket, owner: int):
        self.control, self.owner = control, owner
        self.children: dict[int, tuple[int, int]] = {}   # pidfd: (pid, status pipe's write end)
        self.poller = select.poll()
        self.poller.register(control, select.POLLIN)
        self.poller.register(owner, select.POLLIN)

    def serve(self) -> None:
        while True:
            for fd, _ in self.poller.poll():
                if fd == self.owner:
                    return
                if fd != self.control.fileno():
                    self._reap(fd)
                elif not self._fork_one():
                    return

    def _fork_one(self) -> bool:
        """One request: fork its child, answer its pid; False once the owner closed."""
        data, fds, _, _ = socket.recv_fds(self.control, MAX_REQUEST_BYTES, 5)
        if not data:
            return False
        cwd, arena_bytes, targets, environment = pickle.loads(data)
        engine_fd, arena_fd, status_fd, *outputs = fds
        pid = os.fork()
        if pid == 0:
            self._child(cwd, environment, engine_fd, arena_fd, arena_bytes, status_fd,
                        dict(zip(targets, outputs)))
        pidfd = os.pidfd_open(pid)
        for fd in [engine_fd, arena_fd, *outputs]:
            os.close(fd)
        self.children[pidfd] = (pid, status_fd)
        self.poller.register(pidfd, select.POLLIN)
        try:
            socket.send_fds(self.control, [struct.pack("<q", pid)], [pidfd])
        except OSError:     # the owner gave up on the answer (closed): the child sees its
            return False    # engine's socket closed and exits
        return True

    def _reap(self, pidfd: int) -> None:
        pid, status_fd = self.children.pop(pidfd)
        self.poller.unregister(pidfd)
        _, status = os.waitpid(pid, 0)
        try:
            os.write(status_fd, struct.pack("<i", os.waitstatus_to_exitcode(status)))
        except OSError:    # the owner closed its end: nobody asks
            pass
        os.close(status_fd)
        os.close(pidfd)

    def _child(self, cwd: str | None, environment: dict[str, str | None], engine_fd: int,
               arena_fd: int, arena_bytes: int, status_fd: int, outputs: dict[int, int]) -> None:
        """The forked child: this process's descriptors closed, the owner's stdout, stderr,
        working directory and variables taken, then the engine served. Never returns."""
        code = 1
        try:
            self.control.close()
            for pidfd, (_, other_status_fd) in self.children.items():
                os.close(pidfd)
                os.close(other_status_fd)
            os.close(status_fd)
            devnull = os.open(os.devnull, os.O_RDWR)
            for target in (0, 1, 2):    # as `Popen(stdin=DEVNULL)` started now would have them
                os.dup2(outputs.get(target, devnull), target)
            for fd in {devnull, *outputs.values()}:
                os.close(fd)
            if cwd is not None:
                os.chdir(cwd)
            for name, value in environment.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            signal.signal(signal.SIGINT, signal.default_int_handler)
            from xrec.engine.worker import serve
            code = serve(engine_fd, arena_fd, arena_bytes, self.owner)
        except SystemExit as exc:
            code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            logging.shutdown()
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
