"""`xrec bench serve`: open-loop HTTP load against `xrec serve`, and server vs offline.

* Load: Poisson arrivals at each rate for `--duration` seconds, a mix of small requests
  (W, L) and a `--large-fraction` of large ones; every request is sent when it arrives,
  whether or not earlier ones were answered (open loop). Per rate: throughput,
  p50/p95/p99 (all, small, large) and errors, for each server `--max-concurrency` (1 vs 2:
  whether small requests still wait behind large ones).
* Server vs offline: the same `--num-requests` small requests, all at once, through the
  server (concurrent HTTP clients) and through `Engine.recommend` in this process, runs
  interleaved; target: the server reaches >= 85% of the offline throughput.

The server is started as `python -m xrec.cli serve --model DIR --port P` on 127.0.0.1
(or `--url` names one already running; then there is no concurrency comparison).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import statistics
import subprocess
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from urllib.parse import urlsplit

import numpy as np

from xrec.bench.lib.args import dtype_option, model_dir_of, progress_bar
from xrec.bench.lib.rawhttp import Connection, burst
from xrec.bench.lib.common import (environment, environment_markdown, markdown_table,
                                   module_command, output_paths, percentile, pyplot,
                                   write_outputs)
from xrec.utils.fresh_thread import in_fresh_thread

ROUTE = "/v1/rec/completions"


@dataclass
class Sent:
    kind: str
    start: float
    end: float
    status: int | str          # HTTP status, or the exception's name


def arrivals(rate: float, duration_s: float, seed: int) -> np.ndarray:
    """Poisson arrival times (seconds from the start) of a `rate` per second load."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=int(rate * duration_s * 2 + 20))
    times = np.cumsum(gaps)
    return times[times < duration_s]


def payloads(kind_sizes: dict[str, tuple[int, int]], vocab_size: int, seed: int,
             count: int = 32) -> dict[str, list[dict]]:
    rng = np.random.default_rng(seed)
    return {kind: [{"token_ids": rng.integers(0, vocab_size, length).tolist(), "beam_width": width}
                   for _ in range(count)] for kind, (width, length) in kind_sizes.items()}


async def open_loop(url: str, schedule: list[tuple[float, str]], bodies: dict[str, list[dict]],
                    timeout_s: float = 600.0) -> list[Sent]:
    """Send `(arrival time, kind)` requests at their times; gather every answer."""
    import httpx

    sent: list[Sent] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits) as client:
        async def one(kind: str, body: dict) -> None:
            start = time.perf_counter()
            try:
                status: int | str = (await client.post(ROUTE, json=body)).status_code
            except httpx.HTTPError as e:
                status = type(e).__name__
            sent.append(Sent(kind, start, time.perf_counter(), status))

        origin = time.perf_counter()
        tasks = []
        for index, (at, kind) in enumerate(schedule):
            delay = origin + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            pool = bodies[kind]
            tasks.append(asyncio.create_task(one(kind, pool[index % len(pool)])))
        await asyncio.gather(*tasks)
    return sent


def summarize_load(sent: list[Sent], offered: float) -> dict:
    ok = [s for s in sent if s.status == 200]
    errors: dict[str, int] = {}
    for s in sent:
        if s.status != 200:
            errors[str(s.status)] = errors.get(str(s.status), 0) + 1
    span = max(s.end for s in sent) - min(s.start for s in sent) if sent else float("nan")
    out = {"offered_per_s": offered, "sent": len(sent), "ok": len(ok), "errors": errors,
           "throughput_per_s": len(ok) / span if ok else 0.0}
    for kind in (None, "small", "large"):
        latencies = [(s.end - s.start) * 1e3 for s in ok if kind is None or s.kind == kind]
        prefix = "" if kind is None else kind + "_"
        for q in (50, 95, 99):
            out[f"{prefix}p{q}_ms"] = percentile(latencies, q) if latencies else None
    return out


# ---- the server process --------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def server(model_dir, max_concurrency: int, threads: int | None, device: str, timeout_s: float,
           batch_wait_ms: float = 0.0, dtype: str | None = None):
    """`xrec serve` in a subprocess on a free port; yields its base URL; SIGTERM at the end,
    or when this process ends otherwise (`module_command`)."""
    import httpx

    port = free_port()
    command = module_command("xrec.cli", "serve", "--model", str(model_dir), "--host",
                             "127.0.0.1", "--port", str(port), "--max-concurrency",
                             str(max_concurrency), "--device", device, "--grace-s", "5",
                             "--batch-wait-ms", str(batch_wait_ms))
    if threads:
        command += ["--num-threads", str(threads)]
    if dtype:
        command += ["--dtype", dtype]
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                log.seek(0)
                tail = log.read().decode(errors="replace")[-2000:]
                shown = " ".join(["python -m", *command[4:]])   # not module_command's launcher
                raise OSError(f"`{shown}` exited with status {process.returncode}:\n{tail}")
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise OSError(f"the server did not answer GET /health within {timeout_s} s")
            time.sleep(0.2)
        yield url
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        log.close()


# ---- the command -----------------------------------------------------------------------------

def run(args: argparse.Namespace) -> int:
    import httpx  # noqa: F401  (fail early when the bench extra is missing)

    from xrec.config import ModelConfig

    model_dir = model_dir_of(args)
    vocab = ModelConfig.from_file(model_dir / "config.json").vocab_size
    if len(args.large) != 2:
        raise ValueError(f"--large: expected W,L, got {args.large}")
    sizes = {"small": (args.beam_width, args.length), "large": tuple(args.large)}
    bodies = payloads(sizes, vocab, args.seed)
    env = environment(args.device)
    concurrency = [None] if args.url else args.concurrency
    bar = progress_bar(args, len(concurrency) * (len(args.rates) + 1), "serve")
    loads, versus = [], []
    for value in concurrency:
        with (_external(args.url) if args.url else
              server(model_dir, value, args.threads, args.device, args.startup_timeout,
                     args.batch_wait_ms, args.dtype)) as url:
            versus.append({"max_concurrency": value,
                           **server_vs_offline(url, model_dir, value, args, bodies["small"])})
            bar.update(1)
            for index, rate in enumerate(args.rates):
                schedule = _schedule(rate, args, seed=args.seed + index)
                sent = asyncio.run(open_loop(url, schedule, bodies))
                loads.append({"max_concurrency": value, **summarize_load(sent, rate)})
                bar.update(1)
    bar.close()
    record = {"benchmark": "serve", "environment": env,
              "settings": {"model_dir": str(model_dir), "size": args.size, "items": args.items,
                           "small": sizes["small"], "large": sizes["large"],
                           "large_fraction": args.large_fraction, "duration_s": args.duration,
                           "rates": args.rates, "url": args.url,
                           "batch_wait_ms": args.batch_wait_ms},
              "server_vs_offline": versus, "load": loads}
    paths = output_paths(args.out, "serve")
    write_outputs(paths, record, markdown, draw=lambda path: plot(loads, path))
    return 0


@contextmanager
def _external(url: str):
    yield url.rstrip("/")


def _schedule(rate: float, args: argparse.Namespace, seed: int) -> list[tuple[float, str]]:
    rng = np.random.default_rng(seed + 1000)
    return [(float(t), "large" if rng.random() < args.large_fraction else "small")
            for t in arrivals(rate, args.duration, seed)]


def server_vs_offline(url: str, model_dir, max_concurrency: int | None, args: argparse.Namespace,
                      bodies: list[dict]) -> dict:
    """The same requests through the server (all at once) and through Engine.recommend,
    interleaved; medians of `--repeats` runs after `--warmup`."""
    from xrec import Engine, RecRequest

    batch = [bodies[i % len(bodies)] for i in range(args.num_requests)]
    # a light client (pre-encoded bodies, no JSON decoding): it shares the cores with the server
    encoded = [json.dumps(body).encode() for body in batch]
    host, port = urlsplit(url).hostname, urlsplit(url).port
    requests = [RecRequest(**body) for body in batch]
    options = {"device": args.device, "num_threads": args.threads, "max_concurrency": max_concurrency,
               "batch_wait_ms": args.batch_wait_ms, **dtype_option(args)}
    offline, served = [], []
    loop = asyncio.new_event_loop()
    connections = [Connection(host, port) for _ in encoded]   # kept alive across the runs
    try:
        # loaded in a thread that ends, like every contender of the offline benchmark: a
        # torch op on this long-lived thread would keep an OpenMP team that slows the
        # engine's pipelines (docs/decisions.md, Benchmarks)
        with in_fresh_thread(lambda: Engine.from_pretrained(
                model_dir, isolation="thread",   # as the server's
                **{k: v for k, v in options.items() if v is not None})) as engine:
            for index in range(args.warmup + args.repeats):
                start = time.perf_counter()
                engine.recommend(requests)
                offline_s = time.perf_counter() - start
                sent = loop.run_until_complete(burst(host, port, ROUTE, encoded, connections))
                if any(s.status != 200 for s in sent):
                    raise OSError(f"server answered {[s.status for s in sent]} to the "
                                  "comparison batch")
                if index >= args.warmup:
                    offline.append(offline_s)
                    served.append(max(s.end for s in sent) - min(s.start for s in sent))
    finally:
        loop.run_until_complete(_close_all(connections))
        loop.close()
    off, srv = statistics.median(offline), statistics.median(served)
    return {"num_requests": len(batch), "offline_ms": off * 1e3, "server_ms": srv * 1e3,
            "offline_per_s": len(batch) / off, "server_per_s": len(batch) / srv,
            "server_vs_offline": off / srv}


async def _close_all(connections: list[Connection]) -> None:
    await asyncio.gather(*[c.close() for c in connections])


def markdown(record: dict) -> str:
    s = record["settings"]
    versus = markdown_table(
        ["max_concurrency", "requests", "offline req/s", "server req/s", "server / offline",
         "target ≥ 85%"],
        [[v["max_concurrency"], v["num_requests"], v["offline_per_s"], v["server_per_s"],
          f"{v['server_vs_offline']:.0%}", "met" if v["server_vs_offline"] >= 0.85 else "MISSED"]
         for v in record["server_vs_offline"]])
    load = markdown_table(
        ["max_concurrency", "offered req/s", "sent", "ok", "errors", "throughput req/s",
         "p50 ms", "p95 ms", "p99 ms", "small p50 / p99 ms", "large p50 / p99 ms"],
        [[r["max_concurrency"], r["offered_per_s"], r["sent"], r["ok"],
          ", ".join(f"{k}: {v}" for k, v in r["errors"].items()) or 0, r["throughput_per_s"],
          r["p50_ms"], r["p95_ms"], r["p99_ms"], _pair(r, "small"), _pair(r, "large")]
         for r in record["load"]])
    return (f"## xrec bench serve ({s['size']}; small W,L = {s['small']}, large W,L = "
            f"{s['large']}, {s['large_fraction']:.0%} large; {s['duration_s']} s per rate)\n\n"
            f"### server vs offline (same requests, all at once)\n\n{versus}\n\n"
            f"### open-loop Poisson load\n\n{load}\n\n"
            + environment_markdown(record["environment"]))


def _pair(row: dict, kind: str) -> str | None:
    p50, p99 = row.get(f"{kind}_p50_ms"), row.get(f"{kind}_p99_ms")
    return None if p50 is None else f"{p50:.0f} / {p99:.0f}"


def plot(loads: list[dict], path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for value in dict.fromkeys(r["max_concurrency"] for r in loads):
        rows = [r for r in loads if r["max_concurrency"] == value]
        rates = [r["offered_per_s"] for r in rows]
        for ax, kind in zip(axes, ("small", "large")):
            for q, style in ((50, "-o"), (99, "--x")):
                ys = [r[f"{kind}_p{q}_ms"] or float("nan") for r in rows]
                ax.plot(rates, ys, style, label=f"max_concurrency={value} p{q}")
    for ax, kind in zip(axes, ("small", "large")):
        ax.set_title(f"{kind} requests")
        ax.set_xlabel("offered load, requests/s")
        ax.set_ylabel("latency, ms")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("xrec bench serve (open loop)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
