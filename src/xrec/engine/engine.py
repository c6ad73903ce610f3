"""Engine: the public entry point. Validates at the edge, owns futures, deadlines, shutdown.

    Engine.submit -> FixedStepsScheduler (budgets, FIFO) -> Executor (pipelines)
                  -> RecStep -> responses -> the request's future
"""

from __future__ import annotations

import gc
import logging
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Sequence

import torch

from xrec.api_types import SearchLimits, ValidRequest
from xrec.catalog import ItemCatalog
from xrec.config import EngineOptions
from xrec.engine.executor import BatchReport, Executor
from xrec.engine.frontend import EngineFrontend
from xrec.engine.host_memory import retain_freed_memory
from xrec.engine.requests import BatchLimits, ScheduledRequest
from xrec.engine.scheduler import FixedStepsScheduler
from xrec.errors import Unavailable
from xrec.model.family import RecModel
from xrec.model.loader import load_model
from xrec.search.step import RecStep
from xrec.search.workspace import BatchShape, WorkspaceModel

logger = logging.getLogger(__name__)

DEFAULT_ISOLATION = "thread"


class Engine(EngineFrontend):
    """A loaded model (+ catalog) behind a fixed-steps scheduler and concurrent pipelines.

    >>> engine = Engine.from_pretrained(model_dir, max_concurrency=2)
    >>> engine.recommend([RecRequest(token_ids=[5, 17, 9], beam_width=128)])

    On a CPU, keep the process's other torch work off long-lived threads: a thread
    that ran a parallel op keeps an OpenMP team, and libgomp then throttles every
    team, the pipelines' included (README, "One process, several OpenMP teams").
    """

    def __init__(self, model: RecModel, catalog: ItemCatalog | None, options: EngineOptions,
                 model_name: str = "xrec", tokenizer: Any = None, answers_as_data: bool = False):
        """`tokenizer`: the model directory's `PromptTokenizer` (prompts, chat, result text) or None.
        `answers_as_data`: futures resolve to `ResponseData` (a process-isolated engine's child
        sends those) instead of `RecResponse`."""
        self.model, self.catalog, self.options, self.model_name = model, catalog, options, model_name
        self.tokenizer = tokenizer
        config = model.config
        device = model.device
        if device.type == "cpu" and options.retain_host_memory:
            retain_freed_memory()
        is_constrained = catalog is not None if options.constrained is None else options.constrained
        if is_constrained and catalog is None:
            raise ValueError("option constrained=true needs a catalog (none was found or given)")
        if catalog is not None and tokenizer is not None:
            _check_catalog_tokens(catalog, tokenizer)
        tables = catalog.constraint_tables(device) if is_constrained else None
        if tables is not None and options.rounds > tables.num_levels:
            raise ValueError(f"option rounds: got {options.rounds}, the catalog has "
                             f"{tables.num_levels} token levels")
        self.step = RecStep(model, tables, options.rounds)
        max_positions = None if config.max_positions is None else \
            config.max_positions - (options.rounds - 1)
        self.limits = SearchLimits(config.vocab_size, config.d_model, options.max_input_len,
                                   options.max_beam_width, options.max_top_k,
                                   options.default_beam_width, options.normalize,
                                   config.accepts_embeddings, config.decoder_start_len,
                                   max_positions, _generation_prefix(options, config, tokenizer))
        num_pipelines = options.max_concurrency or (2 if device.type == "cuda" else 1)
        widest = max(tables.max_children[1:], default=1) if tables else config.vocab_size
        self.workspace = WorkspaceModel(config, model.dtype.itemsize, widest, options.rounds)
        self.workspace_per_pipeline = _workspace_budget(model, device, options, num_pipelines)
        total_threads = options.num_threads or torch.get_num_threads()
        threads = max(1, total_threads // num_pipelines) if device.type == "cpu" else None
        self._report_hooks: list[Any] = []
        self.scheduler = FixedStepsScheduler(
            BatchLimits(options.max_seqs_per_batch, options.max_tokens_per_batch,
                        options.max_beams_per_batch, self.workspace_per_pipeline, num_pipelines,
                        options.request_queue_size, options.batch_wait_ms),
            launch=self._launch, workspace_bytes=self._batch_bytes)
        self.executor = Executor(self.step, catalog, num_pipelines, options.each_conversion_threshold,
                                 options.total_conversion_threshold, threads,
                                 None if tokenizer is None else tokenizer.tokens_text,
                                 on_batch_done=self.scheduler.batch_done, on_report=self._on_report,
                                 batch_bytes=self._batch_bytes,
                                 **({"finish": lambda data: data} if answers_as_data else {}))
        self.num_pipelines = num_pipelines
        self._closed = threading.Event()
        # The objects of start-up (torch, model, catalog: ~170k) move to the permanent GC
        # generation so that collections triggered by response building stop rescanning
        # them: that rescanning was 60% of building 16 x 128 results.
        gc.collect()
        gc.freeze()
        self.scheduler.start()
        logger.info("engine ready: %s, %.1fM parameters, %s %s, %d pipeline(s), workspace %.1f MiB "
                    "each, catalog %s, options %s", model_name, config.num_parameters / 1e6, device,
                    model.dtype, num_pipelines, self.workspace_per_pipeline / 2**20,
                    catalog, options)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike, catalog: Any = None,
                        isolation: str = DEFAULT_ISOLATION, **engine_options: Any) -> EngineFrontend:
        """Load `model_dir` (config.json + safetensors, and tokenizer.json when it has one).
        `catalog`: None (the model directory's own, if any), a path, or an `ItemCatalog`.
        `isolation`: "thread" runs the pipelines in this process; "process" runs them in a
        child process (`ProcessEngine`, same API), where the host's own torch work cannot
        throttle them (README, "Embedding the engine")."""
        if isolation == "process":
            from xrec.engine.isolated import ProcessEngine
            return ProcessEngine.start(model_dir, catalog, engine_options)
        if isolation != "thread":
            raise ValueError(f"isolation: got {isolation!r}, allowed: thread, process")
        return cls(*load_parts(model_dir, catalog, EngineOptions.from_kwargs(**engine_options)))

    # ---- requests ----------------------------------------------------------

    def submit_valid(self, valid: ValidRequest) -> Future:
        """Queue a request that `validate` returned."""
        scheduled = self._schedule(valid)
        self.scheduler.submit(scheduled)
        return scheduled.future

    def submit_valid_many(self, valids: Sequence[ValidRequest]) -> list[Future]:
        """Queue validated requests at once (so they can share a batch); a request refused
        at admission (queue full, too big) has its future failed."""
        scheduled = [self._schedule(valid) for valid in valids]
        self.scheduler.submit_many(scheduled)
        return [s.future for s in scheduled]

    def hold_wakeups(self) -> None:
        """Requests submitted until `release_wakeups()` queue without waking the scheduler,
        so requests accepted one by one but together (an HTTP burst) can share a batch.
        Holds nest; a hold delays a launch by at most ~50 ms, it never blocks one."""
        self.scheduler.hold_wakeups()

    def release_wakeups(self) -> None:
        self.scheduler.release_wakeups()

    def _schedule(self, valid: ValidRequest) -> ScheduledRequest:
        if self._closed.is_set():
            raise Unavailable("engine is closed")
        timeout = valid.timeout_ms or self.options.request_timeout_ms
        deadline = None if timeout is None else time.monotonic() + timeout / 1000.0
        return ScheduledRequest(valid.request_id, valid.input_len + valid.prefix_len,
                                valid.beam_width, valid.num_results, payload=valid,
                                deadline=deadline)

    # ---- lifecycle ---------------------------------------------------------

    def close(self, grace_s: float = 30.0) -> None:
        """Stop accepting, finish what is queued and running (up to `grace_s`), stop threads."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.scheduler.close(grace_s)
        self.executor.close(grace_s)

    def add_report_hook(self, hook: Any) -> None:
        """Call `hook(BatchReport)` after every batch (metrics)."""
        self._report_hooks.append(hook)

    # ---- internals -----------------------------------------------------------

    def _launch(self, batch: list[ScheduledRequest]) -> None:
        self.executor.launch(batch)

    def _batch_bytes(self, batch: Sequence[ScheduledRequest]) -> int:
        return self.workspace.batch_bytes(BatchShape.of([r.payload for r in batch]))

    def _on_report(self, report: BatchReport) -> None:
        for hook in self._report_hooks:
            hook(report)


def load_parts(model_dir: str | os.PathLike, catalog: Any,
               options: EngineOptions) -> tuple[RecModel, ItemCatalog | None, EngineOptions, str, Any]:
    """What an `Engine` is built from: the model, its catalog, options, name and tokenizer."""
    from xrec.tokenizer import PromptTokenizer

    device = _resolve_device(options.device)
    dtype = getattr(torch, options.dtype) if options.dtype != "auto" else \
        (torch.bfloat16 if device.type == "cuda" else torch.float32)
    model = load_model(model_dir, device, dtype)
    vocab = model.config.vocab_size
    if catalog is None:
        catalog = ItemCatalog.from_model_dir(model_dir, vocab)
    elif not isinstance(catalog, ItemCatalog):
        catalog = ItemCatalog.read(catalog, vocab)
    tokenizer = PromptTokenizer.from_model_dir(model_dir)
    return model, catalog, options, Path(model_dir).resolve().name, tokenizer


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"option device: got {name!r}, but CUDA is not available here")
    return device


def _generation_prefix(options: EngineOptions, config: Any, tokenizer: Any) -> tuple[int, ...]:
    """The ids of option `generation_prefix` (text through the tokenizer, or ids as given)."""
    prefix = options.generation_prefix
    if prefix is None or prefix == "" or prefix == ():
        return ()
    if config.accepts_embeddings:
        raise ValueError("option generation_prefix: only decoder-only models take one (their prompt "
                         "continues with it); this model is encoder-decoder")
    if isinstance(prefix, str):
        if tokenizer is None:
            raise ValueError(f"option generation_prefix: got text {prefix!r}, but the model directory "
                             "has no tokenizer.json; give token ids")
        ids = tokenizer.encode(prefix, add_special_tokens=False)
    else:
        ids = list(prefix)
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise ValueError(f"option generation_prefix: token id {bad[0]} is outside the vocabulary "
                         f"[0, {config.vocab_size - 1}]")
    return tuple(int(i) for i in ids)


def _check_catalog_tokens(catalog: ItemCatalog, tokenizer: Any) -> None:
    """Every token of every semantic ID must be one the tokenizer knows (else the catalog was
    built for another vocabulary)."""
    import numpy as np

    known = tokenizer.known_ids(catalog.vocab_size)                       # [V] bool
    is_unknown = ~known[catalog.triples]                                  # [n, 3]
    if is_unknown.any():
        row, level = np.argwhere(is_unknown)[0]
        raise ValueError(f"catalog: item {catalog.item_ids[row]} has token {catalog.triples[row, level]} "
                         f"at level {level}, which the model's tokenizer.json does not know "
                         f"({int(is_unknown.any(axis=1).sum())} items have unknown tokens); build the "
                         "catalog through the model's tokenizer (xrec catalog import)")


def _workspace_budget(model: RecModel, device: torch.device, options: EngineOptions,
                      num_pipelines: int) -> int:
    """One pipeline's share of `max_memory_utilization` of the device (or RAM), less the weights."""
    if device.type == "cuda":
        _, total = torch.cuda.mem_get_info(device)
    else:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    usable = int(total * options.max_memory_utilization) - weights
    if usable <= 0:
        raise ValueError(f"option max_memory_utilization={options.max_memory_utilization}: the weights "
                         f"({weights} bytes) leave no workspace in {total} bytes")
    return usable // num_pipelines
