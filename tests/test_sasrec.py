"""SASRec on a synthetic split whose next item is a function of the last one."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from xrec.realdata.data.interactions import Interactions, Split  # noqa: E402
from xrec.realdata.train.sasrec import SASRecConfig, SASRecModel, rank_sasrec, train_sasrec  # noqa: E402

NUM_ITEMS = 30


def cycle_split(num_users: int = 160, seed: int = 0, num_items: int = NUM_ITEMS) -> Split:
    """Users walk one fixed cycle through the items from a random start (lengths 3..40);
    user 0 has exactly 3 interactions (one training item), user 1 has 2 (not evaluated)."""
    rng = np.random.default_rng(seed)
    cycle = rng.permutation(num_items).astype(np.int32)
    lengths = rng.integers(3, 41, num_users)
    lengths[0], lengths[1] = 3, 2
    seqs = [cycle[(rng.integers(num_items) + np.arange(n)) % num_items] for n in lengths]
    users = np.concatenate([np.full(len(s), u, np.int32) for u, s in enumerate(seqs)])
    items = np.concatenate(seqs)
    data = Interactions(name="cycle", user_ids=tuple(map(str, range(num_users))),
                        item_ids=tuple(map(str, range(num_items))), users=users, items=items,
                        timestamps=np.arange(len(items), dtype=np.float64))
    train = tuple(s[:-2] if len(s) >= 3 else s for s in seqs)
    valid = np.array([s[-2] if len(s) >= 3 else -1 for s in seqs], np.int32)
    test = np.array([s[-1] if len(s) >= 3 else -1 for s in seqs], np.int32)
    return Split(data=data, train=train, valid=valid, test=test)


SMALL = SASRecConfig(hidden_size=32, num_blocks=1, num_heads=2, max_len=16, dropout=0.1,
                     epochs=15, batch_size=16, lr=1e-2, patience=15, seed=3, num_threads=1)


@pytest.fixture(scope="module")
def split() -> Split:
    return cycle_split()


@pytest.fixture(scope="module")
def model(split) -> SASRecModel:
    return train_sasrec(split, SMALL, progress=False)


def hit_rate(ranked: np.ndarray, targets: np.ndarray) -> float:
    evaluated = targets >= 0
    return float((ranked[evaluated] == targets[evaluated, None]).any(1).mean())


def test_learns_the_cycle_far_above_most_popular(split, model):
    ranked = rank_sasrec(model, split, "test", 10)
    assert ranked.shape == (split.data.num_users, 10)
    assert ranked.min() >= 0 and ranked.max() < NUM_ITEMS
    hr1 = hit_rate(ranked[:, :1], split.test)
    counts = np.bincount(np.concatenate(split.history("test")), minlength=NUM_ITEMS)
    popular_hr1 = hit_rate(np.full((split.data.num_users, 1), counts.argmax()), split.test)
    assert hr1 >= 0.8, hr1
    assert hr1 >= popular_hr1 + 0.5, (hr1, popular_hr1)
    assert model.epoch_logs and model.epoch_logs[0].valid_hr10 is not None
    assert model.epoch_logs[-1].loss < model.epoch_logs[0].loss


def test_short_histories_are_ranked(split, model):
    # user 0 has one training item: its valid item is the cycle's successor of that item
    for stage in ("valid", "test"):
        ranked = rank_sasrec(model, split, stage, 5, batch_size=7)
        assert ranked.shape == (split.data.num_users, 5)
        assert np.isin(ranked, np.arange(NUM_ITEMS)).all()
        assert all(len(set(row)) == 5 for row in ranked)
    assert rank_sasrec(model, split, "valid", 1)[0, 0] == split.valid[0]


def test_exclude_seen_never_returns_history(split, model):
    history = split.history("test")
    ranked = rank_sasrec(model, split, "test", 10, exclude_seen=True, batch_size=50)
    for row, seen in zip(ranked, history):
        if len(np.unique(seen)) <= NUM_ITEMS - 10:  # else fewer than k unseen items exist
            assert not np.isin(row, seen).any()
    # the true next item is not in the history of short walks: excluding seen keeps it on top
    short = np.array([len(h) < NUM_ITEMS for h in history]) & (split.test >= 0)
    assert short.sum() >= 100
    assert hit_rate(ranked[short, :1], split.test[short]) >= 0.8


def test_seeded_training_is_reproducible(split, model):
    config = SASRecConfig(**{**SMALL.__dict__, "epochs": 2})
    first = train_sasrec(split, config, progress=False, valid_every=2)
    a = rank_sasrec(first, split, "test", 10)
    b = rank_sasrec(train_sasrec(split, config, progress=False, valid_every=2), split, "test", 10)
    np.testing.assert_array_equal(a, b)
    assert [log.valid_hr10 is None for log in first.epoch_logs] == [True, False]


def test_padding_does_not_change_the_output():
    config = SASRecConfig(hidden_size=16, num_blocks=2, num_heads=2, max_len=8, dropout=0.0)
    torch.manual_seed(0)
    net = SASRecModel(NUM_ITEMS, config).eval()
    seq = torch.tensor([[5, 9, 2]])
    padded = torch.tensor([[0, 0, 0, 0, 0, 5, 9, 2]])
    with torch.no_grad():
        torch.testing.assert_close(net(seq), net(padded)[:, -3:])
        assert torch.isfinite(net(padded)).all()


@pytest.mark.parametrize("field,value", [("hidden_size", 30), ("dropout", 1.0), ("max_len", 0),
                                         ("lr", 0.0)])
def test_config_rejects_bad_values(field, value):
    kwargs = {"num_heads": 4} if field == "hidden_size" else {}
    with pytest.raises(ValueError, match=field):
        SASRecConfig(**{field: value}, **kwargs)


def test_chunked_cross_entropy_matches_torch():
    from xrec.realdata.train.sasrec import _SoftmaxCrossEntropy
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 8, generator=gen, requires_grad=True)
    weight = torch.randn(11, 8, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (37,), generator=gen)
    expected = torch.nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="sum")
    grads = torch.autograd.grad(expected * 0.5, (hidden, weight))
    got = _SoftmaxCrossEntropy.apply(hidden, weight, targets, 5)   # 8 chunks, the last short
    torch.testing.assert_close(got, expected)
    for a, b in zip(torch.autograd.grad(got * 0.5, (hidden, weight)), grads):
        torch.testing.assert_close(a, b)


def test_without_validation_trains_on_every_item_but_the_test_one(split):
    refit = split.without_validation()
    assert all(np.array_equal(a, b) for a, b in zip(refit.train, split.history("test")))
    assert (refit.valid == -1).all() and np.array_equal(refit.test, split.test)
    assert np.array_equal(refit.history("test")[0], split.history("test")[0])


@pytest.mark.parametrize("refit", [True, False])
def test_eval_retrains_sasrec_for_the_epochs_validation_chose(tmp_path, monkeypatch, refit):
    """`xrec eval`, test stage: early stopping on validation picks the epoch count, then a
    fresh SASRec trains that many epochs on every item but the test one and is ranked
    (`--no-sasrec-refit`: the early-stopped model is)."""
    split = cycle_split(num_items=60)      # eval ranks 50 items
    from xrec.realdata.evaluate import run
    from xrec.realdata.train import sasrec

    runs = []

    def recording(run_split, config, progress=True):
        model = train_sasrec(run_split, config, progress=progress)
        runs.append((run_split, config, model))
        return model

    monkeypatch.setattr(sasrec, "train_sasrec", recording)
    report = run.evaluate(split, [], tmp_path,
                          run.EvalOptions(baselines=("sasrec",), sasrec_refit=refit),
                          progress=False, log=lambda *_: None)
    facts = report["training"]["sasrec"]
    assert len(runs) == (2 if refit else 1)
    first_split, first_config, first = runs[0]
    assert first_split is split and len(first.epoch_logs) == facts["epochs"]
    assert report["metrics"]["sasrec"]["hr@10"] >= 0.8, report["metrics"]["sasrec"]
    if not refit:
        assert "refit_epochs" not in facts and report["notes"] == []
        return
    refit_split, refit_config, refit_model = runs[1]
    assert all(np.array_equal(a, b) for a, b in zip(refit_split.train, split.history("test")))
    assert (refit_split.valid == -1).all()
    assert facts["refit_epochs"] == facts["best_epoch"] == refit_config.epochs
    assert len(refit_model.epoch_logs) == facts["best_epoch"] <= facts["epochs"]
    assert facts["train_seconds"] == pytest.approx(
        round(first.epoch_logs[-1].seconds, 1) + facts["refit_seconds"], abs=0.11)
    assert any(note.startswith("sasrec: early stopping") for note in report["notes"])


def test_the_cache_trains_once_per_data_and_configuration(tmp_path, split):
    from xrec.realdata.train.sasrec_cache import trained_sasrec
    config = SASRecConfig(**{**SMALL.__dict__, "epochs": 2})
    first = trained_sasrec(split, config, progress=False, cache=tmp_path)
    again = trained_sasrec(split, config, progress=False, cache=tmp_path)
    assert (first.reused, again.reused) == (False, True)
    assert len(list(tmp_path.glob("*.pt"))) == 1
    for name, tensor in first.state_dict().items():
        torch.testing.assert_close(again.state_dict()[name], tensor, rtol=0, atol=0)
    assert again.epoch_logs == first.epoch_logs and not again.training
    # where it runs is not what it learns; another seed or other data is another model
    threads = SASRecConfig(**{**config.__dict__, "num_threads": 2})
    assert trained_sasrec(split, threads, progress=False, cache=tmp_path).reused
    seed = SASRecConfig(**{**config.__dict__, "seed": 4})
    assert not trained_sasrec(split, seed, progress=False, cache=tmp_path).reused
    assert not trained_sasrec(cycle_split(seed=1), config, progress=False, cache=tmp_path).reused
    assert len(list(tmp_path.glob("*.pt"))) == 3
    # a torn entry is trained again and replaced; a wall-time cap is never cached
    entry = next(p for p in tmp_path.glob("*.pt") if p.stat().st_mtime == min(
        q.stat().st_mtime for q in tmp_path.glob("*.pt")))
    entry.write_bytes(entry.read_bytes()[:100])
    models = [trained_sasrec(split, config, progress=False, cache=tmp_path) for _ in range(2)]
    assert [m.reused for m in models] == [False, True]
    capped = SASRecConfig(**{**config.__dict__, "max_seconds": 600.0})
    assert not trained_sasrec(split, capped, progress=False, cache=tmp_path / "capped").reused
    assert not (tmp_path / "capped").exists() and not list(tmp_path.glob(".sasrec-*"))


def test_eval_ranks_the_sasrec_that_sid_build_trained(tmp_path):
    """`xrec sid build --embeddings sasrec` then `xrec eval`: one early-stopped SASRec,
    trained by the first and loaded by the second (same split, same configuration)."""
    from xrec.realdata.evaluate import run
    from xrec.realdata.sid.build import build_sid_dir

    split, cache = cycle_split(num_items=60), tmp_path / "sasrec"
    build_sid_dir(split, tmp_path / "sid", embeddings="sasrec", codebook_size=8,
                  sasrec_cache=cache)
    options = run.EvalOptions(baselines=("sasrec",), sasrec_cache=str(cache))
    first, second = (run.evaluate(split, [], tmp_path / out, options, progress=False,
                                  log=lambda *_: None)
                     for out in ("eval-1", "eval-2"))
    assert first["training"]["sasrec"]["reused"] and not first["training"]["sasrec"]["refit_reused"]
    assert second["training"]["sasrec"]["refit_reused"]
    assert second["metrics"] == first["metrics"]
    assert any("earlier command's training" in note for note in first["notes"])


def test_fewer_items_than_k_ranks_every_item_and_pads_with_minus_one():
    """A catalog of 6 items: training validates HR@10 (k=10 > 6) and `rank_sasrec` with
    k=50 ranks all 6 items, then -1 (as the baselines do)."""
    split = cycle_split(num_users=40, num_items=6)
    model = train_sasrec(split, SASRecConfig(**{**SMALL.__dict__, "epochs": 2}), progress=False)
    ranked = rank_sasrec(model, split, "test", 50)
    assert ranked.shape == (40, 50)
    assert (ranked[:, 6:] == -1).all()
    assert all(sorted(row[:6]) == list(range(6)) for row in ranked)
    with pytest.raises(ValueError, match="k: got 0"):
        rank_sasrec(model, split, "test", 0)
