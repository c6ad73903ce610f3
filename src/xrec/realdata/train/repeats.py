"""Unlikelihood of seen items: a training term that teaches a model (either family) not to
write again an item its window already holds.

Teacher forcing already pushes every non-target token down, a seen item's among them, yet
the ML-1M decoder-only model trained on cross-entropy alone filled 34% of its top-10 slots
with items the user had already met (2.2 of them within the 50-item window it reads). This term pushes
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
The sum is divided by the batch's target count, so the weight is per target token. Each
family says where its logits of item j's tokens are (`TrainableModel.item_logits`).

Measured on ML-1M (docs/decisions.md, "Seen-item unlikelihood"): it halves the seen items in
the top 10, but raises plain HR@10 only where the prompt is a training window (a final fit's
test users), so `xrec train --seen-unlikelihood` is off by default.
"""

from __future__ import annotations

import torch

__all__ = ["seen_unlikelihood"]

MIN_COMPLEMENT = 1e-6   # 1 - p is clamped here: a seen token at p = 1 costs ~13.8, not inf


def seen_unlikelihood(second: torch.Tensor, third: torch.Tensor, tokens: torch.Tensor,
                      real: torch.Tensor, num_targets: int, first_target: int = 0) -> torch.Tensor:
    """The unlikelihood term of a batch of windows of items. `tokens`: [B, L, 3] the items'
    semantic IDs, `real`: [B, L] bool (False: padding); `second`, `third`: [B, L, V] the
    logits that predict item j's second token (given its first) and its third (given its
    first two), read only for targets, items j >= `first_target`; `num_targets`: the batch's
    target tokens."""
    items = tokens.shape[1]
    index = torch.arange(items, device=tokens.device)
    earlier = index[None, :] < index[:, None]                            # [j, k]: k < j
    targets = real & (index >= first_target)                            # [B, L]
    pairs = earlier & targets[:, :, None] & real[:, None, :]             # [B, j, k]
    same = tokens[:, :, None, :] == tokens[:, None, :, :]                # [B, j, k, 3]
    wrong_second = pairs & same[..., 0] & ~same[..., 1]
    wrong_third = pairs & same[..., 0] & same[..., 1] & ~same[..., 2]
    term = second.new_zeros(())
    for scores, penalised, level in ((second, wrong_second, 1), (third, wrong_third, 2)):
        banned = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)  # [B, L, V]
        row, j, k = penalised.nonzero(as_tuple=True)
        banned[row, j, tokens[row, k, level]] = True                     # each token once
        probs = scores.softmax(-1)[banned]                               # [n]
        term = term + -(1 - probs).clamp(min=MIN_COMPLEMENT).log().sum()
    return term / max(1, num_targets)
