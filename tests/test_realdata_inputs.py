"""Real-data stages against torn or awkward inputs: a demo whose evaluation was killed
half-written, options out of range and two models of one name refused before any work."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn")

sys.path.insert(0, str(Path(__file__).parent))

import xrec.realdata.data  # noqa: E402
from test_train import SMALL, walk_interactions  # noqa: E402
from xrec.realdata.data import DataError, leave_one_out  # noqa: E402
from xrec.realdata.data.sources import read_interactions  # noqa: E402
from xrec.realdata.evaluate import run as eval_run  # noqa: E402
from xrec.realdata.movielens import run_demo  # noqa: E402
from xrec.realdata.sid.build import build_sid_dir  # noqa: E402
from xrec.realdata.train.options import TrainOptions  # noqa: E402
from xrec.realdata.train.trainer import train  # noqa: E402


@pytest.fixture(scope="module")
def split():
    return leave_one_out(walk_interactions())


def _tiny_model(split, sid, out):
    train(split, sid, out, TrainOptions(family="qwen3", epochs=1, **SMALL), progress=False,
          log=lambda *_: None, threads=1)
    return out


def _demo_with_cached_stages(split, tmp_path, monkeypatch, users: int):
    """`xrec demo movielens` on `split` under a fresh XREC_HOME whose semantic IDs and
    qwen3 model are already there (the cached stages): its run directory and arguments."""
    monkeypatch.setenv("XREC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(xrec.realdata.data, "load_dataset", lambda name: split.data)
    run = tmp_path / "home" / "runs" / "ml-100k"
    build_sid_dir(split, run / "sid", embeddings="svd", codebook_size=8, dim=8)
    _tiny_model(split, run / "sid", run / "qwen3")
    args = argparse.Namespace(dataset="ml-100k", families="qwen3", baselines="most-popular",
                              users=users, redo_eval=False, no_progress=True)
    return run, args


def test_demo_redoes_an_evaluation_killed_half_written(split, tmp_path, monkeypatch, capsys):
    """The eval stage dies after eval.json and before eval.md: the next demo run finds no
    `eval/` (written whole, renamed into place) and evaluates again, instead of calling the
    stage cached and failing on the missing file."""
    run, args = _demo_with_cached_stages(split, tmp_path, monkeypatch, users=2)
    real = eval_run._agreement_section

    def killed(report):
        raise KeyboardInterrupt

    monkeypatch.setattr(eval_run, "_agreement_section", killed)
    with pytest.raises(KeyboardInterrupt):
        run_demo(args)
    assert not (run / "eval" / "eval.json").exists()
    monkeypatch.setattr(eval_run, "_agreement_section", real)
    capsys.readouterr()
    assert run_demo(args) == 0
    assert "[eval] done" in capsys.readouterr().out
    assert {"eval.json", "eval.md", "predictions.jsonl", "eval.png"} <= {
        f.name for f in (run / "eval").iterdir()}


@pytest.mark.parametrize("field, value", [
    ("lr", math.nan), ("lr", math.inf), ("weight_decay", math.nan), ("weight_decay", -1.0),
    ("seen_unlikelihood", math.nan), ("lookahead", math.nan), ("max_minutes", math.nan),
    ("max_minutes", -1.0), ("warmup_steps", -10), ("valid_users", -5), ("seed", -1),
    ("seed", 10 ** 17),
    ("label_smoothing", math.inf), ("dropout", math.nan), ("valid_beam_width", 9),
    ("valid_beam_width", 513), ("max_items", 1366)])
def test_train_options_out_of_range_are_refused_before_training(field, value):
    """NaN passed the `< 0` checks and failed after a whole epoch on NaN weights (or, for
    max_minutes, meant no limit); negative counts failed late or deep in numpy. A validation
    beam narrower than 10 ranked fewer than 10 items, so its "HR@10" was HR@W; a seed of
    10**17 overflowed torch.manual_seed ("Overflow when unpacking long long", naming
    nothing). Validation runs through the serving engine, whose limits (beam width 512,
    4,096 prompt tokens: 1,365 items) refused a wider beam or a longer prompt after the
    first epoch (an hour on ML-1M with --max-items 2000)."""
    with pytest.raises(ValueError, match=rf"^{field}: got {value}"):
        TrainOptions(**{field: value}).check()


@pytest.mark.parametrize("width", [513, 10 ** 9])
def test_eval_refuses_a_beam_wider_than_the_engine_takes(width):
    """513 was refused by the engine at the first request; 10**9 allocated a [users, W]
    ranking before that (298 GiB for 40 users: numpy's _ArrayMemoryError traceback)."""
    from xrec.realdata.evaluate.run import EvalOptions

    with pytest.raises(ValueError, match=rf"^beam_width: got {width}, expected at most 512 "
                                         r"\(the engine's max_beam_width\)"):
        EvalOptions(beam_width=width)


@pytest.mark.parametrize("seed", [-1, 2 ** 64 + 1])
def test_eval_refuses_a_seed_out_of_range_at_once(seed):
    """It was refused by numpy (-1) or torch (2**64 + 1: "Overflow when unpacking long
    long") when SASRec started, after every model had been ranked."""
    from xrec.realdata.evaluate.run import EvalOptions

    with pytest.raises(ValueError, match=rf"^seed: got {seed}, expected an integer in "
                                         rf"\[0, {2 ** 32 - 1}\]"):
        EvalOptions(seed=seed)


def test_eval_refuses_two_models_of_one_name_before_ranking(split, tmp_path):
    """Rows are named by directory: `exp1/qwen3` and `exp2/qwen3` made one row, the first
    model's metrics lost."""
    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    first = _tiny_model(split, sid, tmp_path / "exp1" / "qwen3")
    second = tmp_path / "exp2" / "qwen3"
    second.parent.mkdir()
    shutil.copytree(first, second)
    with pytest.raises(ValueError, match="both would be the row 'xrec qwen3 \\(qwen3\\)'"):
        eval_run.evaluate(split, [first, second], tmp_path / "eval",
                          eval_run.EvalOptions(baselines=()), progress=False, log=lambda *_: None)
    assert not (tmp_path / "eval").exists()


def _two_tiny_models(split, tmp_path) -> tuple[Path, Path]:
    """Two copies of one tiny model, `first` and `second` (two rows of one eval)."""
    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    first = _tiny_model(split, sid, tmp_path / "first")
    shutil.copytree(first, tmp_path / "second")
    return first, tmp_path / "second"


def test_eval_into_a_reused_out_keeps_only_its_own_predictions(split, tmp_path):
    """`--out` reused by a run that ranks fewer models (or none): the earlier run's
    predictions-<model>.jsonl (and predictions.jsonl) stayed beside an eval.json that does
    not name them. Each run now removes the predictions files it does not write, names its
    own in eval.json's `predictions`, and leaves every other file alone."""
    first, second = _two_tiny_models(split, tmp_path)
    out = tmp_path / "eval"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    def evaluate(models, baselines=()) -> list[str]:
        eval_run.evaluate(split, models, out,
                          eval_run.EvalOptions(beam_width=10, baselines=baselines),
                          progress=False, log=lambda *_: None)
        return sorted(p.name for p in out.glob("predictions*"))

    def named() -> dict:
        return json.loads((out / "eval.json").read_text())["predictions"]

    assert evaluate([first, second]) == ["predictions-second.jsonl", "predictions.jsonl"]
    assert named() == {"xrec qwen3 (first)": "predictions.jsonl",
                       "xrec qwen3 (second)": "predictions-second.jsonl"}
    assert evaluate([second]) == ["predictions.jsonl"]
    assert named() == {"xrec qwen3 (second)": "predictions.jsonl"}
    assert evaluate([], baselines=("most-popular",)) == [] and named() == {}
    assert (out / "notes.txt").read_text() == "mine"


def test_an_eval_that_fails_while_writing_leaves_the_files_the_earlier_eval_json_names(
        split, tmp_path, monkeypatch):
    """A run into a reused `--out` that fails while writing its report (here the Markdown)
    removed the earlier run's predictions first, so the eval.json left behind named a file
    that was gone. Now the predictions are written first, eval.json last, and the stale
    files removed only after it."""
    first, second = _two_tiny_models(split, tmp_path)
    out = tmp_path / "eval"
    options = eval_run.EvalOptions(beam_width=10, baselines=())
    eval_run.evaluate(split, [first, second], out, options, progress=False, log=lambda *_: None)
    report = (out / "eval.json").read_text()

    def fail(_report):
        raise OSError("disk full")

    monkeypatch.setattr(eval_run, "_agreement_section", fail)
    with pytest.raises(OSError, match="disk full"):
        eval_run.evaluate(split, [second], out, options, progress=False, log=lambda *_: None)
    assert (out / "eval.json").read_text() == report
    assert sorted(json.loads(report)["predictions"].values()) == \
        sorted(p.name for p in out.glob("predictions*"))


def test_eval_refuses_two_models_that_would_write_one_predictions_file(split, tmp_path):
    """Rows are named by family and directory, predictions files after the first by
    directory alone: exp1/m (qwen3) and exp2/m (onerec) are two rows, and the later one's
    rankings overwrote the earlier's predictions-m.jsonl."""
    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    first = _tiny_model(split, sid, tmp_path / "first")
    qwen3 = _tiny_model(split, sid, tmp_path / "exp1" / "m")
    onerec = tmp_path / "exp2" / "m"
    train(split, sid, onerec, TrainOptions(family="onerec", epochs=1, **SMALL), progress=False,
          log=lambda *_: None, threads=1)
    with pytest.raises(ValueError, match=r"--model .*exp1/m and .*exp2/m: both would be "
                                         r"written to predictions-m.jsonl"):
        eval_run.evaluate(split, [first, qwen3, onerec], tmp_path / "eval",
                          eval_run.EvalOptions(baselines=()), progress=False, log=lambda *_: None)
    assert not (tmp_path / "eval").exists()


def _write_csv(data, path, rows=None):
    """`data` as an interactions file, its rows in the order `rows` (default: as they are)."""
    rows = range(len(data)) if rows is None else rows
    lines = ["user_id,item_id,timestamp"] + [
        f"{data.user_ids[data.users[r]]},{data.item_ids[data.items[r]]},{data.timestamps[r]:g}"
        for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


SMALL_FLAGS = ["--hidden", "32", "--heads", "2", "--layers", "1", "--max-items", "8",
               "--batch-size", "16", "--warmup-steps", "5", "--valid-beam-width", "10",
               "--threads", "1", "--no-progress"]


def test_train_refuses_semantic_ids_of_the_same_file_in_another_row_order(split, tmp_path,
                                                                          capsys):
    """Item index i is the i-th distinct item of the file: the same rows in reverse order
    number the items otherwise (the same split per user, the same item count), and the
    semantic IDs built from one file gave every item of the other another item's ID."""
    from xrec.cli import main

    data = split.data
    built_from = _write_csv(data, tmp_path / "a.csv")
    reversed_rows = _write_csv(data, tmp_path / "b.csv", range(len(data) - 1, -1, -1))
    sid = tmp_path / "sid"
    assert main(["sid", "build", "--data", str(built_from), "--out", str(sid),
                 "--embeddings", "svd", "--dim", "8", "--codebook-size", "8"]) == 0
    capsys.readouterr()
    assert main(["train", "--data", str(reversed_rows), "--sid", str(sid), "--out",
                 str(tmp_path / "m"), "--epochs", "1", *SMALL_FLAGS]) == 1
    err = capsys.readouterr().err
    last = data.item_ids[data.items[-1]]   # item index 0 of the reversed file
    assert f"item index 0 is {data.item_ids[0]!r} in its catalog but {last!r} in the data" in err
    assert "rows in another order" in err
    assert not (tmp_path / "m").exists() and not (tmp_path / "m.partial").exists()


def test_eval_refuses_a_model_whose_items_are_not_the_datas(split, tmp_path, capsys):
    """A file with as many items, one of them another id: the model trained on the first is
    refused, naming the item, instead of ranking with shifted semantic IDs."""
    from xrec.cli import main

    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    model = _tiny_model(split, sid, tmp_path / "qwen3")
    data = split.data
    renamed = dataclasses.replace(data, item_ids=data.item_ids[:5] + ("renamed",)
                                  + data.item_ids[6:])
    other = _write_csv(renamed, tmp_path / "other.csv")
    assert main(["eval", "--data", str(other), "--model", str(model), "--out",
                 str(tmp_path / "eval"), "--baselines", "none", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert f"item index 5 is {data.item_ids[5]!r} in its catalog but 'renamed' in the data" in err
    assert "(1 of 40 items differ)" in err


NOBODY_EVALUATED = "no user has the 3 interactions the leave-one-out split needs"


@pytest.mark.parametrize("command", [
    ["train", "--epochs", "1", *SMALL_FLAGS], ["train", "--final", "--epochs", "1", *SMALL_FLAGS],
    ["eval", "--baselines", "most-popular,item-knn", "--no-progress"],
    ["sid", "build", "--embeddings", "sasrec", "--codebook-size", "8"]])
def test_data_where_nobody_has_three_interactions_is_refused(tmp_path, monkeypatch, capsys,
                                                             command):
    """Every user has 1 or 2 interactions: leave-one-out evaluates nobody. Training validated
    on no user (HR@10 NaN, "best" epoch 1), eval wrote tables of NaN, and SASRec (eval's
    baseline, sid build's default embeddings) trained all 300 epochs without early stopping.
    A final fit is refused too: it replays what validation chose, and only test items
    measure it. SVD semantic IDs need no evaluated user."""
    from xrec.cli import main

    monkeypatch.setenv("XREC_HOME", str(tmp_path / "home"))
    rows = [f"u{u},i{(u + step) % 12},{step}" for u in range(30) for step in range(1 + u % 2)]
    data = tmp_path / "pairs.csv"
    data.write_text("user_id,item_id,timestamp\n" + "\n".join(rows) + "\n")
    sid = tmp_path / "sid"
    assert main(["sid", "build", "--data", str(data), "--out", str(sid), "--embeddings", "svd",
                 "--dim", "4", "--codebook-size", "8"]) == 0
    where = {"train": ["--sid", str(sid), "--out", str(tmp_path / "m")],
             "eval": ["--out", str(tmp_path / "eval")],
             "sid": ["--out", str(tmp_path / "sid2")]}[command[0]]
    capsys.readouterr()
    assert main([*command, "--data", str(data), *where]) == 1
    err = capsys.readouterr().err
    assert NOBODY_EVALUATED in err and "the most any of its 30 users has is 2" in err
    assert not any((tmp_path / name).exists() for name in ("m", "m.partial", "eval", "sid2"))


@pytest.mark.parametrize("damage, said", [
    (("tokenizer_config.json", None), "no tokenizer_config.json naming its catalog"),
    (("sid_report.json", "{"), "sid_report.json: not a report of `xrec sid build` (Expecting"),
    (("sid_report.json", "{}"), "sid_report.json: not a report of `xrec sid build` (no key "
                                "'num_base_tokens')"),
    (("sid_report.json", "[]"), "sid_report.json: not a report of `xrec sid build` (list "
                                "indices")])
def test_a_damaged_sid_directory_is_named(split, tmp_path, damage, said):
    """A sid directory without its tokenizer_config.json (so without a catalog) failed with
    AttributeError on None, a sid_report.json without its keys with a bare KeyError, a torn
    one with a JSON error that named no file."""
    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    name, text = damage
    if text is None:
        (sid / name).unlink()
    else:
        (sid / name).write_text(text)
    with pytest.raises(DataError, match=re.escape(said)):
        train(split, sid, tmp_path / "m", TrainOptions(epochs=1, **SMALL), progress=False)


@pytest.mark.parametrize("threads", [0, -3, 5000])
def test_train_refuses_a_thread_count_before_training(split, tmp_path, threads):
    """`--threads 0` trained the first epoch on torch's count (0 read as none) and -3 on
    whatever it set, then both failed in the validation engine's options (`num_threads`),
    an epoch late: minutes on ML-1M."""
    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    with pytest.raises(ValueError, match=rf"^threads: got {threads}, expected an integer in "
                                         r"\[1, 4096\]"):
        train(split, sid, tmp_path / "m", TrainOptions(epochs=1, **SMALL), progress=False,
              log=lambda *_: None, threads=threads)
    assert not (tmp_path / "m.partial").exists()


def test_eval_refuses_a_final_fit_on_the_validation_stage(split, tmp_path):
    """`xrec train --final` trains on the validation items: `xrec eval --stage valid`
    measured it on its own training data (a validation HR@10 far above the early-stopped
    model's, without a word); the test stage ranks it as before."""
    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    final = tmp_path / "final"
    train(split, sid, final, TrainOptions(epochs=1, final=True, **SMALL), progress=False,
          log=lambda *_: None, threads=1)
    with pytest.raises(ValueError, match=r"is a final fit \(xrec train --final\), trained on "
                                         r"every validation item: only --stage test"):
        eval_run.evaluate(split, [final], tmp_path / "eval",
                          eval_run.EvalOptions(stage="valid", baselines=()), progress=False,
                          log=lambda *_: None)
    assert not (tmp_path / "eval").exists()
    report = eval_run.evaluate(split, [final], tmp_path / "eval",
                               eval_run.EvalOptions(beam_width=16, baselines=()),
                               progress=False, log=lambda *_: None)
    assert report["users"] == (split.test >= 0).sum()


def test_onerec_refuses_data_with_one_training_item_per_user(tmp_path):
    """Every user has exactly 3 interactions, so 1 training item: the encoder-decoder,
    whose first target is a user's second item, had no training window; every epoch ran no
    step (loss 0.0000) and the untrained model was written as trained. The decoder-only
    family learns from one item, and a final fit has two."""
    rows = [f"u{u},i{(u * 7 + step) % 15},{step}" for u in range(40) for step in range(3)]
    data = leave_one_out(read_interactions("user_id,item_id,timestamp\n" + "\n".join(rows),
                                           "three", "three.csv"))
    sid = tmp_path / "sid"
    build_sid_dir(data, sid, embeddings="svd", codebook_size=8, dim=4)
    with pytest.raises(DataError, match=r"nothing to train on: the encoder-decoder \(onerec\) "
                                        r"learns every training item but a user's first"):
        train(data, sid, tmp_path / "onerec", TrainOptions(family="onerec", epochs=1, **SMALL),
              progress=False, log=lambda *_: None, threads=1)
    assert not (tmp_path / "onerec.partial").exists()
    for family, final in (("qwen3", False), ("onerec", True)):
        report = train(data, sid, tmp_path / f"{family}-{final}",
                       TrainOptions(family=family, epochs=1, final=final, **SMALL),
                       progress=False, log=lambda *_: None, threads=1)
        assert report["history"][0]["loss"] > 0


def test_eval_refuses_a_sasrec_baseline_it_cannot_train_before_ranking(tmp_path):
    """Every user has exactly 3 interactions (1 training item): SASRec has no training
    target, which train_sasrec said only after every model and the other baselines had been
    ranked (on ML-1M-sized data, minutes lost)."""
    rows = [f"u{u},i{(u * 7 + step) % 15},{step}" for u in range(40) for step in range(3)]
    split = leave_one_out(read_interactions("user_id,item_id,timestamp\n" + "\n".join(rows),
                                            "three", "three.csv"))
    with pytest.raises(DataError, match="SASRec: no user has 2 or more training interactions "
                                        r".* --baselines most-popular,item-knn"):
        eval_run.evaluate(split, [], tmp_path / "eval",
                          eval_run.EvalOptions(baselines=("most-popular", "sasrec")),
                          progress=False, log=lambda *_: None)
    assert not (tmp_path / "eval").exists()


@pytest.mark.parametrize("users", [0, -1, 10 ** 6])
def test_demo_refuses_a_count_of_users_to_show_before_its_stages(split, tmp_path, monkeypatch,
                                                                 users):
    """`--users 0` ran every stage, then failed on users[0] with an IndexError traceback;
    -1 and more than the test users failed in numpy's sampling (a message naming nothing)."""
    run, args = _demo_with_cached_stages(split, tmp_path, monkeypatch, users=users)
    with pytest.raises(ValueError, match=rf"^--users: got {users}, expected 1 to 150 "):
        run_demo(args)
    assert not (run / "eval").exists()


@pytest.mark.parametrize("families, baselines, said", [
    ("qwen4", "most-popular", "--families: got 'qwen4', expected a comma-separated list"),
    (",", "most-popular", "--families: got ',', expected a comma-separated list"),
    ("qwen3", "most-popular,nope", "baselines: unknown ['nope']")])
def test_demo_refuses_a_family_or_baseline_before_its_stages(split, tmp_path, monkeypatch,
                                                             capsys, families, baselines, said):
    """A family's typo failed at its training stage, a baseline's at the evaluation (after
    the semantic IDs and every model: an hour on ML-1M); no family at all (",") ended in an
    IndexError traceback after the evaluation."""
    monkeypatch.setenv("XREC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(xrec.realdata.data, "load_dataset", lambda name: split.data)
    run = tmp_path / "home" / "runs" / "ml-100k"
    build_sid_dir(split, run / "sid", embeddings="svd", codebook_size=8, dim=8)
    _tiny_model(split, run / "sid", run / "qwen3")     # the cached stages
    args = argparse.Namespace(dataset="ml-100k", families=families, baselines=baselines,
                              users=1, redo_eval=False, no_progress=True)
    with pytest.raises(ValueError, match=re.escape(said)):
        run_demo(args)
    assert "[sid]" not in capsys.readouterr().out


def test_demo_reads_baselines_as_eval_does(split, tmp_path, monkeypatch, capsys):
    """`--baselines "most-popular, item-knn"` (a space after the comma, as `xrec eval`
    takes it) was the unknown baseline ' item-knn' at the evaluation stage; a family named
    twice trained once and was then two models of one name."""
    monkeypatch.setenv("XREC_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(xrec.realdata.data, "load_dataset", lambda name: split.data)
    run = tmp_path / "home" / "runs" / "ml-100k"
    build_sid_dir(split, run / "sid", embeddings="svd", codebook_size=8, dim=8)
    _tiny_model(split, run / "sid", run / "qwen3")
    args = argparse.Namespace(dataset="ml-100k", families="qwen3, qwen3",
                              baselines="most-popular, item-knn", users=1, redo_eval=False,
                              no_progress=True)
    assert run_demo(args) == 0
    report = json.loads((run / "eval" / "eval.json").read_text())
    assert {"most-popular", "item-knn", "xrec qwen3 (qwen3)"} <= set(report["metrics"])


def test_train_with_a_model_directory_as_sid_writes_its_own_model(split, tmp_path):
    """A trained model's directory carries the semantic-ID files, so it can be --sid; every
    file of it was copied over the new model's, its config.json and model.safetensors
    included: an encoder-decoder trained this way was written, validated and served as the
    other, decoder-only model."""
    from safetensors.torch import load_file

    from xrec.realdata.sequences import SID_FILES

    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    assert sorted(f.name for f in sid.iterdir()) == sorted(SID_FILES)
    first = _tiny_model(split, sid, tmp_path / "qwen3")
    second = tmp_path / "onerec"
    train(split, first, second, TrainOptions(family="onerec", epochs=1, **SMALL),
          progress=False, log=lambda *_: None, threads=1)
    assert json.loads((second / "config.json").read_text()).get("model_type") != "qwen3"
    assert load_file(str(second / "model.safetensors")).keys() != \
        load_file(str(first / "model.safetensors")).keys()
    assert all((second / name).read_bytes() == (sid / name).read_bytes() for name in SID_FILES)


def test_eval_notes_say_which_models_trained_on_the_validation_item(split, tmp_path):
    """With SASRec's refit, eval.md said "the generative models trained without the
    validation item" of every model, a final fit (xrec train --final) too."""
    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    plain = _tiny_model(split, sid, tmp_path / "plain")
    final = tmp_path / "final"
    train(split, sid, final, TrainOptions(epochs=1, final=True, **SMALL), progress=False,
          log=lambda *_: None, threads=1)
    report = eval_run.evaluate(split, [plain, final], tmp_path / "eval",
                               eval_run.EvalOptions(beam_width=50, baselines=("sasrec",),
                                                    sasrec_minutes=0.05),
                               progress=False, log=lambda *_: None)
    (note,) = [n for n in report["notes"] if n.startswith("sasrec: early stopping")]
    assert note.endswith("so did xrec qwen3 (final) (xrec train --final); the other "
                         "generative models trained without the validation item"), note
    assert report["training"]["xrec qwen3 (final)"]["final_fit"] is True
    assert note in (tmp_path / "eval" / "eval.md").read_text()


@pytest.mark.parametrize("text, said", [
    ("{}", "max_items: got None, expected an integer >= 1"),
    ('{"max_items": "50"}', "max_items: got '50', expected an integer >= 1"),
    ('{"max_items": 0}', "max_items: got 0, expected an integer >= 1"),
    ("{", "xrec_prompt.json: not JSON")])
def test_a_damaged_prompt_file_is_named(split, tmp_path, text, said):
    """xrec_prompt.json written by hand (a model trained elsewhere) or damaged: without
    max_items a bare KeyError, a string failed in the prompts with a TypeError, 0 made every
    prompt the whole history (h[-0:]) without a word."""
    from xrec.realdata.ranking import GenerativeRanker

    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    model = _tiny_model(split, sid, tmp_path / "qwen3")
    (model / "xrec_prompt.json").write_text(text)
    with pytest.raises(DataError, match=re.escape(said)):
        ranker = GenerativeRanker.open(model, split.data.item_ids)
        try:
            ranker.rank(split, "test", 10, 10)
        finally:
            ranker.close()


def test_eval_reads_a_train_report_without_options_as_no_final_fit(split, tmp_path):
    """A model trained elsewhere, its train_report.json written by hand without "options":
    the final-fit checks read it as no final fit instead of failing with a KeyError."""
    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    model = _tiny_model(split, sid, tmp_path / "qwen3")
    (model / "train_report.json").write_text(json.dumps(
        {"epochs_run": 1, "best": {"epoch": 1}, "parameters": 1, "train_minutes": 0.1,
         "history": []}))
    report = eval_run.evaluate(split, [model], tmp_path / "eval",
                               eval_run.EvalOptions(stage="valid", beam_width=16, baselines=()),
                               progress=False, log=lambda *_: None)
    assert report["training"]["xrec qwen3 (qwen3)"]["final_fit"] is False
