"""`xrec bench serve --ray`: plain `xrec serve` next to the Ray Serve app, same requests.

Contenders, one after the other on this machine: `xrec serve` (a subprocess, as in
bench/serve.py), then the Serve app (xrec.scale.serve_app) with each of `--replicas`
on a local Ray cluster of this machine's cores. Every replica and the plain server run
one pipeline with `--threads` intra-op threads (default 1). For each:

* sequential: one client, one request at a time: p50 / p99 latency; Serve's overhead
  per request is its p50 less the plain server's;
* closed loop: `--clients` keep-alive clients, each sending its next request when the
  last is answered, for `--duration` seconds: throughput, p50 / p99.

Memory: the proportional set size (PSS: shared pages split between the processes that
map them) of the Ray processes of an idle cluster with Serve started and no app, and
of each replica once its engine is loaded. Target: one replica >= 50% of the plain
server's closed-loop throughput (the gap is Ray's proxy and the hop to the replica).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

from xrec.bench.lib.args import dtype_option, model_dir_of
from xrec.bench.lib.common import (environment, environment_markdown, markdown_table, output_paths,
                               percentile, write_outputs)
from xrec.bench.lib.rawhttp import Connection
from xrec.bench.serve import ROUTE, free_port, payloads, server

MIB = 1 << 20


def run(args: argparse.Namespace) -> int:
    from xrec.config import ModelConfig

    model_dir = model_dir_of(args)
    vocab = ModelConfig.from_file(model_dir / "config.json").vocab_size
    bodies = [json.dumps(b).encode() for b in
              payloads({"small": (args.beam_width, args.length)}, vocab, args.seed)["small"]]
    threads = args.threads or 1
    env = environment(args.device)
    rows = []
    with server(model_dir, 1, threads, args.device, args.startup_timeout,
                args.batch_wait_ms, args.dtype) as url:
        rows.append({"contender": "xrec serve", "replicas": None, **measure(url, bodies, args)})
    memory, ray_rows = _ray_contenders(model_dir, bodies, threads, args)
    rows += ray_rows
    plain = rows[0]
    for row in rows[1:]:
        row["vs_plain"] = row["throughput_per_s"] / plain["throughput_per_s"]
        row["overhead_ms"] = row["seq_p50_ms"] - plain["seq_p50_ms"]
    record = {"benchmark": "serve-ray", "environment": env,
              "settings": {"model_dir": str(model_dir), "size": args.size,
                           "beam_width": args.beam_width, "length": args.length,
                           "threads": threads, "clients": args.clients,
                           "duration_s": args.duration, "replicas": args.replicas},
              "results": rows, "memory": memory}
    write_outputs(output_paths(args.out, "serve-ray"), record, markdown)
    return 0


def _ray_contenders(model_dir: Path, bodies: list[bytes], threads: int,
                    args: argparse.Namespace) -> tuple[dict, list[dict]]:
    import ray
    from ray import serve

    from xrec.scale.batch_ray import init_ray
    from xrec.scale.serve_app import (APP_NAME, PROXY_CALLBACK, PROXY_CALLBACK_VARIABLE,
                                      ServeOptions, replica_infos, start)

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ[PROXY_CALLBACK_VARIABLE] = PROXY_CALLBACK
    before = set(_pids())
    init_ray(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    rows, memory = [], {}
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port},
                    logging_config={"log_level": "WARNING"})
        time.sleep(2.0)   # the proxy and controller settle
        cluster = [pid for pid in _pids() if pid not in before and pid != os.getpid()]
        memory["idle_cluster_pss_mib"] = sum(_pss(pid) for pid in cluster) / MIB
        memory["idle_cluster_processes"] = len(cluster)
        for count in args.replicas:
            options = ServeOptions(str(model_dir), engine_options={"num_threads": threads,
                                                                   "device": args.device,
                                                                   "batch_wait_ms": args.batch_wait_ms,
                                                                   **dtype_option(args)},
                                   num_replicas=count, replica_cpus=float(threads))
            start(options, "127.0.0.1", port)
            infos = replica_infos(count)
            memory[f"replica_pss_mib_{count}"] = [_pss(i["pid"]) / MIB for i in infos]
            rows.append({"contender": "Ray Serve", "replicas": count,
                         **measure(f"http://127.0.0.1:{port}", bodies, args)})
            serve.delete(APP_NAME)
    finally:
        serve.shutdown()
        ray.shutdown()
    return memory, rows


def measure(url: str, bodies: list[bytes], args: argparse.Namespace) -> dict:
    port = int(url.rsplit(":", 1)[1])
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(_sequential(port, bodies, 10))   # warm-up
        sequential = loop.run_until_complete(_sequential(port, bodies, args.num_requests * 4))
        closed = loop.run_until_complete(_closed_loop(port, bodies, args.clients, args.duration))
    finally:
        loop.close()
    ok = [a for a in closed if a[0] == 200]
    span = max(a[2] for a in closed) - min(a[1] for a in closed)
    latencies = [(a[2] - a[1]) * 1e3 for a in ok]
    seq = [(a[2] - a[1]) * 1e3 for a in sequential if a[0] == 200]
    return {"seq_p50_ms": statistics.median(seq), "seq_p99_ms": percentile(seq, 99),
            "throughput_per_s": len(ok) / span, "p50_ms": percentile(latencies, 50),
            "p99_ms": percentile(latencies, 99), "errors": len(closed) - len(ok)}


async def _sequential(port: int, bodies: list[bytes], count: int) -> list[tuple]:
    connection = Connection("127.0.0.1", port)
    try:
        answers = []
        for index in range(count):
            answer = await connection.post(ROUTE, bodies[index % len(bodies)])
            answers.append((answer.status, answer.start, answer.end))
        return answers
    finally:
        await connection.close()


async def _closed_loop(port: int, bodies: list[bytes], clients: int, duration_s: float) -> list:
    answers: list[tuple] = []
    end = time.perf_counter() + duration_s

    async def client(offset: int) -> None:
        connection = Connection("127.0.0.1", port)
        try:
            index = offset
            while time.perf_counter() < end:
                answer = await connection.post(ROUTE, bodies[index % len(bodies)])
                answers.append((answer.status, answer.start, answer.end))
                index += clients
        finally:
            await connection.close()

    await asyncio.gather(*[client(i) for i in range(clients)])
    return answers


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _pss(pid: int) -> int:
    """Proportional set size in bytes (0 for a process that has gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def markdown(record: dict) -> str:
    s, m = record["settings"], record["memory"]
    table = markdown_table(
        ["contender", "replicas", "throughput req/s", "vs plain (target ≥ 50% at 1)", "p50 ms",
         "p99 ms", "sequential p50 / p99 ms", "overhead per request ms", "errors"],
        [[r["contender"], r["replicas"], r["throughput_per_s"],
          f"{r['vs_plain']:.0%}" if "vs_plain" in r else "", r["p50_ms"], r["p99_ms"],
          f"{r['seq_p50_ms']:.1f} / {r['seq_p99_ms']:.1f}", r.get("overhead_ms"), r["errors"]]
         for r in record["results"]])
    replicas = "; ".join(f"{k.rsplit('_', 1)[1]} replica(s): " +
                         ", ".join(f"{v:.0f}" for v in vals) + " MiB"
                         for k, vals in m.items() if k.startswith("replica_pss"))
    return (f"## xrec bench serve --ray ({s['size']}; W={s['beam_width']}, L={s['length']}, "
            f"{s['threads']} thread(s) per server / replica, {s['clients']} closed-loop clients, "
            f"{s['duration_s']} s)\n\n{table}\n\nMemory (PSS): idle cluster with Serve "
            f"{m.get('idle_cluster_pss_mib', 0):.0f} MiB in {m.get('idle_cluster_processes')} "
            f"processes; per replica: {replicas}\n\n" + environment_markdown(record["environment"]))
