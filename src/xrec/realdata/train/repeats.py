"""Unlikelihood of seen items: a training term that teaches a decoder-only model not to
write again an item its window already holds.

Teacher forcing already pushes every non-target token down, a seen item's among them, yet
an ML-1M model trained on cross-entropy alone filled 34% of its top-10 slots with items the
user had already met (2.2 of them within the 50-item window it reads). This term pushes
on those continuations specifically (Welleck et al. 2020, "Neural Text Generation with
Unlikelihood Training", applied to semantic IDs): while predicting item j, for every
earlier item k of the window that shares its prefix with j but not its next token,
-log(1 - p(that token)) is added:

- at j's second token, given j's first: the second token of each earlier item with the
  same first token and another second token;
- at j's third token, given j's first two: the third token of each earlier item with the
  same first two tokens and another third token.

The first token names a cluster of many items, so it is never penalised; an earlier item
equal to j (a real repeat) is never penalised either. Each (position, token) counts once.
The sum is divided by the batch's target count, so the weight is per target token.
"""

from __future__ import annotations

import torch

__all__ = ["seen_unlikelihood"]

MIN_COMPLEMENT = 1e-6   # 1 - p is clamped here: a seen token at p = 1 costs ~13.8, not inf


def seen_unlikelihood(logits: torch.Tensor, ids: torch.Tensor, lengths: torch.Tensor,
                      num_targets: int) -> torch.Tensor:
    """The unlikelihood term of a batch of causal windows (BOS + 3 tokens per item,
    right-padded). `logits`: [B, T, V], position t predicting token t + 1; `ids`: [B, T];
    `lengths`: [B] items per window; `num_targets`: the batch's target tokens."""
    b, width = ids.shape
    items = (width - 1) // 3
    tokens = ids[:, 1:1 + 3 * items].view(b, items, 3)                   # [B, L, 3]
    real = torch.arange(items, device=ids.device) < lengths[:, None]     # [B, L]
    earlier = torch.ones(items, items, dtype=torch.bool, device=ids.device).tril(-1)
    pairs = earlier & real[:, :, None] & real[:, None, :]                # [B, j, k]: k < j
    same = tokens[:, :, None, :] == tokens[:, None, :, :]                # [B, j, k, 3]
    second = pairs & same[..., 0] & ~same[..., 1]                        # k's 2nd token is wrong
    third = pairs & same[..., 0] & same[..., 1] & ~same[..., 2]          # k's 3rd token is wrong
    # logits predicting j's second token sit at j's first token (1 + 3j), its third at 2 + 3j
    term = logits.new_zeros(())
    for offset, penalised, level in ((1, second, 1), (2, third, 2)):
        scores = logits[:, offset:offset + 3 * items:3]                  # [B, L, V]
        banned = torch.zeros(scores.shape, dtype=torch.bool, device=ids.device)
        row, j, k = penalised.nonzero(as_tuple=True)
        banned[row, j, tokens[row, k, level]] = True                     # each token once
        probs = scores.softmax(-1)[banned]                               # [n]
        term = term + -(1 - probs).clamp(min=MIN_COMPLEMENT).log().sum()
    return term / max(1, num_targets)
