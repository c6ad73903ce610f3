"""`xrec bench roofline`: xrec's FLOP/s against this machine's GEMM peak, per component.

For each workload (model size, W, L, requests):

1. the FLOPs a faithful search must do, per component (bench/flops.py: the formulas);
2. the GEMM peak of this machine, in a fresh process, with the same intra-op threads
   (bench/peak.py; bfloat16 too where the device has it), before and after the runs;
3. xrec's step time (median, not profiled) -> achieved FLOP/s and fraction of peak; each
   timed step is bracketed by products of the peak's GEMM shape (in fresh threads, as
   the step), and the fraction is also taken run by run against that reference:
   on a shared machine the GEMM rate drifts within minutes (docs/decisions.md, Roofline),
   so a ratio of two measurements taken minutes apart says more about the neighbours than
   about xrec;
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
from xrec.bench.lib.args import progress_bar
from xrec.bench.lib.common import (environment, environment_markdown, markdown_table,
                               output_paths, pyplot, write_outputs)
from xrec.bench.lib.flops import COMPONENTS, SearchShape, fan_out, search_flops
from xrec.bench.lib.models import make_workload, model_dir
from xrec.bench.lib.peak import Gemm, peaks_in_fresh_process
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
    ("step.py", "_candidates"): "LM head",
    ("beam.py", "select_top"): "top-k", ("step.py", "run"): "top-k", ("step.py", "_to_host"): "top-k",
}
# the targets: (size, W, L, requests, target fraction of the fp32 GEMM peak)
TARGETS = (("onerec-0.1b", 128, 256, 4, 0.80), ("onerec-0.1b", 512, 1024, 1, 0.75),
           ("qwen3-sid-small", 128, 256, 4, 0.70))
QUICK = (("tiny-mha", 8, 16, 2, None), ("qwen3-sid-test", 8, 16, 2, None))
# --sweep: onerec-0.1b as W, L and the batch grow one at a time (the fraction of peak must
# not collapse at W=512 or L=1024)
SWEEP = tuple(dict.fromkeys(
    [("onerec-0.1b", w, 256, 1, None) for w in (64, 128, 256, 512)]
    + [("onerec-0.1b", 128, n, 1, None) for n in (256, 512, 1024)]
    + [("onerec-0.1b", 128, 256, b, None) for b in (1, 2, 4, 8)]))


def workloads_of(args: argparse.Namespace) -> list[tuple[str, int, int, int, float | None]]:
    if args.quick:
        return list(QUICK)
    if args.sweep:
        return list(SWEEP)
    if args.workloads:
        return [(size, w, n, b, None) for size, w, n, b in args.workloads]
    return list(TARGETS)


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = args.threads or torch.get_num_threads()
    peak_repeats = 1 if args.quick else 9
    peaks = peaks_in_fresh_process(args.device, threads, peak_repeats)  # before any model loads
    env = environment(args.device)
    workloads = workloads_of(args)
    bar = progress_bar(args, len(workloads) * (args.warmup + args.repeats + 1), "roofline")
    results = []
    for size in dict.fromkeys(w[0] for w in workloads):   # one engine per model, in order
        engine = load_engine(size, threads, args)
        try:
            for _, width, length, num_requests, target in [w for w in workloads if w[0] == size]:
                results.append({"size": size, "target": target,
                                **measure_workload(engine, width, length, num_requests, peaks,
                                                   args, bar)})
        finally:
            engine.close()
        del engine
        gc.collect()   # the engine's weights go before the next model loads
    bar.close()
    after = peaks_in_fresh_process(args.device, threads, peak_repeats)
    peaks = {"before": peaks, "after": after}
    record = {"benchmark": "roofline", "environment": env, "peaks": peaks,
              "settings": {"items": args.items, "seed": args.seed, "warmup": args.warmup,
                           "repeats": args.repeats, "threads": threads},
              "workloads": results}
    paths = output_paths(args.out, "roofline")
    plot(results, paths["png"])
    write_outputs(paths, record, markdown)
    return 0


def load_engine(size: str, threads: int, args: argparse.Namespace):
    from xrec import Engine

    return Engine.from_pretrained(model_dir(size, args.seed, args.items), isolation="thread",
                                  device=args.device, dtype=args.dtype or "auto", num_threads=threads)


def measure_workload(engine, width: int, length: int, num_requests: int, peaks: dict,
                     args: argparse.Namespace, bar) -> dict:
    from xrec import RecRequest
    from xrec.api_types import validate
    from xrec.search.batch import prepare_batch
    from xrec.search.workspace_buffers import Workspace

    config = engine.model.config
    workload = make_workload(config.vocab_size, num_requests, length, width, args.seed)
    requests = [RecRequest(token_ids=row, beam_width=width) for row in workload.token_ids.tolist()]
    batch = prepare_batch([validate(r, engine.limits) for r in requests], config.d_model)
    dtype = str(engine.model.dtype).removeprefix("torch.")
    peak_dtype = dtype if peaks.get(dtype) else "float32"   # no native bf16: the fp32 peak
    peak = peaks[peak_dtype]
    reference = Gemm(tuple(peak["shape"]), args.device, peak_dtype)
    workspace = Workspace(engine.model.device)   # reused buffers, as a pipeline runs its steps
    timing = interleaved(lambda: engine.step.run(batch, workspace), reference, args, bar)
    profile = in_fresh_thread(lambda: profile_step(engine.step, batch, COMPONENT_OF, workspace))
    bar.update(1)
    shape = SearchShape(num_requests, length, width, fan_out(engine.step.tables),
                        prefix_len=config.decoder_start_len)
    flops = search_flops(config, shape)
    return {**workload.key, "dtype": dtype, **summarize(flops, timing, profile, peak["flops_per_s"])}


def interleaved(step, reference: Gemm, args: argparse.Namespace, bar) -> dict:
    """Warm-up steps, then the reference GEMM and `args.repeats` x (one step, then the
    reference GEMM), each in a fresh thread: step seconds, and per step the reference
    FLOP/s around it (the geometric mean of the products just before and just after:
    the rate drifts within seconds here, and a step is bracketed better than followed)."""
    def timed(fn) -> float:
        def run() -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return in_fresh_thread(run)

    def rate() -> float:
        # the best of three products: the first in a fresh thread also pays its thread team's
        # start, and the step's own team may still spin for a moment
        return reference.flops / in_fresh_thread(lambda: min(reference.seconds() for _ in range(3)))

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


def summarize(flops: dict[str, float], timing: dict, profile: dict, peak: float) -> dict:
    """The headlines (FLOPs / median step time / fresh-process peak, and the median run-by-run
    ratio to the interleaved reference) and one row per component (against the peak)."""
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
    return {"gflop": total / 1e9, "step_ms": step_s * 1e3, "gflop_per_s": total / step_s / 1e9,
            "peak_gflop_per_s": peak / 1e9, "fraction_of_peak": total / step_s / peak,
            "reference_gflop_per_s": statistics.median(timing["reference_flops_per_s"]) / 1e9,
            "fraction_of_reference": statistics.median(by_run),
            "runs": {"step_ms": [s * 1e3 for s in timing["step_s"]],
                     "reference_gflop_per_s": [r / 1e9 for r in timing["reference_flops_per_s"]]},
            "profiled_wall_ms": wall_ms, "host_fraction": profile["host_fraction"],
            "components": rows}


def markdown(record: dict) -> str:
    before, after = record["peaks"]["before"], record["peaks"]["after"]
    fp32 = before["float32"]
    bf16 = before.get("bfloat16")
    lines = [f"## xrec bench roofline (fp32 GEMM peak {fp32['flops_per_s'] / 1e9:.0f} GFLOP/s "
             f"before the runs, {after['float32']['flops_per_s'] / 1e9:.0f} after, at "
             f"{fp32['threads']} threads, shape {'x'.join(map(str, fp32['shape']))}"
             + (f"; bf16 {bf16['flops_per_s'] / 1e9:.0f}" if bf16 else "; no native bf16") + ")\n"]
    header = ["workload", "GFLOP", "step ms (median)", "GFLOP/s", "fraction of peak",
              "reference GEMM GFLOP/s (interleaved)", "fraction of the reference", "target"]
    rows = [[_name(w), w["gflop"], w["step_ms"], w["gflop_per_s"], f"{w['fraction_of_peak']:.2f}",
             w["reference_gflop_per_s"], f"**{w['fraction_of_reference']:.2f}**",
             None if w["target"] is None else f"≥ {w['target']:.2f}"] for w in record["workloads"]]
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
    lines.append("\nFLOPs: the work a faithful search must do (src/xrec/bench/flops.py). Fraction of "
                 "peak = FLOPs / median step time / the GEMM peak measured in a fresh process "
                 "before the runs. Fraction of the reference = the median over runs of FLOPs / "
                 "step time / the FLOP/s of the peak's GEMM timed around that step (the "
                 "target's measure: both sides at the same moment). Component times come from "
                 "one profiled step (the profiler adds a few µs per op); their fractions are "
                 "against the peak.")
    return "\n".join(lines) + "\n\n" + environment_markdown(record["environment"])


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
        ax.set_title(f"{_name(w)}\n{w['fraction_of_reference']:.2f} of the GEMM reference",
                     fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
