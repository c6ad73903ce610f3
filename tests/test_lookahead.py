"""The look-ahead heads (`xrec train --lookahead`): their loss read against the Hugging Face
model's own logits at initialisation, training-only weights that the written model leaves
out, and bad options."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xrec.realdata.sequences import IGNORE
from xrec.realdata.train.lookahead import LookaheadHeads
from xrec.realdata.train.models import TrainableModel, model_config
from xrec.realdata.train.options import TrainOptions

VOCAB = 12
WINDOWS = [[(1, 2, 3), (1, 4, 5), (1, 2, 6), (7, 2, 3)], [(1, 4, 5), (1, 4, 6)]]


def _model(lookahead: float, family: str = "qwen3") -> TrainableModel:
    config = model_config(family, VOCAB, hidden=16, layers=1, heads=2, max_positions=32,
                          bos_id=0)
    return TrainableModel.create(config, seed=0, lookahead=lookahead)


def _with_heads_at_init(family: str, picked_of) -> tuple[float, float, int]:
    """(the loss with heads of weight 0.5 at initialisation, the loss expected from the plain
    model's own logits, the target count): `picked_of(batch, log_p, labels, d)` lists the
    log-probabilities head d must score."""
    batch = [np.array([0, *[t for item in w for t in item]]) for w in WINDOWS]
    plain, ahead = _model(0.0, family), _model(0.5, family)
    with torch.no_grad():
        out, labels = plain.forward(batch)
        got, targets = ahead.loss(batch)
    log_p = out.logits.double().log_softmax(-1)
    expected = float(out.loss)
    for d in (2, 3):
        expected += 0.5 * -float(torch.stack(picked_of(batch, log_p, labels, d)).mean())
    return float(got), expected, targets


def test_heads_start_as_the_next_token_head_shifted_to_their_offsets():
    """At initialisation each head's projection is zero, so head d scores token t + d with
    the logits the model itself gives at position t: the loss is Hugging Face's loss plus
    the weight times, for d = 2 and 3, the mean of -log p_t(token t + d) over a row's real
    positions that have a token d ahead."""
    def picked(batch, log_p, labels, d):
        return [log_p[r, t, int(row[t + d])] for r, row in enumerate(batch)
                for t in range(len(row) - d)]

    got, expected, targets = _with_heads_at_init("qwen3", picked)
    assert targets == sum(3 * len(w) for w in WINDOWS)
    assert got == pytest.approx(expected, rel=1e-4)


def test_encoder_decoder_heads_predict_inside_each_target_block():
    """The encoder-decoder's decoder reads [start, c1, c2] per target item: at
    initialisation head 2 scores c2 from the start position and c3 from c1's, head 3 c3
    from the start, each with the logits T5 itself gives there (scaled as its tied head
    scales them), and no head reaches into the next target's block."""
    num_targets = sum(len(w) - 1 for w in WINDOWS)

    def picked(batch, log_p, labels, d):
        found = [log_p[r, t, int(labels[r, t + d - 1])]
                 for r in range(len(batch)) for t in range(labels.shape[1] - d + 1)
                 if t % 3 + d <= 3 and labels[r, t + d - 1] != IGNORE]
        assert len(found) == (2 if d == 2 else 1) * num_targets
        return found

    got, expected, targets = _with_heads_at_init("onerec", picked)
    assert targets == 3 * num_targets
    assert got == pytest.approx(expected, rel=1e-4)


def test_a_head_without_targets_adds_nothing_and_the_loss_traces_as_one_graph():
    """A head whose every target is missing adds 0 (not a NaN mean of nothing), and the
    loss has no branch on the data: dynamo traces it as one graph (it skipped the whole
    frame until 2026-12-05), so it can be compiled once measured to pay."""
    heads = LookaheadHeads(8)
    output = torch.nn.Linear(8, VOCAB)
    hidden = torch.randn(2, 5, 8)
    nothing = torch.full((2, 5), IGNORE)
    assert float(heads.loss(hidden, nothing, output).detach()) == 0.0
    some = nothing.clone()
    some[0, 2] = 4                                       # head 2 from position 1, head 3 from 0
    # projections start at zero: head d scores position t's normed state
    second, third = (output(heads.norm[i](hidden[0, t])).log_softmax(-1) for i, t in ((0, 1), (1, 0)))
    torch.testing.assert_close(heads.loss(hidden, some, output), -second[4] - third[4])
    explained = torch._dynamo.explain(heads.loss)(hidden, some, output)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@pytest.mark.parametrize("family", ["qwen3", "onerec"])
def test_heads_are_trained_but_not_part_of_the_model(family):
    model = _model(1.0, family)
    own = {id(p) for p in model.hf.parameters()}
    extra = [p for p in model.parameters() if id(p) not in own]
    assert extra and set(model.training_state()) and not set(model.training_state()) & set(model.state())
    batch = [np.array([0, *[t for item in WINDOWS[0] for t in item]])]
    model.loss(batch)[0].backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in extra)


def test_bad_options_are_clear_errors():
    with pytest.raises(ValueError, match="lookahead: got -1"):
        TrainOptions(lookahead=-1.0).check()
    TrainOptions(family="onerec", lookahead=0.5).check()
