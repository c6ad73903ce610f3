"""`xrec train`: a model of either family from a dataset's interaction sequences.

    xrec train --data {ml-1m,ml-100k,PATH} [--sid DIR] [--out DIR] [--family {qwen3,onerec}]
               [--hidden N] [--layers N] [--heads N] [--max-items N] [--epochs N] ...

Heavy imports (torch, transformers, the data loaders) happen inside the command.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from xrec.realdata.train.options import FAMILIES, TRAIN_DTYPES

__all__ = ["add_train_parser", "run_dir"]

_HELP = {
    "family": "qwen3: decoder-only; onerec: encoder-decoder with a causal encoder "
              "(both train every item of a history window in one pass)",
    "hidden": "model width", "layers": "layers (onerec: encoder and decoder each)",
    "heads": "attention heads",
    "max_items": "history items in a prompt (3 tokens each; at most 1365, the engine's 4096 "
                 "input tokens)",
    "epochs": "most epochs", "batch_size": "sequences per step", "lr": "peak learning rate",
    "weight_decay": "AdamW weight decay", "warmup_steps": "linear warm-up steps",
    "dropout": "dropout on the embeddings and each attention and feed-forward output "
               "(training only)",
    "seen_unlikelihood": "weight of a term that pushes down the items a training window "
                         "already holds (0: cross-entropy alone)",
    "label_smoothing": "label smoothing of the cross-entropy (0: none)",
    "lookahead": "weight of two training-only heads that predict, at every position, the "
                 "tokens two and three ahead (the rest of the next item's ID; 0: none)",
    "shifted_windows": "each epoch, end every window but a user's last a random number of "
                       "items earlier (each item meets contexts of every length)",
    "ema": "decay of an exponential moving average of the weights, which validation reads "
           "and the written model holds (0: the trained weights; 0.999: ~1,000 steps)",
    "valid_users": "validation users (0: all)",
    "valid_beam_width": "beam width of the validation search (10 to 512)",
    "patience": "epochs without a better validation HR@10 before stopping",
    "max_minutes": "stop after the epoch that passes this many minutes (0: no limit)",
    "seed": "random seed",
    "final": "the final fit, once validation has chosen the options: train all --epochs on "
             "every item but the test one (the validation item too), without validation",
    "dtype": "precision of the forward pass: bfloat16 is mixed precision (float32 weights, "
             "compiled at the first step); auto: bfloat16 where the CPU computes it natively "
             "and the family validated in it, else float32",
}


_CHOICES = {"family": FAMILIES, "dtype": TRAIN_DTYPES}


def run_dir(dataset: str) -> Path:
    """Where the real-data stages of a dataset write by default: `$XREC_HOME/runs/<name>`."""
    from xrec.utils.files import xrec_home
    return xrec_home() / "runs" / Path(dataset).stem


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    from xrec.realdata.train.options import FAMILY_DEFAULTS, TrainOptions

    train = subparsers.add_parser(
        "train", help="train a model of either family on interaction sequences",
        description="Teacher-forced cross-entropy on the items' semantic-ID tokens, validation "
                    "HR@10 through the serving engine after each epoch, early stopping (--final: "
                    "every item but the test one, all epochs, no validation). A "
                    "killed run started again with the same options resumes after its last "
                    "epoch. Writes a model directory that `xrec serve --model` loads.")
    train.add_argument("--data", required=True, help="ml-1m, ml-100k, or an interaction file")
    train.add_argument("--sid", help="semantic-ID directory of `xrec sid build` "
                       "(default: $XREC_HOME/runs/<dataset>/sid)")
    train.add_argument("--out", help="model directory to write "
                       "(default: $XREC_HOME/runs/<dataset>/<family>)")
    for f in fields(TrainOptions):
        flag = "--" + f.name.replace("_", "-")
        if f.name in _CHOICES:
            train.add_argument(flag, choices=_CHOICES[f.name], default=f.default,
                               help=f"{_HELP[f.name]} (default {f.default})")
        elif isinstance(f.default, bool):
            train.add_argument(flag, action="store_true", help=_HELP[f.name])
        elif f.default is None:     # the family's default
            defaults = {family: values[f.name] for family, values in FAMILY_DEFAULTS.items()}
            train.add_argument(flag, type=type(defaults["qwen3"]), default=None,
                               help=f"{_HELP[f.name]} (default " + ", ".join(
                                   f"{family} {value}" for family, value in defaults.items()) + ")")
        else:
            train.add_argument(flag, type=type(f.default), default=f.default,
                               help=f"{_HELP[f.name]} (default {f.default})")
    train.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(run=run_train, interrupted_hint=lambda args: (   # Ctrl-C: xrec.cli
        "; the same command again resumes after the last epoch it finished"))
    return train


def run_train(args: argparse.Namespace) -> int:
    from xrec.realdata.data import leave_one_out, load_dataset
    from xrec.realdata.train.options import TrainOptions
    from xrec.realdata.train.trainer import train

    options = TrainOptions(**{f.name: getattr(args, f.name) for f in fields(TrainOptions)})
    split = leave_one_out(load_dataset(args.data))
    sid = Path(args.sid) if args.sid else run_dir(args.data) / "sid"
    out = Path(args.out) if args.out else run_dir(args.data) / options.family
    report = train(split, sid, out, options, progress=not args.no_progress,
                   threads=args.threads)
    best = report["best"]
    chosen = ("the last epoch (--final: no validation)" if best["hr@10"] is None else
              f"best validation HR@10 {best['hr@10']:.4f} at epoch {best['epoch']}")
    print(f"wrote {out}: {chosen}, {report['train_minutes']:.1f} min; serve it with: "
          f"xrec serve --model {out}")
    return 0
