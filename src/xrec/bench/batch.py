"""`xrec bench batch`: rows/s of `xrec batch` in process and with `--ray`, next to the Engine.

One input file of `--rows` random requests (Parquet, or JSONL with `--input-format`);
contenders, one after the other on the same file and the same engine options:

* engine:  `Engine.recommend` on the first `--engine-rows` requests, in slices of
           `--chunk-rows` (what an offline caller of the Python API does; no file I/O);
* batch:   `xrec batch` in process on every row (reading, validation, writing included);
* ray:     `xrec batch --ray` on every row (a local Ray cluster of this machine's cores;
           its start-up is outside the measured time, the actors' engine loading inside).

Targets: batch >= 90% of the engine's rows/s; `identical`: the ray output equals the
in-process output, record for record. Rows/s counts the rows answered: an error record
(a row the engine refused) is written at once and is no answer.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from xrec.bench.lib.args import dtype_option, model_dir_of
from xrec.bench.lib.common import environment, environment_markdown, markdown_table, output_paths, \
    write_outputs

CONTENDERS = ("engine", "batch", "ray")


def write_input(path: Path, num_rows: int, vocab_size: int, lengths: tuple[int, int], seed: int,
                fmt: str) -> Path:
    rng = np.random.default_rng(seed)
    sizes = rng.integers(lengths[0], lengths[1] + 1, num_rows)
    ids = [rng.integers(0, vocab_size, n).tolist() for n in sizes]
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.table({"id": np.arange(num_rows), "token_ids": ids}), path,
                       row_group_size=8192)
    else:
        import orjson
        with open(path, "wb") as f:
            for index, tokens in enumerate(ids):
                f.write(orjson.dumps({"id": index, "token_ids": tokens}) + b"\n")
    return path


def run(args: argparse.Namespace) -> int:
    from xrec.config import ModelConfig
    from xrec.scale.batch import BatchJob, run_batch
    from xrec.scale.rows import RowSettings, read_output

    model_dir = model_dir_of(args)
    vocab = ModelConfig.from_file(model_dir / "config.json").vocab_size
    contenders = args.contenders or list(CONTENDERS)
    unknown = sorted(set(contenders) - set(CONTENDERS))
    if unknown:
        raise ValueError(f"--contenders: unknown {unknown}; allowed: {', '.join(CONTENDERS)}")
    env = environment(args.device)
    work = Path(tempfile.mkdtemp(prefix="xrec-bench-batch-", dir=args.out if os.path.isdir(args.out)
                                 else None))
    suffix = ".parquet" if args.input_format == "parquet" else ".jsonl"
    source = write_input(work / f"in{suffix}", args.rows, vocab, tuple(args.lengths), args.seed,
                         args.input_format)
    settings = RowSettings(beam_width=args.beam_width, num_results=args.num_results)
    options = {"device": args.device, **({"num_threads": args.threads} if args.threads else {}),
               **dtype_option(args)}

    def job(out: str) -> BatchJob:
        return BatchJob(str(source), str(work / out), str(model_dir), settings=settings,
                        chunk_rows=args.chunk_rows, engine_options=options,
                        progress=not args.no_progress)

    results: dict[str, dict] = {}
    if "engine" in contenders:
        results["engine"] = _engine_rate(job("unused"), source, min(args.engine_rows, args.rows))
    if "batch" in contenders:
        summary = run_batch(job("batch"))
        results["batch"] = {"rows": summary.num_rows, "seconds": summary.seconds,
                            "rows_per_s": answered_per_s(summary), "errors": summary.num_errors}
    if "ray" in contenders:
        results["ray"] = _ray_rate(job("ray"), args)
    if "batch" in results and "ray" in results:
        results["ray"]["identical"] = read_output(work / "ray") == read_output(work / "batch")
    record = {"benchmark": "batch", "environment": env,
              "settings": {"model_dir": str(model_dir), "size": args.size, "rows": args.rows,
                           "engine_rows": min(args.engine_rows, args.rows),
                           "lengths": args.lengths, "beam_width": args.beam_width,
                           "num_results": args.num_results, "chunk_rows": args.chunk_rows,
                           "input_format": args.input_format, "engine_options":
                           job("x").options(), "work_dir": str(work)},
              "results": results}
    write_outputs(output_paths(args.out, "batch"), record, markdown)
    return 0


def answered_per_s(summary) -> float:
    """Rows answered without an error per second of a `run_batch` summary (its own
    `rows_per_s` counts error records too, which are written without a search)."""
    answered = summary.num_rows - summary.num_errors
    return answered / summary.seconds if summary.seconds > 0 else float("nan")


def _engine_rate(job, source: Path, num_rows: int) -> dict:
    from xrec.scale.batch import load_engine
    from xrec.scale.rows import check_input, decode_row, file_format, iter_chunks

    info = check_input(source, file_format(source), job.settings)
    requests = []
    for _, raws in iter_chunks(info, job.chunk_rows):
        requests += [decode_row(raw, job.settings)[1] for raw in raws]
        if len(requests) >= num_rows:
            break
    requests = requests[:num_rows]
    engine = load_engine(job.model_dir, job.catalog, job.options())
    try:
        engine.recommend(requests[:job.chunk_rows])   # warm-up
        started = time.perf_counter()
        for start in range(0, len(requests), job.chunk_rows):
            engine.recommend(requests[start:start + job.chunk_rows])
        seconds = time.perf_counter() - started
    finally:
        engine.close()
    return {"rows": len(requests), "seconds": seconds, "rows_per_s": len(requests) / seconds}


def _ray_rate(job, args: argparse.Namespace) -> dict:
    import ray

    from xrec.scale.batch_ray import RayOptions, init_ray, run_batch_ray

    started = time.perf_counter()
    init_ray(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    startup = time.perf_counter() - started
    try:
        summary = run_batch_ray(job, RayOptions(num_actors=args.actors, actor_cpus=args.actor_cpus))
    finally:
        ray.shutdown()
    return {"rows": summary.num_rows, "seconds": summary.seconds,
            "rows_per_s": answered_per_s(summary), "errors": summary.num_errors,
            "cluster_startup_s": startup}


def markdown(record: dict) -> str:
    s, r = record["settings"], record["results"]
    engine = r.get("engine", {}).get("rows_per_s")
    rows = []
    for name in CONTENDERS:
        if name not in r:
            continue
        res = r[name]
        ratio = res["rows_per_s"] / engine if engine else None
        target = ""
        if name == "batch" and ratio is not None:
            target = "met" if ratio >= 0.9 else "MISSED"
        rows.append([name, res["rows"], res.get("errors", 0), res["seconds"], res["rows_per_s"],
                     None if ratio is None else f"{ratio:.0%}", target,
                     res.get("identical", "")])
    table = markdown_table(["contender", "rows", "errors", "seconds", "rows/s answered",
                            "vs engine", "batch ≥ 90%", "ray output = in-process"], rows)
    return (f"## xrec bench batch ({s['size']}; {s['rows']} rows of {s['lengths'][0]}-"
            f"{s['lengths'][1]} tokens, W={s['beam_width']}, chunk {s['chunk_rows']} rows, "
            f"{s['input_format']}; engine options {s['engine_options']})\n\n{table}\n\n"
            + environment_markdown(record["environment"]))
