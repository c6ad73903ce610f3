"""Engine: the public entry point. Validates at the edge, owns futures, deadlines, shutdown.

    Engine.submit -> FixedStepsScheduler (budgets, FIFO) -> ScheduledBatch -> Executor
                  (pipelines: RecStep, responses) -> BatchReport -> the scheduler answers
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from xrec.api_types import CatalogVersion, SearchLimits, ValidRequest
from xrec.catalog import ItemCatalog
from xrec.catalog.formats import CatalogError
from xrec.catalog.sid_vocab import random_catalog_of_size
from xrec.config import EngineOptions, FamilyConfig, read_model_config
from xrec.config.engine import checked_grace_s
from xrec.config.sizes import size_config
from xrec.engine.catalogs import CatalogSlots, ServedCatalog, serve_catalog
from xrec.engine.executor import AnswerSettings, EngineBatch, Executor
from xrec.engine.frontend import (EngineFrontend, EngineStats, arrival_time, close_once,
                                  off_own_threads)
from xrec.engine.host import own_process, retain_freed_memory
from xrec.engine.requests import BatchLimits, BatchReport, ScheduledRequest
from xrec.engine.responses import ResponseData
from xrec.engine.scheduler import FixedStepsScheduler
from xrec.errors import Internal, InvalidArgument, Unavailable, XrecError
from xrec.model.dtype import dtype_name, emulation_warning, resolve_dtype
from xrec.model.gemm import cpu_fp32_gemm
from xrec.model.family import RecModel
from xrec.model.fusion import fuse, should_fuse, unfuse, warm_up
from xrec.model.loader import load_model
from xrec.model.random_init import random_model
from xrec.model.registry import model_class
from xrec.search.graphs import CudaGraphs, DecodeGraphs
from xrec.search.step import RecStep
from xrec.search.workspace import WorkspaceModel
from xrec.tokenizer import PromptTokenizer
from xrec.utils.files import FileRefused, check_regular_file
from xrec.utils.fresh_thread import in_fresh_thread

logger = logging.getLogger(__name__)

# The pipelines in a child process by default: a host that runs its own torch work on a
# long-lived thread cannot throttle them (README, "Embedding the engine").
DEFAULT_ISOLATION = "process"


class Engine(EngineFrontend):
    """A loaded model (+ catalog) behind a fixed-steps scheduler and concurrent pipelines.

    >>> engine = Engine.from_pretrained(model_dir, isolation="thread", max_concurrency=2)
    >>> engine.recommend([RecRequest(token_ids=[5, 17, 9], beam_width=128)])

    In-thread, the host's own torch work can slow the pipelines: a long-lived thread
    that ran a parallel op keeps an OpenMP team, and libgomp then throttles every team
    of the process. `from_pretrained`'s default, isolation="process", avoids that
    (README, "Embedding the engine").

    `close()` drains; an engine not closed is stopped (`close(0)`: waiting requests
    fail UNAVAILABLE, a running batch stops at its next round, the threads end) when it
    is garbage-collected or the interpreter exits, so that no torch work is running
    when the interpreter finalizes (that aborts the process). Its threads and their
    callbacks hold the scheduler and the executor, never the engine.
    """

    def __init__(self, model: RecModel, catalog: ItemCatalog | None, options: EngineOptions,
                 model_name: str = "xrec", tokenizer: PromptTokenizer | None = None,
                 answers_as_data: bool = False):
        """`tokenizer`: the model directory's `PromptTokenizer` (prompts, chat, result text) or None.
        `answers_as_data`: futures resolve to `ResponseData` (a process-isolated engine's child
        sends those) instead of `RecResponse`.

        Nothing process-wide is changed here (the host's process is the host's), except
        what option `retain_host_memory=True` asks for; a process that exists to serve
        calls `xrec.engine.host.own_process` once the engine is loaded."""
        self.model, self.options, self.model_name = model, options, model_name
        self.dtype, self.family = dtype_name(model.dtype), model.family
        self.tokenizer = tokenizer
        config = model.config
        device = model.device
        warning = emulation_warning(model.dtype, device)   # bfloat16 without native support
        if warning:
            logger.warning(warning)
        if device.type == "cpu" and options.retain_host_memory:
            retain_freed_memory()
        if device.type == "cpu" and model.dtype == torch.float32:
            # at load, not in the first request: the library of float32 products is measured
            logger.info("float32 products on this CPU: %s", cpu_fp32_gemm())
        self.fused_kernels = _fused_kernels(options, model)
        self.uses_graphs = _uses_graphs(options, model)
        # fixed for the engine's life: a catalog loaded later constrains iff this one did
        self.is_constrained = catalog is not None if options.constrained is None else options.constrained
        if self.is_constrained and catalog is None:
            raise ValueError("option constrained=true needs a catalog (none was found or given)")
        self._catalogs = catalogs = CatalogSlots(self._serve_catalog(catalog, source=None))
        prefix = _generation_prefix(options, config, tokenizer)
        self.limits = SearchLimits(config.vocab_size, config.d_model, options.max_input_len,
                                   options.max_beam_width, options.max_top_k,
                                   options.default_beam_width, options.normalize,
                                   config.accepts_embeddings, config.decoder_start_len,
                                   _max_prompt_positions(config, options, prefix), prefix,
                                   self.is_constrained, options.max_exclude_items)
        num_pipelines = options.max_concurrency or (2 if device.type == "cuda" else 1)
        self.workspace_per_pipeline = _workspace_budget(model, device, options, num_pipelines)
        total_threads = options.num_threads or torch.get_num_threads()
        threads = max(1, total_threads // num_pipelines) if device.type == "cpu" else None
        self._report_hooks: list[Callable[[BatchReport], None]] = []
        # The callbacks below reference the parts, not `self`: the engine stays collectable.
        self.scheduler = scheduler = FixedStepsScheduler(
            BatchLimits(options.max_seqs_per_batch, options.max_tokens_per_batch,
                        options.max_beams_per_batch, self.workspace_per_pipeline, num_pipelines,
                        options.request_queue_size, options.batch_wait_ms),
            launch=lambda batch: executor.launch(batch),   # assigned below, before start()
            catalog=lambda: catalogs.current)
        answers = AnswerSettings(options.each_conversion_threshold,
                                 options.total_conversion_threshold,
                                 None if tokenizer is None else tokenizer.tokens_text)
        self.executor = executor = Executor(
            model, num_pipelines, threads, answers,
            functools.partial(_batch_done, scheduler, self._report_hooks, answers_as_data),
            options.adaptive_threads, _cuda_graphs if self.uses_graphs else None)
        self.num_pipelines = num_pipelines
        self._closed = threading.Event()          # set as a close begins
        self._close_ended = threading.Event()    # set once it has ended
        scheduler.start()
        self._own_threads = (scheduler.thread, *executor.threads)
        self._finalizer = weakref.finalize(self, _close_off_own_threads, scheduler, executor,
                                           self._closed, self._close_ended, self._own_threads)
        logger.info("engine ready: %s, %.1fM parameters, %s %s, %d pipeline(s), workspace %.1f MiB "
                    "each, catalog %s, options %s", model_name, config.num_parameters / 1e6, device,
                    self.dtype, num_pipelines, self.workspace_per_pipeline / 2**20,
                    catalog, options)

    @classmethod
    def from_pretrained(cls, model_dir: str | os.PathLike,
                        catalog: str | os.PathLike | ItemCatalog | None = None,
                        isolation: str = DEFAULT_ISOLATION, catalog_extended: bool | None = None,
                        **engine_options: Any) -> EngineFrontend:
        """Load `model_dir` (config.json + safetensors, and tokenizer.json when it has one).
        `catalog`: None (the model directory's own, if any), a path, or an `ItemCatalog`.
        `catalog_extended`: read the `catalog` path's extended records (None: as the model
        directory declares its own catalog, never for a text file; `ItemCatalog.read_for_model`).
        `isolation`: "process" (default) runs the pipelines in a child process
        (`ProcessEngine`, the same request API), where the host's own torch work cannot
        throttle them; "thread" runs them in this process, returning an `Engine` (its
        internals reachable; what `xrec serve` uses), built in a thread that ends so that
        the caller's thread keeps no OpenMP team. README, "Embedding the engine"."""
        check_catalog_extended(catalog, catalog_extended)
        if isolation == "process":
            from xrec.engine.isolated import ProcessEngine
            return ProcessEngine.start(model_dir, catalog, engine_options, catalog_extended)
        if isolation != "thread":
            raise ValueError(f"isolation: got {isolation!r}, allowed: thread, process")
        options = EngineOptions.from_kwargs(**engine_options)
        return in_fresh_thread(lambda: cls(*load_parts(model_dir, catalog, options, catalog_extended)))

    @classmethod
    def from_random(cls, size: str, seed: int = 0, num_items: int = 100_000,
                    sizes: dict[str, FamilyConfig] | None = None, **engine_options: Any) -> Engine:
        """An in-thread engine over a random model of a named size (`sizes`, default
        `MODEL_SIZES`) and its random catalog, built in memory on the option `device` in
        the option `dtype`: nothing is written or read (a 1.7B model on a GPU in seconds).
        On a CPU the model and catalog equal those `xrec make-model` writes with `seed`
        (in the size's dtype); on an accelerator the weights are drawn there
        (`model.random_init.random_model`). No tokenizer: requests give token ids."""
        options = EngineOptions.from_kwargs(**engine_options)
        return in_fresh_thread(lambda: cls(*random_parts(size, seed, num_items, options, sizes)))

    # ---- requests ----------------------------------------------------------

    def submit_valid(self, valid: ValidRequest, as_data: bool = False,
                     arrived_at: float | None = None) -> Future:
        """Queue a request that `validate` returned."""
        scheduled = self._schedule(valid, as_data, arrival_time(arrived_at))
        self.scheduler.submit(scheduled)
        return scheduled.future

    def submit_valid_many(self, valids: Sequence[ValidRequest], as_data: bool = False,
                          arrived_at: float | None = None) -> list[Future]:
        """Queue validated requests at once (so they can share a batch); a request refused
        at admission (queue full, too big) has its future failed."""
        arrival = arrival_time(arrived_at)
        scheduled = [self._schedule(valid, as_data, arrival) for valid in valids]
        self.scheduler.submit_many(scheduled)
        return [s.future for s in scheduled]

    def hold_wakeups(self) -> None:
        self.scheduler.hold_wakeups()

    def release_wakeups(self) -> None:
        self.scheduler.release_wakeups()

    def _schedule(self, valid: ValidRequest, as_data: bool, arrival: float) -> ScheduledRequest:
        if self._closed.is_set():
            raise Unavailable("engine is closed")
        timeout = valid.timeout_ms or self.options.request_timeout_ms
        deadline = None if timeout is None else arrival + timeout / 1000.0
        return ScheduledRequest(valid.request_id, valid.input_len + valid.prefix_len,
                                valid.beam_width, valid.num_results, request=valid,
                                deadline=deadline, answer_as_data=as_data)

    # ---- the catalog (hot reload: engine/catalogs.py) ---------------------------

    @property
    def catalog(self) -> ItemCatalog | None:
        """The catalog new batches run on."""
        return self._catalogs.current.catalog

    @property
    def step(self) -> RecStep:
        """The search over the current catalog's constraint tables."""
        return self._catalogs.current.step

    @property
    def workspace(self) -> WorkspaceModel:
        return self._catalogs.current.workspace

    @property
    def catalog_version(self) -> CatalogVersion | None:
        return self._catalogs.current.version

    @property
    def previous_catalog_version(self) -> CatalogVersion | None:
        previous = self._catalogs.previous
        return None if previous is None else previous.version

    def catalog_versions(self) -> tuple[CatalogVersion | None, CatalogVersion | None]:
        return self._catalogs.versions()

    def load_catalog(self, catalog: str | os.PathLike | ItemCatalog,
                     extended: bool | None = None) -> CatalogVersion:
        """Load a new catalog (a file, read as `ItemCatalog.read` does, or an `ItemCatalog`),
        check it completely against the model and the engine, and swap it in atomically:
        batches already launched finish on the catalog they started with, later ones run
        on the new one, and the current one becomes the previous (see `restore_catalog`).
        `extended`: read extended records (None: as the current catalog, never for a text
        file).

        Raises `InvalidArgument` for a catalog that fails a check: the current one keeps
        serving. At most two catalogs are in memory: the previous one is let go first
        (`Unavailable` if a batch still runs on it after 30 s), except for a path that is
        no regular file (missing, a FIFO, a directory), refused before that.
        """
        if self._closed.is_set():
            raise Unavailable("engine is closed")
        if not isinstance(catalog, (str, os.PathLike, ItemCatalog)) or catalog == "":
            raise InvalidArgument(f"catalog: got {catalog!r}, expected a file path or an ItemCatalog")
        if extended is not None and not isinstance(extended, bool):
            raise InvalidArgument(f"extended: got {extended!r}, expected true, false or None")

        def build() -> ServedCatalog:
            if isinstance(catalog, ItemCatalog):
                loaded, source = catalog, None
            else:
                current = self._catalogs.current.catalog
                # by default as the current one; a text file has no strings to read
                is_extended = extended if extended is not None else \
                    current is not None and current.is_extended and \
                    not ItemCatalog.is_text_path(catalog)
                loaded = ItemCatalog.read(catalog, self.model.config.vocab_size, is_extended)
                # text that is valid UTF-8 (JSON answers, metrics labels): bytes of a name that
                # do not decode are written as \xNN, not kept as surrogates
                source = os.fsencode(Path(catalog).resolve()).decode("utf-8", "backslashreplace")
            try:
                return self._serve_catalog(loaded, source)
            except ValueError as exc:   # InvalidArgument is a ValueError too
                raise InvalidArgument(str(exc) if isinstance(exc, InvalidArgument) else
                                      f"catalog {source or loaded}: "
                                      f"{str(exc).removeprefix('catalog: ')}") from None

        if not isinstance(catalog, ItemCatalog):
            # a file that cannot be read at all (missing, a FIFO, a directory) is refused
            # before the previous version is let go: it stays restorable (as over HTTP)
            try:
                check_regular_file(catalog)
            except FileRefused as exc:
                raise CatalogError(f"cannot read catalog file {Path(catalog)}: {exc}") from None
        version = self._catalogs.replace(lambda: in_fresh_thread(build)).version
        logger.info("catalog loaded: %s", version)
        return version

    def restore_catalog(self) -> CatalogVersion | None:
        """Make the previous catalog current again (the current one becomes the previous);
        `NotFound` when there is none. Returns the version now serving."""
        if self._closed.is_set():
            raise Unavailable("engine is closed")
        version = self._catalogs.restore().version
        logger.info("catalog restored: %s", version)
        return version

    def _serve_catalog(self, catalog: ItemCatalog | None, source: str | None) -> ServedCatalog:
        return serve_catalog(catalog, source, self.model, self.options.rounds, self.is_constrained,
                             self.tokenizer, self.uses_graphs)

    # ---- lifecycle ---------------------------------------------------------

    def close(self, grace_s: float = 30.0) -> None:
        """Stop accepting, finish what is queued and running (up to `grace_s`), then stop:
        what still waits fails UNAVAILABLE, a batch still running stops at its next round
        (UNAVAILABLE), and the threads end. Idempotent: a call while another thread's close
        runs returns once that one has ended (its grace). Called on one of the engine's own
        threads (a done-callback runs on the pipeline that answered), it returns at once and
        the engine closes on a thread of its own."""
        close_once(self._finalizer, self._own_threads, self._close_ended,
                   checked_grace_s(grace_s))

    def describe(self) -> dict:
        """What start-up logs and a process-isolated engine's parent show (plain values)."""
        model = self.model
        return {"limits": self.limits, "options": self.options, "model_name": self.model_name,
                "config": model.config, "device": str(model.device), "dtype": self.dtype,
                "fused_kernels": self.fused_kernels, "family": self.family,
                "num_parameters": sum(p.numel() for p in model.parameters()),
                "weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
                "num_pipelines": self.num_pipelines,
                "workspace_per_pipeline": self.workspace_per_pipeline,
                "catalog": None if self.catalog is None else str(self.catalog),
                "catalog_version": self.catalog_version}

    def own_process(self) -> None:
        """Take the process-wide settings of a process that exists to serve this engine
        (glibc's malloc thresholds, a GC freeze: `xrec.engine.host`); never from a host's."""
        own_process(self.options, self.model.device.type == "cpu")

    def add_report_hook(self, hook: Callable[[BatchReport], None]) -> None:
        self._report_hooks.append(hook)

    def stats(self) -> EngineStats:
        scheduler, executor = self.scheduler, self.executor
        return EngineStats(self.num_pipelines, executor.num_busy, scheduler.num_waiting,
                           scheduler.num_running_batches,
                           self.workspace_per_pipeline * self.num_pipelines,
                           executor.workspace_bytes_in_use, self.catalog_version,
                           not self._closed.is_set() and scheduler.is_running,
                           executor.cpu_threads, *executor.graph_counts)


def _fused_kernels(options: EngineOptions, model: RecModel) -> bool:
    """Option `fused_kernels` resolved and applied (xrec.model.fusion): the model's element-wise
    chains compiled, and warmed up on synthetic batches so that no request pays a compile.
    Where compiling fails (no C++ compiler, say), None leaves them eager with a warning and
    true raises."""
    if not should_fuse(options.fused_kernels, model.device, model.dtype, model.config.d_model):
        return False
    start = time.perf_counter()
    fuse(model)
    try:
        # in a thread that ends: the warm-up's OpenMP team must not stay on this thread
        in_fresh_thread(lambda: warm_up(model, options.rounds))
    except Exception as error:  # whatever torch.compile raises: the eager chains still serve
        unfuse(model)
        if options.fused_kernels:
            raise RuntimeError(f"option fused_kernels=true: compiling failed: {error}") from error
        logger.warning("fused element-wise kernels unavailable, running them eagerly: %s: %s",
                       type(error).__name__, str(error).splitlines()[0] if str(error) else "")
        return False
    logger.info("fused element-wise kernels: compiled in %.1f s", time.perf_counter() - start)
    return True


def _uses_graphs(options: EngineOptions, model: RecModel) -> bool:
    """Option `cuda_graphs` resolved: on for CUDA and a capturable model unless false; true
    needs both."""
    if options.cuda_graphs and model.device.type != "cuda":
        raise ValueError(f"option cuda_graphs=true needs a CUDA device, got {model.device}")
    if options.cuda_graphs and not model.is_capturable:
        raise ValueError("option cuda_graphs=true: this model's mixture of experts reads its "
                         "per-expert token counts on the host, so its rounds cannot be captured")
    if options.cuda_graphs is None:
        return model.device.type == "cuda" and model.is_capturable
    return options.cuda_graphs


def _cuda_graphs() -> DecodeGraphs:
    return DecodeGraphs(CudaGraphs())


def _batch_done(scheduler: FixedStepsScheduler, hooks: list[Callable[[BatchReport], None]],
                answers_as_data: bool, batch: EngineBatch,
                report: BatchReport[ResponseData]) -> None:
    """A pipeline finished `batch` (on that pipeline's thread): the scheduler answers its
    requests and frees its slot, then the hooks see the report. A hook that raises is
    logged: it neither stops the other hooks nor the pipeline."""
    if not answers_as_data:
        try:
            report = _with_responses(batch, report)
        except Exception as exc:
            logger.exception("converting the answers of a batch of %d requests failed",
                             batch.num_requests)
            report = replace(report, answers=(), error=Internal(
                f"batch failed: {type(exc).__name__}: {exc}"))
    scheduler.finish(batch, report)
    if hooks:
        summary = report.without_answers()
        for hook in hooks:
            try:
                hook(summary)
            except Exception:
                logger.exception("report hook failed")


def _close_off_own_threads(scheduler: FixedStepsScheduler, executor: Executor,
                           closed: threading.Event, ended: threading.Event, threads: tuple,
                           grace_s: float = 0.0) -> None:
    """`Engine.close`, and the finalizer (`close(0)` once the engine is collected or the
    interpreter exits). On one of the engine's own `threads` it closes on a new thread: a
    pipeline cannot wait for the batch it is still finishing (a done-callback calling close
    waited its whole grace), and a cyclic collection runs wherever it is triggered, maybe
    while that thread holds one of the engine's locks."""
    off_own_threads(threads, _close_parts, scheduler, executor, closed, ended, grace_s)


def _close_parts(scheduler: FixedStepsScheduler, executor: Executor, closed: threading.Event,
                 ended: threading.Event, grace_s: float) -> None:
    """`Engine.close`, also run when an engine is collected or the interpreter exits (grace
    0): refuse, drain for `grace_s`, fail what waits, stop running batches, end the threads;
    then set `ended`."""
    closed.set()
    try:
        deadline = time.monotonic() + grace_s
        scheduler.close(grace_s)
        executor.close(max(0.0, deadline - time.monotonic()))
    finally:
        ended.set()


def _with_responses(batch: EngineBatch, report: BatchReport[ResponseData]) -> BatchReport:
    """The report with a `RecResponse` for each request that asked for one (the others keep
    their `ResponseData`: the HTTP server writes its JSON from the arrays)."""
    if not report.is_ok:
        return report
    answers = tuple(data if r.answer_as_data or isinstance(data, XrecError) else data.to_response()
                    for r, data in zip(batch.requests, report.answers))
    return replace(report, answers=answers)


def check_catalog_extended(catalog: str | os.PathLike | ItemCatalog | None,
                           catalog_extended: bool | None) -> None:
    """`catalog_extended` is true, false or None, and names how to read a catalog file."""
    if catalog_extended is None:
        return
    if not isinstance(catalog_extended, bool):
        raise ValueError(f"catalog_extended: got {catalog_extended!r}, expected true, false or "
                         f"None (as the model directory declares)")
    if catalog is None or isinstance(catalog, ItemCatalog):
        raise ValueError("catalog_extended: says how to read a catalog file; give one as "
                         "catalog (the model directory's own is read as its "
                         "tokenizer_config.json's extended_item_info says)")


def load_parts(model_dir: str | os.PathLike, catalog: str | os.PathLike | ItemCatalog | None,
               options: EngineOptions, catalog_extended: bool | None = None,
               ) -> tuple[RecModel, ItemCatalog | None, EngineOptions, str, PromptTokenizer | None]:
    """What an `Engine` is built from: the model, its catalog, options, name and tokenizer."""

    device = _resolve_device(options.device)
    family = model_class(read_model_config(Path(model_dir) / "config.json"))
    model = load_model(model_dir, device, resolve_dtype(options.dtype, device, family.cpu_auto_bf16))
    vocab = model.config.vocab_size
    if catalog is None:
        catalog = ItemCatalog.from_model_dir(model_dir, vocab)
    elif not isinstance(catalog, ItemCatalog):
        catalog = ItemCatalog.read_for_model(catalog, model_dir, vocab, catalog_extended)
    tokenizer = PromptTokenizer.from_model_dir(model_dir)
    return model, catalog, options, Path(model_dir).resolve().name, tokenizer


def random_parts(size: str, seed: int, num_items: int, options: EngineOptions,
                 sizes: dict[str, FamilyConfig] | None = None,
                 ) -> tuple[RecModel, ItemCatalog | None, EngineOptions, str, None]:
    """`load_parts` for a random model of a named size, built in memory (`Engine.from_random`)."""
    config = size_config(size, num_items, sizes, seed)
    device = _resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device, model_class(config).cpu_auto_bf16)
    warning = emulation_warning(dtype, device)
    if warning:
        logger.warning(warning)
    model = random_model(config, seed, device, dtype)
    catalog = random_catalog_of_size(size, config.vocab_size, num_items, seed) if num_items else None
    return model, catalog, options, f"random-{size}-seed{seed}", None


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"option device: got {name!r}, but CUDA is not available here")
    return device


def _max_prompt_positions(config: FamilyConfig, options: EngineOptions,
                          prefix: tuple[int, ...]) -> int | None:
    """The prompt positions the model holds beside the tokens the search generates after the
    first round; a model that holds no prompt at all is refused here, not at every request."""
    if config.max_positions is None:
        return None
    most = config.max_positions - (options.rounds - 1)
    if most < len(prefix) + 1:
        raise ValueError(f"config key 'max_position_embeddings': got {config.max_positions}, which "
                         f"holds no prompt: the search generates {options.rounds} tokens and the "
                         f"generation prefix is {len(prefix)}; at least "
                         f"{options.rounds + len(prefix)} are needed")
    return most


def _generation_prefix(options: EngineOptions, config: FamilyConfig,
                       tokenizer: PromptTokenizer | None) -> tuple[int, ...]:
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
        ids = tokenizer.encode(prefix, add_special_tokens=False, field="option generation_prefix")
    else:
        ids = list(prefix)
    bad = [i for i in ids if not 0 <= i < config.vocab_size]
    if bad:
        raise ValueError(f"option generation_prefix: token id {bad[0]} is outside the vocabulary "
                         f"[0, {config.vocab_size - 1}]")
    return tuple(int(i) for i in ids)


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
