"""The training loss's extra terms: the seen-item unlikelihood (`xrec.realdata.train.repeats`)
against a loop written from its definition, its place in both families' training loss, and
label smoothing against Hugging Face's own loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from xrec.realdata.train.models import TrainableModel, model_config, seq2seq_inputs
from xrec.realdata.train.options import TrainOptions
from xrec.realdata.train.repeats import MIN_COMPLEMENT, seen_unlikelihood

VOCAB = 12


def _reference(predict, windows: list[list[tuple[int, int, int]]], num_targets: int,
               first_target: int = 0) -> float:
    """`predict(row, j, level)`: the logits that predict token `level` (1 or 2) of item j.
    Per window, per target item j, per level: the distinct tokens of earlier items that
    share j's prefix up to that level and differ at it; -log(1 - p) of each, summed."""
    total = 0.0
    for row, items in enumerate(windows):
        for j in range(first_target, len(items)):
            for level in (1, 2):
                banned = {items[k][level] for k in range(j) if items[k][:level] ==
                          items[j][:level] and items[k][level] != items[j][level]}
                probs = predict(row, j, level).double().softmax(-1)
                total += sum(-math.log(max(1 - float(probs[t]), MIN_COMPLEMENT)) for t in banned)
    return total / num_targets


def _tensors(windows):
    length = max(len(w) for w in windows)
    tokens = torch.zeros(len(windows), length, 3, dtype=torch.long)
    real = torch.zeros(len(windows), length, dtype=torch.bool)
    for row, items in enumerate(windows):
        if items:
            tokens[row, :len(items)] = torch.tensor(items)
        real[row, :len(items)] = True
    return tokens, real


def _term(windows, second, third, num_targets=1, first_target=0):
    tokens, real = _tensors(windows)
    return float(seen_unlikelihood(second, third, tokens, real, num_targets, first_target))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("first_target", [0, 1])
def test_matches_the_definition_on_random_windows(seed, first_target):
    rng = np.random.default_rng(seed)
    # few distinct tokens per level, so prefixes are shared often; windows of unequal length
    windows = [[tuple(int(t) for t in rng.integers(1, 4, 3)) for _ in range(n)]
               for n in (7, 3, 0, 9)]
    gen = torch.Generator().manual_seed(seed)
    second, third = (torch.randn(4, 9, VOCAB, generator=gen) * 3 for _ in range(2))
    got = _term(windows, second, third, 50, first_target)
    want = _reference(lambda r, j, level: (second, third)[level - 1][r, j], windows, 50,
                      first_target)
    assert got == pytest.approx(want, rel=1e-5) and got > 0


def test_what_is_penalised_and_what_is_not():
    a, b = (1, 2, 3), (1, 4, 5)
    second, third = torch.randn(2, 3, VOCAB), torch.randn(2, 3, VOCAB)
    assert _term([[a, a]], second[:1, :2], third[:1, :2]) == 0          # a real repeat
    assert _term([[(6, 2, 3), a]], second[:1, :2], third[:1, :2]) == 0  # another first token
    # b then a: only a (j = 1) is a target with b before it; padding rows never count
    got = _term([[b, a], [a, b, a]], second[:, :3], third[:, :3])
    p = second.softmax(-1)
    want = -math.log(1 - p[0, 1, 4]) - math.log(1 - p[1, 1, 2]) - math.log(1 - p[1, 2, 4])
    assert got == pytest.approx(want, rel=1e-5)
    # a seen token at probability one costs -log(MIN_COMPLEMENT), not infinity
    sure = torch.zeros(1, 2, VOCAB)
    sure[0, 1, 2] = 100.0
    assert _term([[a, b]], sure, torch.zeros(1, 2, VOCAB)) == pytest.approx(
        -math.log(MIN_COMPLEMENT), rel=1e-4)


def _model(family: str, weight: float) -> TrainableModel:
    config = model_config(family, VOCAB, hidden=16, layers=1, heads=2, max_positions=32,
                          bos_id=0)
    return TrainableModel.create(config, seed=0, seen_unlikelihood=weight)


WINDOWS = [[(1, 2, 3), (1, 4, 5), (1, 2, 6), (7, 2, 3)], [(1, 4, 5), (1, 4, 6)]]


def _predictions(family: str, logits: torch.Tensor):
    """Where each family's logits of item j's token `level` are, from its layout's docs."""
    if family == "qwen3":   # BOS, then 3 tokens per item: position 3j + level predicts it
        return lambda row, j, level: logits[row, 3 * j + level]
    # decoder blocks [start, c1, c2] of targets 1 .. n: block j - 1, offset level
    return lambda row, j, level: logits[row, 3 * (j - 1) + level]


@pytest.mark.parametrize("family", ["qwen3", "onerec"])
def test_each_family_adds_the_weighted_term_at_its_own_positions(family):
    batch = [np.array([0, *[t for item in w for t in item]]) for w in WINDOWS]
    plain, weighted = _model(family, 0.0), _model(family, 2.0)
    with torch.no_grad():
        ce, targets = plain.loss(batch)
        total, _ = weighted.loss(batch)
        logits = plain.forward(batch)[0].logits
    first = 1 if family == "onerec" else 0
    term = _reference(_predictions(family, logits), WINDOWS, targets, first)
    assert term > 0
    assert float(total) == pytest.approx(float(ce) + 2.0 * term, rel=1e-5)
    if family == "onerec":   # the layout read above is the one the decoder is fed
        labels = seq2seq_inputs(batch, 0)["labels"][0]
        assert labels[:9].tolist() == [t for item in WINDOWS[0][1:] for t in item]


def test_a_step_on_the_term_lowers_a_seen_continuation():
    model = _model("qwen3", 1.0)
    batch = [np.array([0, *[t for item in WINDOWS[0] for t in item]])]
    optimizer = torch.optim.SGD(model.hf.parameters(), lr=0.5)

    def seen_probability() -> float:    # p(4 | 1) where item 2's second token is predicted
        with torch.no_grad():
            return float(model.forward(batch)[0].logits[0, 7].softmax(-1)[4])
    before = seen_probability()
    optimizer.zero_grad()
    (model.loss(batch)[0] - model.forward(batch)[0].loss).backward()
    optimizer.step()
    assert seen_probability() < before


def test_options_reject_a_negative_weight():
    with pytest.raises(ValueError, match="seen_unlikelihood: got -1"):
        TrainOptions(seen_unlikelihood=-1.0).check()


@pytest.mark.parametrize("family", ["qwen3", "onerec"])
def test_label_smoothing_mixes_the_models_own_loss_with_the_uniform_one(family):
    """(1 - s) x Hugging Face's own cross-entropy (which aligns logits and labels itself) +
    s x the mean over target positions of -log p averaged over the vocabulary."""
    batch = [np.array([0, *[t for item in w for t in item]]) for w in WINDOWS]
    config = model_config(family, VOCAB, hidden=16, layers=1, heads=2, max_positions=32,
                          bos_id=0)
    smoothed = TrainableModel.create(config, seed=0, label_smoothing=0.2)
    with torch.no_grad():
        out, _ = smoothed.forward(batch)
        got, targets = smoothed.loss(batch)
    log_p = out.logits.double().log_softmax(-1)
    if family == "qwen3":   # every real token but the last predicts the next one
        rows = [log_p[r, :len(w) - 1] for r, w in enumerate(batch)]
    else:                   # one decoder position per target token
        labels = seq2seq_inputs(batch, 0)["labels"]
        rows = [log_p[r][labels[r] >= 0] for r in range(len(batch))]
    uniform = -torch.cat(rows).mean(-1)
    assert len(uniform) == targets
    assert float(got) == pytest.approx(0.8 * float(out.loss) + 0.2 * float(uniform.mean()),
                                       rel=1e-5)


def test_label_smoothing_out_of_range_is_a_clear_error():
    with pytest.raises(ValueError, match="label_smoothing"):
        TrainOptions(label_smoothing=1.0).check()
