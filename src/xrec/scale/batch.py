"""`xrec batch` in process: every row of a file through one Engine, resumable.

The input is cut into chunks of `chunk_rows` rows (chunk k holds rows
[k * chunk_rows, (k + 1) * chunk_rows)). A chunk's valid requests are submitted to
the engine at once and the next chunk is submitted when this one is answered, so
the engine's batches are a function of the chunk alone: the scheduler's greedy FIFO
split of one submission, with one pipeline (with several, a batch's share depends
on which pipelines are free at the time). Numbers depend on the batch a request
runs in and on the intra-op thread count, so the Ray path (batch_ray.py) gives each
actor exactly one chunk per call and the same engine options. The same records, row
for row (scores to fp32 rounding: see batch_ray.py), with and without Ray, and from one
run to the next, hold with `--adaptive-threads false` and a fixed `--num-threads`. With
the default (adaptive threads: an engine runs fewer threads while other processes take
cores), scores can differ in the last bits, and near-ties can swap, as the machine's
load changes the thread count. The effective setting is in the manifest's identity, so
a `--resume` under another is refused.

Three threads keep the engine busy: a reader decodes and validates chunk k + 1
while chunk k runs; a writer turns chunk k - 1's answers into records and writes
them. The output is a directory of part files, `part-000000.parquet` (or `.jsonl`)
per chunk, and a manifest `_xrec_batch.json`. A part file is written under a
temporary name and renamed, then the manifest (also renamed into place) counts it;
a killed run leaves at most a part file that the manifest does not count, which a
`--resume` deletes and writes again: every row exactly once (a counted part that is
missing or not whole is written again too, with every part after it). A run holds a lock on
`._xrec_batch.lock` in the output directory from start to end: a second run on the same
directory fails at once instead of deleting the parts the first has not yet counted.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

from xrec.errors import XrecError
from xrec.scale.rows import (InputInfo, RowError, RowSettings, answer_record, check_input,
                             decode_row, error_record, file_format, iter_chunks, naming_os_errors,
                             output_records, output_schema_for, pyarrow_modules, write_records)
from xrec.utils.files import fsync_path
from xrec.utils.fresh_thread import in_fresh_thread

if TYPE_CHECKING:
    from xrec.engine.engine import Engine
    from xrec.engine.frontend import EngineFrontend

logger = logging.getLogger("xrec.batch")

MANIFEST = "_xrec_batch.json"
HIDDEN = "._xrec_batch."      # xrec batch's own hidden files: the lock, a manifest being written
LOCK = HIDDEN + "lock"
DEFAULT_CHUNK_ROWS = 1024
MAX_CHUNKS = 999_999          # part-{chunk:06d}: past it, names no longer sort in chunk order
SUFFIX = {"parquet": ".parquet", "jsonl": ".jsonl"}


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class BatchJob:
    """One `xrec batch` run. `engine_options`: `Engine.from_pretrained` options; the batch
    sets `max_concurrency=1`, `num_threads` (default: this machine's usable cores) and
    `adaptive_threads` (default: the engine's, resolved: `options`)."""

    input: str
    output: str
    model_dir: str
    catalog: str | None = None
    settings: RowSettings = field(default_factory=RowSettings)
    input_format: str | None = None
    output_format: str | None = None
    chunk_rows: int = DEFAULT_CHUNK_ROWS
    engine_options: dict = field(default_factory=dict)
    resume: bool = False
    overwrite: bool = False
    progress: bool = True
    catalog_extended: bool | None = None   # how to read `catalog` (Engine.from_pretrained)

    def __post_init__(self) -> None:
        if isinstance(self.chunk_rows, bool) or not isinstance(self.chunk_rows, int) or \
                not 1 <= self.chunk_rows <= 1 << 20:
            raise ValueError(f"--chunk-rows: got {self.chunk_rows!r}, allowed: 1 to {1 << 20}")
        if self.resume and self.overwrite:
            raise ValueError("--resume and --overwrite: give one of them")
        concurrency = self.engine_options.get("max_concurrency")
        if concurrency not in (None, 1):
            raise ValueError(f"--max-concurrency: got {concurrency}; xrec batch runs one pipeline "
                             "per engine (with several, batches depend on timing and the output "
                             "is not reproducible); use --num-threads, or --ray for more engines")

    def options(self) -> dict:
        """The engine options every engine of this job uses (in process or in a Ray actor).
        `adaptive_threads` is resolved here (the engine's default follows the environment) so
        that the identity says what ran: it changes the records (see the module docstring)."""
        from xrec.engine.threads import adaptive_by_default

        options = dict(self.engine_options)
        options["max_concurrency"] = 1
        options.setdefault("num_threads", usable_cores())
        if options.get("adaptive_threads") is None:
            options["adaptive_threads"] = adaptive_by_default()
        options["request_queue_size"] = max(options.get("request_queue_size") or 0,
                                            self.chunk_rows, 1024)
        return options

    def check_settings(self) -> None:
        """The search settings every row shares, against the engine options (ValueError naming
        the flag): one out of range failed every row alone, once the model had loaded, and the
        run wrote an output of error records and exited 0."""
        from xrec.config import EngineOptions

        options = EngineOptions.from_kwargs(**self.options())
        for flag, value, high, option in (
                ("--beam-width", self.settings.beam_width, options.max_beam_width, "max_beam_width"),
                ("--num-results", self.settings.num_results, options.max_top_k, "max_top_k")):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= high):
                raise ValueError(f"{flag}: got {value!r}, allowed: 1 to {high} (the engine option "
                                 f"{option})")

    def formats(self) -> tuple[str, str]:
        """(input format, output format): the output's is the input's unless given."""
        fmt = file_format(self.input, self.input_format)
        return fmt, file_format(self.output, self.output_format or fmt, "--output")

    def num_chunks(self, info: InputInfo) -> int:
        """The input's chunks; ValueError past MAX_CHUNKS (part names would sort out of order)."""
        num_chunks = -(-info.num_rows // self.chunk_rows)
        if num_chunks > MAX_CHUNKS:
            raise ValueError(f"--chunk-rows {self.chunk_rows}: {info.num_rows} rows make "
                             f"{num_chunks} chunks, more than the {MAX_CHUNKS} part files an "
                             f"output holds; give --chunk-rows {-(-info.num_rows // MAX_CHUNKS)} "
                             "or more")
        return num_chunks

    def identity(self, info: InputInfo, output_format: str) -> dict:
        """What a resumed run must share with the run it continues: the model's files and the
        catalog's by size and mtime too (changed in place, the same paths load another model)."""
        stat = os.stat(info.path)
        return {"input": os.path.abspath(info.path), "input_size": stat.st_size,
                "input_mtime_ns": stat.st_mtime_ns, "input_rows": info.num_rows,
                "output_format": output_format, "chunk_rows": self.chunk_rows,
                "model_dir": os.path.abspath(self.model_dir),
                "model_files": model_files_stamp(self.model_dir),
                "catalog": None if self.catalog is None else os.path.abspath(self.catalog),
                "catalog_file": None if self.catalog is None else catalog_stamp(self.catalog),
                "catalog_extended": self.catalog_extended,
                "settings": asdict(self.settings),
                "engine_options": {k: (list(v) if isinstance(v, tuple) else v)
                                   for k, v in sorted(self.options().items())}}


def model_files_stamp(model_dir: str) -> dict[str, list[int]]:
    """{name: [size, mtime_ns]} of the regular files directly in `model_dir`."""
    if not os.path.isdir(model_dir):
        raise ValueError(f"--model {model_dir}: no such directory")
    with os.scandir(model_dir) as entries:
        files = sorted((e.name, e.stat()) for e in entries if e.is_file())
    return {name: [stat.st_size, stat.st_mtime_ns] for name, stat in files}


def catalog_stamp(catalog: str) -> list[int]:
    """[size, mtime_ns] of the catalog file."""
    try:
        stat = os.stat(catalog)
    except FileNotFoundError:
        raise ValueError(f"--catalog {catalog}: no such file") from None
    return [stat.st_size, stat.st_mtime_ns]


@dataclass
class BatchSummary:
    num_rows: int          # rows written by this run
    num_errors: int        # of them, error records
    seconds: float
    output: str
    num_skipped: int = 0   # rows a resumed run found already written
    dtype: str | None = None   # the dtype the engine ran in (None: no engine here, e.g. --ray)

    @property
    def rows_per_s(self) -> float:
        return self.num_rows / self.seconds if self.seconds > 0 else float("nan")


# ---- the output directory ------------------------------------------------------------------

@contextmanager
def hold_output(job: BatchJob) -> Iterator[None]:
    """`job.output`, made and held by this run alone: an exclusive lock on its LOCK file from
    before `prepare_output` to the end. Two runs on one directory lose rows: a --resume
    deletes the part another run has renamed but not yet counted. The lock file stays (an
    unlinked one could be locked by one run while another locks its replacement)."""
    check_output(job)   # a refused run leaves no lock file in a directory that is not its own
    out = Path(job.output)
    out.mkdir(parents=True, exist_ok=True)
    with naming_os_errors(out / LOCK):
        fd = os.open(out / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ValueError(f"--output {out}: another xrec batch run is writing it (it holds "
                             f"{out / LOCK}); wait for it to end, or give another --output") from None
        yield
    finally:
        os.close(fd)


def is_ours(name: str) -> bool:
    """A file xrec batch writes: the manifest, its hidden files, a part (or one half written)."""
    return name == MANIFEST or name.startswith((HIDDEN, "part-", ".part-"))


def check_output(job: BatchJob) -> list[str]:
    """The names in `job.output` ([]: not there yet), or a ValueError where this run must not
    write there. A directory holding only xrec batch's hidden files (the lock, a manifest a
    kill left half written) counts as empty."""
    out = Path(job.output)
    if not out.exists():
        if job.resume:
            raise _no_earlier_run(out)
        return []
    if not out.is_dir():
        raise ValueError(f"--output {out}: exists and is not a directory")
    entries = sorted(os.listdir(out))
    if job.overwrite:
        strangers = [name for name in entries if not is_ours(name)]
        if strangers:
            raise ValueError(f"--overwrite: {out} holds files that xrec batch did not write "
                             f"({', '.join(strangers[:5])}); refusing to delete them")
    elif job.resume:
        if MANIFEST not in entries:
            raise _no_earlier_run(out)
    elif any(not name.startswith(HIDDEN) for name in entries):
        raise ValueError(f"--output {out}: exists and is not empty; give --resume to continue "
                         "the run that wrote it, or --overwrite to replace it")
    return entries


def _no_earlier_run(out: Path) -> ValueError:
    return ValueError(f"--resume: {out} holds no earlier run (no {MANIFEST})")


def prepare_output(job: BatchJob, identity: dict) -> int:
    """Make `job.output` (held: `hold_output`) ready; the number of chunks already written
    (a resumed run)."""
    out = Path(job.output)
    ours = [name for name in check_output(job) if is_ours(name) and name != LOCK]
    if not job.resume:   # --overwrite, or an empty directory: anything of ours goes
        for name in ours:
            (out / name).unlink()
        return 0
    manifest = read_manifest(out)
    if manifest is None:
        raise _no_earlier_run(out)
    if "ray" in manifest:
        raise ValueError(f"--resume: {out} was written by a --ray run, which is not resumable "
                         "(Ray Data writes its parts; its manifest is written once they all "
                         "are): that output is complete; give --overwrite to write it again")
    differing = [key for key in identity if manifest.get("job", {}).get(key) != identity[key]]
    if differing:
        raise ValueError(f"--resume: {out} was written by a different run ({', '.join(differing)} "
                         "differ); give the same input, model and settings, or --overwrite")
    done = intact_chunks(out, identity, int(manifest["num_done_chunks"]))
    kept = {part_name(k, identity["output_format"]) for k in range(done)}
    for name in ours:   # written after the manifest, or half written (a part, the manifest)
        if name != MANIFEST and name not in kept:
            (out / name).unlink()
    return done


def intact_chunks(out: Path, identity: dict, num_done: int) -> int:
    """How many of the `num_done` chunks the manifest counts are there whole: the first whose
    part is missing, unreadable or holds other than its chunk's rows (a copy cut short, a
    power loss before parts were fsynced) is written again, with every part after it."""
    fmt, chunk_rows, num_rows = identity["output_format"], identity["chunk_rows"], identity["input_rows"]
    for chunk in range(num_done):
        path = out / part_name(chunk, fmt)
        expected = min(chunk_rows, num_rows - chunk * chunk_rows)
        found = part_rows(path, fmt)
        if found != expected:
            logger.warning("--resume: %s %s; writing it and every part after it again", path,
                           found if isinstance(found, str) else
                           f"holds {found} rows, its chunk has {expected}")
            return chunk
    return num_done


def part_rows(path: Path, fmt: str) -> int | str:
    """The rows of a part file, or why it has none (missing, unreadable)."""
    if not path.is_file():
        return "is missing"
    if fmt == "parquet":
        _, pq = pyarrow_modules()
        try:
            return pq.ParquetFile(path).metadata.num_rows
        except Exception as e:   # pyarrow's own errors: truncated, not Parquet, ...
            return f"is not a readable Parquet file ({e})"
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            lines, last = lines + block.count(b"\n"), block[-1:]
    return lines if last == b"\n" else "ends in a partial line"


def part_name(chunk: int, fmt: str) -> str:
    return f"part-{chunk:06d}{SUFFIX[fmt]}"


def read_manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except ValueError as e:
        raise ValueError(f"{out / MANIFEST}: unreadable ({e}); give --overwrite to start over") from None


def write_manifest(out: Path, identity: dict, num_done_chunks: int, num_done_rows: int,
                   is_complete: bool, **extra: Any) -> None:
    tmp = out / f".{MANIFEST}.tmp"
    body = {"job": identity, "num_done_chunks": num_done_chunks, "num_done_rows": num_done_rows,
            "is_complete": is_complete, **extra}
    with naming_os_errors(out / MANIFEST):
        with open(tmp, "w") as f:
            f.write(json.dumps(body, indent=1) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out / MANIFEST)
        fsync_path(out)


# ---- chunks ----------------------------------------------------------------------------------

Prepared = list   # per row: (row id, ValidRequest) or an error record (dict)


def prepare_chunk(engine: EngineFrontend, raws: Sequence[Any], settings: RowSettings) -> Prepared:
    """Decode and validate a chunk's rows (prompts are tokenized here)."""
    prepared: Prepared = []
    for raw in raws:
        try:
            row_id, request = decode_row(raw, settings)
        except RowError as e:
            prepared.append(error_record(e.row_id, e.code, e.message))
            continue
        try:
            prepared.append((row_id, engine.validate(request)))
        except XrecError as e:
            prepared.append(error_record(row_id, e.code, e.message))
    return prepared


def submit_chunk(engine: EngineFrontend, prepared: Prepared) -> list[Future]:
    """The chunk's valid requests, submitted at once (so the engine's batches depend on the
    chunk only)."""
    return engine.submit_valid_many([p[1] for p in prepared if isinstance(p, tuple)])


def chunk_records(prepared: Prepared, futures: Sequence[Future]) -> list[dict]:
    """Records in row order, from the answers of `submit_chunk` (waits for each)."""
    answers = iter(futures)
    records = []
    for item in prepared:
        if isinstance(item, dict):
            records.append(item)
            continue
        row_id, _ = item
        try:
            records.append(answer_record(row_id, next(answers).result()))
        except XrecError as e:
            records.append(error_record(row_id, e.code, e.message))
    return records


def run_chunk(engine: EngineFrontend, raws: Sequence[Any], settings: RowSettings) -> list[dict]:
    """One chunk start to end (the Ray actors' call)."""
    prepared = prepare_chunk(engine, raws, settings)
    futures = submit_chunk(engine, prepared)
    for future in futures:   # all answered before records are built: the chunk ran whole
        future.exception()
    return chunk_records(prepared, futures)


# ---- the run -----------------------------------------------------------------------------

def load_engine(model_dir: str, catalog: str | None, options: dict,
                owns_process: bool = False, catalog_extended: bool | None = None) -> Engine:
    """The engine, in-thread, built in a thread that ends (so this thread keeps no OpenMP
    team) with the imports a run needs: Ctrl-C reaches the caller only once it is built (a
    process that exits with a half-made engine aborts; a built one is closed at exit), and
    never inside an import. A KeyboardInterrupt raised in an import turned into another error
    (a dataclass's `__set_name__` wraps it in a RuntimeError), or, under `python -m xrec`,
    killed the process by SIGINT at exit whatever it returned: CPython 3.11 takes a
    KeyboardInterrupt that crossed an `exec` of source text, as dataclasses build their
    methods, for unhandled even when it was caught (docs/decisions.md, "Ctrl-C").
    `owns_process`: this process exists to run it (the `xrec batch` command, a Ray actor or
    replica), so it takes a serving process's settings (`Engine.own_process`)."""
    def load() -> Engine:
        import tqdm  # noqa: F401  (the run's progress bar)

        from xrec import Engine

        engine = Engine.from_pretrained(model_dir, catalog=catalog, isolation="thread",
                                        catalog_extended=catalog_extended, **options)
        if owns_process:
            engine.own_process()
        return engine

    return in_fresh_thread(load)


_DONE = object()


def run_batch(job: BatchJob, engine: EngineFrontend | None = None,
              owns_process: bool = False) -> BatchSummary:
    """Run `job` in this process (`engine`: an already loaded one with `job.options()`;
    `owns_process`: see `load_engine`)."""
    job.check_settings()
    input_format, output_format = job.formats()
    info = check_input(job.input, input_format, job.settings)
    schema = output_schema_for(info, output_format)
    num_chunks = job.num_chunks(info)
    identity = job.identity(info, output_format)
    out = Path(job.output)
    with hold_output(job):
        start_chunk = prepare_output(job, identity)
        done_rows = min(start_chunk * job.chunk_rows, info.num_rows)
        if start_chunk >= num_chunks:
            write_manifest(out, identity, num_chunks, info.num_rows, True)
            return BatchSummary(0, 0, 0.0, str(out), done_rows)
        write_manifest(out, identity, start_chunk, done_rows, False)
        own_engine = engine is None
        if own_engine:
            engine = load_engine(job.model_dir, job.catalog, job.options(), owns_process,
                                 job.catalog_extended)
        try:
            return _pipeline(job, engine, info, identity, schema, output_format, start_chunk,
                             num_chunks, done_rows)
        finally:
            if own_engine:
                engine.close()


def _pipeline(job: BatchJob, engine: EngineFrontend, info: InputInfo, identity: dict, schema: Any,
              output_format: str, start_chunk: int, num_chunks: int, done_rows: int) -> BatchSummary:
    from tqdm import tqdm

    out = Path(job.output)
    prepared_chunks: queue.Queue = queue.Queue(maxsize=1)   # the reader's lookahead: one chunk
    answered: queue.Queue = queue.Queue(maxsize=2)
    failures: list[BaseException] = []
    stop = threading.Event()
    counts = {"rows": 0, "errors": 0}
    bar = tqdm(total=info.num_rows, initial=done_rows, unit="row", desc="xrec batch",
               disable=not job.progress, file=sys.stderr, smoothing=0.05)

    def put(q: queue.Queue, item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for index, raws in iter_chunks(info, job.chunk_rows, start_chunk):
                if not put(prepared_chunks, (index, prepare_chunk(engine, raws, job.settings))):
                    return
        except BaseException as e:   # re-raised by the caller
            failures.append(e)
            stop.set()
        put(prepared_chunks, _DONE)

    def write() -> None:
        rows = done_rows
        try:
            while True:
                try:
                    item = answered.get(timeout=0.1)
                except queue.Empty:
                    if stop.is_set():
                        return
                    continue
                if item is _DONE:
                    return
                index, prepared, futures = item
                records = output_records(chunk_records(prepared, futures), schema)
                write_records(out / part_name(index, output_format), records, output_format, schema)
                rows += len(records)
                counts["rows"] += len(records)
                counts["errors"] += sum(r["error"] is not None for r in records)
                write_manifest(out, identity, index + 1, rows, index + 1 == num_chunks)
                bar.update(len(records))
        except BaseException as e:   # re-raised by the caller
            failures.append(e)
            stop.set()

    started = time.perf_counter()
    reader = threading.Thread(target=read, name="xrec-batch-read", daemon=True)
    writer = threading.Thread(target=write, name="xrec-batch-write", daemon=True)
    reader.start()
    writer.start()
    is_clean = False
    try:
        while not stop.is_set():
            try:
                item = prepared_chunks.get(timeout=0.1)
            except queue.Empty:
                continue
            if item is _DONE:
                is_clean = put(answered, _DONE)   # the writer drains what is queued, then stops
                break
            index, prepared = item
            futures = submit_chunk(engine, prepared)
            for future in futures:   # the next chunk waits: an engine batch never mixes chunks
                while not stop.is_set() and not _is_done_within(future, 0.1):
                    pass
            put(answered, (index, prepared, futures))
    finally:
        if not is_clean:
            stop.set()
        writer.join()
        stop.set()
        reader.join()
        bar.close()
    if failures:
        raise failures[0]
    return BatchSummary(counts["rows"], counts["errors"], time.perf_counter() - started, str(out),
                        done_rows, engine.dtype)


def _is_done_within(future: Future, timeout_s: float) -> bool:
    try:
        future.exception(timeout=timeout_s)
    except FutureTimeout:
        return False
    return True
