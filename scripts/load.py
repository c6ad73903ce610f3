"""Closed-loop load against a running `xrec serve` on 127.0.0.1: N clients for T seconds.

Each client sends one request, waits for its answer, sends the next, until
the duration or the request cap is reached (both bound every loop). Counts:

* served      HTTP 2xx with at least one result
* empty       HTTP 2xx without results
* lost        sent but never answered (connection reset, read timeout, ...)
* server_5xx  HTTP 5xx answers
* other       other HTTP statuses (4xx, 429) and unexpected answers

Latency percentiles are of the served requests. With `--pid`, the server's
resident memory (VmRSS, and the peak VmHWM) is read from /proc at the start
and the end. Prints a Markdown table and writes JSON (`--out`).

    python scripts/load.py --url http://127.0.0.1:8000 --clients 16 --duration 30 --pid 1234
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx

ROUTES = {"native": "/v1/rec/completions", "xllm": "/v1/completions"}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server URL (127.0.0.1 only)")
    p.add_argument("--clients", type=int, default=8, help="concurrent clients (1..1024)")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of measured load")
    p.add_argument("--max-requests", type=int, default=100_000, help="cap on measured requests")
    p.add_argument("--warmup", type=int, default=10, help="requests sent first, not measured")
    p.add_argument("--api", choices=sorted(ROUTES), default="native")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--beam-width", type=int, default=128)
    p.add_argument("--vocab-size", type=int, default=64, help="token ids drawn from [0, V)")
    p.add_argument("--d-model", type=int, default=0,
                   help="send sparse_embedding [L, D] (b64 on native) instead of token_ids")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout (s)")
    p.add_argument("--pid", type=int, help="server process id, for its memory")
    p.add_argument("--api-key", default=os.environ.get("XREC_API_KEY"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="load.json", help="JSON output path")
    args = p.parse_args(argv)
    host = urlsplit(args.url).hostname
    if host != "127.0.0.1":
        p.error(f"--url: got host {host!r}; this tool only targets 127.0.0.1")
    if not 1 <= args.clients <= 1024:
        p.error(f"--clients: got {args.clients}, allowed 1..1024")
    if not 0 < args.duration <= 3600 or args.max_requests < 1 or args.warmup < 0:
        p.error("--duration must be in (0, 3600], --max-requests >= 1, --warmup >= 0")
    return args


def make_bodies(args: argparse.Namespace, count: int = 64) -> list[bytes]:
    rng = random.Random(args.seed)
    bodies = []
    for _ in range(count):
        body: dict = {"beam_width": args.beam_width}
        if args.d_model:
            values = [rng.gauss(0.0, 1.0) for _ in range(args.input_len * args.d_model)]
            shape = [args.input_len, args.d_model]
            if args.api == "native":
                import struct
                raw = struct.pack(f"<{len(values)}f", *values)
                body["sparse_embedding"] = {"shape": shape, "b64": base64.b64encode(raw).decode()}
            else:
                body["input_tensors"] = [{"name": "sparse_embedding", "data_type": "FLOAT",
                                          "shape": shape, "contents": {"fp32_contents": values}}]
        else:
            body["token_ids"] = [rng.randrange(args.vocab_size) for _ in range(args.input_len)]
        bodies.append(json.dumps(body).encode())
    return bodies


def memory_kib(pid: int | None) -> dict[str, int]:
    if pid is None:
        return {}
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return {}
    return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in lines)
            if k in ("VmRSS", "VmHWM")}


def classify(response: httpx.Response, api: str) -> str:
    if 200 <= response.status_code < 300:
        try:
            out = response.json()
        except ValueError:
            return "other"
        return "served" if out.get("results" if api == "native" else "choices") else "empty"
    return "server_5xx" if response.status_code >= 500 else "other"


async def run_load(args: argparse.Namespace, bodies: list[bytes]) -> dict:
    route = ROUTES[args.api]
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    counts = {"served": 0, "empty": 0, "lost": 0, "server_5xx": 0, "other": 0}
    statuses: dict[str, int] = {}
    latencies: list[float] = []
    budget = {"left": args.max_requests}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, limits=limits,
                                 timeout=args.timeout) as client:
        for body in (bodies * (args.warmup // len(bodies) + 1))[:args.warmup]:
            await client.post(route, content=body)
        start = time.perf_counter()
        deadline = start + args.duration

        async def one_client(index: int) -> None:
            turn = index
            while budget["left"] > 0 and time.perf_counter() < deadline:
                budget["left"] -= 1
                body = bodies[turn % len(bodies)]
                turn += args.clients
                sent = time.perf_counter()
                try:
                    response = await client.post(route, content=body)
                except (httpx.TransportError, httpx.TimeoutException) as e:
                    counts["lost"] += 1
                    statuses[type(e).__name__] = statuses.get(type(e).__name__, 0) + 1
                    continue
                kind = classify(response, args.api)
                counts[kind] += 1
                statuses[str(response.status_code)] = statuses.get(str(response.status_code), 0) + 1
                if kind == "served":
                    latencies.append(time.perf_counter() - sent)

        await asyncio.gather(*(one_client(i) for i in range(args.clients)))
        elapsed = time.perf_counter() - start
    latencies.sort()
    return {"elapsed_s": elapsed, "sent": sum(counts.values()), **counts, "statuses": statuses,
            "served_per_s": counts["served"] / elapsed,
            "latency_ms": {f"p{q}": _percentile(latencies, q) * 1e3 for q in (50, 95, 99)}}


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return float("nan")
    rank = min(len(sorted_values) - 1, max(0, round(q / 100 * (len(sorted_values) - 1))))
    return sorted_values[rank]


def environment() -> dict:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=5, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    return {"git_sha": sha, "python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def markdown(record: dict) -> str:
    r, mem = record["result"], record["memory_kib"]
    rows = [("clients", record["args"]["clients"]), ("duration (s)", f"{r['elapsed_s']:.1f}"),
            ("sent", r["sent"]), ("served", r["served"]),
            ("served / s", f"{r['served_per_s']:.1f}"),
            ("lost", r["lost"]), ("5xx", r["server_5xx"]), ("other errors", r["other"]),
            ("empty results", r["empty"])]
    rows += [(f"latency {k} (ms)", f"{v:.1f}") for k, v in r["latency_ms"].items()]
    if mem.get("start"):
        rows += [("server RSS start (MiB)", f"{mem['start'].get('VmRSS', 0) / 1024:.1f}"),
                 ("server RSS end (MiB)", f"{mem['end'].get('VmRSS', 0) / 1024:.1f}"),
                 ("server RSS peak (MiB)", f"{mem['end'].get('VmHWM', 0) / 1024:.1f}")]
    lines = ["| metric | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    bodies = make_bodies(args)
    memory = {"start": memory_kib(args.pid)}
    try:
        result = asyncio.run(run_load(args, bodies))
    except httpx.HTTPError as e:
        print(f"load: cannot reach {args.url}: {e!r}", file=sys.stderr)
        return 1
    memory["end"] = memory_kib(args.pid)
    record = {"args": vars(args) | {"api_key": bool(args.api_key)}, "environment": environment(),
              "result": result, "memory_kib": memory}
    print(markdown(record))
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
