"""`xrec serve`: load the engine, serve the app with uvicorn, drain on SIGTERM / SIGINT.

Start-up: the options are checked (an empty API key is refused: it would turn
auth off), the listening socket is bound (a busy port is one error line and exit
1, before anything loads), `/health` answers 503 while the model loads on a
background thread; then the options, the model size, the workspace per pipeline
and the URL are logged (logger `xrec.server`, at INFO, shown without `-v`) and
`/health` turns 200. Connections are served by `xrec.server.limits`'s protocol
(head size, read deadlines, idle timeout, connection cap).

Shutdown on the first SIGTERM or SIGINT: `/health` turns 503 and new
requests get 503 UNAVAILABLE at once; `engine.close(grace_s)` lets queued
and running requests finish (what still waits after `grace_s` is answered
UNAVAILABLE, and so is a request whose batch is still running then: the
batch finishes, its answer is dropped); once every HTTP request in flight has
been answered (bounded wait), uvicorn stops and the process exits 0. Later
signals are ignored until the process has exited: the drain is bounded by the
grace period, never killed mid-batch. A batch still running then is not waited
for: its clients have their answer, and the `xrec serve` process leaves at once
(`os._exit(0)`): interpreter shutdown with torch running on a pipeline thread
aborts ("terminate called without an active exception", status 134). For the same
reason a signal that comes while the model loads ends the process at once with
status 0, without waiting for the load (there is nothing to drain yet).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from xrec.config.engine import check_grace_flag
from xrec.engine.frontend import EngineFrontend
from xrec.server.app import create_app
from xrec.server.service import XrecService
from xrec.server.limits import ConnectionLimits, protocol_class

logger = logging.getLogger("xrec.server")

HTTP_TAIL_S = 10.0   # after the engine drained: how long answers may take to be written
BACKLOG = 2048
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose SIGTERM / SIGINT drains the engine before stopping."""

    def __init__(self, config: uvicorn.Config, service: XrecService, grace_s: float):
        super().__init__(config)
        self.service, self.grace_s = service, grace_s
        self.drain_thread: threading.Thread | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Runs in a signal handler: flags and a thread only (no logging, no locks).
        # Not recorded in _captured_signals: uvicorn must not re-raise it after a clean drain.
        self.service.begin_drain()
        if self.drain_thread is None:
            self.drain_thread = threading.Thread(target=self._drain, args=(sig,),
                                                 name="xrec-drain", daemon=True)
            self.drain_thread.start()

    def _drain(self, sig: int) -> None:
        logger.info("signal %d: draining (grace period %.1f s); later signals are ignored",
                    sig, self.grace_s)
        try:
            engine = self.service.engine
            if engine is not None:
                engine.close(self.grace_s)
            self.service.abandon_unfinished()  # the grace period is over
            deadline = time.monotonic() + HTTP_TAIL_S
            while self.service.num_in_flight > 0 and time.monotonic() < deadline:
                time.sleep(0.02)  # bounded: the answers are being written
            if self.service.num_in_flight:
                logger.error("%d HTTP request(s) still open after the drain",
                             self.service.num_in_flight)
        finally:
            self.should_exit = True


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The `--max-header-bytes ...` flags (unset ones keep the defaults)."""
    names = ("max_header_bytes", "header_timeout_s", "body_timeout_s", "keep_alive_s",
             "max_connections")
    try:
        return ConnectionLimits(**{n: getattr(args, n) for n in names
                                   if getattr(args, n, None) is not None})
    except ValueError as e:
        raise ValueError(f"--{str(e).replace('_', '-')}") from None


def catalog_files(args: argparse.Namespace) -> dict[str, Any]:
    """The `--catalog-dir` / `--max-catalog-bytes` flags as `create_app`'s keywords."""
    options: dict[str, Any] = {"catalog_dir": getattr(args, "catalog_dir", None)}
    if getattr(args, "max_catalog_bytes", None) is not None:
        options["max_catalog_bytes"] = args.max_catalog_bytes
    return options


def server_config(app: Any, limits: ConnectionLimits, verbose: bool = False,
                  **options: Any) -> uvicorn.Config:
    """uvicorn's settings for `app` behind `limits` (`xrec serve`'s, also used by tests)."""
    registry = app.state.xrec.metrics.registry
    return uvicorn.Config(app, http=protocol_class(limits, registry),
                          timeout_keep_alive=limits.keep_alive_s,
                          log_level="info" if verbose else "warning", access_log=False,
                          lifespan="off", timeout_graceful_shutdown=max(1, int(HTTP_TAIL_S)),
                          **options)


def serve(args: argparse.Namespace, model_dir: str, engine_options: dict[str, Any],
          owns_process: bool = False) -> int:
    """Run the server until a signal drains it; 0 after a clean drain, 1 if loading failed.
    `owns_process` (the `xrec serve` process): SIGTERM / SIGINT stay ignored after the
    drain, until the process has exited, and the process leaves at once when a batch
    still runs past the grace period."""
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)  # the start-up lines show without -v
    api_key = args.api_key if args.api_key is not None else os.environ.get("XREC_API_KEY")
    name = args.served_model_name or Path(model_dir).resolve().name
    try:
        app = create_app(None, served_model_name=name, api_key=api_key,
                         max_body_bytes=args.max_body_bytes, **catalog_files(args))
    except ValueError as e:
        if api_key is not None and str(e).startswith("api key"):
            raise ValueError(f"--api-key / XREC_API_KEY: {str(e)[len('api key: '):]}") from None
        if str(e).startswith(("catalog_dir:", "max_catalog_bytes:")):
            flag, _, problem = str(e).partition(":")
            raise ValueError(f"--{flag.replace('_', '-')}:{problem}") from None
        raise
    service: XrecService = app.state.xrec
    check_grace_flag(args.grace_s)
    limits = connection_limits(args)
    _reserve_file_descriptors(limits.max_connections)
    sock = listen(args.host, args.port)
    config = server_config(app, limits, getattr(args, "verbose", False))
    server = DrainingServer(config, service, args.grace_s)
    previous = _install_signal_handlers(server.handle_exit)
    try:
        status = _run(server, sock, args, model_dir, engine_options, name, api_key,
                      owns_process)
    finally:
        sock.close()
        if previous is not None:
            for sig, handler in previous.items():
                signal.signal(sig, signal.SIG_IGN if owns_process else handler)
    if owns_process:
        _exit_now_if_busy(service.engine, status)
    return status


def _exit_now_if_busy(engine: EngineFrontend | None, status: int) -> None:
    """Leave the process at once when a pipeline still runs a batch (module docstring)."""
    num_busy = 0 if engine is None else engine.stats().num_pipelines_busy
    if num_busy:
        logger.warning("xrec serve: %d batch(es) still running past the grace period (their "
                       "requests were answered UNAVAILABLE); exiting without waiting", num_busy)
        _leave_now(status)


def _leave_now(status: int) -> None:
    """Exit with `status` without finalizing the interpreter, which would abort the process
    (status 134) while torch runs on another thread (a batch, or the model loading)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _run(server: DrainingServer, sock: socket.socket, args: argparse.Namespace, model_dir: str,
         engine_options: dict[str, Any], name: str, api_key: str | None,
         owns_process: bool) -> int:
    """Load the engine on a thread while `server` serves `sock`; until the drain ends."""
    from xrec import Engine

    service = server.service
    failure: list[BaseException] = []

    def load() -> None:
        try:
            # in-thread: the server runs no torch of its own, so nothing throttles the
            # pipelines, and it saves the hop to a child (README, "Embedding the engine")
            engine = Engine.from_pretrained(model_dir, catalog=args.catalog, isolation="thread",
                                            catalog_extended=getattr(args, "catalog_extended", None),
                                            **engine_options)
        except BaseException as e:  # reported by serve() after the server stops
            failure.append(e)
            server.should_exit = True
            return
        if service.is_draining:  # a signal came while loading
            engine.close(0)
            return
        if owns_process:
            engine.own_process()
        service.attach(engine)
        deadline = time.monotonic() + 10.0
        while not server.started and time.monotonic() < deadline and not server.should_exit:
            time.sleep(0.01)  # bounded: the socket is normally open long before the model
        _log_start(engine, name, args.host, sock.getsockname()[1], api_key is not None,
                   service.max_body_bytes, server.config.http.limits)

    loader = threading.Thread(target=load, name="xrec-load", daemon=True)
    loader.start()
    server.run(sockets=[sock])
    loader.join(timeout=1.0)
    if loader.is_alive() and owns_process:  # stopped while loading: nothing to drain
        logger.info("xrec serve: stopped while the model was loading")
        _leave_now(0)
    if server.drain_thread is not None:
        server.drain_thread.join(timeout=max(1.0, 3 * args.grace_s))
    if service.engine is not None:  # idempotent; closes it when no signal did
        service.engine.close(args.grace_s)
    if failure:
        error = failure[0]
        if isinstance(error, (ValueError, OSError)):
            raise error
        raise RuntimeError(f"loading {model_dir} failed: {error!r}") from error
    logger.info("xrec serve: stopped")
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on `host:port`; OSError naming both when it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP,
            flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise OSError(f"--host {host}: cannot be resolved ({e.strerror})") from None
    # proto=IPPROTO_TCP, or asyncio leaves Nagle on (40 ms delayed-ACK stalls per answer)
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _install_signal_handlers(handler: Any) -> dict | None:
    """SIGTERM / SIGINT -> `handler` from now on (also before uvicorn installs its own and
    after it restores them); the previous handlers, or None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return {sig: signal.signal(sig, handler) for sig in SIGNALS}


def _reserve_file_descriptors(max_connections: int) -> None:
    """Raise the soft open-file limit to what `max_connections` may need (each open
    connection and each lingering refused one holds a descriptor), up to the hard limit."""
    needed = 2 * max_connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        if target < needed:
            logger.warning("open-file limit %d is below the %d that --max-connections %d may "
                           "need; raise the hard limit (ulimit -Hn) or lower --max-connections",
                           target, needed, max_connections)


def _log_start(engine: EngineFrontend, name: str, host: str, port: int, has_key: bool,
               max_body_bytes: int, limits: ConnectionLimits) -> None:
    info = engine.describe()
    logger.info("xrec serve: model %r (%s, %s, dtype %s): %.2fM parameters, %.1f MiB of "
                "weights, catalog %s", name, info["family"], info["device"], info["dtype"],
                info["num_parameters"] / 1e6, info["weight_bytes"] / 2**20, info["catalog"])
    logger.info("xrec serve: d_model=%d vocab_size=%d; %d pipeline(s), workspace %.1f MiB "
                "per pipeline", info["config"].d_model, info["config"].vocab_size,
                info["num_pipelines"], info["workspace_per_pipeline"] / 2**20)
    logger.info("xrec serve: options %s", info["options"])
    display = f"[{host}]" if ":" in host else host
    logger.info("xrec serve: listening on http://%s:%d (auth %s, body limit %d bytes, header "
                "limit %d bytes, header / body / keep-alive timeouts %g / %g / %g s, at most %d "
                "connections); SIGTERM drains", display, port, "on" if has_key else "off",
                max_body_bytes, limits.max_header_bytes, limits.header_timeout_s,
                limits.body_timeout_s, limits.keep_alive_s, limits.max_connections)
