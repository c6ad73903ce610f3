"""`xrec bench contention`: throughput with one core taken by a busy neighbour, per thread policy.

Workloads, each measured in a fresh process that uses every core of this machine (its
`--threads`, default all):

    serve   `Engine.recommend` on batches of `--num-requests` random requests (W, L)
    batch   `xrec batch` in process on a file of `--rows` random requests (rows/s answered:
            error records are no answers, as in `xrec bench batch`; none answered is an error)
    train   `xrec train`'s decoder-only step (its default model, batch 32, windows of 50 items)

Policies: `fixed` keeps the thread count whatever the load (what xrec did before; the
`adaptive_threads=false` engine option), `adaptive` follows the cores other processes leave
free (engine/threads.py `FollowFreeCores`, the default). Neighbours: `idle`, or `busy`: a
process spinning on the last CPU of this process's affinity for the whole measurement.

Rows run `--rounds` times in turn, so that a slow phase of a shared machine falls on every
row alike. Reported per workload and policy: the median over rounds of each throughput,
busy/idle of that policy, and busy against the idle throughput of `fixed` (the yardstick of
issue 23: with one of 2 cores busy, at least 0.4x of the idle throughput).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from xrec.bench.lib.args import dtype_option, model_dir_of
from xrec.bench.lib.common import environment, environment_markdown, markdown_table, \
    output_paths, write_outputs

WORKLOADS = ("serve", "batch", "train")
POLICIES = ("fixed", "adaptive")
NEIGHBOURS = ("idle", "busy")
TARGET = 0.4
# the busy neighbour: spins on CPU argv[1]; the kernel kills it when its parent, the bench
# (pid argv[2]), ends however it ends (PR_SET_PDEATHSIG: SIGTERM, SIGKILL, a crash)
SPIN = ("import ctypes, os, signal, sys\n"
        "ctypes.CDLL(None).prctl(1, signal.SIGKILL)\n"
        "if os.getppid() != int(sys.argv[2]):\n    sys.exit()\n"
        "os.sched_setaffinity(0, {int(sys.argv[1])})\n"
        "while True:\n    pass\n")


def run(args: argparse.Namespace) -> int:
    if len(os.sched_getaffinity(0)) < 2:
        raise ValueError("xrec bench contention needs 2 or more CPUs (one is taken by the neighbour)")
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        raise ValueError(f"--workloads: unknown {unknown}, allowed: {', '.join(WORKLOADS)}")
    base = {"model_dir": str(model_dir_of(args)), "beam_width": args.beam_width,
            "length": args.length, "num_requests": args.num_requests, "rows": args.rows,
            "seconds": args.seconds, "threads": args.threads or len(os.sched_getaffinity(0)),
            "seed": args.seed, **dtype_option(args)}
    env = environment("cpu")   # the load average and date at the start
    cases = [(w, p, n) for w in args.workloads for p in POLICIES for n in NEIGHBOURS]
    results: dict[tuple, list[float]] = {case: [] for case in cases}
    for index in range(args.rounds):
        for workload, policy, neighbour in cases:
            print(f"xrec bench contention: round {index + 1}/{args.rounds}, {workload}, "
                  f"{policy}, {neighbour}", file=sys.stderr)
            setting = {**base, "workload": workload, "policy": policy}
            results[(workload, policy, neighbour)].append(
                _measure_in_fresh_process(setting, busy=neighbour == "busy"))
    rows = []
    for workload in args.workloads:
        fixed_idle = statistics.median(results[(workload, "fixed", "idle")])
        for policy in POLICIES:
            idle = statistics.median(results[(workload, policy, "idle")])
            busy = statistics.median(results[(workload, policy, "busy")])
            rows.append({"workload": workload, "policy": policy, "idle": idle, "busy": busy,
                         "idle_rounds": results[(workload, policy, "idle")],
                         "busy_rounds": results[(workload, policy, "busy")],
                         "busy_vs_idle": busy / idle, "busy_vs_fixed_idle": busy / fixed_idle,
                         "met": busy / fixed_idle >= TARGET})
    record = {"benchmark": "contention", "environment": env,
              "settings": {"size": args.size, **{k: v for k, v in base.items() if k != "model_dir"},
                           "rounds": args.rounds, "target": TARGET},
              "rows": rows}
    write_outputs(output_paths(args.out, "contention"), record, markdown)
    return 0


def _measure_in_fresh_process(setting: dict, busy: bool) -> float:
    neighbour = None
    try:
        if busy:   # killed below whatever ends the measurement, Ctrl-C while it settles included
            cpu = max(os.sched_getaffinity(0))
            neighbour = subprocess.Popen([sys.executable, "-c", SPIN, str(cpu), str(os.getpid())])
            time.sleep(0.5)
        done = subprocess.run([sys.executable, "-m", "xrec.bench.contention", json.dumps(setting)],
                              capture_output=True, text=True, check=False)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    if done.returncode != 0:
        raise RuntimeError(f"the measuring process failed ({done.returncode}):\n{done.stderr[-3000:]}")
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    if "error" in measured:   # settings the workload refuses: an argument error, not a rate
        raise ValueError(f"{setting['workload']} workload: {measured['error']}")
    return float(measured["per_s"])


UNITS = {"serve": "requests/s", "batch": "rows/s", "train": "steps/s"}


def markdown(record: dict) -> str:
    s = record["settings"]
    header = ["workload", "policy", "idle", "busy neighbour", "busy / idle",
              f"busy / fixed idle (target ≥ {s['target']})"]
    rows = [[r["workload"], r["policy"], f"{r['idle']:.2f} {UNITS[r['workload']]}",
             f"{r['busy']:.2f}", f"{r['busy_vs_idle']:.2f}",
             f"{r['busy_vs_fixed_idle']:.2f} ({'met' if r['met'] else 'missed'})"]
            for r in record["rows"]]
    title = (f"## xrec bench contention ({s['size']}, W={s['beam_width']}, L={s['length']}, "
             f"{s['threads']} threads; {s['rounds']} rounds, medians)\n\n")
    return title + markdown_table(header, rows) + "\n\n" + environment_markdown(record["environment"])


# ---- the measuring process ----------------------------------------------------------------

def measure(setting: dict) -> dict:
    adaptive = setting["policy"] == "adaptive"
    workload = setting["workload"]
    if workload == "train":
        return {"per_s": _train_rate(setting, adaptive)}
    if workload == "batch":
        return {"per_s": _batch_rate(setting, adaptive)}
    return {"per_s": _serve_rate(setting, adaptive)}


def _serve_rate(setting: dict, adaptive: bool) -> float:
    from xrec import Engine, RecRequest
    from xrec.bench.lib.models import make_workload

    with Engine.from_pretrained(setting["model_dir"], isolation="thread",
                                num_threads=setting["threads"], adaptive_threads=adaptive,
                                **dtype_option(setting)) as engine:
        workload = make_workload(engine.limits.vocab_size, setting["num_requests"],
                                 setting["length"], setting["beam_width"], setting["seed"])
        requests = [RecRequest(token_ids=ids.tolist(), beam_width=workload.beam_width)
                    for ids in workload.token_ids]
        engine.recommend(requests)
        return len(requests) * _runs_per_s(lambda: engine.recommend(requests), setting["seconds"])


def _batch_rate(setting: dict, adaptive: bool) -> float:
    from xrec.bench.batch import answered_per_s, write_input
    from xrec.config import ModelConfig
    from xrec.errors import InvalidArgument
    from xrec.scale.batch import BatchJob, run_batch
    from xrec.scale.rows import RowSettings

    vocab = ModelConfig.from_file(Path(setting["model_dir"]) / "config.json").vocab_size
    with tempfile.TemporaryDirectory(prefix="xrec-contention-") as tmp:
        source = write_input(Path(tmp) / "in.jsonl", setting["rows"], vocab,
                             (setting["length"], setting["length"]), setting["seed"], "jsonl")
        job = BatchJob(str(source), str(Path(tmp) / "out"), setting["model_dir"],
                       settings=RowSettings(beam_width=setting["beam_width"]), progress=False,
                       engine_options={"num_threads": setting["threads"],
                                       "adaptive_threads": adaptive, **dtype_option(setting)})
        summary = run_batch(job)
        if summary.num_errors == summary.num_rows:   # no answer: no rate to compare
            raise InvalidArgument(f"xrec batch answered none of its {summary.num_rows} rows "
                                  f"(the first error record: {_first_error(job.output)})")
        return answered_per_s(summary)


def _first_error(output: str) -> str:
    from xrec.scale.rows import read_output

    return next(r["error"] for r in read_output(output) if r["error"] is not None)


def _train_rate(setting: dict, adaptive: bool) -> float:
    import numpy as np
    import torch

    from xrec.engine.threads import training_threads
    from xrec.realdata.train.models import TrainableModel, model_config
    from xrec.realdata.train.options import TrainOptions
    from xrec.realdata.train.precision import compile_settings, resolve_train_dtype

    o = TrainOptions()
    vocab = 3 * 256 + 8        # three 256-code levels and a few special tokens
    model = TrainableModel.create(model_config(o.family, vocab, o.hidden, o.layers, o.heads,
                                               3 * o.max_items + 8, 1), o.seed,
                                  lookahead=o.lookahead,
                                  dtype=resolve_train_dtype(o.dtype, o.family))
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr)
    rng = np.random.default_rng(setting["seed"])
    batch = [rng.integers(2, vocab, 3 * o.max_items + 1) for _ in range(o.batch_size)]
    with training_threads(setting["threads"], adaptive) as cores, compile_settings():
        def step():
            cores.follow()
            loss, _ = model.loss(batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        step()
        return _runs_per_s(step, setting["seconds"])


def _runs_per_s(work, seconds: float) -> float:
    """Runs of `work` per second: the median of each run's time, over `seconds` (at least 3)."""
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < 3 or time.perf_counter() - started < seconds:
        begun = time.perf_counter()
        work()
        times.append(time.perf_counter() - begun)
    return 1.0 / statistics.median(times)


if __name__ == "__main__":
    from xrec.errors import InvalidArgument

    try:
        print(json.dumps(measure(json.loads(sys.argv[1]))))
    except InvalidArgument as e:   # e.g. requests longer than the model takes: the bench names it
        print(json.dumps({"error": str(e)}))
