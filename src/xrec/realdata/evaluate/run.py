"""`xrec eval`: trained generative models and the baselines ranked on the same split, the
metrics of the fixed protocol (docs/real-data.md) with and without already-seen items, the
published figures beside them; written as JSON, Markdown, a PNG and `predictions.jsonl`.

Seen items are removed from a generative model's W results after the search ("seen
removed"), and with `exclude_seen` also excluded inside the search ("seen excluded in
search": each user's history as the request's `exclude_items`).

Generative models rank in float32; with `dtype` "bfloat16" (or "auto" where it resolves
to bfloat16) also in that dtype: rows "<model>, bfloat16" beside the float32 ones, and
their agreement (top-1 equality, top-10 overlap, HR@10 / NDCG@10 relative difference;
evaluate/agreement.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from xrec.config.engine import EngineOptions
from xrec.realdata.data import Split
from xrec.realdata.data.metrics import metrics_table, ranking_metrics, remove_seen
from xrec.realdata.evaluate.agreement import agreement, agreement_table
from xrec.realdata.train.options import check_seed
from xrec.utils.files import write_file_atomically
from xrec.utils.progress import bar_disabled

__all__ = ["EvalOptions", "PUBLISHED", "evaluate"]

KS = (5, 10, 50)
MIN_BEAM_WIDTH = 10                # HR@10, the headline metric, needs 10 items
SEEN_REMOVED, SEEN_EXCLUDED = ", seen removed", ", seen excluded in search"   # row suffixes
BF16_ROW = ", bfloat16"            # the suffix of a model's rows ranked in bfloat16
BASELINES = ("most-popular", "item-knn", "sasrec")
DTYPES = ("float32", "bfloat16", "auto")
# meta-recsys/generative-recommenders README: raw ML-1M, 3,706 items, leave-one-out, full
# ranking with the items each user has seen removed (its eval's filter_invalid_ids=True): to be
# read against the "seen removed" rows
PUBLISHED = {"ml-1m": {"SASRec (published)" + SEEN_REMOVED: {"hr@10": 0.2853, "ndcg@10": 0.1603},
                       "HSTU (published)" + SEEN_REMOVED: {"hr@10": 0.3097, "ndcg@10": 0.1720}}}


@dataclass(frozen=True)
class EvalOptions:
    """`beam_width`: results per user of a generative model; below max(KS) = 50 its @50
    metrics are over at most W items (the report says so). `exclude_seen`: also rank each
    generative model with the user's history excluded inside the search. `dtype`: besides
    float32, rank each generative model in this dtype too ("auto": what the engine picks
    here) and report how far it is from float32."""

    stage: str = "test"
    beam_width: int = 128
    normalize: str = "full"
    baselines: tuple[str, ...] = ("most-popular", "item-knn", "sasrec")
    sasrec_minutes: float | None = None   # SASRec's wall-time cap (None: to convergence)
    sasrec_refit: bool = True   # test stage: retrain SASRec on all but the test item (below)
    sasrec_cache: str | None = None   # a directory of trained SASRecs (train/sasrec_cache.py)
    seed: int = 0
    exclude_seen: bool = False
    dtype: str = "float32"

    def __post_init__(self):
        # numpy (below 0) and torch (2**64 and above) refused it only when SASRec started,
        # after the ranking
        check_seed(self.seed)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype: got {self.dtype!r}, allowed: {', '.join(DTYPES)}")
        if self.beam_width < MIN_BEAM_WIDTH:
            raise ValueError(f"beam_width: got {self.beam_width}, expected >= {MIN_BEAM_WIDTH} "
                             f"(HR@{MIN_BEAM_WIDTH} needs that many items)")
        if self.beam_width > EngineOptions.max_beam_width:   # 10**9 allocated [users, W] first
            raise ValueError(f"beam_width: got {self.beam_width}, expected at most "
                             f"{EngineOptions.max_beam_width} (the engine's max_beam_width)")
        if self.stage not in ("valid", "test"):
            raise ValueError(f"stage: got {self.stage!r}, expected 'valid' or 'test'")
        if self.normalize not in ("allowed", "full"):
            raise ValueError(f"normalize: got {self.normalize!r}, expected 'allowed' or 'full'")
        if self.sasrec_minutes is not None and not self.sasrec_minutes > 0:
            raise ValueError(f"sasrec_minutes: got {self.sasrec_minutes}, expected > 0 or None "
                             f"(no cap)")
        unknown = set(self.baselines) - set(BASELINES)
        if unknown:
            raise ValueError(f"baselines: unknown {sorted(unknown)}, allowed: "
                             f"{', '.join(BASELINES)}")


def evaluate(split: Split, model_dirs: list[Path], out_dir: Path, options: EvalOptions,
             progress: bool = True, log=print) -> dict:
    """Ranks `options.stage` for every user with a target; returns and writes the report."""
    split.check_evaluated("`xrec eval` ranks for them alone")
    _check_distinct_names(model_dirs)
    if options.stage == "valid":
        _check_no_final_fit(model_dirs)
    if "sasrec" in options.baselines:   # else refused after every model had been ranked
        from xrec.realdata.train.sasrec import check_trainable
        check_trainable(split)
    out_dir.mkdir(parents=True, exist_ok=True)
    users = np.flatnonzero(split.targets(options.stage) >= 0)
    targets = split.targets(options.stage)[users]
    everyone = split.history(options.stage)
    histories = [everyone[u] for u in users]
    k = max(KS)
    rows: dict[str, dict] = {}
    training: dict[str, dict] = {}     # row -> epochs, best epoch, parameters, train seconds
    timings: dict[str, float] = {}
    rankings: dict[str, np.ndarray] = {}
    agreements: dict[str, dict] = {}   # model -> its bfloat16 ranking against float32
    for model_dir in model_dirs:
        name = _model_name(model_dir)
        training[name] = _trained_model_facts(model_dir)
        passes, _ = _rank_generative(split, model_dir, options, users, progress)
        ranked, timings[name] = passes[0]
        rankings[name] = _pad(ranked, k)            # [U, k]; -1 past the W results
        rows[name] = ranking_metrics(rankings[name], targets, KS)
        rows[name + SEEN_REMOVED] = ranking_metrics(remove_seen(ranked, histories, k),
                                                    targets, KS)
        if options.exclude_seen:
            excluded, timings[name + SEEN_EXCLUDED] = passes[1]
            rows[name + SEEN_EXCLUDED] = ranking_metrics(_pad(excluded, k), targets, KS)
        if options.dtype != "float32":
            other_passes, _ = _rank_generative(split, model_dir, options, users, progress,
                                               options.dtype)
            if other_passes:   # none where "auto" is float32 here: nothing to compare
                row = name + BF16_ROW
                other, timings[row] = other_passes[0]
                rows[row] = ranking_metrics(_pad(other, k), targets, KS)
                rows[row + SEEN_REMOVED] = ranking_metrics(remove_seen(other, histories, k),
                                                           targets, KS)
                agreements[name] = {"row": row, **agreement(rankings[name], _pad(other, k),
                                                             rows[name], rows[row])}
        for row in (name, name + SEEN_EXCLUDED, name + BF16_ROW):
            if row in timings:
                log(f"{row}: HR@10 {rows[row]['hr@10']:.4f}, NDCG@10 {rows[row]['ndcg@10']:.4f} "
                    f"({timings[row]:.1f} s, {len(users) / timings[row]:.0f} users/s)")
    for name in options.baselines:
        started = time.perf_counter()
        both, training[name] = _rank_baseline(name, split, options, k, progress)
        timings[name] = time.perf_counter() - started
        for exclude, ranked in zip((False, True), both):
            rows[name + (SEEN_REMOVED if exclude else "")] = \
                ranking_metrics(ranked[users], targets, KS)
        log(f"{name}: HR@10 {rows[name]['hr@10']:.4f} ({timings[name]:.1f} s)")
    report = {"dataset": split.data.name, "stage": options.stage, "users": int(len(users)),
              "items": split.data.num_items, "options": _jsonable(options.__dict__),
              "metrics": rows, "training": training, "agreement": agreements,
              "seconds": {n: round(t, 2) for n, t in timings.items()},
              "published": PUBLISHED.get(split.data.name, {}),
              "models": {_model_name(d): str(d) for d in model_dirs},
              "predictions": {_model_name(d): _predictions_file(i, d)
                              for i, d in enumerate(model_dirs)},
              "notes": _notes(options, bool(model_dirs), training.get("sasrec", {}),
                              {_model_name(d): training[_model_name(d)] for d in model_dirs})}
    _write(out_dir, report, split, users, targets, rankings, model_dirs)
    return report


def _check_distinct_names(model_dirs: list[Path]) -> None:
    """Rows are named by family and directory name, predictions files after the first by
    directory name: two models of one name made one row or one file (the other's metrics or
    rankings lost), before any ranking is done."""
    seen: dict[str, Path] = {}
    for index, model_dir in enumerate(model_dirs):
        for name in (f"the row {_model_name(model_dir)!r}",
                     f"written to {_predictions_file(index, model_dir)}"):
            if name in seen:
                raise ValueError(f"--model {seen[name]} and {model_dir}: both would be {name}; "
                                 f"give the directories distinct names")
            seen[name] = model_dir


def _check_no_final_fit(model_dirs: list[Path]) -> None:
    """A final fit (`xrec train --final`) trained on the validation items: ranked on the
    validation stage it is measured on its own training data."""
    for model_dir in model_dirs:
        if _is_final_fit(_train_report(model_dir) or {}):
            raise ValueError(f"--model {model_dir} is a final fit (xrec train --final), trained "
                             f"on every validation item: only --stage test measures it")


def _model_name(model_dir: Path) -> str:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    family = "xrec " + ("qwen3" if config.get("model_type", "").startswith("qwen") else "onerec")
    return f"{family} ({Path(model_dir).name})"


def _notes(options: EvalOptions, has_models: bool, sasrec_facts: dict,
           model_facts: dict[str, dict] | None = None) -> list[str]:
    """What a reader must know to compare the rows; `model_facts`: each generative model's
    `_trained_model_facts` (a final fit trained on the validation items too)."""
    notes = []
    reused = [what for what, key in (("early-stopped", "reused"), ("final fit", "refit_reused"))
              if sasrec_facts.get(key)]
    if reused:
        notes.append(f"sasrec: the {' and '.join(reused)} model(s) came from an earlier "
                     f"command's training on the same data and configuration (cached in "
                     f"{options.sasrec_cache}); its epochs and seconds are that training's")
    if "sasrec" in options.baselines and options.stage == "test" and options.sasrec_refit:
        notes.append("sasrec: early stopping on validation chose its epoch count; the model "
                     "ranked here then trained that many epochs on every item but the test "
                     f"one (the published protocol's training data); "
                     f"{_generative_training(model_facts or {})}")
    if has_models and options.beam_width < max(KS):
        notes.append(f"beam width {options.beam_width} < {max(KS)}: a generative model's "
                     f"ranking holds at most {options.beam_width} items, so its @{max(KS)} "
                     f"metrics are over at most {options.beam_width} items and not comparable "
                     f"with the baselines' or the published ones")
    return notes


def _generative_training(model_facts: dict[str, dict]) -> str:
    """Whether the generative models saw the validation item in training, for the notes
    (it was said of every model, a final fit's too)."""
    final = [name for name, facts in model_facts.items() if facts.get("final_fit")]
    if not final:
        return "the generative models trained without the validation item"
    said = f"so did {', '.join(final)} (xrec train --final)"
    if len(final) < len(model_facts):
        said += "; the other generative models trained without the validation item"
    return said


def _pad(ranked: np.ndarray, k: int) -> np.ndarray:
    """`ranked` [U, K] cut or padded with -1 to [U, k]."""
    padding = np.full((len(ranked), max(0, k - ranked.shape[1])), -1, dtype=ranked.dtype)
    return np.concatenate([ranked[:, :k], padding], axis=1)


def _rank_generative(split, model_dir, options: EvalOptions, users, progress,
                     dtype: str = "float32") -> tuple[list[tuple[np.ndarray, float]], str]:
    """(ranking [U, W], seconds) of the plain search, then, with `options.exclude_seen`, of
    the search excluding each user's history; and the dtype the engine ran in. The engine
    is opened once, before both timed passes. Another `dtype` than float32: the plain
    search only, and none where the engine resolved it to float32."""
    from tqdm import tqdm

    from xrec.realdata.ranking import GenerativeRanker

    ranker = GenerativeRanker.open(model_dir, split.data.item_ids, dtype=dtype)
    resolved = ranker.engine.dtype
    if dtype == "float32":
        in_search_passes = (False, True) if options.exclude_seen else (False,)
    else:   # the other dtype: the plain search, unless "auto" is float32 here
        in_search_passes = (False,) if resolved != "float32" else ()
    passes = []
    try:
        for in_search in in_search_passes:
            desc = f"eval {Path(model_dir).name}" + (", seen excluded" if in_search else "") + \
                ("" if dtype == "float32" else f", {resolved}")
            with tqdm(total=len(users), desc=desc, unit="user", disable=bar_disabled(progress),
                      dynamic_ncols=True) as bar:
                started = time.perf_counter()
                ranked = ranker.rank(split, options.stage, options.beam_width,
                                     options.beam_width, normalize=options.normalize,
                                     users=users, bar=bar, exclude_seen_in_search=in_search)
                passes.append((ranked, time.perf_counter() - started))
    finally:
        ranker.close()
    return passes, resolved


def _trained_model_facts(model_dir: Path) -> dict:
    """Epochs run, best epoch, parameters and training seconds from `xrec train`'s report
    (empty for a directory without one, e.g. a model trained elsewhere)."""
    report = _train_report(model_dir)
    if report is None:
        return {}
    return {"epochs": report["epochs_run"], "best_epoch": report["best"]["epoch"],
            "final_fit": _is_final_fit(report),
            "parameters": report["parameters"],
            "train_seconds": round(60 * report["train_minutes"], 1)}


def _train_report(model_dir: Path) -> dict | None:
    """`xrec train`'s train_report.json of `model_dir` (None: a model trained elsewhere)."""
    path = Path(model_dir) / "train_report.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _is_final_fit(report: dict) -> bool:
    """Whether a train report is a final fit's (`xrec train --final`: trained on the
    validation items too); a report without options is not."""
    return bool(report.get("options", {}).get("final"))


def _rank_baseline(name: str, split: Split, options: EvalOptions, k: int, progress: bool):
    """((ranking with seen items, ranking without), each [num_users, k]; training facts:
    epochs, best epoch, parameters and seconds for SASRec, none for the untrained ones).

    SASRec, test stage, `sasrec_refit`: early stopping on validation chooses the epoch
    count, then a fresh model trains that many epochs on every item but the test one
    (`Split.without_validation`, the published protocol's training data) and is the one
    ranked; its epochs and seconds are in the facts too."""
    if name == "sasrec":
        from xrec.realdata.train.sasrec import SASRecConfig, rank_sasrec
        from xrec.realdata.train.sasrec_cache import trained_sasrec
        cap = None if options.sasrec_minutes is None else 60 * options.sasrec_minutes
        config = SASRecConfig(seed=options.seed, max_seconds=cap)
        model = trained_sasrec(split, config, progress, options.sasrec_cache)
        logs = model.epoch_logs
        validated = [log for log in logs if log.valid_hr10 is not None]
        best = max(validated, key=lambda log: (log.valid_hr10, log.valid_ndcg10), default=None)
        best_epoch = best.epoch if best else len(logs)
        facts = {"epochs": len(logs), "best_epoch": best_epoch,
                 "parameters": sum(p.numel() for p in model.parameters()),
                 "train_seconds": round(logs[-1].seconds, 1),
                 "valid_hr@10": [round(log.valid_hr10, 4) for log in validated],
                 "reused": model.reused}
        if options.stage == "test" and options.sasrec_refit:
            model = trained_sasrec(split.without_validation(),
                                   replace(config, epochs=best_epoch, max_seconds=None),
                                   progress, options.sasrec_cache)
            facts["refit_reused"] = model.reused
            facts["refit_epochs"] = best_epoch
            facts["refit_seconds"] = round(model.epoch_logs[-1].seconds, 1)
            facts["train_seconds"] = round(facts["train_seconds"] + facts["refit_seconds"], 1)
        return (rank_sasrec(model, split, options.stage, k),
                rank_sasrec(model, split, options.stage, k, exclude_seen=True)), facts
    from xrec.realdata.data.baselines import rank_baseline
    return (rank_baseline(name, split, options.stage, k),
            rank_baseline(name, split, options.stage, k, exclude_seen=True)), {}


def _predictions_file(index: int, model_dir: Path) -> str:
    """The first model's ranking is predictions.jsonl, another's predictions-<dir name>.jsonl."""
    return "predictions.jsonl" if index == 0 else f"predictions-{Path(model_dir).name}.jsonl"


def _write(out_dir: Path, report: dict, split: Split, users, targets, rankings, model_dirs):
    """Each file whole or not at all, the predictions first and eval.json last (a run killed
    midway leaves every file whole, the earlier eval.json if any), then the plot."""
    item_ids, user_ids = split.data.item_ids, split.data.user_ids
    for name, ranked in rankings.items():
        lines = (json.dumps({"user_id": user_ids[u], "target": item_ids[t],
                             "ranked": [item_ids[i] for i in row if i >= 0]}) + "\n"
                 for u, t, row in zip(users, targets, ranked))
        write_file_atomically(out_dir / report["predictions"][name], "".join(lines).encode())
    rows = {**report["metrics"], **report["published"]}
    columns = ("hr@5", "hr@10", "ndcg@10", "hr@50", "ndcg@50")
    facts = ("epochs", "best_epoch", "parameters", "train_seconds")
    table = metrics_table({n: {**{c: m.get(c) for c in columns},
                               **{f: _training_cell(report["training"], n, f) for f in facts}}
                           for n, m in rows.items()})
    options = report["options"]
    timed = ", ".join(f"{n} {t:,.1f}" for n, t in report["seconds"].items())
    notes = "".join(f"- {note}\n" for note in report["notes"])
    write_file_atomically(out_dir / "eval.md", (
        f"## {report['dataset']}: {report['stage']} stage, {report['users']:,} users, ranking "
        f"over all {report['items']:,} items\n\n{table}\n\n"
        f"Generative models: beam width {options['beam_width']} = results per user, "
        f"normalize={options['normalize']}. Seconds: {timed}.\n" + (f"\n{notes}" if notes else "")
        + _agreement_section(report)).encode())
    write_file_atomically(out_dir / "eval.json", (json.dumps(report, indent=2) + "\n").encode())
    # a reused --out kept the predictions of an earlier run's models beside this eval.json
    for stale in {*out_dir.glob("predictions.jsonl"), *out_dir.glob("predictions-*.jsonl")}:
        if stale.name not in report["predictions"].values():
            stale.unlink()
    _plot(out_dir / "eval.png", report, model_dirs)
    print(table)


def _agreement_section(report: dict) -> str:
    """eval.md's bfloat16-against-float32 table (empty without bfloat16 rows)."""
    if not report["agreement"]:
        return ""
    return ("\n### bfloat16 against float32 (the same users; gate: HR@10 and NDCG@10 within 1% "
            "relative, top-10 overlap >= 0.95)\n\n"
            + agreement_table(report["agreement"], report["metrics"], report["seconds"]) + "\n")


def _training_cell(training: dict, row: str, fact: str) -> int | None:
    """A row's training fact for the table (a "seen removed" or bfloat16 row is its
    model's); whole seconds, so that the table prints it as a count."""
    for suffix in (SEEN_REMOVED, SEEN_EXCLUDED, BF16_ROW):
        row = row.removesuffix(suffix)
    value = training.get(row, {}).get(fact)
    return None if value is None else int(round(value))


def _plot(path: Path, report: dict, model_dirs) -> None:
    """Left: HR@10 and NDCG@10 per method (published figures hatched); the rows with seen
    items removed or excluded only when `exclude_seen` asked for the comparison.
    Right: each trained model's validation HR@10 per epoch."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {n: m for n, m in report["metrics"].items()
            if report["options"]["exclude_seen"] or not n.endswith(SEEN_REMOVED)}
    rows.update(report["published"])
    fig, (bars, curves) = plt.subplots(1, 2, figsize=(max(12, 5 + 0.6 * len(rows)), 4.5),
                                       width_ratios=(max(1, len(rows) / 8), 1))
    x = np.arange(len(rows))
    for offset, metric in ((-0.2, "hr@10"), (0.2, "ndcg@10")):
        values = [m[metric] for m in rows.values()]
        drawn = bars.bar(x + offset, values, 0.4, label=metric.upper())
        for bar, name in zip(drawn, rows):
            if name in report["published"]:
                bar.set_hatch("//")
    bars.set_xticks(x, list(rows), rotation=25, ha="right", fontsize=8)
    bars.set_title(f"{report['dataset']}, {report['stage']}: {report['users']:,} users, "
                   f"W={report['options']['beam_width']}")
    bars.legend()
    for model_dir in model_dirs:
        train_report = Path(model_dir) / "train_report.json"
        if train_report.is_file():
            history = [h for h in json.loads(train_report.read_text())["history"]
                       if h["valid_hr@10"] is not None]      # none in a final fit
            if history:
                curves.plot([h["epoch"] for h in history], [h["valid_hr@10"] for h in history],
                            marker="o", label=_model_name(model_dir))
    curves.set_xlabel("epoch")
    curves.set_ylabel("validation HR@10")
    curves.set_title("training")
    if curves.lines:
        curves.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _jsonable(d: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}
