"""`xrec bench offline | scaling | breakdown | roofline | serve | embedded | batch |
contention`: argument parsing and dispatch.

Every command runs its contenders side by side (on a CPU, `offline` and `scaling` run each
xrec engine in a child process of its own: one OpenMP team per process), prints a Markdown
table and writes `<out>/<name>-<timestamp>.json`, `.md` and (where a curve says more)
`.png`. Heavy imports (torch, transformers, matplotlib) happen inside the commands.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from xrec.bench.lib.models import BENCH_SIZES, QUICK_SIZE

# family -> (default size, --quick size)
FAMILY_SIZES = {"onerec": ("onerec-0.015b", QUICK_SIZE), "qwen3": ("qwen3-sid-tiny", "qwen3-sid-test")}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    default_size, quick_size = FAMILY_SIZES[args.family]
    args.is_size_given = args.size is not None   # --case gr-inference: its own default on CUDA
    if args.quick and getattr(args, "case", None):   # --quick ran the tiny grid in its place
        parser.error(f"--quick runs the tiny grid, not a --case: leave out --quick or --case "
                     f"{args.case} (--case gr-inference scales down with --size, --contexts, "
                     f"--batches, --beam-width)")
    if args.quick:
        apply_quick(args)
        args.size = quick_size
    args.size = args.size or default_size
    if BENCH_SIZES[args.size].is_encoder_decoder != (args.family == "onerec"):
        parser.error(f"--size {args.size} is not of --family {args.family}")
    try:   # now, not after minutes of measuring: results that cannot be written are lost
        Path(args.out).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        parser.error(f"--out {args.out}: cannot be the output directory ({e.strerror})")
    try:
        return args.run(args) or 0
    except (ValueError, OSError) as e:
        print(f"xrec bench {args.command}: error: {e}", file=sys.stderr)
        return 1


def _count(text: str) -> int:
    """A count of runs, requests, rows, tokens or threads: an integer >= 1."""
    return _int_at_least(text, 1)


def _count0(text: str) -> int:
    """A count that may be 0 (warm-up runs, the online row's clients): an integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _floats(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected numbers > 0, got {text!r}")
    return values


def _workloads(text: str) -> list[tuple[str, int, int, int]]:
    workloads = []
    for item in _names(text):
        size, *numbers = item.split(":")
        if size not in BENCH_SIZES or len(numbers) != 3:
            raise argparse.ArgumentTypeError(f"expected SIZE:W:L:B with SIZE among "
                                             f"{', '.join(BENCH_SIZES)}, got {item!r}")
        workloads.append((size, *_ints(",".join(numbers))))
    return workloads


def _dtypes(text: str) -> list[str]:
    allowed = ("float32", "bfloat16", "float16")
    names = _names(text)
    if not names or any(n not in allowed for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated dtypes among "
                                         f"{', '.join(allowed)}, got {text!r}")
    return names


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="xrec bench", description="Benchmarks (see docs/benchmarks.md).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--family", choices=sorted(FAMILY_SIZES), default="onerec",
                       help="model family: onerec (encoder-decoder) or qwen3 (decoder-only, "
                       "OpenOneRec's vocabulary); sets the default --size")
        p.add_argument("--size", choices=sorted(BENCH_SIZES), default=None,
                       help="named model size (default: onerec-0.015b, or qwen3-sid-tiny for "
                       "--family qwen3)")
        p.add_argument("--model", help="an existing model directory (with a catalog) instead of "
                       "a random model of --size")
        p.add_argument("--items", type=_count, default=100_000, help="random catalog size")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--out", default="bench-results", help="output directory")
        p.add_argument("--warmup", type=_count0, default=1, help="warm-up runs per contender (the last "
                       "one measures peak memory and gives the results that are compared)")
        p.add_argument("--repeats", type=_count, default=5, help="measured runs per contender")
        p.add_argument("--threads", type=_count, help="torch intra-op threads (default: torch's)")
        p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
        p.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                       help="xrec's dtype (default: the engine's 'auto': bfloat16 where the "
                            "hardware has it natively and the family allows it, else float32); "
                            "hf and naive always run float32")
        p.add_argument("--quick", action="store_true", help=f"tiny sizes ({QUICK_SIZE}, a few "
                       "requests): a smoke test in seconds")
        p.add_argument("--no-progress", action="store_true", help="no progress bar")

    def contenders(p: argparse.ArgumentParser, default: str) -> None:
        p.add_argument("--contenders", type=_names, default=None,
                       help="comma-separated among xrec, xrec-full, xrec-filter, xrec-fp32 (xrec in "
                            "float32 whatever --dtype says), hf, naive "
                            f"(default {default})")
        p.add_argument("--hf-repeats", type=_count, default=None,
                       help="measured runs of the slow contenders hf and naive "
                            "(default: --repeats, at most 3)")

    offline = sub.add_parser("offline", help="requests/s and latency of a batch vs HF generate")
    common(offline)
    offline.add_argument("--cuda-graphs", default=None, choices=("true", "false"),
                         help="the engine's option cuda_graphs (default: on for CUDA): false "
                              "launches every round from Python (the rows before graphs)")
    contenders(offline, "xrec,xrec-full,hf,naive; xrec,xrec-full,hf for --case; xrec,xrec-filter "
                        "for --case filter; xrec-eager,hf for --case gr-inference")
    offline.add_argument("--case", choices=("target1", "target2", "targets", "filter",
                                            "gr-inference"),
                         help="the headline cases: onerec (docs/quality.md): target1 W=128 L=256 "
                         "16 requests, target2 W=512 L=1024 4 requests; qwen3 (issue 9): target1 "
                         "W=128 L=256 4 requests; targets: all of the family's; filter (issue "
                         "25): W=128 L=256 16 requests, xrec against xrec-filter (each request "
                         "excludes 1,000 items and 2 level-1 subtrees); gr-inference (issue "
                         "24, --family qwen3): NVIDIA's protocol, qwen3-sid-1.7b on CUDA, bf16, "
                         "W=256, contexts 1000,5000 x batches 1,8, top-1 vs float32, HF, online")
    offline.add_argument("--contexts", type=_ints, default=None,
                         help="--case gr-inference: prompt lengths (default 1000,5000)")
    offline.add_argument("--batches", type=_ints, default=None,
                         help="--case gr-inference: requests per batch (default 1,8)")
    offline.add_argument("--beam-width", type=_count, default=None,
                         help="--case gr-inference: beam width (default 256)")
    offline.add_argument("--online-concurrency", type=_count0, default=4,
                         help="--case gr-inference: requests in flight of the online row (0: none)")
    offline.add_argument("--online-requests", type=_count, default=32,
                         help="--case gr-inference: requests of the online row")
    offline.add_argument("--beam-widths", type=_ints, default=[64, 128, 256, 512])
    offline.add_argument("--lengths", type=_ints, default=[128, 512, 1024])
    offline.add_argument("--num-requests", type=_count, default=8)
    # 11 runs keep one noisy run off the median (docs/decisions.md, Benchmarks)
    offline.set_defaults(run=_run("offline"), repeats=11)

    scaling = sub.add_parser("scaling", help="time and peak memory as W, L and batch grow")
    common(scaling)
    contenders(scaling, "xrec,xrec-full,hf,naive")
    scaling.add_argument("--beam-widths", type=_ints, default=[64, 128, 256, 512])
    scaling.add_argument("--lengths", type=_ints, default=[128, 256, 512, 1024])
    scaling.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16])
    scaling.add_argument("--base", type=_ints, default=[128, 256],
                         help="W,L held fixed while the other variables grow")
    scaling.set_defaults(run=_run("scaling"), repeats=3)

    breakdown = sub.add_parser("breakdown", help="where a step's time goes (torch.profiler)")
    common(breakdown)
    breakdown.add_argument("--beam-width", type=_count, default=128)
    breakdown.add_argument("--length", type=_count, default=256)
    breakdown.add_argument("--num-requests", type=_count, default=16)
    breakdown.set_defaults(run=_run("breakdown"))

    serve = sub.add_parser("serve", help="open-loop HTTP load against `xrec serve`")
    common(serve)
    serve.add_argument("--url", help="an already running server (default: start `xrec serve`)")
    serve.add_argument("--rates", type=_floats, default=[2.0, 5.0, 10.0],
                       help="Poisson arrival rates, requests/s")
    serve.add_argument("--duration", type=_seconds, default=20.0, help="seconds of load per rate")
    serve.add_argument("--beam-width", type=_count, default=128)
    serve.add_argument("--length", type=_count, default=256)
    serve.add_argument("--large", type=_ints, default=[512, 1024],
                       help="W,L of the large requests in the mixed load")
    serve.add_argument("--large-fraction", type=float, default=0.2)
    serve.add_argument("--concurrency", type=_ints, default=[1, 2],
                       help="server --max-concurrency values to compare")
    serve.add_argument("--num-requests", type=_count, default=16,
                       help="requests of the server-vs-offline comparison")
    serve.add_argument("--batch-wait-ms", type=float, default=0.0,
                       help="engine option of the server and of the offline engine: how long a "
                            "free pipeline may hold a partial batch to fill it")
    serve.add_argument("--startup-timeout", type=_seconds, default=120.0)
    serve.add_argument("--ray", action="store_true", help="plain `xrec serve` next to the Ray "
                       "Serve app with --replicas (bench/serve_ray.py)")
    serve.add_argument("--replicas", type=_ints, default=[1, 2], help="with --ray: replica counts")
    serve.add_argument("--clients", type=_count, default=8, help="with --ray: closed-loop clients")
    # one comparison run is one short burst: 15 keep a noisy run off the median (docs/decisions.md, Benchmarks)
    serve.set_defaults(run=_run_serve, repeats=15)
    batch = sub.add_parser("batch", help="xrec batch rows/s: in process and --ray vs the Engine")
    common(batch)
    batch.add_argument("--contenders", type=_names, default=None,
                       help="comma-separated among engine, batch, ray (default all)")
    batch.add_argument("--rows", type=_count, default=100_000)
    batch.add_argument("--engine-rows", type=_count, default=20_000,
                       help="rows of the engine contender (the first of the same file)")
    batch.add_argument("--lengths", type=_ints, default=[8, 64], help="min,max input tokens")
    batch.add_argument("--beam-width", type=_count, default=16)
    batch.add_argument("--num-results", type=_count, default=None)
    batch.add_argument("--chunk-rows", type=_count, default=1024)
    batch.add_argument("--input-format", choices=("parquet", "jsonl"), default="parquet")
    batch.add_argument("--actors", type=_count, default=None, help="ray: actors (default: derived)")
    batch.add_argument("--actor-cpus", type=float, default=None)
    batch.set_defaults(run=_run("batch"), repeats=1)
    roofline = sub.add_parser("roofline", help="FLOP/s against this machine's GEMM peak, per "
                              "component and dtype (default: the issue-13/23 target workloads)")
    common(roofline)
    roofline.add_argument("--workloads", type=_workloads, default=None,
                          help="comma-separated SIZE:W:L:B (default: onerec-0.1b:128:256:4, "
                               "onerec-0.1b:512:1024:1, qwen3-sid-small:128:256:4)")
    roofline.add_argument("--sweep", action="store_true",
                          help="onerec-0.1b as W (64..512), L (256..1024) and the batch (1..8) "
                               "grow one at a time: does the fraction of peak hold?")
    roofline.add_argument("--dtypes", type=_dtypes, default=None,
                          help="comma-separated among float32, bfloat16, float16: each workload "
                               "runs in each, against that dtype's GEMM peak (default: --dtype "
                               "if given, else float32 and, where the device has it natively, "
                               "bfloat16)")
    roofline.set_defaults(run=_run("roofline"), repeats=5)
    embedded = sub.add_parser("embedded", help="the engine in a host that runs its own torch "
                              "work: isolation thread vs process")
    common(embedded)
    embedded.add_argument("--beam-width", type=_count, default=128)
    embedded.add_argument("--length", type=_count, default=256)
    embedded.add_argument("--num-requests", type=_count, default=16)
    embedded.add_argument("--conditions", type=_names, default=["alone", "main-op", "host-loop"],
                          help="host conditions among alone, main-op, host-loop")
    embedded.add_argument("--isolations", type=_names, default=["thread", "process"],
                          help="isolation modes among thread, process")
    embedded.add_argument("--rounds", type=_count, default=None,
                          help="times every row runs, in turn (a fresh process each); each "
                               "row reports the median over rounds (default 3, --quick 1)")
    embedded.set_defaults(run=_run("embedded"), repeats=7)
    contention = sub.add_parser("contention", help="throughput with one core taken by a busy "
                                "neighbour: fixed threads vs threads that follow the free cores")
    common(contention)
    contention.add_argument("--workloads", type=_names, default=["serve", "batch", "train"],
                            help="comma-separated among serve, batch, train")
    contention.add_argument("--beam-width", type=_count, default=128)
    contention.add_argument("--length", type=_count, default=256)
    contention.add_argument("--num-requests", type=_count, default=16,
                            help="serve: requests per batch")
    contention.add_argument("--rows", type=_count, default=800, help="batch: rows of the file")
    contention.add_argument("--seconds", type=_seconds, default=8.0,
                            help="serve, train: seconds of runs per measurement")
    contention.add_argument("--rounds", type=_count, default=3,
                            help="times every row runs, in turn (a fresh process each)")
    contention.set_defaults(run=_run("contention"))
    return parser


def apply_quick(args: argparse.Namespace) -> None:
    """Tiny sizes for a smoke test: the tiny model, a small catalog, few short runs."""
    args.items, args.warmup = 2000, 1
    args.repeats = min(args.repeats, 2)
    if getattr(args, "hf_repeats", None) is None and hasattr(args, "hf_repeats"):
        args.hf_repeats = 1
    if args.command == "offline":
        args.beam_widths, args.lengths, args.num_requests = [4, 16], [16], 2
    elif args.command == "scaling":
        args.beam_widths, args.lengths, args.batch_sizes, args.base = [4, 8], [8, 32], [1, 2], [8, 16]
    elif args.command == "breakdown":
        args.beam_width, args.length, args.num_requests = 8, 16, 2
    elif args.command == "serve":
        args.rates, args.duration, args.beam_width, args.length = [20.0], 1.0, 8, 16
        args.large, args.num_requests, args.repeats = [16, 64], 4, 1
    elif args.command == "embedded":
        args.beam_width, args.length, args.num_requests = 8, 16, 2
        args.rounds = args.rounds or 1
    elif args.command == "batch":
        args.rows, args.engine_rows, args.beam_width, args.chunk_rows = 200, 200, 4, 64
    elif args.command == "contention":
        args.beam_width, args.length, args.num_requests, args.rows = 8, 16, 2, 40
        args.seconds, args.rounds = 0.2, 1


def _run_serve(args: argparse.Namespace) -> int:
    return _run("serve_ray" if args.ray else "serve")(args)


def _run(command: str):
    def run(args: argparse.Namespace) -> int:
        import importlib
        return importlib.import_module(f"xrec.bench.{command}").run(args)
    return run


if __name__ == "__main__":
    sys.exit(main())
