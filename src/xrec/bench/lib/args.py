"""What every `xrec bench` command reads of its parsed arguments (`bench/cli.py` builds them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from xrec.bench.lib.models import model_dir


def slow_repeats_of(args: argparse.Namespace) -> int:
    """Measured runs of the slow contenders (hf, naive): --hf-repeats, else --repeats up to 3."""
    return args.hf_repeats if args.hf_repeats is not None else min(args.repeats, 3)


def model_dir_of(args: argparse.Namespace):
    """--model, or the cached random model of --size/--seed/--items."""
    if args.model:
        return Path(args.model)
    return model_dir(args.size, args.seed, args.items)


# Engine options of every engine a benchmark measures xrec's speed with: what a serving
# process takes (`Engine.own_process`; docs/decisions.md, "Host memory on a CPU"), so that
# the bench measures xrec as it serves. Process-wide: in-process contenders share it.
SERVING_OPTIONS = {"retain_host_memory": True}


def dtype_option(args: argparse.Namespace | dict) -> dict:
    """--dtype (of the arguments, or of a setting built from them) as engine options:
    {"dtype": ...} when given, else {} (the engine's "auto")."""
    dtype = args.get("dtype") if isinstance(args, dict) else getattr(args, "dtype", None)
    return {"dtype": dtype} if dtype else {}


def cuda_graphs_of(args: argparse.Namespace) -> bool | None:
    """--cuda-graphs as the engine option (None: the engine's default)."""
    value = getattr(args, "cuda_graphs", None)
    return None if value is None else value == "true"


def progress_bar(args: argparse.Namespace, total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="run", disable=args.no_progress, file=sys.stderr)
