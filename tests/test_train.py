"""`xrec train` / `xrec eval` on a small slice built here: semantic IDs, training of both
families, evaluation through the engine, resuming a killed run, and the trained directory
computing what the trained Hugging Face model computes."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from xrec import Engine, RecRequest
from xrec.realdata.data import DataError, Interactions, leave_one_out
from xrec.realdata.data.baselines import rank_baseline
from xrec.realdata.data.metrics import ranking_metrics
from xrec.realdata.ranking import GenerativeRanker
from xrec.realdata.evaluate.run import EvalOptions, evaluate
from xrec.realdata.sid.build import build_sid_dir
from xrec.realdata.train.models import TrainableModel, batches, num_batches
from xrec.realdata.train.options import TrainOptions
from xrec.realdata.sequences import SidVocabulary, prompts
from xrec.realdata.train.trainer import train

NUM_ITEMS, NUM_USERS = 40, 150
SMALL = dict(hidden=32, heads=2, layers=1, max_items=8, batch_size=16, lr=1e-2,
             warmup_steps=5, valid_beam_width=10)


def walk_interactions(seed: int = 0) -> Interactions:
    """Users walk the item cycle 0, 1, ..., 39 from a random start, 6 to 14 steps: the next
    item is a function of the last one, which a sequential model must learn."""
    rng = np.random.default_rng(seed)
    users, items = [], []
    for user in range(NUM_USERS):
        start = rng.integers(NUM_ITEMS)
        for step in range(rng.integers(6, 15)):
            users.append(user)
            items.append((start + step) % NUM_ITEMS)
    users, items = np.array(users), np.array(items)
    item_ids, first = np.unique(items, return_index=True)
    by_first = item_ids[np.argsort(first)]              # item index = order of first appearance
    index = {item: i for i, item in enumerate(by_first)}
    return Interactions("walk", tuple(str(u) for u in range(NUM_USERS)),
                        tuple(f"item-{i}" for i in by_first), users.astype(np.int32),
                        np.array([index[i] for i in items], dtype=np.int32),
                        np.arange(len(items), dtype=np.float64))


@pytest.fixture(scope="module")
def split():
    return leave_one_out(walk_interactions())


@pytest.fixture(scope="module")
def sid_dir(split, tmp_path_factory):
    out = tmp_path_factory.mktemp("walk") / "sid"
    build_sid_dir(split, out, embeddings="svd", codebook_size=8, dim=8)
    return out


@pytest.fixture(scope="module")
def trained(split, sid_dir):
    """One trained model per family."""
    return {family: _train(split, sid_dir, sid_dir.parent / family, family)
            for family in ("qwen3", "onerec")}


def _train(split, sid_dir, out, family, epochs=12, **options):
    train(split, sid_dir, out, TrainOptions(family=family, epochs=epochs, patience=20,
                                            **SMALL, **options),
          progress=False, log=lambda *_: None, threads=1)
    return out


@pytest.mark.parametrize("family", ["qwen3", "onerec"])
def test_trained_model_beats_popularity_and_random(split, trained, family):
    """Validation stage through the engine: the walk is learnt (HR@10 far above the 10/40 of
    a random ranking and above most-popular)."""
    ranker = GenerativeRanker.open(trained[family], split.data.item_ids)
    try:
        ranked = ranker.rank(split, "valid", 10, 16)
    finally:
        ranker.close()
    users = np.flatnonzero(split.valid >= 0)
    hr = ranking_metrics(ranked, split.valid[users], ks=(10,))["hr@10"]
    popular = rank_baseline("most-popular", split, "valid", 10)[users]
    hr_popular = ranking_metrics(popular, split.valid[users], ks=(10,))["hr@10"]
    assert hr >= 0.8 and hr > hr_popular + 0.3, (hr, hr_popular)


def test_trained_directory_serves_what_was_trained(split, trained):
    """The written directory, served by xrec, scores a semantic ID exactly as the trained
    Hugging Face model does: teacher-forced log-probabilities, summed, from the forward pass
    training runs (onerec: the last target of a one-pass window)."""
    for family, model_dir in trained.items():
        vocab = SidVocabulary.read(model_dir, split.data.item_ids)
        prompt = prompts(vocab, [split.train[0]], 8)[0]
        with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
            best = engine.recommend([RecRequest(token_ids=prompt, beam_width=8,
                                                normalize="full")])[0].results[0]
        model = TrainableModel.create(_config(model_dir), seed=0)
        from safetensors.torch import load_file
        model.load_state(load_file(str(model_dir / "model.safetensors")))
        model.hf.eval()
        target = torch.tensor([best.tokens])
        with torch.no_grad():
            out, _ = model.forward([np.array([*prompt, *best.tokens])])
        last = out.logits[0, -3:] if family == "onerec" else out.logits[0, -4:-1]
        expected = last.log_softmax(-1).gather(1, target.T).sum()
        assert best.score == pytest.approx(float(expected), abs=1e-4), family


@pytest.mark.parametrize("family", ["qwen3", "onerec"])
def test_dropout_acts_in_training_only(split, trained, family):
    """`dropout`: the same initial weights; in training mode a pass drops (two passes differ,
    and differ from the model without dropout); in eval mode it is the model without."""
    config = _config(trained[family])
    vocab = SidVocabulary.read(trained[family], split.data.item_ids)
    batch = [np.array([*prompts(vocab, [split.train[0]], 8)[0], 5, 6, 7])]
    plain, dropped = (TrainableModel.create(config, seed=0, dropout=p) for p in (0.0, 0.3))
    for name, tensor in plain.state().items():
        torch.testing.assert_close(dropped.state()[name], tensor, rtol=0, atol=0)
    with torch.no_grad():
        reference = plain.forward(batch)[0].logits
        first, second = (dropped.forward(batch)[0].logits for _ in range(2))
        assert not torch.allclose(first, second) and not torch.allclose(first, reference)
        dropped.hf.eval()
        torch.testing.assert_close(dropped.forward(batch)[0].logits, reference)
    with pytest.raises(ValueError, match="dropout: got 1.0"):
        TrainOptions(dropout=1.0).check()


def _config(model_dir):
    from xrec.config import read_model_config
    return read_model_config(model_dir / "config.json")


def test_eval_writes_table_predictions_and_plot(split, trained, tmp_path):
    report = evaluate(split, [trained["qwen3"]], tmp_path,
                      EvalOptions(stage="test", beam_width=50,
                                  baselines=("most-popular", "item-knn")),
                      progress=False, log=lambda *_: None)
    names = list(report["metrics"])
    assert any(n.startswith("xrec qwen3") for n in names)
    assert {"most-popular", "item-knn", "item-knn, seen removed"} <= set(names)
    assert not any("in search" in n for n in names) and report["notes"] == []   # no flag, W=50
    lines = (tmp_path / "predictions.jsonl").read_text().splitlines()
    assert len(lines) == int((split.test >= 0).sum())
    first = json.loads(lines[0])
    assert set(first) == {"user_id", "target", "ranked"} and len(first["ranked"]) >= 10
    assert all(item in split.data.item_ids for item in first["ranked"])
    # the table and the predictions agree: HR@10 recomputed from predictions.jsonl
    hits = [json.loads(line)["target"] in json.loads(line)["ranked"][:10] for line in lines]
    model_row = next(n for n in names if n.startswith("xrec qwen3") and "seen" not in n)
    assert np.mean(hits) == pytest.approx(report["metrics"][model_row]["hr@10"])
    assert (tmp_path / "eval.png").stat().st_size > 0 and (tmp_path / "eval.md").is_file()


def test_eval_ranks_bf16_beside_fp32_with_their_agreement(split, trained, tmp_path):
    """--dtype bfloat16: each model's bfloat16 rows beside its float32 ones, and how far
    apart they are (issue 23's gate figures), in eval.json and eval.md."""
    report = evaluate(split, [trained["qwen3"], trained["onerec"]], tmp_path,
                      EvalOptions(beam_width=20, baselines=(), dtype="bfloat16"),
                      progress=False, log=lambda *_: None)
    names = list(report["metrics"])
    models = [n for n in names if n.startswith("xrec") and "," not in n]
    assert len(models) == 2 and set(report["agreement"]) == set(models)
    for model in models:
        assert names.index(model + ", bfloat16") > names.index(model)   # beside its float32 rows
        assert model + ", bfloat16, seen removed" in names and model + ", bfloat16" in report["seconds"]
        figures = report["agreement"][model]
        assert figures["users"] == report["users"] and figures["row"] == model + ", bfloat16"
        assert 0 <= figures["top1_equal"] <= 1 and 0 <= figures["top10_overlap"] <= 1
        for metric in ("hr@10", "ndcg@10"):
            difference = figures[f"{metric}_relative_difference"]
            assert difference is None or abs(difference) <= 1, (metric, difference)
        assert isinstance(figures["meets_gate"], bool)
    assert json.loads((tmp_path / "eval.json").read_text())["agreement"] == report["agreement"]
    assert "### bfloat16 against float32" in (tmp_path / "eval.md").read_text()
    # "auto" is float32 on a CPU while the families' gate is unmeasured: nothing to compare
    auto = evaluate(split, [trained["qwen3"]], tmp_path / "auto",
                    EvalOptions(beam_width=20, baselines=(), dtype="auto"),
                    progress=False, log=lambda *_: None)
    assert auto["agreement"] == {} and not any("bfloat16" in n for n in auto["metrics"])


def test_agreement_by_hand():
    from xrec.realdata.evaluate.agreement import agreement
    fp32 = np.array([[1, 2, 3, -1], [4, 5, 6, 7]])
    bf16 = np.array([[1, 3, 9, -1], [5, 4, 6, 7]])
    metrics = {"hr@10": 0.5, "ndcg@10": 0.25}
    got = agreement(fp32, bf16, metrics, {"hr@10": 0.505, "ndcg@10": 0.2}, k=4)
    assert got["top1_equal"] == 0.5 and got["top4_overlap"] == pytest.approx((2 / 4 + 4 / 4) / 2)
    assert got["hr@10_relative_difference"] == pytest.approx(0.01)
    assert got["ndcg@10_relative_difference"] == pytest.approx(-0.2) and not got["meets_gate"]
    assert agreement(fp32, fp32, metrics, metrics, k=4)["hr@10_relative_difference"] == 0.0
    zero = {"hr@10": 0.0, "ndcg@10": 0.0}   # both miss every target: they agree
    full = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    assert agreement(full, full, zero, zero, k=4)["meets_gate"]
    assert agreement(fp32, fp32, zero, metrics, k=4)["hr@10_relative_difference"] is None
    with pytest.raises(ValueError, match="expected the same"):
        agreement(fp32, bf16[:1], metrics, metrics, k=4)


@pytest.mark.parametrize("batch_size", [1, 2, 3, 16])
def test_batches_hold_every_example_once_and_no_lone_one(batch_size):
    """A batch of one would be a compiled pass's shape of its own (a second compile), so a
    lone leftover joins the batch before it; `num_batches` counts what `batches` makes."""
    for count in range(0, 2 * 50 * batch_size + 3):
        examples = [[0] * (1 + i % 7) for i in range(count)]
        made = batches(examples, batch_size, np.random.default_rng(count))
        assert sorted(id(e) for b in made for e in b) == sorted(id(e) for e in examples)
        assert len(made) == num_batches(count, batch_size)
        assert all(len(b) <= batch_size + 1 for b in made)
        if batch_size > 1 and count > 1:
            assert min(len(b) for b in made) > 1, (count, [len(b) for b in made])


def _signal_after_the_first_epoch(child: subprocess.Popen, state: Path, signum: int) -> tuple:
    """Sends `signum` to a training `child` once its `state` (state.json) says an epoch is
    committed; (stdout, stderr) once it has ended."""
    try:
        while child.poll() is None:
            if state.is_file() and json.loads(state.read_text())["epoch"] >= 1:
                child.send_signal(signum)
                break
            time.sleep(0.02)
        return child.communicate(timeout=120)
    finally:
        child.kill()

@pytest.mark.parametrize("options", [{}, {"ema": 0.9}, {"lookahead": 0.0}])
def test_killed_run_resumes_where_it_stopped(split, sid_dir, tmp_path, options):
    """A run killed (SIGKILL) after its first epoch, started again with the same options,
    ends with the weights of an uninterrupted run (with `ema`: the average and the trained
    weights both resume; by default the training-only look-ahead heads too)."""
    straight = _train(split, sid_dir, tmp_path / "straight", "qwen3", epochs=3, **options)
    out = tmp_path / "killed"
    script = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
              f"from test_train import walk_interactions, _train\n"
              f"from xrec.realdata.data import leave_one_out\n"
              f"from pathlib import Path\n"
              f"_train(leave_one_out(walk_interactions()), Path({str(sid_dir)!r}), "
              f"Path({str(out)!r}), 'qwen3', epochs=3, **{options!r})\n")
    child = subprocess.Popen([sys.executable, "-c", script])
    state = tmp_path / "killed.partial" / "state.json"
    _signal_after_the_first_epoch(child, state, signal.SIGKILL)
    assert not out.exists(), "the run was killed before its end: no model directory yet"
    epoch_at_kill = json.loads(state.read_text())["epoch"]
    assert 1 <= epoch_at_kill < 3
    logged = []
    train(split, sid_dir, out, TrainOptions(family="qwen3", epochs=3, patience=20, **SMALL,
                                            **options),
          progress=False, log=logged.append, threads=1)
    assert any("resuming" in line for line in logged)
    from safetensors.torch import load_file
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)
    assert not (tmp_path / "killed.partial").exists()



def test_ctrl_c_is_one_line_exit_130_and_the_same_command_resumes(sid_dir, tmp_path):
    """Ctrl-C in `xrec train` printed a traceback; now one line that says how to go on, exit
    130, and the same command again resumes (after the epoch state.json names). Its progress
    bar shows on a terminal only: redirected, it was a stream of carriage returns."""
    walk = walk_interactions()
    data = tmp_path / "walk.csv"
    data.write_text("user_id,item_id,timestamp\n" + "".join(
        f"{walk.user_ids[u]},{walk.item_ids[i]},{t:.0f}\n"
        for u, i, t in zip(walk.users, walk.items, walk.timestamps)))
    out = tmp_path / "model"
    command = [sys.executable, "-m", "xrec", "train", "--data", str(data), "--sid", str(sid_dir),
               "--out", str(out), "--epochs", "3", "--patience", "20", "--threads", "1",
               "--no-progress"] + [f"--{k.replace('_', '-')}={v}" for k, v in SMALL.items()]
    child = subprocess.Popen(   # SIGINT at its default even where the test runner ignores it
        command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    state = tmp_path / "model.partial" / "state.json"
    _, stderr = _signal_after_the_first_epoch(child, state, signal.SIGINT)
    assert child.returncode == 130, stderr[-2000:]
    assert stderr.strip().splitlines()[-1] == (
        "xrec train: interrupted; the same command again resumes after the last epoch it "
        "finished")
    assert not out.exists() and 1 <= json.loads(state.read_text())["epoch"] < 3
    # with its progress asked for, and its output a pipe: the epoch's line, no bar (its unit)
    resumed = subprocess.run([a for a in command if a != "--no-progress"], capture_output=True,
                             text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resuming" in resumed.stdout and (out / "model.safetensors").is_file()
    assert "epoch 3: loss" in resumed.stdout and "batch/s" not in resumed.stderr


class _Killed(Exception):
    """Stands for a kill at a chosen point of a run."""


def _interrupted(split, sid_dir, out, monkeypatch, where, epochs=3, **options):
    """Runs `train` until `where` (a (class, method) pair, patched) raises `_Killed` at its
    second call (epoch 2), then restores it."""
    owner, name = where
    real, calls = getattr(owner, name), []

    def dies(self, *args):
        calls.append(1)
        if len(calls) == 2:
            raise _Killed
        return real(self, *args)

    monkeypatch.setattr(owner, name, dies)
    with pytest.raises(_Killed):
        _train(split, sid_dir, out, "qwen3", epochs=epochs, **options)
    monkeypatch.setattr(owner, name, real)


@pytest.mark.parametrize("where", ["validate", "checkpoint"])
def test_run_killed_inside_an_epochs_commit_resumes_bit_exact(split, sid_dir, tmp_path,
                                                             monkeypatch, where):
    """Killed while validating epoch 2 (its checkpoint written, state.json still at epoch 1)
    or while writing epoch 2's checkpoint: the resumed run redoes epoch 2 from epoch 1's
    files only and ends with an uninterrupted run's weights, bit for bit."""
    from safetensors.torch import load_file
    from xrec.realdata.train import trainer
    straight = _train(split, sid_dir, tmp_path / "straight", "qwen3", epochs=3)
    target = (trainer._Run, "validate") if where == "validate" else (TrainableModel, "save")
    out = tmp_path / "killed"
    _interrupted(split, sid_dir, out, monkeypatch, target)
    assert json.loads((tmp_path / "killed.partial" / "state.json").read_text())["epoch"] == 1
    logged = []
    train(split, sid_dir, out, TrainOptions(family="qwen3", epochs=3, patience=20, **SMALL),
          progress=False, log=logged.append, threads=1)
    assert any("resuming" in line and "after epoch 1" in line for line in logged)
    report = json.loads((out / "train_report.json").read_text())
    assert [h["epoch"] for h in report["history"]] == [1, 2, 3]
    a, b = load_file(str(straight / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_resume_refuses_other_data_or_rebuilt_semantic_ids(split, tmp_path, monkeypatch):
    """An unfinished run resumes only on the split and the semantic IDs it began with: other
    interactions (the same item count) or a sid directory rebuilt in place are refused."""
    from xrec.realdata.train import trainer
    sid = tmp_path / "sid"
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8)
    out = tmp_path / "m"
    _interrupted(split, sid, out, monkeypatch, (trainer._Run, "validate"))
    options = TrainOptions(family="qwen3", epochs=3, patience=20, **SMALL)
    # the same items (so the same item indices), each user's interactions in reverse order
    other = leave_one_out(dataclasses.replace(split.data, timestamps=-split.data.timestamps))
    assert other.data.item_ids == split.data.item_ids
    with pytest.raises(ValueError, match="other inputs: the interaction data"):
        train(other, sid, out, options, progress=False, threads=1)
    build_sid_dir(split, sid, embeddings="svd", codebook_size=8, dim=8, seed=1, replace=True)
    with pytest.raises(ValueError, match="other inputs: the semantic IDs .* were rebuilt"):
        train(split, sid, out, options, progress=False, threads=1)


def test_final_fit_trains_on_the_validation_item_too_without_validating(split, sid_dir,
                                                                        tmp_path):
    """`final`: all epochs on every item but the test one, no validation; the same weights
    as a final fit on `split.without_validation()` (which has nothing more to add)."""
    options = TrainOptions(family="qwen3", epochs=2, final=True, **SMALL)
    report = train(split, sid_dir, tmp_path / "final", options, progress=False,
                   log=lambda *_: None, threads=1)
    assert report["epochs_run"] == 2 and report["best"] == {"epoch": 2, "hr@10": None}
    assert [h["valid_hr@10"] for h in report["history"]] == [None, None]
    train(split.without_validation(), sid_dir, tmp_path / "same", options, progress=False,
          log=lambda *_: None, threads=1)
    from safetensors.torch import load_file
    final, same = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("final", "same"))
    for name in final:
        torch.testing.assert_close(final[name], same[name], rtol=0, atol=0, msg=name)
    ranker = GenerativeRanker.open(tmp_path / "final", split.data.item_ids)
    try:
        assert ranker.rank(split, "test", 10, 16).shape == (split.data.num_users, 10)
    finally:
        ranker.close()


def test_shifted_windows_change_training_and_repeat_with_the_seed(split, sid_dir, tmp_path):
    """`shifted_windows` cuts each epoch's windows from (seed, epoch): a second run (or a
    resumed one) trains on the same windows; the weights differ from end-aligned windows'."""
    from safetensors.torch import load_file
    weights = {}
    for name, shifted in (("a", True), ("b", True), ("plain", False)):
        options = TrainOptions(family="qwen3", epochs=2, final=True, shifted_windows=shifted,
                               **SMALL)
        train(split, sid_dir, tmp_path / name, options, progress=False, log=lambda *_: None,
              threads=1)
        weights[name] = load_file(str(tmp_path / name / "model.safetensors"))
    for name in weights["a"]:
        torch.testing.assert_close(weights["a"][name], weights["b"][name], rtol=0, atol=0)
    assert any(not torch.equal(weights["a"][n], weights["plain"][n]) for n in weights["a"])


def test_ema_writes_the_average_of_the_trained_weights(split, sid_dir, tmp_path):
    """With a decay near 0 the average is the trained weights, so the written model is the
    plain run's; with 0.9 it is not, and its validation is the average's."""
    from safetensors.torch import load_file
    runs = {decay: _train(split, sid_dir, tmp_path / f"ema{decay}", "qwen3", epochs=2,
                          **({"ema": decay} if decay else {})) for decay in (0, 1e-9, 0.9)}
    plain, tiny, average = (load_file(str(runs[d] / "model.safetensors")) for d in runs)
    for name in plain:
        torch.testing.assert_close(tiny[name], plain[name], rtol=0, atol=1e-6, msg=name)
    assert any(not torch.allclose(average[n], plain[n]) for n in plain)


@pytest.mark.parametrize("family", ["qwen3", "onerec"])
def test_lookahead_heads_change_training_but_not_the_written_model(split, sid_dir, tmp_path,
                                                                   family):
    """The look-ahead heads train the model (other weights than a plain run's) and are left
    out of what it writes: the same tensors, the same parameter count, a model that serves."""
    from safetensors.torch import load_file
    plain = _train(split, sid_dir, tmp_path / "plain", family, epochs=2, lookahead=0.0)
    ahead = _train(split, sid_dir, tmp_path / "ahead", family, epochs=2, lookahead=0.5)
    a, b = (load_file(str(d / "model.safetensors")) for d in (plain, ahead))
    assert a.keys() == b.keys() and all(a[n].shape == b[n].shape for n in a)
    assert any(not torch.allclose(a[n], b[n]) for n in a)
    reports = [json.loads((d / "train_report.json").read_text()) for d in (plain, ahead)]
    assert reports[0]["parameters"] == reports[1]["parameters"]
    ranker = GenerativeRanker.open(ahead, split.data.item_ids)
    try:
        assert ranker.rank(split, "test", 10, 16).shape == (split.data.num_users, 10)
    finally:
        ranker.close()


def test_bad_inputs_have_clear_errors(split, sid_dir, tmp_path):
    options = TrainOptions(family="qwen3", epochs=1, **SMALL)
    with pytest.raises(DataError, match="run `xrec sid build` first"):
        train(split, tmp_path / "nothing", tmp_path / "m", options, progress=False)
    other = leave_one_out(walk_interactions(seed=1))   # 40 items too, but another split
    small = Interactions("tiny", ("u",), ("a", "b", "c"), np.zeros(3, np.int32),
                         np.array([0, 1, 2], np.int32), np.array([0.0, 1.0, 2.0]))
    with pytest.raises(DataError, match="catalog has 40 items, the data has 3"):
        train(leave_one_out(small), sid_dir, tmp_path / "m", options, progress=False)
    (tmp_path / "exists").mkdir()
    with pytest.raises(ValueError, match="exists"):
        train(other, sid_dir, tmp_path / "exists", options, progress=False)
    with pytest.raises(ValueError, match="hidden 30 is not a multiple of heads 4"):
        train(split, sid_dir, tmp_path / "m", TrainOptions(hidden=30, heads=4), progress=False)
    with pytest.raises(ValueError, match="beam_width: got 9, expected >= 10"):
        EvalOptions(beam_width=9)
