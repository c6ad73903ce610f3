"""`xrec batch --ray`: Ray Data `map_batches` over an actor pool of Engines.

    read (Parquet columns, or JSONL lines as text)
      -> repartition(target_num_rows_per_block=chunk_rows, strict=True), order preserved
      -> map_batches(ChunkActor, batch_size=chunk_rows, compute=ActorPoolStrategy(size=A))
      -> write (part-NNNNNN-<write uuid>.parquet, or .jsonl through JsonlDatasink)

Each call of an actor gets exactly one chunk (rows [k * chunk_rows, (k + 1) * chunk_rows)
of the input: strict blocks of chunk_rows in input order, one block per batch) and runs
it as `xrec batch` in process does (`batch.run_chunk`: decode, validate, one submission,
one pipeline, the same `num_threads`), so the records are the same, row for row: ids,
items, tokens and errors exactly, scores to fp32 rounding (an sgemm's last bits can
depend on its buffers' alignment, which differs between processes).

CPUs: an actor reserves `actor_cpus` (default: its intra-op threads, at most the
cluster's CPUs less one); the pool is sized so that at least one CPU stays free for
the read and write tasks. A pool that takes every CPU leaves Ray Data's read tasks
unscheduled: the run hangs without an error, so such a pool is refused.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xrec.scale.batch import (BatchJob, BatchSummary, MANIFEST, hold_output, load_engine,
                              prepare_output, run_chunk, write_manifest)
from xrec.scale.rows import (InputInfo, RowSettings, check_input, count_errors, output_records,
                             output_schema_for, records_jsonl, records_table, table_rows)

logger = logging.getLogger("xrec.batch")

TASK_CPUS = 1.0   # what Ray Data's read and write tasks ask for (its default)
NOT_RESUMABLE = ("--resume: a --ray run is not resumable (its output is written by Ray Data's "
                 "tasks); run again with --overwrite, or without --ray")


@dataclass(frozen=True)
class RayOptions:
    """`address`: None -> $RAY_ADDRESS, else a local cluster. None sizes: derived from the
    cluster (see the module docstring)."""

    address: str | None = None
    num_actors: int | None = None
    actor_cpus: float | None = None
    actor_gpus: float = 0.0

    def __post_init__(self) -> None:
        if self.num_actors is not None and not 1 <= self.num_actors <= 4096:
            raise ValueError(f"--actors: got {self.num_actors}, allowed: 1 to 4096")
        if self.actor_cpus is not None and not 0 < self.actor_cpus <= 1024:
            raise ValueError(f"--actor-cpus: got {self.actor_cpus}, expected > 0")
        if not 0 <= self.actor_gpus <= 64:
            raise ValueError(f"--actor-gpus: got {self.actor_gpus}, expected >= 0")


# Ray starts its workers at nice 15 so that its own daemons keep the CPU. On a cluster xrec
# starts, the workers are the engines, the work itself: at nice 15 beside any busy process
# they got a sliver of a core (a Serve replica's engine load took 2 min 8 s instead of 5 s
# beside the test suite). Such a cluster runs them at 0; a joined one keeps its own setting.
WORKER_NICENESS_VARIABLE = "RAY_worker_niceness"


def init_ray(**kwargs: Any) -> None:
    """`ray.init(**kwargs)`, with the workers of a cluster it starts at nice 0 (unless
    $RAY_worker_niceness says otherwise: the raylet reads it at its start)."""
    import ray

    os.environ.setdefault(WORKER_NICENESS_VARIABLE, "0")
    ray.init(**kwargs)


def connect(address: str | None, flag: str = "--address") -> bool:
    """Join the cluster at `address` ($RAY_ADDRESS when None), else start a local one.
    True when this call connected this process (the caller calls `ray.shutdown`, which
    stops a cluster this call started and leaves a joined one: `started_cluster`).
    ValueError when a given cluster cannot be reached (probed first: Ray's own connect
    retries for minutes)."""
    import ray

    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address not in (None, "auto", "local") and not address.startswith("ray://"):
        _probe(address, flag)
    try:
        init_ray(address=address, log_to_driver=False, logging_level=logging.WARNING,
                 include_dashboard=False if address is None else None)
    except (ConnectionError, TimeoutError, RuntimeError, ValueError) as e:
        raise ValueError(f"{flag} {address}: cannot reach the Ray cluster "
                         f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else e})") from None
    return True


def started_cluster() -> bool:
    """Whether the cluster this process is connected to is one its `ray.init` started (a
    local one, which goes with it), not one it joined (`--address`, $RAY_ADDRESS, a `ray
    start` of this machine), whose Serve and jobs are not this process's to stop."""
    from ray._private import worker   # no public API says whether ray.init started the head

    node = getattr(worker, "_global_node", None)   # private: read defensively; unknown is
    return bool(getattr(node, "head", False))        # "joined" (a local cluster ends with us)


def _probe(address: str, flag: str, timeout_s: float = 5.0) -> None:
    """A TCP connection to the cluster's GCS `host:port`, or a ValueError saying why not."""
    import socket

    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{flag} {address}: expected HOST:PORT of a Ray cluster's head "
                         "(as `ray start --head` prints it), ray://HOST:PORT, or auto")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(f"{flag} {address}: cannot reach the Ray cluster "
                         f"({e.strerror or type(e).__name__}); is `ray start --head` running "
                         "there?") from None


def pool_size(cluster_cpus: float, num_threads: int, options: RayOptions) -> tuple[int, float]:
    """(actors, CPUs per actor) on `cluster_cpus` free CPUs, leaving TASK_CPUS of them to the
    read and write tasks."""
    free = cluster_cpus - TASK_CPUS
    if free <= 0:
        raise ValueError(f"the Ray cluster has {cluster_cpus:g} CPU(s) free; an actor pool needs more "
                         f"than {TASK_CPUS:g} (Ray Data's read and write tasks take one)")
    actor_cpus = options.actor_cpus or min(float(num_threads), free)
    num_actors = options.num_actors or max(1, math.floor(free / actor_cpus + 1e-9))
    if num_actors * actor_cpus > free + 1e-9:
        raise ValueError(f"--actors {num_actors} x --actor-cpus {actor_cpus:g} = "
                         f"{num_actors * actor_cpus:g} CPUs, but the cluster has {cluster_cpus:g} free "
                         f"and Ray Data's read and write tasks need {TASK_CPUS:g} (a pool that "
                         "takes every CPU hangs without an error); lower one of them")
    return num_actors, actor_cpus


class ChunkActor:
    """One Engine per actor; each call runs one chunk (a pyarrow table) to its records."""

    def __init__(self, model_dir: str, catalog: str | None, options: dict, settings: RowSettings,
                 input_format: str, output_format: str, schema: Any,
                 catalog_extended: bool | None = None):
        self.engine = load_engine(model_dir, catalog, options, owns_process=True,
                                  catalog_extended=catalog_extended)
        self.settings, self.input_format, self.output_format = settings, input_format, output_format
        self.schema = schema

    def __call__(self, table: Any) -> Any:
        import pyarrow as pa

        raws = table.column("text").to_pylist() if self.input_format == "jsonl" else \
            table_rows(table, self.settings.id_column)
        records = output_records(run_chunk(self.engine, raws, self.settings), self.schema)
        if self.output_format == "parquet":
            return records_table(records, self.schema)
        return pa.table({"jsonl": pa.array([records_jsonl([r]) for r in records], pa.binary())})


def run_batch_ray(job: BatchJob, options: RayOptions) -> BatchSummary:
    """Run `job` with Ray Data; the same records as `batch.run_batch`, row for row."""
    import ray

    if job.resume:   # Ray would write every row again beside the parts already there
        raise ValueError(NOT_RESUMABLE)
    job.check_settings()
    input_format, output_format = job.formats()
    info = check_input(job.input, input_format, job.settings)
    if info.format == "jsonl":
        _check_utf8(info.path)
    elif not Path(info.path).suffix:
        raise ValueError(f"--input {info.path}: --ray reads a Parquet file by its suffix (Ray "
                         "Data's reader skips a name without one); give it one, e.g. .parquet")
    schema = output_schema_for(info, output_format)
    num_chunks = job.num_chunks(info)
    identity = job.identity(info, output_format)
    out = Path(job.output).resolve()
    with hold_output(job):
        prepare_output(job, identity)
        is_local = connect(options.address)
        try:
            # what is free now: Serve replicas or other jobs may hold part of the cluster
            cluster_cpus = float(ray.available_resources().get("CPU", 0))
            engine_options = job.options()
            num_actors, actor_cpus = pool_size(cluster_cpus, engine_options["num_threads"], options)
            logger.info("xrec batch --ray: %d actor(s) x %g CPU(s), %d intra-op thread(s) each, "
                        "on a cluster of %g CPUs", num_actors, actor_cpus,
                        engine_options["num_threads"], cluster_cpus)
            started = time.perf_counter()
            dataset = _dataset(info, job, engine_options, schema, output_format, num_actors,
                               actor_cpus, options.actor_gpus)
            _write(dataset, out, output_format, job.progress)
            seconds = time.perf_counter() - started
        finally:
            if is_local:
                ray.shutdown()
        num_errors = count_errors(out)
        write_manifest(out, identity, num_chunks, info.num_rows, True,
                       ray={"actors": num_actors, "actor_cpus": actor_cpus})
    return BatchSummary(info.num_rows, num_errors, seconds, str(out))


def _check_utf8(path: str) -> None:
    """Ray Data's `read_text` decodes strictly: a line that is not UTF-8 would fail the whole
    run midway, so it is refused before anything starts (the in-process run fails that row
    alone)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ValueError(f"--input {path}: line {number} is not UTF-8 text; --ray reads "
                                 "only UTF-8 (without --ray that row alone fails)") from None


def _dataset(info: InputInfo, job: BatchJob, engine_options: dict, schema: Any, output_format: str,
             num_actors: int, actor_cpus: float, actor_gpus: float) -> Any:
    import ray
    from ray.data import ActorPoolStrategy, DataContext

    context = DataContext.get_current()
    context.execution_options.preserve_order = True   # chunk k = rows of chunk k, in order
    context.enable_progress_bars = job.progress
    if info.format == "parquet":
        # the file's own suffix: the format is decided (`.pq`, --format parquet), and Ray
        # Data reads `*.parquet` only unless told (None is that default too)
        dataset = ray.data.read_parquet(info.path, columns=list(info.columns),
                                        file_extensions=[Path(info.path).suffix])
    else:
        dataset = ray.data.read_text(info.path, drop_empty_lines=True)
    dataset = dataset.repartition(target_num_rows_per_block=job.chunk_rows, strict=True)
    return dataset.map_batches(
        ChunkActor, batch_size=job.chunk_rows, batch_format="pyarrow", zero_copy_batch=True,
        compute=ActorPoolStrategy(size=num_actors), num_cpus=actor_cpus,
        num_gpus=actor_gpus or None,
        fn_constructor_kwargs={"model_dir": job.model_dir, "catalog": job.catalog,
                               "options": engine_options, "settings": job.settings,
                               "input_format": info.format, "output_format": output_format,
                               "schema": schema, "catalog_extended": job.catalog_extended})


def _write(dataset: Any, out: Path, output_format: str, progress: bool) -> None:
    from ray.data.datasource import BlockBasedFileDatasink, FilenameProvider

    class PartNames(FilenameProvider):
        def __init__(self, suffix: str):
            super().__init__()
            self.suffix = suffix

        def get_filename_for_task(self, write_uuid: str, task_index: int) -> str:
            return f"part-{task_index:06d}-{write_uuid}{self.suffix}"   # task order = row order

    if output_format == "parquet":
        dataset.write_parquet(str(out), filename_provider=PartNames(".parquet"))
        return

    class JsonlDatasink(BlockBasedFileDatasink):
        """Writes the actors' serialized lines as they are (the in-process bytes)."""

        def write_block_to_file(self, block: Any, file: Any) -> None:
            for line in block.to_arrow().column("jsonl").to_pylist():
                file.write(line)

    dataset.write_datasink(JsonlDatasink(str(out), filename_provider=PartNames(".jsonl")))


__all__ = ["RayOptions", "run_batch_ray", "connect", "pool_size", "ChunkActor", "MANIFEST"]
