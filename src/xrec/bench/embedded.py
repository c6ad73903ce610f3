"""`xrec bench embedded`: the engine inside a host process that does its own torch work.

Host conditions, each in a fresh process per isolation mode (`thread`, `process`):

    alone      the host does nothing but call the engine
    main-op    one 512x512 matmul on the host's main thread before the engine starts
               (a feature model, a notebook cell): its OpenMP team lives on
    host-loop  a host thread multiplies 256x256 matrices without pause while the engine
               serves; the two share the cores, so both sides' shares are reported

The rows run `--rounds` times in turn (a fresh process each time), so that a slow phase
of a shared machine falls on every row alike. Reported per row: the median over rounds of
the median batch time of `--repeats` runs of the same batch, its throughput as a fraction
of xrec alone (in-thread, the fastest case with an idle host; the median over rounds of
the ratio within each round), and for `host-loop` the
fraction of its solo speed the host loop kept. The transport overhead is measured in one
more fresh process that holds both kinds of engine: one W=128 request with a
256 x d_model embedding, sent to each in turn, the median of the paired differences
(process minus thread) and each side's p50. The same process times a process-isolated
engine's start: its first (which starts the fork server, `xrec.engine.forkserver`), then
`--repeats` starts forked from the fork server and as fresh interpreters
(`XREC_FORK_SERVER=off`) in turn, each start's `from_pretrained` alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

from xrec.bench.lib.args import dtype_option, model_dir_of
from xrec.bench.lib.common import (environment, environment_markdown, markdown_table,
                               output_paths, write_outputs)

CONDITIONS = ("alone", "main-op", "host-loop")
ISOLATIONS = ("thread", "process")
LOOP_SIZE = 256
SOLO_LOOP_S = 2.0
LATENCY_RUNS = 21


def run(args: argparse.Namespace) -> int:
    for flag, names, allowed in (("--conditions", args.conditions, CONDITIONS),
                                 ("--isolations", args.isolations, ISOLATIONS)):
        unknown = sorted(set(names) - set(allowed))
        if unknown or not names:
            raise ValueError(f"{flag}: unknown {unknown}, allowed: {', '.join(allowed)}")
    model_dir = model_dir_of(args)
    env = environment(args.device)   # the load average and date at the start
    args.rounds = args.rounds or 3
    base = {"model_dir": str(model_dir), "beam_width": args.beam_width, "length": args.length,
            "num_requests": args.num_requests, "repeats": args.repeats, "warmup": args.warmup,
            "threads": args.threads, "seed": args.seed, **dtype_option(args)}
    pairs = [(c, i) for c in args.conditions for i in args.isolations]
    rounds: dict[tuple[str, str], list[dict]] = {pair: [] for pair in pairs}
    for index in range(args.rounds):
        for condition, isolation in pairs:
            print(f"xrec bench embedded: round {index + 1}/{args.rounds}, {condition}, "
                  f"isolation={isolation}", file=sys.stderr)
            rounds[(condition, isolation)].append(_measure_in_fresh_process(
                {**base, "condition": condition, "isolation": isolation}))
    rows = [{**base, "condition": c, "isolation": i, **_median_of_rounds(rounds[(c, i)])}
            for c, i in pairs]
    # the yardstick is xrec alone in-thread: without that row there is no ratio (another
    # row against itself would read 1.00, the target met)
    reference = next((r for r in rows if r["condition"] == "alone" and r["isolation"] == "thread"),
                     None)
    for row in rows:   # paired by round: rows of one round ran minutes apart, not tens
        row["throughput_vs_alone"] = None if reference is None else statistics.median(
            r / t for r, t in zip(reference["batch_ms_rounds"], row["batch_ms_rounds"]))
    transport = start = None
    if set(ISOLATIONS) <= set(args.isolations):
        print("xrec bench embedded: transport overhead and engine start", file=sys.stderr)
        measured = _measure_in_fresh_process({**base, "condition": "transport"})
        transport, start = measured["transport"], measured["start"]
    record = {"benchmark": "embedded", "environment": env,
              "settings": {"size": args.size, "items": args.items, "beam_width": args.beam_width,
                           "length": args.length, "num_requests": args.num_requests,
                           "repeats": args.repeats, "rounds": args.rounds,
                           "threads": args.threads},
              "rows": rows, "transport": transport, "start": start}
    write_outputs(output_paths(args.out, "embedded"), record, markdown)
    return 0


def _median_of_rounds(results: list[dict]) -> dict:
    out = {"batch_ms": statistics.median(r["batch_ms"] for r in results),
           "batch_ms_rounds": [r["batch_ms"] for r in results]}
    if results[0].get("loop_kept") is not None:
        out["loop_kept"] = statistics.median(r["loop_kept"] for r in results)
    return out


def _measure_in_fresh_process(setting: dict) -> dict:
    done = subprocess.run([sys.executable, "-m", "xrec.bench.embedded", json.dumps(setting)],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(record: dict) -> str:
    s = record["settings"]
    header = ["host", "isolation", "batch ms (median of rounds)", "throughput vs xrec alone",
              "host loop kept"]
    rows = [[r["condition"], r["isolation"],
             f"{r['batch_ms']:.1f} ({', '.join(f'{t:.0f}' for t in r['batch_ms_rounds'])})",
             "not measured (no alone, thread row)" if r["throughput_vs_alone"] is None
             else f"{r['throughput_vs_alone']:.2f}",
             "" if r.get("loop_kept") is None else f"{r['loop_kept']:.2f}"]
            for r in record["rows"]]
    title = (f"## xrec bench embedded ({s['size']}, {s['num_requests']} requests, "
             f"W={s['beam_width']}, L={s['length']}; {s['rounds']} rounds of {s['repeats']} "
             "batches)\n\nTarget: with torch work on the host's main thread (`main-op`), "
             "≥ 0.95 of xrec alone.\n\n")
    transport = record["transport"]
    tail = "" if transport is None else (
        f"\n\nTransport overhead, one W={record['settings']['beam_width']} request with a 256-row "
        f"embedding, sent in turn to an in-thread and a process-isolated engine: "
        f"{transport['overhead_ms']:.2f} ms (median of paired differences; p50 "
        f"{transport['thread_p50_ms']:.1f} ms in-thread, {transport['process_p50_ms']:.1f} ms "
        "in a child)")
    start = record.get("start")
    if start is not None:
        tail += (f"\n\nEngine start, isolation=\"process\": the first of a process "
                 f"{start['first_s']:.2f} s (it starts the fork server); then "
                 f"{start['forked_s']:.2f} s forked from it against {start['fresh_s']:.2f} s as a "
                 f"fresh interpreter, {start['fresh_vs_forked']:.1f}x (medians of "
                 f"{start['starts']} starts each, in turn)")
    return title + markdown_table(header, rows) + tail + "\n\n" + \
        environment_markdown(record["environment"])


# ---- the measuring process ----------------------------------------------------------------

def measure(setting: dict) -> dict:
    import torch

    from xrec import Engine, RecRequest
    from xrec.bench.lib.models import make_workload

    if setting["condition"] == "transport":
        return _transport_and_starts(setting)
    if setting["condition"] == "main-op":
        torch.randn(512, 512) @ torch.randn(512, 512)   # the host's own torch work, main thread
    loop = _HostLoop() if setting["condition"] == "host-loop" else None
    solo_rate = loop.solo_rate() if loop else None
    options = _engine_options(setting)
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
    finally:
        engine.close()
    return result


def _transport_and_starts(setting: dict) -> dict:
    """One request with an embedding, to an in-thread and a process-isolated engine in turn
    (both in this process, loaded on threads that end): the cost of the hop to the child;
    and the process-isolated engine's start (`_starts`)."""
    import numpy as np

    from xrec import Engine, RecRequest
    from xrec.engine.forkserver import FORK_SERVER_ENV
    from xrec.utils.fresh_thread import in_fresh_thread

    options = _engine_options(setting)
    os.environ.pop(FORK_SERVER_ENV, None)   # the first start runs the fork server, as described
    started = time.perf_counter()
    child = Engine.from_pretrained(setting["model_dir"], isolation="process", **options)
    first_s = time.perf_counter() - started
    with in_fresh_thread(lambda: Engine.from_pretrained(setting["model_dir"], isolation="thread",
                                                        **options)) as local, child:
        start = {"first_s": first_s, **_starts(setting, options)}
        if not local.limits.accepts_embeddings:
            return {"transport": None, "start": start}
        embedding = np.random.default_rng(setting["seed"]).standard_normal(
            (256, local.limits.d_model), dtype=np.float32)
        request = RecRequest(sparse_embedding=embedding, beam_width=setting["beam_width"])
        times: dict[str, list[float]] = {"thread": [], "process": []}
        for index in range(LATENCY_RUNS + 1):
            for name, engine in (("thread", local), ("process", child)):
                started = time.perf_counter()
                engine.recommend(request)
                if index:   # the first of each is a warm-up
                    times[name].append(1e3 * (time.perf_counter() - started))
    return {"transport": {"overhead_ms": statistics.median(p - t for t, p in zip(times["thread"],
                                                                                 times["process"])),
                          "thread_p50_ms": statistics.median(times["thread"]),
                          "process_p50_ms": statistics.median(times["process"])},
            "start": start}


def _starts(setting: dict, options: dict) -> dict:
    """`repeats` process-isolated engine starts forked from this process's fork server and as
    many as fresh interpreters, in turn: the medians of `from_pretrained`'s time and of the
    paired ratio (fresh over forked)."""
    from xrec import Engine
    from xrec.engine.forkserver import FORK_SERVER_ENV

    times: dict[str, list[float]] = {"on": [], "off": []}
    try:
        for _ in range(setting["repeats"]):
            for mode in times:
                os.environ[FORK_SERVER_ENV] = mode
                started = time.perf_counter()
                engine = Engine.from_pretrained(setting["model_dir"], isolation="process",
                                                **options)
                times[mode].append(time.perf_counter() - started)
                engine.close()
    finally:
        os.environ.pop(FORK_SERVER_ENV, None)
    return {"forked_s": statistics.median(times["on"]), "fresh_s": statistics.median(times["off"]),
            "fresh_vs_forked": statistics.median(f / k for k, f in zip(times["on"], times["off"])),
            "starts": setting["repeats"], "forked_all_s": times["on"], "fresh_all_s": times["off"]}


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


def _engine_options(setting: dict) -> dict:
    """The engine options a setting asks for: threads and dtype where given."""
    return {**({"num_threads": setting["threads"]} if setting["threads"] else {}),
            **dtype_option(setting)}


if __name__ == "__main__":
    print(json.dumps(measure(json.loads(sys.argv[1]))))
