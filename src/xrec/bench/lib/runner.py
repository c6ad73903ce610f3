"""Loading the contenders and running them side by side, interleaved, on one workload."""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from xrec.bench.lib.args import SERVING_OPTIONS
from xrec.bench.lib.common import MIB, PeakMemory, summarize
from xrec.bench.lib.contenders import (HFContender, RunResult, XrecContender, build_trie,
                                       overlap)
from xrec.bench.lib.models import Workload, exclusions_of
from xrec.utils.fresh_thread import in_fresh_thread

CONTENDERS = ("xrec", "xrec-full", "xrec-filter", "xrec-fp32", "hf", "naive")
SLOW = ("hf", "naive")          # run --hf-repeats times instead of --repeats
REFERENCE = "hf"


@dataclass
class Contenders:
    """The loaded contenders (by name, in run order) and what must be closed after."""

    by_name: dict[str, Any]
    engine: Any = None
    vocab_size: int = 0
    info: dict = field(default_factory=dict)
    float32_engine: Any = None      # xrec-fp32's: the engine in float32 whatever "auto" says

    def close(self) -> None:
        for engine in (self.engine, self.float32_engine):
            if engine is not None:
                engine.close()


def load_contenders(names: list[str], model_dir: Path, device: str, threads: int | None,
                    engine_options: dict | None = None, seed: int = 0) -> Contenders:
    import torch

    from xrec import Engine
    from xrec.catalog import ItemCatalog
    from xrec.config import read_model_config
    from xrec.model.loader import load_model

    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        raise ValueError(f"contenders: unknown {unknown}, allowed: {', '.join(CONTENDERS)}")
    if threads:
        torch.set_num_threads(threads)
    # On a CPU each xrec engine runs in a child process of its own (the library's default
    # isolation): two OpenMP teams in one process (two engines, or an engine's and HF's)
    # make libgomp throttle every team (docs/decisions.md, "One OpenMP team per process").
    # Fixed threads: a child that follows the free cores reads the other contenders' CPU
    # time as a busy neighbour and takes one thread.
    isolation = "thread" if device.startswith("cuda") else "process"

    def open_engine(**overrides):
        options = {"device": device, "num_threads": threads, **SERVING_OPTIONS,
                   "adaptive_threads": False, **(engine_options or {}), **overrides}
        return Engine.from_pretrained(model_dir, isolation=isolation,
                                      **{k: v for k, v in options.items() if v is not None})

    engine = open_engine() if {"xrec", "xrec-full", "xrec-filter"} & set(names) else None
    # xrec-fp32's engine: float32 whatever the options or "auto" give xrec's
    float32_engine = open_engine(dtype="float32") if "xrec-fp32" in names else None
    config = read_model_config(Path(model_dir) / "config.json")
    # the float32 model of the Hugging Face and naive contenders, in this process
    model = load_model(model_dir, device, torch.float32) if set(SLOW) & set(names) else None
    if "naive" in names and not config.is_encoder_decoder:
        raise ValueError("contender naive: a generic encoder-decoder search; this model is "
                         "decoder-only (compare with hf)")
    catalog = ItemCatalog.from_model_dir(model_dir, config.vocab_size)
    if catalog is None:
        raise ValueError(f"{model_dir} has no catalog (tokenizer_config.json item_catalog or vocab_file)")
    by_name: dict[str, Any] = {}
    trie = build_trie(catalog.triples) if set(SLOW) & set(names) else None
    for name in names:
        if name == "xrec":
            by_name[name] = XrecContender(engine, "allowed", name)
        elif name == "xrec-full":
            by_name[name] = XrecContender(engine, "full", name)
        elif name == "xrec-filter":   # each request excludes 1,000 items and 2 subtrees
            by_name[name] = XrecContender(engine, "allowed", name,
                                          lambda w, c=catalog: exclusions_of(c, w, seed))
        elif name == "xrec-fp32":
            by_name[name] = XrecContender(float32_engine, "allowed", name)
        elif name == "hf":
            by_name[name] = HFContender(_hf_model(model, model_dir, device), trie)
        else:
            from xrec.bench.lib.naive import NaiveContender
            by_name[name] = NaiveContender(model, trie)
    info = {"model_dir": str(model_dir), "config": config.to_dict(),
            "num_items": catalog.num_items, "num_triples": catalog.num_triples,
            "isolation": isolation}
    if engine is not None:
        info["engine_options"] = asdict(engine.options)
        info["engine_pipelines"] = engine.num_pipelines
    info["engine_dtypes"] = {name: e.dtype for name, e in
                             (("xrec", engine), ("xrec-fp32", float32_engine)) if e is not None}
    # The contenders' long-lived objects (HF's trie above all) are not garbage: keep the
    # collector from rescanning one contender's heap inside another's timed run
    # (docs/decisions.md, Benchmarks).
    gc.collect()
    gc.freeze()
    return Contenders(by_name, engine, config.vocab_size, info, float32_engine)


def _hf_model(model, model_dir: Path, device: str):
    """The Hugging Face model of the same weights: T5 exported from an encoder-decoder, or
    the decoder-only directory loaded as it is (float32, HF's default attention)."""
    import torch

    if model.config.is_encoder_decoder:
        from xrec.realdata.train.hf_models import export_hf_t5
        return export_hf_t5(model)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return _for_generate(hf).to(device)


def hf_causal_from(model, dtype=None):
    """The Hugging Face model (`AutoModelForCausalLM` of the config's `model_type`) of a
    decoder-only xrec `model` in memory: its tensors, under the same names, on its device,
    in `dtype` (default: the model's). For models built without a directory
    (`Engine.from_random`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model.config.is_encoder_decoder:
        raise ValueError("hf_causal_from: a decoder-only model; encoder-decoder models are "
                         "exported with export_hf_t5")
    dtype = dtype or model.dtype
    with torch.device(model.device):
        hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**model.config.to_dict()),
                                              dtype=dtype)
    result = hf.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if result.unexpected_keys or set(result.missing_keys) - tied:
        raise ValueError(f"hf_causal_from: tensors do not fit {type(hf).__name__}: missing "
                         f"{sorted(set(result.missing_keys) - tied)}, unexpected "
                         f"{sorted(result.unexpected_keys)}")
    hf.tie_weights()
    return _for_generate(hf)


def _for_generate(hf):
    """No end of sequence (3 tokens always), pad 0, inference only."""
    for cfg in (hf.config, hf.generation_config):
        cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id = None, None, 0
    return hf.eval().requires_grad_(False)


def load_for(args, names: list[str]) -> Contenders:
    """`load_contenders` for a bench command's arguments, in a thread that ends (no
    OpenMP team left on the caller's thread)."""
    from xrec.bench.lib.args import cuda_graphs_of, model_dir_of
    return in_fresh_thread(
        lambda: load_contenders(names, model_dir_of(args), args.device, args.threads,
                                {"dtype": args.dtype, "cuda_graphs": cuda_graphs_of(args)},
                                args.seed))


def run_point(contenders: Contenders, workload: Workload, warmup: int, repeats: int,
              slow_repeats: int, device: str, bar=None,
              checked: dict[str, RunResult] | None = None) -> dict[str, dict]:
    """Warm up each contender (its last warm-up run measures peak memory and gives the
    results compared with the reference), then run them interleaved: A1 B1 C1 A2 B2 ...
    Returns per contender the timing summary, peak memory, overlap and ratios vs HF;
    `checked`, when given, receives each contender's compared `RunResult`."""
    runs: dict[str, list] = {name: [] for name in contenders.by_name}
    checked = {} if checked is None else checked
    memory: dict[str, float | None] = {}
    for name, contender in contenders.by_name.items():
        for index in range(warmup):
            if index == warmup - 1:
                with PeakMemory(device, pid=getattr(contender, "pid", None)) as mem:
                    checked[name] = in_fresh_thread(lambda: contender.run(workload))
                memory[name] = mem.peak_bytes / MIB
            else:
                in_fresh_thread(lambda: contender.run(workload))
            _tick(bar, name)
    for index in range(max(repeats, slow_repeats)):
        for name, contender in contenders.by_name.items():
            if index < (slow_repeats if name in SLOW else repeats):
                runs[name].append(in_fresh_thread(lambda: contender.run(workload)))
                _tick(bar, name)
    out: dict[str, dict] = {}
    for name, results in runs.items():
        if not results:
            continue
        row = summarize([r.wall_s for r in results], [x for r in results for x in r.latencies_s],
                        workload.num_requests)
        row["peak_mib"] = memory.get(name)
        row.update({k: v for k, v in results[-1].info.items()})
        checked.setdefault(name, results[0])
        out[name] = row
    reference = out.get(REFERENCE)
    for name, row in out.items():
        if reference is not None:
            row["speedup_vs_hf"] = reference["median_ms"] / row["median_ms"]
            if row["peak_mib"] and reference["peak_mib"]:
                row["memory_vs_hf"] = row["peak_mib"] / reference["peak_mib"]
            if name != REFERENCE:
                row["overlap_vs_hf"] = overlap(checked[name].triples, checked[REFERENCE].triples)
    return out


def num_runs(contenders: Contenders, warmup: int, repeats: int, slow_repeats: int) -> int:
    return sum(warmup + (slow_repeats if name in SLOW else repeats) for name in contenders.by_name)


def _tick(bar, name: str) -> None:
    if bar is not None:
        bar.set_postfix_str(name)
        bar.update(1)
