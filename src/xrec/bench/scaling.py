"""`xrec bench scaling`: time and peak memory of each contender as W, L and batch grow.

One variable at a time around a base point (W, L, one request), plus the memory target
point W=512, L=1024, one request (docs/quality.md: xrec's peak extra memory there must be
at most 1/10 of HF generate's). Peak memory is the RSS growth during one run (CPU) or
`max_memory_allocated` growth (CUDA).
"""

from __future__ import annotations

import argparse

from xrec.bench.lib.args import progress_bar, slow_repeats_of
from xrec.bench.lib.common import (environment, environment_markdown, markdown_table,
                               output_paths, pyplot, write_outputs)
from xrec.bench.lib.models import make_workload
from xrec.bench.lib.runner import load_for, num_runs, run_point
from xrec.utils.fresh_thread import in_fresh_thread

MEMORY_TARGET = (512, 1024, 1)     # W, L, B
AXES = ("beam_width", "input_len", "num_requests")


def points_of(args: argparse.Namespace) -> list[tuple[str, tuple[int, int, int]]]:
    if len(args.base) != 2:
        raise ValueError(f"--base: expected W,L, got {args.base}")
    width, length = args.base
    points = [("beam_width", (w, length, 1)) for w in args.beam_widths]
    points += [("input_len", (width, n, 1)) for n in args.lengths]
    points += [("num_requests", (width, length, b)) for b in args.batch_sizes]
    if not args.quick:
        points.append(("memory target", MEMORY_TARGET))
    return points


def run(args: argparse.Namespace) -> int:
    names = args.contenders or ["xrec", "xrec-full", "hf", "naive"]
    slow_repeats = slow_repeats_of(args)
    points = points_of(args)
    contenders = load_for(args, names)
    try:
        env = environment(args.device)
        # one untimed run of each contender first: one-time allocations stay out of the curves
        smallest = min((p for _, p in points), key=lambda p: p[0] * p[1] * p[2])
        first = make_workload(contenders.vocab_size, smallest[2], smallest[1], smallest[0], args.seed)
        for contender in contenders.by_name.values():
            in_fresh_thread(lambda: contender.run(first))
        bar = progress_bar(args, len(points) * num_runs(contenders, args.warmup, args.repeats,
                                                       slow_repeats), "scaling")
        results = []
        for axis, (width, length, num_requests) in points:
            workload = make_workload(contenders.vocab_size, num_requests, length, width, args.seed)
            rows = run_point(contenders, workload, args.warmup, args.repeats, slow_repeats,
                             args.device, bar)
            results.append({"axis": axis, **workload.key, "contenders": rows})
        bar.close()
    finally:
        contenders.close()
    record = {"benchmark": "scaling", "environment": env, "model": contenders.info,
              "settings": {"size": args.size, "items": args.items, "seed": args.seed,
                           "warmup": args.warmup, "repeats": args.repeats,
                           "slow_repeats": slow_repeats, "contenders": names, "base": args.base},
              "points": results}
    paths = output_paths(args.out, "scaling")
    write_outputs(paths, record, markdown, draw=lambda path: plot(results, path))
    return 0


def markdown(record: dict) -> str:
    header = ["varied", "W", "L", "B", "contender", "median ms", "× HF (time)", "peak MiB",
              "memory / HF's", "overlap vs HF"]
    rows = []
    for p in record["points"]:
        for name, r in p["contenders"].items():
            ov = r.get("overlap_vs_hf")
            rows.append([p["axis"], p["beam_width"], p["input_len"], p["num_requests"], name,
                         r["median_ms"], _x(r.get("speedup_vs_hf")), r["peak_mib"],
                         None if r.get("memory_vs_hf") is None else f"{r['memory_vs_hf']:.3f}",
                         None if not ov or ov["mean"] is None else f"{ov['mean']:.1%}"])
    s = record["settings"]
    return (f"## xrec bench scaling ({s['size']}, {s['items']} items, base W,L = {s['base']}; "
            f"medians of {s['repeats']} runs, {s['slow_repeats']} of hf/naive)\n\n"
            + markdown_table(header, rows)
            + "\n\nPeak MiB: RSS growth during one run of the batch (target: xrec ≤ 1/10 of "
            "HF's at W=512, L=1024, one request).\n\n" + environment_markdown(record["environment"]))


def _x(value: float | None) -> str | None:
    return None if value is None else f"{value:.1f}×"


def plot(points: list[dict], path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    labels = {"beam_width": "beam width W (L fixed, 1 request)",
              "input_len": "input length L (W fixed, 1 request)",
              "num_requests": "requests per batch (W, L fixed)"}
    for col, axis in enumerate(AXES):
        series = [p for p in points if p["axis"] == axis]
        names = list(dict.fromkeys(n for p in series for n in p["contenders"]))
        for name in names:
            xs = [p[axis] for p in series if name in p["contenders"]]
            rows = [p["contenders"][name] for p in series if name in p["contenders"]]
            axes[0][col].plot(xs, [r["median_ms"] for r in rows], marker="o", label=name)
            axes[1][col].plot(xs, [r["peak_mib"] or 0.0 for r in rows], marker="o", label=name)
        for row, ylabel in ((0, "median time per batch, ms"), (1, "peak extra memory, MiB")):
            ax = axes[row][col]
            ax.set_xscale("log", base=2)
            ax.set_yscale("log" if row == 0 else "linear")
            ax.set_xlabel(labels[axis])
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=8)
    fig.suptitle("xrec bench scaling")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
