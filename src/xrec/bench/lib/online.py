"""An engine already loaded in this process behind `xrec serve`'s HTTP app, and closed-loop
clients against it: the online row of a benchmark that built its engine in memory
(`Engine.from_random`, no model directory for a `xrec serve` subprocess to load).

The app and uvicorn settings are `xrec serve`'s (`create_app`, `server_config`); uvicorn
runs on a thread of this process, on a socket bound to a free port of 127.0.0.1. The
clients are `rawhttp.Connection`s (bodies encoded once, answers not parsed).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from xrec.bench.lib.common import percentile
from xrec.bench.lib.rawhttp import Answer, Connection

ROUTE = "/v1/rec/completions"
START_TIMEOUT_S = 30.0


def unavailable() -> str | None:
    """Why the in-process server cannot run here (a serving dependency missing, as on a
    machine that holds torch alone); None when it can."""
    try:
        import xrec.server.app  # noqa: F401
        import xrec.server.run  # noqa: F401
    except ImportError as e:
        return f"not available: {e.name or e} is not installed (xrec's serving dependencies)"
    return None


@contextmanager
def serving(engine) -> Iterator[tuple[str, int]]:
    """`engine` behind `xrec serve`'s app and uvicorn settings on a thread; yields (host,
    port). The engine stays open at the end (its owner closes it)."""
    import uvicorn

    from xrec.server.app import create_app
    from xrec.server.limits import ConnectionLimits
    from xrec.server.run import server_config

    app = create_app(engine)
    # IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets it knows to be TCP
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(128)
    server = uvicorn.Server(server_config(app, ConnectionLimits()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                              name="xrec-bench-server", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            raise OSError(f"the in-process server did not start within {START_TIMEOUT_S} s")
        yield "127.0.0.1", sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)
        sock.close()


async def closed_loop(host: str, port: int, bodies: list[bytes], concurrency: int,
                      num_requests: int) -> list[Answer]:
    """`concurrency` keep-alive clients, each sending its next body as soon as its last is
    answered, until `num_requests` were sent (bodies taken in turn)."""
    connections = [Connection(host, port) for _ in range(concurrency)]
    answers: list[Answer] = []
    taken = 0

    async def client(connection: Connection) -> None:
        nonlocal taken
        while taken < num_requests:
            body = bodies[taken % len(bodies)]
            taken += 1
            answers.append(await connection.post(ROUTE, body))

    try:
        await asyncio.gather(*[client(c) for c in connections])
    finally:
        await asyncio.gather(*[c.close() for c in connections])
    return answers


def measure(engine, bodies: list[bytes], concurrency: int, num_requests: int) -> dict:
    """One round of `concurrency` requests as a warm-up, then `num_requests` requests with
    `concurrency` in flight: throughput, latency percentiles, errors by status."""
    with serving(engine) as (host, port):
        asyncio.run(closed_loop(host, port, bodies, concurrency, concurrency))
        answers = asyncio.run(closed_loop(host, port, bodies, concurrency, num_requests))
    ok = [a for a in answers if a.status == 200]
    errors: dict[str, int] = {}
    for a in answers:
        if a.status != 200:
            errors[str(a.status)] = errors.get(str(a.status), 0) + 1
    span = max(a.end for a in answers) - min(a.start for a in answers)
    latencies = [(a.end - a.start) * 1e3 for a in ok]
    return {"concurrency": concurrency, "sent": len(answers), "ok": len(ok), "errors": errors,
            "throughput_per_s": len(ok) / span if ok else 0.0,
            **{f"p{q}_ms": percentile(latencies, q) if ok else None for q in (50, 95, 99)}}
