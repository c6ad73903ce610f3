"""Look-ahead heads: a training term that asks a model's decoder to predict, at every
position, the tokens two and three ahead as well as the next one, so the state at an item's
last token has to hold the whole next semantic ID rather than its first token alone (the
issue's lever "predicting the full 3-token ID at every position"; multi-token prediction as
in Gloeckle et al. 2024, "Better & Faster Large Language Models via Multi-token Prediction").

Head d (d = 2, 3) reads the final hidden state h of position t and predicts token t + d
through the model's own output layer: logits = output(norm_d(h + W_d h)), W_d starting at
zero, so each head starts as the next-token head (up to the norm's scale) and learns its
offset. The decoder-only family's positions run on through the window, from one item into
the next; the encoder-decoder's decoder reads one block [start, c1, c2] per target item, so
there a head predicts only inside its block (start: c2 and c3; c1: c3). The
heads are training-only parameters: the written model, and so serving, is the plain
model (`TrainableModel.state` leaves them out); a resumed run restores them from the optimizer
file. The term is the mean cross-entropy of each head over the positions that have a token
d ahead, weighted per head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xrec.realdata.sequences import IGNORE

__all__ = ["LookaheadHeads"]

OFFSETS = (2, 3)   # the rest of the next item's ID, whichever token a position holds


class LookaheadHeads(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.project = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in OFFSETS)
        self.norm = nn.ModuleList(nn.RMSNorm(hidden, eps=eps) for _ in OFFSETS)
        for linear in self.project:
            nn.init.zeros_(linear.weight)

    def loss(self, hidden: torch.Tensor, next_tokens: torch.Tensor, output,
             block: int = 0) -> torch.Tensor:
        """Sum over the heads of the mean cross-entropy of predicting, from `hidden[:, t]`
        ([B, T, H] final states), the token d ahead of position t, `next_tokens[:, t + d - 1]`
        ([B, T]: the token after each position, IGNORE where none), through `output` (final
        states -> logits). `block`: positions form independent blocks of this many (a target
        is read only inside t's block; 0: one run)."""
        term = hidden.new_zeros(())
        for d, project, norm in zip(OFFSETS, self.project, self.norm):
            state = hidden[:, :hidden.shape[1] + 1 - d]
            logits = output(norm(state + project(state)))
            target = next_tokens[:, d - 1:]
            if block:
                position = torch.arange(target.shape[1], device=target.device)
                target = target.masked_fill(position % block + d > block, IGNORE)
            # the mean over the positions with a target, 0 where none has one: a sum over a
            # count, with no branch on the data (dynamo would skip the whole frame)
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                    ignore_index=IGNORE, reduction="sum")
            term = term + total / (target != IGNORE).sum().clamp(min=1)
        return term
