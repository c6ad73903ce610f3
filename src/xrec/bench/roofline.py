"""`xrec bench roofline`: xrec's FLOP/s against this machine's GEMM peak, per component and dtype.

For each workload (model size, W, L, requests) and each dtype (`--dtypes`; default float32,
and bfloat16 where the device computes it natively):

1. the FLOPs a faithful search must do, per component (bench/lib/flops.py: the formulas);
2. the GEMM peak of that dtype on this machine, in a fresh process, with the same intra-op
   threads (bench/lib/peak.py: the best product over shapes 1024³ to 4096³), measured
   before and after the runs; the **higher** of the two is the denominator (a neighbour
   can only slow a product, never speed it up, so the higher is nearer the machine);
3. xrec's step time (median, not profiled) -> achieved FLOP/s and **fraction of peak**, the
   measure the targets are read against. The steps run on one thread, as a pipeline runs
   them, which ends with the workload. Each timed step is also bracketed by products of
   a reference shape on that thread, and the run-by-run ratio to that reference is
   reported beside it (docs/decisions.md, Roofline): it says how the step compares with a
   product at the same moment, never the targets' denominator;
4. one profiled step (bench/breakdown.py's attribution by Python stack) -> time per
   component next to its FLOPs: where the time goes that the FLOPs do not explain.

Components: encoder / prompt (projections and FFN), cross K/V, decoder (projections and
FFN of the prefix and of every round), attention (scores and values, every stage), LM
head (candidate logits and their normalisation), top-k (selection, the beam update and
the copy to the host: no FLOPs), host (the step's wall time that no torch op covers).
"""
from __future__ import annotations

import argparse
import gc
import math
import statistics
import time

from xrec.bench.breakdown import profile_step
from xrec.bench.lib.args import SERVING_OPTIONS, progress_bar
from xrec.bench.lib.common import (environment, environment_markdown, markdown_table,
                               output_paths, pyplot, write_outputs)
from xrec.bench.lib.flops import COMPONENTS, SearchShape, fan_out, search_flops
from xrec.bench.lib.models import make_workload, model_dir
from xrec.bench.lib.peak import Gemm, default_dtypes, peaks_in_fresh_process, reference_gemm
from xrec.utils.fresh_thread import in_fresh_thread

HOST = "host"
# (file, function) of the innermost xrec frame -> component
COMPONENT_OF = {
    ("onerec.py", "encode"): "encoder / prompt", ("onerec.py", "_encoder_input"): "encoder / prompt",
    ("qwen.py", "prefill"): "encoder / prompt",
    ("onerec.py", "prepare_cross"): "cross K/V",
    ("onerec.py", "decode_prefix"): "decoder", ("onerec.py", "_prefix"): "decoder",
    ("onerec.py", "decode_step"): "decoder", ("qwen.py", "decode_step"): "decoder",
    **{("attention.py", name): "attention"
       for name in ("attend", "attend_beams", "shared_stage", "unshared_stage", "merge_states")},
    ("family.py", "beam_attention"): "attention",
    ("step.py", "_candidates"): "LM head",
    ("beam.py", "select_top"): "top-k", ("step.py", "run"): "top-k", ("step.py", "_to_host"): "top-k",
}
# the workloads of issues 13 and 23: (size, W, L, requests)
TARGETS = (("onerec-0.1b", 128, 256, 4), ("onerec-0.1b", 512, 1024, 1),
           ("qwen3-sid-small", 128, 256, 4))
# (size, W, L, requests, dtype) -> the target fraction of that dtype's fresh-process peak
# (issue 23; the other two float32 rows keep issue 13's figures, now against the peak)
TARGET_FRACTIONS = {("onerec-0.1b", 128, 256, 4, "float32"): 0.80,
                    ("onerec-0.1b", 512, 1024, 1, "float32"): 0.75,
                    ("qwen3-sid-small", 128, 256, 4, "float32"): 0.70,
                    ("onerec-0.1b", 128, 256, 4, "bfloat16"): 0.50,
                    ("qwen3-sid-small", 128, 256, 4, "bfloat16"): 0.40}
QUICK = (("tiny-mha", 8, 16, 2), ("qwen3-sid-test", 8, 16, 2))
# --sweep: onerec-0.1b as W, L and the batch grow one at a time (the fraction of peak must
# not collapse at W=512 or L=1024)
SWEEP = tuple(dict.fromkeys(
    [("onerec-0.1b", w, 256, 1) for w in (64, 128, 256, 512)]
    + [("onerec-0.1b", 128, n, 1) for n in (256, 512, 1024)]
    + [("onerec-0.1b", 128, 256, b) for b in (1, 2, 4, 8)]))


def workloads_of(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    if args.quick:
        return list(QUICK)
    if args.sweep:
        return list(SWEEP)
    if args.workloads:
        return [tuple(w) for w in args.workloads]
    return list(TARGETS)


def dtypes_of(args: argparse.Namespace) -> list[str]:
    """--dtypes; else --dtype alone; else float32 and, where native, bfloat16."""
    if args.dtypes:
        return list(dict.fromkeys(args.dtypes))
    if args.dtype:
        return [args.dtype]
    return default_dtypes(args.device)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = args.threads or torch.get_num_threads()
    dtypes = dtypes_of(args)
    repeats = 3 if args.quick else 7
    before = peaks_in_fresh_process(args.device, threads, dtypes, repeats, args.quick)  # no model yet
    env = environment(args.device)
    workloads = workloads_of(args)
    bar = progress_bar(args, len(workloads) * len(dtypes) * (args.warmup + args.repeats + 1),
                       "roofline")
    measured = []
    for size in dict.fromkeys(w[0] for w in workloads):   # one engine per model and dtype
        for dtype in dtypes:
            engine = load_engine(size, threads, dtype, args)
            try:
                for _, width, length, num_requests in [w for w in workloads if w[0] == size]:
                    measured.append(measure_workload(engine, size, width, length, num_requests,
                                                     before[dtype], args, bar))
            finally:
                engine.close()
            del engine
            gc.collect()   # the engine's weights go before the next model loads
    bar.close()
    after = peaks_in_fresh_process(args.device, threads, dtypes, repeats, args.quick)
    results = [summarize(m, before[m["dtype"]], after[m["dtype"]]) for m in measured]
    add_speedups(results)
    record = {"benchmark": "roofline", "environment": env,
              "peaks": {"before": before, "after": after},
              "settings": {"items": args.items, "seed": args.seed, "warmup": args.warmup,
                           "repeats": args.repeats, "threads": threads, "dtypes": dtypes},
              "workloads": results}
    paths = output_paths(args.out, "roofline")
    write_outputs(paths, record, markdown, draw=lambda path: plot(results, path))
    return 0


def load_engine(size: str, threads: int, dtype: str, args: argparse.Namespace):
    from xrec import Engine

    return Engine.from_pretrained(model_dir(size, args.seed, args.items), isolation="thread",
                                  device=args.device, dtype=dtype, num_threads=threads,
                                  **SERVING_OPTIONS)


def measure_workload(engine, size: str, width: int, length: int, num_requests: int, peak: dict,
                     args: argparse.Namespace, bar) -> dict:
    """The step's FLOPs, its timed runs (each bracketed by the reference product of `peak`,
    the engine's dtype's peak before the runs) and one profiled step; no ratios yet."""
    from xrec import RecRequest
    from xrec.api_types import validate
    from xrec.model.gemm import cpu_fp32_gemm
    from xrec.search.batch import prepare_batch
    from xrec.search.workspace_buffers import Workspace

    config = engine.model.config
    workload = make_workload(config.vocab_size, num_requests, length, width, args.seed)
    requests = [RecRequest(token_ids=row, beam_width=width) for row in workload.token_ids.tolist()]
    batch = prepare_batch([validate(r, engine.limits) for r in requests], config.d_model)
    workspace = Workspace(engine.model.device)   # reused buffers, as a pipeline runs its steps

    def measure() -> tuple[Gemm, dict, dict]:
        # one thread for the reference, the timed steps and the profiled one, as a pipeline
        # runs its steps; it ends, so the bench keeps no OpenMP team (xrec.utils.fresh_thread)
        reference = reference_gemm(peak, args.device, engine.dtype)
        timing = interleaved(lambda: engine.step.run(batch, workspace), reference, args, bar)
        return reference, timing, profile_step(engine.step, batch, COMPONENT_OF, workspace)

    reference, timing, profile = in_fresh_thread(measure)
    bar.update(1)
    shape = SearchShape(num_requests, length, width, fan_out(engine.step.tables),
                        prefix_len=config.decoder_start_len)
    key = (size, width, length, num_requests, engine.dtype)
    return {"size": size, **workload.key, "dtype": engine.dtype,
            "target": TARGET_FRACTIONS.get(key), "reference_shape": list(reference.shape),
            "reference_library": reference.library,
            "cpu_gemm": cpu_fp32_gemm() if args.device == "cpu" else None,
            "flops": search_flops(config, shape), "timing": timing, "profile": profile}


def interleaved(step, reference: Gemm, args: argparse.Namespace, bar) -> dict:
    """Warm-up steps, then the reference GEMM and `args.repeats` x (one step, then the
    reference GEMM), all on the calling thread: step seconds, and per step the reference
    FLOP/s around it (the geometric mean of the products just before and just after:
    the rate drifts within seconds here, and a step is bracketed better than followed)."""
    def timed(fn) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    def rate() -> float:
        return reference.flops / min(reference.seconds() for _ in range(3))   # the best of three

    for _ in range(args.warmup):
        timed(step)
        bar.update(1)
    steps, rates = [], [rate()]
    for _ in range(args.repeats):
        steps.append(timed(step))
        rates.append(rate())
        bar.update(1)
    around = [math.sqrt(before * after) for before, after in zip(rates, rates[1:])]
    return {"step_s": steps, "reference_flops_per_s": around}


def summarize(measured: dict, before: dict, after: dict) -> dict:
    """One workload's row: FLOPs / median step time against its dtype's fresh-process peak,
    the higher of `before` and `after` (the targets' measure); the median run-by-run ratio
    to the interleaved reference beside it; one row per component (against the peak)."""
    flops, timing, profile = measured["flops"], measured["timing"], measured["profile"]
    peak = max(before["flops_per_s"], after["flops_per_s"])
    total = sum(flops.values())
    step_s = statistics.median(timing["step_s"])
    by_run = [total / s / r for s, r in zip(timing["step_s"], timing["reference_flops_per_s"])]
    wall_ms = profile["profiled_wall_ms"]
    times = {name: profile["parts_ms"].get(name, 0.0) for name in COMPONENTS}
    times["other ops"] = profile["parts_ms"].get("other ops", 0.0)
    times[HOST] = profile["host_ms"]
    rows = {}
    for name, ms in times.items():
        work = flops.get(name, 0.0)
        rate = work / (ms / 1e3) if ms > 0 and work else None
        rows[name] = {"gflop": work / 1e9, "ms": ms, "flop_share": work / total,
                      "time_share": ms / wall_ms, "gflop_per_s": None if rate is None else rate / 1e9,
                      "fraction_of_peak": None if rate is None else rate / peak}
    keep = {k: v for k, v in measured.items() if k not in ("flops", "timing", "profile")}
    by_library = {name: max(rate, after["by_library"][name])
                  for name, rate in before["by_library"].items()}
    return {**keep, "peak_by_library_gflop_per_s": {k: v / 1e9 for k, v in by_library.items()},
            "fraction_by_library": {k: total / step_s / v for k, v in by_library.items() if v},
            "gflop": total / 1e9, "step_ms": step_s * 1e3,
            "gflop_per_s": total / step_s / 1e9, "peak_gflop_per_s": peak / 1e9,
            "peak_before_gflop_per_s": before["flops_per_s"] / 1e9,
            "peak_after_gflop_per_s": after["flops_per_s"] / 1e9,
            "is_native": before["native"], "fraction_of_peak": total / step_s / peak,
            "reference_gflop_per_s": statistics.median(timing["reference_flops_per_s"]) / 1e9,
            "fraction_of_reference": statistics.median(by_run),
            "runs": {"step_ms": [s * 1e3 for s in timing["step_s"]],
                     "reference_gflop_per_s": [r / 1e9 for r in timing["reference_flops_per_s"]]},
            "profiled_wall_ms": wall_ms, "host_fraction": profile["host_fraction"],
            "components": rows}


def add_speedups(results: list[dict]) -> None:
    """`speedup_vs_float32`: the float32 row's median step time / this row's, for the rows of
    another dtype whose workload also ran in float32 (None otherwise)."""
    fp32 = {_key(w): w["step_ms"] for w in results if w["dtype"] == "float32"}
    for w in results:
        base = fp32.get(_key(w))
        w["speedup_vs_float32"] = None if base is None or w["dtype"] == "float32" \
            else base / w["step_ms"]


def _key(w: dict) -> tuple:
    return w["size"], w["beam_width"], w["input_len"], w["num_requests"]


def markdown(record: dict) -> str:
    before, after = record["peaks"]["before"], record["peaks"]["after"]
    threads = next(iter(before.values()))["threads"]
    peaks = "; ".join(
        f"{dtype}{'' if p['native'] else ' (emulated)'} {p['flops_per_s'] / 1e9:,.0f} before, "
        f"{after[dtype]['flops_per_s'] / 1e9:,.0f} after ({'x'.join(map(str, p['shape']))}"
        f", {p['library']}"
        f"{_libraries(p, after[dtype])})"
        for dtype, p in before.items())
    lines = [f"## xrec bench roofline (fresh-process GEMM peaks in GFLOP/s at {threads} "
             f"threads: {peaks})\n"]
    header = ["workload", "dtype", "GFLOP", "step ms (median)", "GFLOP/s", "× float32",
              "peak GFLOP/s", "**fraction of peak**", "target", "fraction of ATen's product's peak",
              "reference GFLOP/s (interleaved)", "fraction of the reference", "CPU float32 products"]
    rows = [[_name(w), w["dtype"], w["gflop"], w["step_ms"], w["gflop_per_s"],
             None if w["speedup_vs_float32"] is None else f"{w['speedup_vs_float32']:.2f}",
             w["peak_gflop_per_s"], f"**{w['fraction_of_peak']:.2f}**", _target(w),
             _fraction(w["fraction_by_library"].get("aten")),
             w["reference_gflop_per_s"], f"{w['fraction_of_reference']:.2f}", w.get("cpu_gemm")]
            for w in record["workloads"]]
    lines.append(markdown_table(header, rows))
    for w in record["workloads"]:
        header = ["component", "GFLOP", "FLOP share", "ms (profiled)", "time share", "GFLOP/s",
                  "fraction of peak"]
        rows = [[name, c["gflop"], f"{c['flop_share']:.1%}", c["ms"], f"{c['time_share']:.1%}",
                 c["gflop_per_s"], None if c["fraction_of_peak"] is None else f"{c['fraction_of_peak']:.2f}"]
                for name, c in w["components"].items() if c["ms"] or c["gflop"]]
        lines.append(f"\n### {_name(w)}, {w['dtype']}: per component (profiled step "
                     f"{w['profiled_wall_ms']:.0f} ms)\n")
        lines.append(markdown_table(header, rows))
    lines.append("\nFLOPs: the work a faithful search must do (src/xrec/bench/lib/flops.py). "
                 "Fraction of peak (the targets' measure) = FLOPs / median step time / the "
                 "peak GFLOP/s: the best product of the row's dtype over shapes 1024³ to 4096³ "
                 "in a fresh process, through ATen's product (`torch.mm`) or, on a CPU, "
                 "oneDNN's linear, whichever is faster, the higher of the measurements before "
                 "and after the runs; the fraction of ATen's product's peak reads the same "
                 "step against `torch.mm` alone (MKL on a CPU). × float32 = the float32 "
                 "row's step time / this row's. Fraction of the "
                 "reference = the median over runs of FLOPs / step time / the FLOP/s of a "
                 "reference product timed in fresh threads around that step (both sides at "
                 "one moment; a fresh thread's product reads low, so this reads high). "
                 "Component times come from one profiled step (the profiler adds a few µs "
                 "per op); their fractions are against the peak.")
    return "\n".join(lines) + "\n\n" + environment_markdown(record["environment"])


def _libraries(before: dict, after: dict) -> str:
    """'; aten 185, onednn 402': each library's best product, before and after together."""
    names = before["by_library"]
    if len(names) < 2:
        return ""
    return "; " + ", ".join(f"{name} {max(names[name], after['by_library'][name]) / 1e9:,.0f}"
                            for name in names)


def _fraction(value: float | None) -> str | None:
    return None if value is None else f"{value:.2f}"


def _target(w: dict) -> str | None:
    if w["target"] is None:
        return None
    return f"≥ {w['target']:.2f} ({'met' if w['fraction_of_peak'] >= w['target'] else 'not met'})"


def _name(w: dict) -> str:
    return f"{w['size']} W={w['beam_width']} L={w['input_len']} B={w['num_requests']}"


def plot(results: list[dict], path) -> None:
    plt = pyplot()
    cols = min(3, len(results))
    rows = -(-len(results) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
    for ax in axes.flat[len(results):]:
        ax.axis("off")
    for ax, w in zip(axes.flat, results):
        names = [n for n, c in w["components"].items() if c["ms"] or c["gflop"]]
        ys = range(len(names))
        ax.barh([y + 0.2 for y in ys], [w["components"][n]["time_share"] for n in names],
                height=0.4, label="time share")
        ax.barh([y - 0.2 for y in ys], [w["components"][n]["flop_share"] for n in names],
                height=0.4, label="FLOP share")
        ax.set_yticks(list(ys), names)
        ax.invert_yaxis()
        ax.set_xlabel("share of the step")
        ax.set_title(f"{_name(w)}, {w['dtype']}\n{w['fraction_of_peak']:.2f} of the "
                     f"{w['dtype']} GEMM peak", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
