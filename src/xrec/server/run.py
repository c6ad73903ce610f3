"""`xrec serve`: load the engine, serve the app with uvicorn, drain on SIGTERM / SIGINT.

Start-up: the listening socket opens first and `/health` answers 503 while
the model loads on a background thread; then the options, the model size,
the workspace per pipeline and the URL are logged (logger `xrec.server`, at
INFO, shown without `-v`) and `/health` turns 200.

Shutdown on the first SIGTERM or SIGINT: `/health` turns 503 and new
requests get 503 UNAVAILABLE at once; `engine.close(grace_s)` lets queued
and running requests finish (what still waits after `grace_s` is answered
UNAVAILABLE); once every HTTP request in flight has been answered (bounded
wait), uvicorn stops and the process exits 0. Later signals are logged and
ignored: the drain is bounded by the grace period, never killed mid-batch.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from xrec.server.app import XrecService, create_app

logger = logging.getLogger("xrec.server")

HTTP_TAIL_S = 10.0   # after the engine drained: how long answers may take to be written


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
            deadline = time.monotonic() + HTTP_TAIL_S
            while self.service.num_in_flight > 0 and time.monotonic() < deadline:
                time.sleep(0.02)  # bounded: the answers are being written
            if self.service.num_in_flight:
                logger.error("%d HTTP request(s) still open after the drain",
                             self.service.num_in_flight)
        finally:
            self.should_exit = True


def serve(args: argparse.Namespace, model_dir: str, engine_options: dict[str, Any]) -> int:
    """Run the server until a signal drains it; 0 after a clean drain, 1 if loading failed."""
    from xrec import Engine

    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)  # the start-up lines show without -v
    api_key = args.api_key or os.environ.get("XREC_API_KEY") or None
    name = args.served_model_name or Path(model_dir).resolve().name
    app = create_app(None, served_model_name=name, api_key=api_key,
                     max_body_bytes=args.max_body_bytes)
    service: XrecService = app.state.xrec
    if args.grace_s < 0:
        raise ValueError(f"--grace-s: got {args.grace_s}, expected >= 0")
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level="info" if getattr(args, "verbose", False) else "warning",
                            access_log=False, lifespan="off",
                            timeout_graceful_shutdown=max(1, int(HTTP_TAIL_S)))
    server = DrainingServer(config, service, args.grace_s)
    failure: list[BaseException] = []

    def load() -> None:
        try:
            engine = Engine.from_pretrained(model_dir, catalog=args.catalog, **engine_options)
        except BaseException as e:  # reported by serve() after the server stops
            failure.append(e)
            server.should_exit = True
            return
        if service.is_draining:  # a signal came while loading
            engine.close(0)
            return
        service.attach(engine)
        deadline = time.monotonic() + 10.0
        while not server.started and time.monotonic() < deadline and not server.should_exit:
            time.sleep(0.01)  # bounded: the socket is normally open long before the model
        _log_start(engine, name, args.host, _bound_port(server, args.port), api_key is not None,
                   args.max_body_bytes)

    loader = threading.Thread(target=load, name="xrec-load", daemon=True)
    loader.start()
    server.run()
    loader.join(timeout=1.0)
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


def _bound_port(server: uvicorn.Server, default: int) -> int:
    for listener in getattr(server, "servers", None) or []:
        for sock in listener.sockets:
            return sock.getsockname()[1]
    return default


def _log_start(engine: Any, name: str, host: str, port: int, has_key: bool,
               max_body_bytes: int) -> None:
    config = engine.model.config
    num_params = sum(p.numel() for p in engine.model.parameters())
    num_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    logger.info("xrec serve: model %r (%s): %.2fM parameters, %.1f MiB of weights, catalog %s",
                name, engine.model.device, num_params / 1e6,
                num_bytes / 2**20, engine.catalog)
    logger.info("xrec serve: d_model=%d vocab_size=%d; %d pipeline(s), workspace %.1f MiB "
                "per pipeline", config.d_model, config.vocab_size, engine.num_pipelines,
                engine.workspace_per_pipeline / 2**20)
    logger.info("xrec serve: options %s", engine.options)
    display = f"[{host}]" if ":" in host else host
    logger.info("xrec serve: listening on http://%s:%d (auth %s, body limit %d bytes); "
                "SIGTERM drains", display, port, "on" if has_key else "off", max_body_bytes)
