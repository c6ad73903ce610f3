"""`xrec bench breakdown`: where one batch's step time goes, in each normalisation.

The real `RecStep.run` is profiled with torch.profiler twice:

* without Python stacks: the step's wall time (a `bench::step` range around the call)
  and the time of its top-level torch ops, a `torch.compile`d chain counting as one op
  (xrec.model.fusion); host overhead = wall - ops (the Python and dispatch time between
  ops);
* with Python stacks: each top-level op is attributed to a part of the step by the
  innermost xrec function on its stack (`encode`, `prepare_cross`, `decode_prefix`, or a
  decoder-only model's `prefill`; `decode_step` per round, `_candidates` per round, `select_top`; what `run` does itself
  is the beam update). The two runs issue the same ops in the same order, so the parts
  take the op times of the first (cheaper to profile) run.

No hooks in xrec's code are needed. The engine around the step (validation, scheduling,
item conversion, responses) is measured apart: `Engine.recommend` minus the step.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time

from xrec.bench.lib.args import SERVING_OPTIONS, dtype_option, model_dir_of, progress_bar
from xrec.bench.lib.common import (environment, environment_markdown, markdown_table,
                               output_paths, pyplot, write_outputs)
from xrec.bench.lib.models import make_workload
from xrec.utils.fresh_thread import in_fresh_thread

# (file, function) of the innermost xrec frame -> part; "{r}" takes the call's round
PARTS = {
    ("beam.py", "select_top"): "top-k select",
    ("step.py", "_candidates"): "LM head + normalise, round {r}",
    ("onerec.py", "decode_step"): "decoder, round {r}",
    ("qwen.py", "decode_step"): "decoder, round {r}",
    ("onerec.py", "decode_prefix"): "decoder prefix (round 0)",
    ("onerec.py", "_prefix"): "decoder prefix (round 0)",
    ("onerec.py", "prepare_cross"): "cross K/V",
    ("onerec.py", "encode"): "encoder",
    ("onerec.py", "_encoder_input"): "encoder",
    ("qwen.py", "prefill"): "prompt (round 0)",
    ("step.py", "_to_host"): "copy to host",
    ("step.py", "run"): "beam update",
}
ROUND_BASE = {"decode_step": 1, "_candidates": 0}
_FRAME = re.compile(r"xrec/(?:[\w/]+/)?(\w+\.py)\(\d+\): (\w+)$")
MODES = ("allowed", "full")
COMPILED_REGION = "Torch-Compiled Region"
FUSED_LABEL = "fused chains (torch.compile)"


def run(args: argparse.Namespace) -> int:
    import torch

    from xrec import Engine, RecRequest
    from xrec.api_types import validate
    from xrec.search.batch import prepare_batch
    from xrec.search.workspace_buffers import Workspace

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = Engine.from_pretrained(model_dir_of(args), isolation="thread", device=args.device,
                                    num_threads=args.threads, **dtype_option(args),
                                    **SERVING_OPTIONS)
    try:
        env = environment(args.device)
        config = engine.model.config
        workload = make_workload(config.vocab_size, args.num_requests, args.length,
                                 args.beam_width, args.seed)
        bar = progress_bar(args, len(MODES) * 2 * (args.warmup + args.repeats) + 2 * len(MODES),
                           "breakdown")
        modes, dtype = {}, engine.dtype
        workspace = Workspace(engine.model.device)   # reused buffers, as a pipeline runs its steps
        for mode in MODES:
            requests = [RecRequest(token_ids=row, beam_width=workload.beam_width, normalize=mode)
                        for row in workload.token_ids.tolist()]
            batch = prepare_batch([validate(r, engine.limits) for r in requests], config.d_model)

            def on_one_thread() -> tuple[float, dict]:
                # the timed steps and the profiled one on one thread, as a pipeline runs
                # them; it ends, so the bench keeps no OpenMP team (xrec.utils.fresh_thread)
                return (_timed(lambda: engine.step.run(batch, workspace), args, bar),
                        profile_step(engine.step, batch, workspace=workspace))

            step_s, profile = in_fresh_thread(on_one_thread)
            api_s = _timed(lambda: engine.recommend(requests), args, bar)
            modes[mode] = {"step_ms": step_s * 1e3, "recommend_ms": api_s * 1e3, **profile}
            bar.update(2)
        bar.close()
    finally:
        engine.close()
    record = {"benchmark": "breakdown", "environment": env,
              "settings": {"size": args.size, "items": args.items, "seed": args.seed,
                           "warmup": args.warmup, "repeats": args.repeats, "dtype": dtype,
                           **workload.key},
              "modes": modes}
    paths = output_paths(args.out, "breakdown")
    write_outputs(paths, record, markdown, draw=lambda path: plot(modes, path))
    return 0


def _timed(fn, args: argparse.Namespace, bar) -> float:
    for _ in range(args.warmup):
        fn()
        bar.update(1)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
        bar.update(1)
    return statistics.median(times)


def profile_step(step, batch, parts: dict[tuple[str, str], str] = PARTS, workspace=None) -> dict:
    """Wall time, op time, host overhead and op time per part of one `step.run(batch,
    workspace)`; `parts`: (file, function) of the innermost xrec frame that names an op's
    part."""
    wall_us, ops = _profiled_ops(step, batch, workspace, with_stack=False)
    _, ops_stacked = _profiled_ops(step, batch, workspace, with_stack=True)
    parts_of = _parts(ops_stacked, parts)
    is_matched = [e.name for e in ops] == [e.name for e in ops_stacked]
    timed = ops if is_matched else ops_stacked
    parts: dict[str, float] = {}
    top_ops: dict[str, dict[str, float]] = {}
    for event, part in zip(timed, parts_of):
        elapsed = event.time_range.elapsed_us() / 1e3
        parts[part] = parts.get(part, 0.0) + elapsed
        by_op = top_ops.setdefault(part, {})
        name = FUSED_LABEL if event.name.startswith(COMPILED_REGION) else event.name
        by_op[name] = by_op.get(name, 0.0) + elapsed
    op_us = sum(e.time_range.elapsed_us() for e in ops)
    return {"profiled_wall_ms": wall_us / 1e3, "op_ms": op_us / 1e3,
            "host_ms": (wall_us - op_us) / 1e3, "host_fraction": 1.0 - op_us / wall_us,
            "num_ops": len(ops), "parts_ms": parts,
            "top_ops_ms": {part: dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:4])
                           for part, by_op in top_ops.items()},
            "part_times_from": "plain run" if is_matched else "stack run"}


def _profiled_ops(step, batch, workspace, with_stack: bool):
    """(wall µs of the step, its top-level torch ops in order) from one profiled run."""
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], with_stack=with_stack) as prof:
        with record_function("bench::step"):
            step.run(batch, workspace)
    events = list(prof.events())
    marker = next(e for e in events if e.name == "bench::step")
    start, end = marker.time_range.start, marker.time_range.end
    ops = [e for e in events if _is_op(e) and e.thread == marker.thread
           and start <= e.time_range.start <= end and not _has_op_parent(e)]
    ops.sort(key=lambda e: e.time_range.start)
    return end - start, ops


def _is_op(event) -> bool:
    """A torch op, or a `torch.compile`d function (fused kernels: xrec.model.fusion), whose
    kernels the profiler does not list one by one."""
    name = event.name
    return ("::" in name and not name.startswith("bench::")) or name.startswith(COMPILED_REGION)


def _has_op_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if _is_op(parent):
            return True
        parent = parent.cpu_parent
    return False


def _parts(ops, parts: dict[tuple[str, str], str]) -> list[str]:
    """The part of each op: its innermost xrec frame in `parts` (rounds numbered by call order)."""
    calls: dict[str, list[float]] = {name: [] for name in ROUND_BASE}
    found = []
    for event in ops:
        parent, part = event.cpu_parent, "other ops"
        while parent is not None:
            match = _FRAME.search(parent.name)
            if match and (match.group(1), match.group(2)) in parts:
                part = parts[match.group(1), match.group(2)]
                func = match.group(2)
                if func in calls:
                    if parent.time_range.start not in calls[func]:
                        calls[func].append(parent.time_range.start)
                    part = part.format(r=ROUND_BASE[func] + calls[func].index(parent.time_range.start))
                break
            parent = parent.cpu_parent
        found.append(part)
    return found


def _ordered_parts(modes: dict) -> list[str]:
    order = ["encoder", "cross K/V", "decoder prefix (round 0)", "prompt (round 0)"]
    names = {p for m in modes.values() for p in m["parts_ms"]}
    order += sorted(n for n in names if n.startswith("decoder, round"))
    order += sorted(n for n in names if n.startswith("LM head"))
    order += ["top-k select", "beam update", "copy to host", "other ops"]
    return [p for p in order if p in names]


def markdown(record: dict) -> str:
    modes = record["modes"]
    header = ["part"] + [f"{m} ms" for m in modes] + [f"{m} %" for m in modes]
    rows = []
    for part in _ordered_parts(modes):
        values = [m["parts_ms"].get(part, 0.0) for m in modes.values()]
        shares = [f"{v / m['profiled_wall_ms']:.1%}" for v, m in zip(values, modes.values())]
        rows.append([part, *values, *shares])
    rows.append(["**host overhead** (wall - ops; target ≤ 10%)",
                 *[m["host_ms"] for m in modes.values()],
                 *[f"**{m['host_fraction']:.1%}**" for m in modes.values()]])
    rows.append(["step, profiled", *[m["profiled_wall_ms"] for m in modes.values()],
                 *["100%" for _ in modes]])
    rows.append(["step, not profiled (median)", *[m["step_ms"] for m in modes.values()],
                 *[None for _ in modes]])
    rows.append(["Engine.recommend of the batch (median)", *[m["recommend_ms"] for m in modes.values()],
                 *[f"{m['recommend_ms'] / m['step_ms'] - 1:+.0%} vs the step" for m in modes.values()]])
    s = record["settings"]
    return (f"## xrec bench breakdown ({s['size']}, {s['items']} items, W={s['beam_width']}, "
            f"L={s['input_len']}, {s['num_requests']} requests, {s.get('dtype', 'float32')})\n\n"
            + markdown_table(header, rows)
            + "\n\nPart times are torch-op times attributed by Python stack; % of the profiled "
            "step. The profiler itself adds a few µs per op to the host overhead.\n\n"
            + environment_markdown(record["environment"]))


def plot(modes: dict, path) -> None:
    plt = pyplot()
    parts = _ordered_parts(modes) + ["host overhead"]
    fig, ax = plt.subplots(figsize=(12, 2.6 + 0.4 * len(modes)))
    left = [0.0] * len(modes)
    colors = plt.get_cmap("tab20").colors
    for index, part in enumerate(parts):
        values = [m["host_ms"] if part == "host overhead" else m["parts_ms"].get(part, 0.0)
                  for m in modes.values()]
        ax.barh(list(modes), values, left=left, label=part, color=colors[index % len(colors)])
        left = [a + b for a, b in zip(left, values)]
    ax.set_xlabel("ms (profiled step)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("xrec bench breakdown")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
