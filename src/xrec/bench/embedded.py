"""`xrec bench embedded`: the engine inside a host process that does its own torch work.

Host conditions, each in a fresh process per isolation mode (`thread`, `process`):

    alone      the host does nothing but call the engine
    main-op    one 512x512 matmul on the host's main thread before the engine starts
               (a feature model, a notebook cell): its OpenMP team lives on
    host-loop  a host thread multiplies 256x256 matrices without pause while the engine
               serves; the two share the cores, so both sides' shares are reported

Reported per row: the median batch time of `--repeats` runs of the same batch, its
throughput as a fraction of xrec alone (in-thread, the fastest case with an idle
host), and for `host-loop` the fraction of its solo speed the host loop kept. The
transport overhead is the p50 latency of one W=128 request with a 256 x d_model
embedding, process minus thread, measured in the `alone` processes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from xrec.bench.cli import model_dir_of
from xrec.bench.common import environment, markdown_table, output_paths, write_outputs

CONDITIONS = ("alone", "main-op", "host-loop")
ISOLATIONS = ("thread", "process")
LOOP_SIZE = 256
SOLO_LOOP_S = 2.0
LATENCY_RUNS = 21


def run(args: argparse.Namespace) -> int:
    model_dir = model_dir_of(args)
    rows = []
    for condition in args.conditions:
        for isolation in args.isolations:
            setting = {"model_dir": str(model_dir), "condition": condition, "isolation": isolation,
                       "beam_width": args.beam_width, "length": args.length,
                       "num_requests": args.num_requests, "repeats": args.repeats,
                       "warmup": args.warmup, "threads": args.threads, "seed": args.seed}
            print(f"xrec bench embedded: {condition}, isolation={isolation}", file=sys.stderr)
            rows.append({**setting, **_measure_in_fresh_process(setting)})
    reference = next((r for r in rows if r["condition"] == "alone" and r["isolation"] == "thread"),
                     rows[0])
    for row in rows:
        row["throughput_vs_alone"] = reference["batch_ms"] / row["batch_ms"]
    latency = {r["isolation"]: r["latency_p50_ms"] for r in rows if r.get("latency_p50_ms")}
    record = {"benchmark": "embedded", "environment": environment(args.device),
              "settings": {"size": args.size, "items": args.items, "beam_width": args.beam_width,
                           "length": args.length, "num_requests": args.num_requests,
                           "repeats": args.repeats, "threads": args.threads},
              "rows": rows,
              "transport_overhead_p50_ms": latency["process"] - latency["thread"]
              if {"process", "thread"} <= latency.keys() else None}
    write_outputs(output_paths(args.out, "embedded"), record, markdown)
    return 0


def _measure_in_fresh_process(setting: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "xrec.bench.embedded", json.dumps(setting)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(record: dict) -> str:
    header = ["host", "isolation", "batch ms (median)", "throughput vs xrec alone",
              "host loop kept"]
    rows = [[r["condition"], r["isolation"], f"{r['batch_ms']:.1f}",
             f"{r['throughput_vs_alone']:.2f}",
             "" if r.get("loop_kept") is None else f"{r['loop_kept']:.2f}"]
            for r in record["rows"]]
    overhead = record["transport_overhead_p50_ms"]
    tail = "" if overhead is None else \
        f"\n\nTransport overhead, p50 of one W=128 request with a 256-row embedding: {overhead:.2f} ms"
    return markdown_table(header, rows) + tail


# ---- the measuring process ----------------------------------------------------------------

def measure(setting: dict) -> dict:
    import torch

    from xrec import Engine, RecRequest
    from xrec.bench.models import make_workload

    if setting["condition"] == "main-op":
        torch.randn(512, 512) @ torch.randn(512, 512)   # the host's own torch work, main thread
    loop = _HostLoop() if setting["condition"] == "host-loop" else None
    solo_rate = loop.solo_rate() if loop else None
    options = {"num_threads": setting["threads"]} if setting["threads"] else {}
    engine = Engine.from_pretrained(setting["model_dir"], isolation=setting["isolation"], **options)
    try:
        limits = engine.limits
        workload = make_workload(limits.vocab_size, setting["num_requests"], setting["length"],
                                 setting["beam_width"], setting["seed"])
        requests = [RecRequest(token_ids=ids.tolist(), beam_width=workload.beam_width)
                    for ids in workload.token_ids]
        for _ in range(setting["warmup"]):
            engine.recommend(requests)
        if loop:
            loop.start()
        times = []
        for _ in range(setting["repeats"]):
            started = time.perf_counter()
            engine.recommend(requests)
            times.append(time.perf_counter() - started)
        result: dict[str, Any] = {"batch_ms": 1e3 * statistics.median(times),
                                  "batch_ms_all": [1e3 * t for t in times]}
        if loop:
            result["loop_kept"] = loop.stop() / solo_rate
        if setting["condition"] == "alone" and limits.accepts_embeddings:
            result["latency_p50_ms"] = _latency_p50(engine, limits.d_model, setting["seed"])
    finally:
        engine.close()
    return result


def _latency_p50(engine: Any, d_model: int, seed: int) -> float:
    import numpy as np

    from xrec import RecRequest
    embedding = np.random.default_rng(seed).standard_normal((256, d_model), dtype=np.float32)
    request = RecRequest(sparse_embedding=embedding, beam_width=128)
    engine.recommend(request)
    times = []
    for _ in range(LATENCY_RUNS):
        started = time.perf_counter()
        engine.recommend(request)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


class _HostLoop:
    """A host thread multiplying matrices until stopped; its rate alone and while serving."""

    def __init__(self):
        import torch
        self.a = torch.randn(LOOP_SIZE, LOOP_SIZE)
        self.count = 0
        self.stopping = threading.Event()
        self.thread: threading.Thread | None = None

    def _spin(self) -> None:
        while not self.stopping.is_set():
            self.a @ self.a
            self.count += 1

    def solo_rate(self) -> float:
        self.start()
        time.sleep(SOLO_LOOP_S)
        return self.stop()

    def start(self) -> None:
        self.count, self.started = 0, time.perf_counter()
        self.stopping.clear()
        self.thread = threading.Thread(target=self._spin, name="host-loop", daemon=True)
        self.thread.start()

    def stop(self) -> float:
        """Matmuls per second since `start`."""
        self.stopping.set()
        self.thread.join()
        return self.count / (time.perf_counter() - self.started)


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
