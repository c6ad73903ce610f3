"""`xrec bench offline --case gr-inference`: NVIDIA sid-gr-inference's protocol (issue 24).

qwen3-sid-1.7b (Qwen3-1.7B's shapes in OpenOneRec's vocabulary) in bfloat16, beam 256, 3
tokens, prompts of exactly 1,000 and 5,000 random token ids, batches of 1 and 8; the model
and its catalog are built in memory on the device (`Engine.from_random`: nothing written).
Prefix cache off: xrec has none, every batch computes its prompts' K/V anew. Per (context,
batch), the contenders run interleaved after their warm-up (`runner.run_point`):

* `xrec-graphs`: the engine with its decode rounds captured as CUDA graphs (option
  `cuda_graphs`, on by default on CUDA); a slot that says why it did not run on a CPU;
* `xrec-eager`: the same with `cuda_graphs=False`, every round launched from Python;
  `Engine.submit_many` of the batch with `normalize="full"` (the log-softmax
  over the whole vocabulary, as HF `generate` and NVIDIA's search normalise);
* `hf`: `generate` with the same catalog trie (`prefix_allowed_tokens_fn`) on the same
  weights in the same dtype, at the first context and the smallest batch only (it repeats
  the prompt per beam).

Correctness next to speed: each batch once more through an xrec engine in float32 over the
same weights (the measured dtype's, upcast): the share of requests whose top-1 triple is
that engine's. The online row: the eager engine behind `xrec serve`'s app in this process,
`--online-concurrency` requests in flight (`lib/online.py`).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from typing import Any

from xrec.bench.lib import online
from xrec.bench.lib.args import progress_bar, slow_repeats_of
from xrec.bench.lib.common import (environment, environment_markdown, markdown_table,
                                   output_paths, pyplot, write_outputs)
from xrec.bench.lib.contenders import HFContender, XrecContender, build_trie
from xrec.bench.lib.models import BENCH_SIZES, make_workload
from xrec.bench.lib.runner import Contenders, hf_causal_from, num_runs, run_point
from xrec.utils.fresh_thread import in_fresh_thread

SIZE, DTYPE, BEAM_WIDTH, CONTEXTS, BATCHES = "qwen3-sid-1.7b", "bfloat16", 256, (1000, 5000), (1, 8)
# issue 24, on a GPU: (context, batch) -> the median batch time to stay under, ms
TARGET_MS = {(1000, 1): 17.6, (1000, 8): 93.2, (5000, 1): 42.3, (5000, 8): 307.9}
MIN_TOP1_VS_FP32 = 0.95
MIN_VS_HF, VS_HF_BATCH = 20.0, 8     # batch 8's ms per request, HF generate's at batch 1 over it
CONTENDERS, GRAPHS = ("xrec-eager", "hf"), "xrec-graphs"
NORMALIZE = "full"
PREFIX_CACHE = "none: xrec has no prefix cache (every batch computes its prompts' K/V)"


@dataclass(frozen=True)
class Protocol:
    """What a run measures: the protocol's values, or the flags' scaled-down ones."""

    size: str
    dtype: str
    beam_width: int
    contexts: tuple[int, ...]
    batches: tuple[int, ...]
    contenders: tuple[str, ...]
    online_concurrency: int
    online_requests: int

    @property
    def hf_point(self) -> tuple[int, int]:
        return self.contexts[0], min(self.batches)

    @property
    def has_targets(self) -> bool:
        """Issue 24's targets are for its workload only (the device is in the record)."""
        return (self.size, self.dtype, self.beam_width) == (SIZE, DTYPE, BEAM_WIDTH)


def protocol_of(args: argparse.Namespace) -> Protocol:
    if args.family != "qwen3":
        raise ValueError("--case gr-inference: a decoder-only protocol; add --family qwen3")
    if args.model:
        raise ValueError("--case gr-inference builds its model in memory (--size); --model is "
                         "not supported")
    names = tuple(args.contenders or CONTENDERS)
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or "xrec-eager" not in names:
        raise ValueError(f"--contenders for --case gr-inference: got {','.join(names)}, allowed: "
                         f"xrec-eager (always) and hf")
    if args.online_concurrency < 0 or args.online_requests < 1:
        raise ValueError(f"--online-concurrency {args.online_concurrency} / --online-requests "
                         f"{args.online_requests}: expected >= 0 / >= 1")
    # the real size is the default on CUDA; a CPU runs the family's default size
    size = SIZE if args.device.startswith("cuda") and not getattr(args, "is_size_given", True) \
        else args.size
    return Protocol(size, args.dtype or DTYPE, args.beam_width or BEAM_WIDTH,
                    tuple(args.contexts or CONTEXTS), tuple(args.batches or BATCHES), names,
                    args.online_concurrency, args.online_requests)


def graphs_unavailable(device: str) -> str | None:
    """Why the xrec-graphs slot cannot run here; None when it can."""
    if not device.startswith("cuda"):
        return "not available: CUDA graphs need a CUDA device"
    return None


@dataclass
class Loaded:
    """The engines and contenders of a run; `reference`: the float32 engine's contender."""

    engines: list
    contenders: dict[str, Any]
    reference: XrecContender
    vocab_size: int
    graphs_reason: str | None
    info: dict

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def engine_options(protocol: Protocol, args: argparse.Namespace) -> dict:
    """Limits that admit the largest batch as one engine batch."""
    width, context, batch = protocol.beam_width, max(protocol.contexts), max(protocol.batches)
    options = {"device": args.device, "num_threads": args.threads,
               "max_input_len": max(4096, context), "max_beam_width": max(512, width),
               "max_top_k": max(1024, width), "max_seqs_per_batch": max(64, batch),
               "max_tokens_per_batch": max(65536, context * batch),
               "max_beams_per_batch": max(8192, width * batch)}
    return {k: v for k, v in options.items() if v is not None}


def load(protocol: Protocol, args: argparse.Namespace) -> Loaded:
    import torch

    from xrec import Engine
    from xrec.config import EngineOptions
    from xrec.model.random_init import random_model

    if args.threads:
        torch.set_num_threads(args.threads)
    options = engine_options(protocol, args)
    eager = Engine.from_random(protocol.size, args.seed, args.items, sizes=BENCH_SIZES,
                               dtype=protocol.dtype, cuda_graphs=False, **options)
    engines = [eager]
    try:
        # the reference: the same weights upcast (a float32 load of the bf16 checkpoint)
        model32 = random_model(eager.model.config, device="meta", dtype=torch.float32)
        model32.load_state_dict({k: v.float() for k, v in eager.model.state_dict().items()},
                                assign=True)
        fp32 = Engine(model32, eager.catalog, EngineOptions.from_kwargs(
            **options, dtype="float32", max_concurrency=1, cuda_graphs=False), "xrec-fp32")
        engines.append(fp32)
        contenders: dict[str, Any] = {}
        reason = graphs_unavailable(args.device)
        if reason is None:   # the same model, its decode rounds captured
            graphs = Engine(eager.model, eager.catalog, EngineOptions.from_kwargs(
                **options, dtype=protocol.dtype, cuda_graphs=True), GRAPHS)
            engines.append(graphs)
            contenders[GRAPHS] = XrecContender(graphs, NORMALIZE, GRAPHS)
        contenders["xrec-eager"] = XrecContender(eager, NORMALIZE, "xrec-eager")
        if "hf" in protocol.contenders:
            contenders["hf"] = HFContender(hf_causal_from(eager.model),
                                           build_trie(eager.catalog.triples))
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    config = eager.model.config
    info = {"size": protocol.size, "config": config.to_dict(), "dtype": protocol.dtype,
            "num_parameters": config.num_parameters, "num_items": eager.catalog.num_items,
            "engine_options": asdict(eager.options), "engine_pipelines": eager.num_pipelines}
    return Loaded(engines, contenders, XrecContender(fp32, NORMALIZE, "xrec-fp32"),
                  config.vocab_size, reason, info)


def run(args: argparse.Namespace) -> int:
    import gc

    protocol = protocol_of(args)
    slow_repeats = slow_repeats_of(args)
    loaded = in_fresh_thread(lambda: load(protocol, args))
    gc.collect()
    gc.freeze()   # the trie and the engines are not garbage (docs/decisions.md, Benchmarks)
    try:
        env = environment(args.device)
        grid = [(c, b, _view(loaded, protocol, c, b)) for c in protocol.contexts
                for b in protocol.batches]
        total = sum(num_runs(view, args.warmup, args.repeats, slow_repeats) + 1
                    for *_, view in grid) + int(protocol.online_concurrency > 0)
        bar = progress_bar(args, total, "gr-inference")
        points = []
        for context, batch, view in grid:
            try:
                points.append(measure_point(loaded, view, protocol, context, batch, args,
                                            slow_repeats, bar))
            except Exception as e:   # out of device memory, say: recorded, the others still run
                points.append({"context": context, "batch": batch, "contenders": {},
                               "error": f"{type(e).__name__}: {e}"[:300]})
        online_row = measure_online(loaded, protocol, args) if protocol.online_concurrency else None
        bar.update(int(protocol.online_concurrency > 0))
        bar.close()
    finally:
        loaded.close()
    agreement = add_verdicts(points, protocol)
    record = {"benchmark": "offline", "case": "gr-inference", "environment": env,
              "model": loaded.info,
              "settings": {**asdict(protocol), "hf_point": protocol.hf_point,
                           "has_targets": protocol.has_targets, "items": args.items,
                           "seed": args.seed, "warmup": args.warmup, "repeats": args.repeats,
                           "slow_repeats": slow_repeats, "normalize": NORMALIZE,
                           "rounds": 3, "prefix_cache": PREFIX_CACHE},
              "points": points, "top1_vs_fp32": agreement, "online": online_row}
    paths = output_paths(args.out, "offline-gr-inference")
    write_outputs(paths, record, markdown, draw=lambda path: plot(points, path))
    return 1 if any("error" in p for p in points) else 0


def _view(loaded: Loaded, protocol: Protocol, context: int, batch: int) -> Contenders:
    """The contenders of one point: hf at its one point only."""
    names = [n for n in loaded.contenders if n != "hf" or (context, batch) == protocol.hf_point]
    return Contenders({n: loaded.contenders[n] for n in names})


def measure_point(loaded: Loaded, view: Contenders, protocol: Protocol, context: int,
                  batch: int, args: argparse.Namespace, slow_repeats: int, bar) -> dict:
    workload = make_workload(loaded.vocab_size, batch, context, protocol.beam_width, args.seed)
    checked: dict = {}
    rows = run_point(view, workload, args.warmup, args.repeats, slow_repeats, args.device, bar,
                     checked)
    reference = in_fresh_thread(lambda: loaded.reference.run(workload))
    bar.update(1)
    for name, row in rows.items():
        row["ms_per_request"] = row["median_ms"] / batch
        row["top1_vs_fp32"] = top1_agreement(checked[name].triples, reference.triples)
        row["top1"] = [list(r[0]) if r else None for r in checked[name].triples]
    slot = {} if GRAPHS in rows else {GRAPHS: {"available": False, "reason": loaded.graphs_reason}}
    return {"context": context, "batch": batch, "beam_width": protocol.beam_width,
            "fp32_top1": [list(r[0]) if r else None for r in reference.triples],
            "contenders": {**slot, **rows}}


def top1_agreement(results: list[list[tuple]], reference: list[list[tuple]]) -> dict:
    """How many requests have the reference's best triple as their best."""
    equal = sum(bool(a) and bool(b) and tuple(a[0]) == tuple(b[0])
                for a, b in zip(results, reference))
    return {"equal": equal, "requests": len(reference), "fraction": equal / len(reference)}


def measure_online(loaded: Loaded, protocol: Protocol, args: argparse.Namespace) -> dict:
    """The eager engine behind the HTTP app: requests of the first context, in flight at once."""
    context = protocol.contexts[0]
    prompts = make_workload(loaded.vocab_size, min(16, protocol.online_requests), context,
                            protocol.beam_width, args.seed + 1).token_ids.tolist()
    bodies = [json.dumps({"token_ids": p, "beam_width": protocol.beam_width,
                          "normalize": NORMALIZE}).encode() for p in prompts]
    engine = loaded.contenders["xrec-eager"].engine
    row = {"contender": "xrec-eager", "context": context, "beam_width": protocol.beam_width,
           "concurrency": protocol.online_concurrency}
    reason = online.unavailable()
    if reason is not None:
        return {**row, "available": False, "reason": reason}
    return {**row, **online.measure(engine, bodies, protocol.online_concurrency,
                                    protocol.online_requests)}


def add_verdicts(points: list[dict], protocol: Protocol) -> dict:
    """Per xrec row: ms per request against HF's (at HF's context) and, for the protocol's
    workload, the targets; returns the top-1 agreement of xrec-eager over all requests."""
    hf = next((p["contenders"]["hf"] for p in points if "hf" in p["contenders"]), None)
    for point in points:
        for name, row in point["contenders"].items():
            if name == "hf" or not row.get("available", True):
                continue
            if hf is not None and point["context"] == protocol.hf_point[0]:
                row["vs_hf_per_request"] = hf["ms_per_request"] / row["ms_per_request"]
            if protocol.has_targets:
                row["target_ms"] = TARGET_MS.get((point["context"], point["batch"]))
                if point["batch"] == VS_HF_BATCH and "vs_hf_per_request" in row:
                    row["target_vs_hf"] = MIN_VS_HF
    rows = [p["contenders"]["xrec-eager"]["top1_vs_fp32"] for p in points
            if "xrec-eager" in p["contenders"]]
    equal, requests = sum(r["equal"] for r in rows), sum(r["requests"] for r in rows)
    fraction = equal / requests if requests else None
    target = MIN_TOP1_VS_FP32 if protocol.has_targets else None
    return {"equal": equal, "requests": requests, "fraction": fraction, "target": target,
            "met": None if target is None or fraction is None else fraction >= target}


def _verdict(row: dict) -> str | None:
    parts = []
    if row.get("target_ms") is not None:
        met = row["median_ms"] <= row["target_ms"]
        parts.append(f"≤ {row['target_ms']:g} ms {'met' if met else 'MISSED'}")
    if row.get("target_vs_hf") is not None:
        met = row["vs_hf_per_request"] >= row["target_vs_hf"]
        parts.append(f"≥ {row['target_vs_hf']:g}× HF {'met' if met else 'MISSED'}")
    return "; ".join(parts) or None


def markdown(record: dict) -> str:
    s = record["settings"]
    header = ["context", "batch", "contender", "batch ms", "ms / request", "target",
              "top-1 = fp32", "overlap vs HF", "× HF / request", "peak MiB"]
    rows = []
    for p in record["points"]:
        if "error" in p:
            rows.append([p["context"], p["batch"], None, f"failed: {p['error']}"] + [None] * 6)
        for name, r in p["contenders"].items():
            if not r.get("available", True):
                rows.append([p["context"], p["batch"], name, r["reason"]] + [None] * 6)
                continue
            top1, ov = r["top1_vs_fp32"], r.get("overlap_vs_hf")
            rows.append([p["context"], p["batch"], name, r["median_ms"], r["ms_per_request"],
                         _verdict(r), f"{top1['equal']}/{top1['requests']}",
                         None if not ov or ov["mean"] is None else f"{ov['mean']:.1%}",
                         None if "vs_hf_per_request" not in r else f"{r['vs_hf_per_request']:.1f}×",
                         r["peak_mib"]])
    a = record["top1_vs_fp32"]
    share = "" if a["fraction"] is None else f" ({a['fraction']:.1%})"
    goal = "" if a["target"] is None else \
        f"; target ≥ {a['target']:.0%} {'met' if a['met'] else 'MISSED'}"
    text = (f"## xrec bench offline --case gr-inference ({s['size']}, {s['dtype']}, "
            f"W={s['beam_width']}, {s['rounds']} tokens, {s['items']} items; {s['warmup']} "
            f"warm-up, {s['repeats']} runs, {s['slow_repeats']} of hf; medians)\n\n"
            + markdown_table(header, rows)
            + f"\n\nTop-1 equal to xrec float32 (same weights upcast): {a['equal']}/"
            f"{a['requests']} requests{share}{goal}. "
            f"Normalisation {s['normalize']!r} (HF's). Prefix cache: {s['prefix_cache']}. "
            + ("Targets: issue 24, on a GPU." if s["has_targets"] else
               f"Targets apply to {SIZE}, {DTYPE}, W={BEAM_WIDTH} only.")
            + f" × HF / request: HF's ms per request (context {s['hf_point'][0]}, batch "
            f"{s['hf_point'][1]}) / the row's.\n\n")
    o = record["online"]
    if o is not None and not o.get("available", True):
        text += f"Online row ({o['concurrency']} in flight): {o['reason']}.\n\n"
    elif o is not None:
        text += ("### online: the eager engine behind `xrec serve`'s app, in this process\n\n"
                 + markdown_table(["in flight", "requests", "context", "W", "req/s", "p50 ms",
                                   "p95 ms", "p99 ms", "errors"],
                                  [[o["concurrency"], o["ok"], o["context"], o["beam_width"],
                                    o["throughput_per_s"], o["p50_ms"], o["p95_ms"], o["p99_ms"],
                                    ", ".join(f"{k}: {v}" for k, v in o["errors"].items()) or 0]])
                 + "\n\n")
    return text + environment_markdown(record["environment"])


def plot(points: list[dict], path) -> None:
    plt = pyplot()
    names = [n for n in dict.fromkeys(n for p in points for n in p["contenders"])
             if any("median_ms" in p["contenders"].get(n, {}) for p in points)]
    fig, ax = plt.subplots(figsize=(max(6, 1.5 * len(points)), 4))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        xs = [i + j * width for i, p in enumerate(points) if "median_ms" in p["contenders"].get(name, {})]
        ys = [p["contenders"][name]["median_ms"] for p in points
              if "median_ms" in p["contenders"].get(name, {})]
        ax.bar(xs, ys, width, label=name)
    targets = [(i, p["contenders"].get("xrec-eager", {}).get("target_ms"))
               for i, p in enumerate(points)]
    if any(t for _, t in targets):
        ax.scatter([i for i, t in targets if t], [t for _, t in targets if t], marker="_", s=400,
                   color="black", label="target", zorder=3)
    ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(points))])
    ax.set_xticklabels([f"L={p['context']}\nB={p['batch']}" for p in points], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("batch ms (median, log)")
    ax.set_title("xrec bench offline --case gr-inference")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
