"""`xrec bench offline`: requests/s and per-request latency of a batch, xrec vs HF generate.

For each grid point (W, L, B) the contenders run side by side, interleaved, on the same
batch of random token-id requests; the table gives the speed-up over HF generate and
the top-N overlap of each contender's triples with HF's ("full" must be 1.0).
"""

from __future__ import annotations

import argparse
import statistics

from xrec.bench.lib.args import progress_bar, slow_repeats_of
from xrec.bench.lib.common import (environment, environment_markdown, markdown_table,
                               output_paths, pyplot, write_outputs)
from xrec.bench.lib.models import make_workload
from xrec.bench.lib.runner import load_for, num_runs, run_point

# per family, (W, L, B) -> the speed-up over HF each xrec mode must reach:
# onerec: docs/quality.md, "Targets"; qwen3: issue 9 (qwen3-sid-tiny, 100k items)
CASES = {
    "onerec": {"target1": ((128, 256, 16), {"xrec": 50.0, "xrec-full": 12.0}),
               "target2": ((512, 1024, 4), {"xrec": 100.0, "xrec-full": 50.0})},
    "qwen3": {"target1": ((128, 256, 4), {"xrec": 200.0, "xrec-full": 50.0})},
}
# issue 25: each request excludes 1,000 random items and 2 whole level-1 subtrees, against
# the same batch unfiltered in the same run: at most this much slower (paired runs)
FILTER_CASE = (128, 256, 16)
MAX_FILTER_SLOWDOWN = 1.10


def points_of(args: argparse.Namespace) -> list[tuple[tuple[int, int, int], dict]]:
    if args.case == "filter":
        return [(FILTER_CASE, {})]
    if args.case:
        cases = CASES[args.family]
        names = list(cases) if args.case == "targets" else [args.case]
        unknown = [n for n in names if n not in cases]
        if unknown:
            raise ValueError(f"--case {unknown[0]}: family {args.family} has {', '.join(cases)}")
        return [cases[n] for n in names]
    return [((w, length, args.num_requests), {}) for length in args.lengths for w in args.beam_widths]


def run(args: argparse.Namespace) -> int:
    if args.case == "gr-inference":   # its own engines, points and table (gr_inference.py)
        from xrec.bench.gr_inference import run as run_gr_inference
        return run_gr_inference(args)
    generic = ["xrec", "xrec-full", "hf"] + (["naive"] if args.family == "onerec" else [])
    names = args.contenders or (["xrec", "xrec-filter"] if args.case == "filter" else
                                ["xrec", "xrec-full", "hf"] if args.case else generic)
    slow_repeats = slow_repeats_of(args)
    points = points_of(args)
    contenders = load_for(args, names)
    try:
        env = environment(args.device)
        bar = progress_bar(args, len(points) * num_runs(contenders, args.warmup, args.repeats,
                                                       slow_repeats), "offline")
        results = []
        for (width, length, num_requests), targets in points:
            workload = make_workload(contenders.vocab_size, num_requests, length, width, args.seed)
            rows = run_point(contenders, workload, args.warmup, args.repeats, slow_repeats,
                             args.device, bar)
            _add_paired_ratios(rows)
            results.append({**workload.key, "targets": targets, "contenders": rows})
        bar.close()
    finally:
        contenders.close()
    record = {"benchmark": "offline", "environment": env, "model": contenders.info,
              "settings": {"size": args.size, "items": args.items, "seed": args.seed,
                           "warmup": args.warmup, "repeats": args.repeats,
                           "slow_repeats": slow_repeats, "contenders": names},
              "points": results}
    paths = output_paths(args.out, "offline" + (f"-{args.case}" if args.case else ""))
    write_outputs(paths, record, markdown, draw=lambda path: plot(results, path))
    return 0


def _add_paired_ratios(rows: dict[str, dict]) -> None:
    """Medians of the ratios of runs side by side (interleaved: run i of each ran back to
    back): xrec-filter's batch time over xrec's, and xrec-fp32's over xrec's (what the
    engine's dtype buys)."""
    for other, key, row in (("xrec-filter", "vs_unfiltered", "xrec-filter"),
                            ("xrec-fp32", "speedup_vs_float32", "xrec")):
        if other in rows and "xrec" in rows:
            pairs = zip(rows[other]["wall_ms"], rows["xrec"]["wall_ms"])
            rows[row][key] = statistics.median(o / x for o, x in pairs)


def markdown(record: dict) -> str:
    header = ["W", "L", "B", "contender", "req/s", "batch ms", "p50 ms", "p95 ms", "p99 ms",
              "× HF", "target", "overlap vs HF", "peak MiB"]
    rows = []
    for point in record["points"]:
        for name, r in point["contenders"].items():
            target = point["targets"].get(name)
            speedup = r.get("speedup_vs_hf")
            verdict = None if target is None or speedup is None else \
                f"≥ {target:g}× {'met' if speedup >= target else 'MISSED'}"
            if r.get("speedup_vs_float32") is not None:
                verdict = "; ".join(filter(None, [verdict, f"{r['speedup_vs_float32']:.2f}× "
                                                  f"xrec-fp32 (paired)"]))
            slowdown = r.get("vs_unfiltered")
            if slowdown is not None:
                verdict = (f"{slowdown:.3f}× unfiltered (≤ {MAX_FILTER_SLOWDOWN:g}× "
                           f"{'met' if slowdown <= MAX_FILTER_SLOWDOWN else 'MISSED'})")
            ov = r.get("overlap_vs_hf")
            overlap_text = None if not ov or ov["mean"] is None else \
                f"{ov['mean']:.1%} (min {ov['min']:.1%})"
            rows.append([point["beam_width"], point["input_len"], point["num_requests"], name,
                         r["requests_per_s"], r["median_ms"], r["p50_ms"], r["p95_ms"],
                         r["p99_ms"], None if speedup is None else f"{speedup:.1f}×", verdict,
                         overlap_text, r["peak_mib"]])
    s = record["settings"]
    return (f"## xrec bench offline ({s['size']}, {s['items']} items, {s['warmup']} warm-up, "
            f"{s['repeats']} runs, {s['slow_repeats']} of hf/naive; medians)\n\n"
            + markdown_table(header, rows)
            + "\n\n× HF: HF's median batch time / the contender's. Overlap: |top-N ∩ HF top-N| / N "
            "per request. Peak MiB: RSS growth during one run.\n\n"
            + environment_markdown(record["environment"]))


def plot(points: list[dict], path) -> None:
    plt = pyplot()
    names = list(dict.fromkeys(n for p in points for n in p["contenders"]))
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(points) * len(names) / 2), 4))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        xs = [i + j * width for i, p in enumerate(points) if name in p["contenders"]]
        ys = [p["contenders"][name]["requests_per_s"] for p in points if name in p["contenders"]]
        ax.bar(xs, ys, width, label=name)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(points))])
    ax.set_xticklabels([f"W={p['beam_width']}\nL={p['input_len']}\nB={p['num_requests']}"
                        for p in points], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("requests / s (log)")
    ax.set_title("xrec bench offline")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
