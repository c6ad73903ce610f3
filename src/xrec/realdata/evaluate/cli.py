"""`xrec eval`: trained models and baselines on a dataset's leave-one-out split.

    xrec eval --data {ml-1m,ml-100k,PATH} [--model DIR ...] [--out DIR] [--beam-width N]
              [--baselines most-popular,item-knn,sasrec] [--stage {test,valid}] [--exclude-seen]
              [--dtype {float32,bfloat16,auto}]
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_eval_parser"]


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    from xrec.realdata.evaluate.run import BASELINES, DTYPES, EvalOptions

    defaults = EvalOptions()
    ev = subparsers.add_parser(
        "eval", help="HR@k / NDCG@k of trained models and baselines on a dataset",
        description="Leave-one-out, ranking over all items, with and without the items a user "
                    "has already seen. Writes eval.json, eval.md, eval.png and "
                    "predictions.jsonl (the first model's ranking per test user; "
                    "predictions-<model dir>.jsonl for the others). A reused --out keeps "
                    "only this run's predictions files.")
    ev.add_argument("--data", required=True, help="ml-1m, ml-100k, or an interaction file")
    ev.add_argument("--model", action="append", default=[], help="a model directory of "
                    "`xrec train` (repeatable; default: those under $XREC_HOME/runs/<dataset>)")
    ev.add_argument("--out", help="output directory (default: $XREC_HOME/runs/<dataset>/eval)")
    ev.add_argument("--stage", choices=("test", "valid"), default=defaults.stage)
    ev.add_argument("--beam-width", type=int, default=defaults.beam_width,
                    help=f"beam width = results per user (default {defaults.beam_width}; at "
                         f"least 10, at most 512; below 50 the @50 metrics are over at most W "
                         f"items)")
    ev.add_argument("--exclude-seen", action="store_true",
                    help="also rank each model with the user's history excluded inside the "
                         "search: a row '<model>, seen excluded in search' beside "
                         "'<model>, seen removed' (removed after the search)")
    ev.add_argument("--normalize", choices=("allowed", "full"), default=defaults.normalize)
    ev.add_argument("--dtype", choices=DTYPES, default=defaults.dtype,
                    help="generative models rank in float32; bfloat16 (or auto, where the "
                         "engine's 'auto' picks bfloat16 here) also ranks them in that dtype: "
                         "rows '<model>, bfloat16' and their agreement with float32 (top-1 "
                         "equal, top-10 overlap, HR@10 / NDCG@10 relative difference)")
    ev.add_argument("--baselines", default=",".join(defaults.baselines),
                    help=f"comma-separated among {', '.join(BASELINES)}, or 'none'")
    ev.add_argument("--sasrec-minutes", type=float, default=defaults.sasrec_minutes,
                    help="cap SASRec's training at this many minutes (default: no cap; it "
                         "trains to convergence, early stopping on validation HR@10)")
    ev.add_argument("--no-sasrec-refit", action="store_true",
                    help="test stage: rank the SASRec that early stopping picked (default: "
                         "retrain it for the epochs picked on every item but the test one, "
                         "the published protocol's training data)")
    ev.add_argument("--seed", type=int, default=defaults.seed)
    ev.add_argument("--no-progress", action="store_true")
    ev.set_defaults(run=run_eval)
    return ev


def trained_models(run: Path) -> list[Path]:
    """The finished model directories of `xrec train` under a run directory."""
    from xrec.realdata.ranking import PROMPT_FILE
    return sorted(d for d in run.iterdir() if (d / PROMPT_FILE).is_file()) if run.is_dir() else []


def run_eval(args: argparse.Namespace) -> int:
    from xrec.realdata.data import leave_one_out, load_dataset
    from xrec.realdata.evaluate.run import EvalOptions, evaluate
    from xrec.realdata.train.cli import run_dir

    baselines = () if args.baselines == "none" else tuple(
        b.strip() for b in args.baselines.split(",") if b.strip())
    options = EvalOptions(stage=args.stage, beam_width=args.beam_width, normalize=args.normalize,
                          baselines=baselines, sasrec_minutes=args.sasrec_minutes, seed=args.seed,
                          sasrec_refit=not args.no_sasrec_refit,
                          exclude_seen=args.exclude_seen, dtype=args.dtype,
                          sasrec_cache=str(run_dir(args.data) / "sasrec"))
    models = [Path(m) for m in args.model] or trained_models(run_dir(args.data))
    if not models and not baselines:
        raise ValueError("nothing to evaluate: no --model, no model under the run directory, "
                         "and --baselines none")
    split = leave_one_out(load_dataset(args.data))
    out = Path(args.out) if args.out else run_dir(args.data) / "eval"
    report = evaluate(split, models, out, options, progress=not args.no_progress)
    print(f"wrote {out}/" + ", ".join(["eval.md", "eval.json", "eval.png",
                                       *report["predictions"].values()]))
    return 0
