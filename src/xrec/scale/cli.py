"""`xrec batch` and `xrec serve --ray`: their flags, registered on `xrec`'s parser.

Nothing here imports torch or ray: `xrec --help` stays fast, and a Ray flag without
Ray installed is one clear error line (exit 1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from xrec.config import EngineOptions
from xrec.config.engine import add_catalog_flags, check_catalog_flags
from xrec.demo import model_dir_or_demo

if TYPE_CHECKING:
    from xrec.scale.batch import BatchJob

RAY_MISSING = ("Ray is not installed; install the optional extra: pip install 'xrec[ray]' "
               "(the default, without --ray, needs no Ray)")


def require_ray(flag: str) -> Any:
    """`ray`, or a ValueError naming the flag and the install command."""
    try:
        import ray
    except ImportError:
        raise ValueError(f"{flag}: {RAY_MISSING}") from None
    return ray


def add_batch_parser(sub: Any) -> argparse.ArgumentParser:
    batch = sub.add_parser("batch", help="recommendations for every row of a Parquet / JSONL "
                           "file (offline candidate generation), in process or with --ray")
    batch.add_argument("--input", required=True, help="Parquet or JSONL file, one request per "
                       "row: an id column and token_ids, prompt or sparse_embedding; optional "
                       "exclude_items (a list of catalog item ids never to recommend)")
    batch.add_argument("--output", required=True, help="output directory (part files + "
                       "_xrec_batch.json); refused if it exists, unless --resume or --overwrite")
    batch.add_argument("--model", help="model directory (default: the built-in demo model)")
    add_catalog_flags(batch)
    batch.add_argument("--format", dest="input_format", choices=("parquet", "jsonl"),
                       help="input format (default: from the suffix)")
    batch.add_argument("--output-format", choices=("parquet", "jsonl"),
                       help="output format (default: the input's)")
    batch.add_argument("--id-column", default="id", help="the input's id column (default: id)")
    batch.add_argument("--beam-width", type=int, help="default: the engine's default_beam_width")
    batch.add_argument("--num-results", type=int, help="semantic ids per row (default: the "
                       "beam width)")
    batch.add_argument("--no-items", action="store_true", help="no catalog items in the output")
    batch.add_argument("--chunk-rows", type=int, default=1024, help="rows submitted to an "
                       "engine at once; also the unit of --resume and of a Ray batch (default 1024)")
    again = batch.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue the run that wrote "
                       "--output (a killed run restarts where it stopped)")
    again.add_argument("--overwrite", action="store_true", help="replace --output")
    batch.add_argument("--no-progress", action="store_true", help="no progress bar")
    ray = batch.add_argument_group("Ray Data (--ray; pip install 'xrec[ray]')")
    ray.add_argument("--ray", action="store_true", help="map_batches over an actor pool of "
                     "engines (a local Ray cluster, or --address)")
    ray.add_argument("--address", help="an existing Ray cluster (default: $RAY_ADDRESS, else "
                     "a local one)")
    ray.add_argument("--actors", type=int, help="engine actors (default: as many as the "
                     "cluster's CPUs hold, keeping one CPU for reading and writing)")
    ray.add_argument("--actor-cpus", type=float, help="CPUs each actor reserves (default: "
                     "--num-threads, at most the cluster's CPUs less one)")
    ray.add_argument("--actor-gpus", type=float, help="GPUs each actor reserves (default 0)")
    EngineOptions.add_cli_args(batch)
    batch.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    batch.set_defaults(run=run_batch_command, interrupted_hint=_resume_hint)   # Ctrl-C: xrec.cli
    return batch


def batch_job(args: argparse.Namespace) -> BatchJob:
    from xrec.scale.batch import BatchJob
    from xrec.scale.rows import RowSettings

    # --normalize is the engine option (every row's default)
    settings = RowSettings(args.id_column, args.beam_width, args.num_results, None,
                           not args.no_items)
    return BatchJob(args.input, args.output, model_dir_or_demo(args.model), args.catalog, settings,
                    args.input_format, args.output_format, args.chunk_rows,
                    EngineOptions.kwargs_from_cli(args),
                    args.resume, args.overwrite, not args.no_progress, args.catalog_extended)


def run_batch_command(args: argparse.Namespace) -> int:
    check_catalog_flags(args.catalog, args.catalog_extended)
    if args.ray:
        require_ray("--ray")
        if args.resume:   # before the demo model is written on first use
            from xrec.scale.batch_ray import NOT_RESUMABLE
            raise ValueError(NOT_RESUMABLE)
    else:
        refuse_ray_flags(args, BATCH_RAY_FLAGS, "`xrec batch` runs one engine in this process")
    job = batch_job(args)
    if args.ray:
        from xrec.scale.batch_ray import RayOptions, run_batch_ray
        summary = run_batch_ray(job, RayOptions(args.address, args.actors, args.actor_cpus,
                                                args.actor_gpus or 0.0))
    else:
        from xrec.scale.batch import run_batch
        summary = run_batch(job, owns_process=True)
    if summary.num_rows == 0:
        done = f"{summary.num_skipped} rows already written" if summary.num_skipped else \
            "the input has no rows"
        print(f"xrec batch: nothing to do: {done} -> {summary.output}", file=sys.stderr)
        return 0
    skipped = f", {summary.num_skipped} already written" if summary.num_skipped else ""
    dtype = f", {summary.dtype}" if summary.dtype else ""
    print(f"xrec batch: {summary.num_rows} rows ({summary.num_errors} errors{skipped}) in "
          f"{summary.seconds:.1f} s, {summary.rows_per_s:.1f} rows/s{dtype} -> {summary.output}",
          file=sys.stderr)
    return 0


def _resume_hint(args: argparse.Namespace) -> str:
    """What an interrupted run left (`xrec.cli.main`'s Ctrl-C line): the rows its manifest
    counts, and how to go on."""
    from xrec.scale.batch import read_manifest

    try:
        manifest = None if args.ray else read_manifest(Path(args.output))
    except ValueError:
        manifest = None
    if manifest is None:
        return ""
    if manifest.get("is_complete"):
        return f"; all {manifest['num_done_rows']} rows are written to {args.output}"
    return (f"; {manifest['num_done_rows']} of {manifest['job']['input_rows']} rows are "
            f"written to {args.output}: run it again with --resume to continue")


# ---- xrec serve --ray -----------------------------------------------------------------------

# the flags only --ray applies (default None: given or not); without --ray they were
# accepted and ignored
BATCH_RAY_FLAGS = ("address", "actors", "actor_cpus", "actor_gpus")
SERVE_RAY_FLAGS = ("replicas", "max_replicas", "address", "replica_cpus", "replica_gpus")


def refuse_ray_flags(args: argparse.Namespace, names: tuple[str, ...], without: str) -> None:
    """ValueError naming the Ray flags given without --ray (`without`: what runs instead)."""
    given = ["--" + name.replace("_", "-") for name in names if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: only with --ray (without it, {without}); give "
                         "--ray, or leave them out")


def add_serve_ray_flags(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("Ray Serve (--ray; pip install 'xrec[ray]')")
    group.add_argument("--ray", action="store_true", help="serve through Ray Serve: --replicas "
                       "engines behind one HTTP endpoint (the same routes)")
    group.add_argument("--replicas", type=int, help="replicas (each one Engine; default 1)")
    group.add_argument("--max-replicas", type=int, help="autoscale between --replicas and this "
                       "on the replicas' queues")
    group.add_argument("--address", help="an existing Ray cluster (default: $RAY_ADDRESS, else "
                       "a local one)")
    group.add_argument("--replica-cpus", type=float,
                       help="CPUs each replica reserves; its intra-op threads follow (default 1)")
    group.add_argument("--replica-gpus", type=float, help="GPUs each replica reserves (default 0)")


# `xrec serve`'s own connection handling (xrec.server.limits); with --ray, Serve's proxy
# takes the connections
CONNECTION_FLAGS = ("max_header_bytes", "header_timeout_s", "body_timeout_s", "keep_alive_s",
                    "max_connections")


def check_serve_ray_args(args: argparse.Namespace) -> None:
    """The `xrec serve` flags that --ray cannot apply, refused before Ray starts (they were
    accepted and ignored); without --ray, the flags only --ray applies."""
    if not args.ray:
        refuse_ray_flags(args, SERVE_RAY_FLAGS, "`xrec serve` is one process with one engine")
        return
    if args.catalog_dir is not None:
        raise ValueError("--catalog-dir: catalog loads are not served with --ray (each replica "
                         "holds its own catalog)")
    given = ["--" + name.replace("_", "-") for name in CONNECTION_FLAGS
             if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)}: connection limits are `xrec serve`'s own; with "
                         "--ray, Ray Serve's proxy takes the connections (its RAY_SERVE_* "
                         "settings)")
    if args.port == 0:
        raise ValueError("--port 0: --ray needs a fixed port (Serve's proxies listen on it on "
                         "every node, and report no port they picked)")


def run_serve_ray(args: argparse.Namespace, model_dir: str, engine_options: dict) -> int:
    require_ray("--ray")
    from xrec.scale.serve_app import ServeOptions, serve_forever
    options = ServeOptions.from_args(args, model_dir, engine_options)
    return serve_forever(options, args.address, args.host, args.port)
