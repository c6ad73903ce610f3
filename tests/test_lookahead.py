"""The look-ahead heads (`xrec train --lookahead`): their loss read against the Hugging Face
model's own logits at initialisation, training-only weights that the written model leaves
out, and bad options."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xrec.realdata.train.models import TrainableModel, model_config
from xrec.realdata.train.options import TrainOptions

VOCAB = 12
WINDOWS = [[(1, 2, 3), (1, 4, 5), (1, 2, 6), (7, 2, 3)], [(1, 4, 5), (1, 4, 6)]]


def _model(lookahead: float) -> TrainableModel:
    config = model_config("qwen3", VOCAB, hidden=16, layers=1, heads=2, max_positions=32,
                          bos_id=0)
    return TrainableModel.create(config, seed=0, lookahead=lookahead)


def test_heads_start_as_the_next_token_head_shifted_to_their_offsets():
    """At initialisation each head's projection is zero, so head d scores token t + d with
    the logits the model itself gives at position t: the loss is Hugging Face's loss plus
    the weight times, for d = 2 and 3, the mean of -log p_t(token t + d) over a row's real
    positions that have a token d ahead."""
    batch = [np.array([0, *[t for item in w for t in item]]) for w in WINDOWS]
    plain, ahead = _model(0.0), _model(0.5)
    with torch.no_grad():
        out, _ = plain.forward(batch)
        got, targets = ahead.loss(batch)
    log_p = out.logits.double().log_softmax(-1)
    expected = float(out.loss)
    for d in (2, 3):
        picked = [log_p[r, t, int(row[t + d])] for r, row in enumerate(batch)
                  for t in range(len(row) - d)]
        expected += 0.5 * -float(torch.stack(picked).mean())
    assert targets == sum(len(row) - 1 for row in batch)
    assert float(got) == pytest.approx(expected, rel=1e-4)


def test_heads_are_trained_but_not_part_of_the_model():
    model = _model(1.0)
    own = {id(p) for p in model.hf.parameters()}
    extra = [p for p in model.parameters() if id(p) not in own]
    assert extra and set(model.training_state()) and not set(model.training_state()) & set(model.state())
    batch = [np.array([0, *[t for item in WINDOWS[0] for t in item]])]
    model.loss(batch)[0].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in extra)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="lookahead: got -1"):
        TrainOptions(lookahead=-1.0).check()
    with pytest.raises(ValueError, match="decoder-only"):
        TrainOptions(family="onerec", lookahead=0.5).check()
    config = model_config("onerec", VOCAB, hidden=16, layers=1, heads=2, max_positions=32,
                      bos_id=0)
    with pytest.raises(ValueError, match="decoder-only"):
        TrainableModel.create(config, seed=0, lookahead=0.5)
