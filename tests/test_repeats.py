"""The seen-item unlikelihood (`xrec.realdata.train.repeats`) against a loop written from its
definition, and its place in the training loss."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from xrec.realdata.train.models import TrainableModel, model_config
from xrec.realdata.train.options import TrainOptions
from xrec.realdata.train.repeats import MIN_COMPLEMENT, seen_unlikelihood

VOCAB = 12


def _reference(logits: torch.Tensor, windows: list[list[tuple[int, int, int]]],
               num_targets: int) -> float:
    """Per window, per item j, per level: the distinct tokens of earlier items that share
    j's prefix up to that level and differ at it; -log(1 - p) of each, summed."""
    total = 0.0
    for row, items in enumerate(windows):
        for j, item in enumerate(items):
            for level in (1, 2):
                banned = {items[k][level] for k in range(j)
                          if items[k][:level] == item[:level] and items[k][level] != item[level]}
                probs = logits[row, 3 * j + level].double().softmax(-1)
                total += sum(-math.log(max(1 - float(probs[t]), MIN_COMPLEMENT)) for t in banned)
    return total / num_targets


def _batch(windows):
    width = 1 + 3 * max(len(w) for w in windows)
    ids = torch.zeros(len(windows), width, dtype=torch.long)
    for row, items in enumerate(windows):
        ids[row, 1:1 + 3 * len(items)] = torch.tensor([t for item in items for t in item])
    return ids, torch.tensor([len(w) for w in windows])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_definition_on_random_windows(seed):
    rng = np.random.default_rng(seed)
    # few distinct tokens per level, so prefixes are shared often; windows of unequal length
    windows = [[tuple(int(t) for t in rng.integers(1, 4, 3)) for _ in range(n)]
               for n in (7, 3, 0, 9)]
    ids, lengths = _batch(windows)
    logits = torch.randn(len(windows), ids.shape[1], VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    got = seen_unlikelihood(logits, ids, lengths, num_targets=50)
    assert float(got) == pytest.approx(_reference(logits, windows, 50), rel=1e-5)
    assert float(got) > 0


def test_what_is_penalised_and_what_is_not():
    a, b = (1, 2, 3), (1, 4, 5)
    cases = {
        "a repeat of the same item": ([[a, a]], 0.0),
        "another first token": ([[(6, 2, 3), a]], 0.0),
        "the later item's tokens never count for an earlier one": ([[b, a]], None),
        "padding after a short window": ([[a], [a, b, a]], None),
    }
    for name, (windows, expected) in cases.items():
        ids, lengths = _batch(windows)
        logits = torch.randn(len(windows), ids.shape[1], VOCAB)
        got = float(seen_unlikelihood(logits, ids, lengths, num_targets=1))
        want = _reference(logits, windows, 1) if expected is None else expected
        assert got == pytest.approx(want, rel=1e-5, abs=1e-7), name
    # a seen second token at probability one costs -log(MIN_COMPLEMENT), not infinity
    ids, lengths = _batch([[a, b]])
    logits = torch.zeros(1, ids.shape[1], VOCAB)
    logits[0, 4, 2] = 100.0                        # predicting b's 2nd token: a's, surely
    got = float(seen_unlikelihood(logits, ids, lengths, num_targets=1))
    assert got == pytest.approx(-math.log(MIN_COMPLEMENT), rel=1e-4)


def test_the_training_loss_adds_the_weighted_term_and_its_gradient_lowers_a_seen_token():
    config = model_config("qwen3", VOCAB, hidden=16, layers=1, heads=2, max_positions=32,
                          bos_id=0)
    windows = [[(1, 2, 3), (1, 4, 5), (1, 2, 6)]]
    batch = [np.array([0, *[t for item in w for t in item]]) for w in windows]
    plain = TrainableModel.create(config, seed=0)
    weighted = TrainableModel.create(config, seed=0, seen_unlikelihood=2.0)
    ce, targets = plain.loss(batch)
    total, _ = weighted.loss(batch)
    ids, lengths = _batch(windows)
    term = seen_unlikelihood(plain.forward(batch)[0].logits, ids, lengths, targets)
    assert float(total.detach()) == pytest.approx(float(ce.detach()) + 2.0 * float(term.detach()), rel=1e-5)
    assert float(term) > 0
    # one step on the term alone lowers p(4 | 1) where the third item is predicted
    optimizer = torch.optim.SGD(weighted.hf.parameters(), lr=0.5)

    def seen_probability() -> float:
        with torch.no_grad():
            return float(weighted.forward(batch)[0].logits[0, 7].softmax(-1)[4])
    before = seen_probability()
    optimizer.zero_grad()
    (weighted.loss(batch)[0] - weighted.forward(batch)[0].loss).backward()
    optimizer.step()
    assert seen_probability() < before


def test_options_reject_a_negative_weight_and_the_encoder_decoder():
    with pytest.raises(ValueError, match="seen_unlikelihood: got -1"):
        TrainOptions(seen_unlikelihood=-1.0).check()
    with pytest.raises(ValueError, match="decoder-only family"):
        TrainOptions(family="onerec", seen_unlikelihood=1.0).check()
    config = model_config("onerec", VOCAB, hidden=16, layers=1, heads=2, max_positions=32,
                          bos_id=0)
    with pytest.raises(ValueError, match="decoder-only family only"):
        TrainableModel.create(config, seed=0, seen_unlikelihood=1.0)
