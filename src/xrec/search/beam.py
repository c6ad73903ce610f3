"""Beam search pieces: constrained children, normalisation, global top-k, ancestry.

Everything is batched over requests and beams; no Python loop over beams or
candidates. Scores and log-probabilities are float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NEG_INF = float("-inf")


@dataclass(frozen=True)
class Children:
    """The allowed next tokens of every beam, padded to the level's widest node.

    `tokens [B, W, C]` (padding repeats a valid token), `is_valid [B, W, C]`,
    `first [B, W]`: the index of the beam's first child in the level's token array
    (child c of a beam becomes node `first + c` one level down), `nodes [B, W, C]`:
    those child nodes (padding repeats a valid one).
    """

    tokens: torch.Tensor
    is_valid: torch.Tensor
    first: torch.Tensor
    nodes: torch.Tensor


def gather_children(offsets: torch.Tensor, tokens: torch.Tensor, nodes: torch.Tensor,
                    max_children: int) -> Children:
    """Children of `nodes [B, W]` in one CSR level (`offsets [n+1]`, `tokens [m]`)."""
    first = offsets[nodes]                                               # [B, W]
    count = offsets[nodes + 1] - first
    rank = torch.arange(max_children, device=nodes.device)
    is_valid = rank < count.unsqueeze(-1)                                # [B, W, C]
    position = (first.unsqueeze(-1) + rank).clamp(max=len(tokens) - 1)
    return Children(tokens[position], is_valid, first, position)


def normalize(logits: torch.Tensor, is_valid: torch.Tensor | None,
              full_lse: torch.Tensor | None) -> torch.Tensor:
    """Log-probabilities of the candidates `logits [..., C]`.

    With `full_lse [...]` ("full" normalisation) the candidates are normalised over
    the whole vocabulary; otherwise over the valid candidates only ("allowed").
    Invalid candidates get -inf, never NaN (a beam with no valid child is all -inf).
    """
    if is_valid is not None:
        logits = logits.masked_fill(~is_valid, NEG_INF)
    lse = full_lse if full_lse is not None else torch.logsumexp(logits, dim=-1)
    lp = logits - lse.unsqueeze(-1)
    return lp if is_valid is None else lp.masked_fill(~is_valid, NEG_INF)


def select_top(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Best `k` of `scores [B, M]` per row, best first: values and flat indices `[B, k]`.

    Ties are ordered by the lower flat index. Rows with fewer than k candidates are
    padded with -inf (index 0). A NaN score (a model whose arithmetic overflowed) counts
    as -inf: it never outranks a real score and is returned as -inf, not a result.
    """
    num_rows, num_cands = scores.shape
    take = min(k, num_cands)
    # + 0.0: -0.0 -> 0.0 (in a copy). NaN -> -inf: its order would follow its sign bit, which
    # the device picks (inf - inf is -NaN on x86, +NaN on CUDA and ARM), and +NaN outranked
    # every real score
    scores = (scores.float() + 0.0).nan_to_num_(nan=NEG_INF, posinf=math.inf, neginf=NEG_INF)
    # topk leaves the order of equal values to the kernel, so it runs on unique int64 keys:
    # high 32 bits = the float32 score's bits made order-preserving, low 32 bits = the
    # reversed index. Best key first = best score first, equal scores by lower index.
    bits = scores.view(torch.int32)
    bits = bits ^ ((bits >> 31) & 0x7FFFFFFF)                          # [B, M] ordered like scores
    reversed_index = torch.arange(num_cands - 1, -1, -1, device=scores.device)
    keys = bits.to(torch.int64) * (1 << 32) + reversed_index           # [B, M] unique per row
    indices = keys.topk(take, dim=-1, sorted=True).indices             # [B, take]
    values = scores.gather(-1, indices)  # pragma: no mutate
    if take < k:  # pragma: no mutate
        pad = k - take
        values = torch.cat([values, values.new_full((num_rows, pad), NEG_INF)], dim=-1)
        indices = torch.cat([indices, indices.new_zeros((num_rows, pad))], dim=-1)
    return values, indices


def mask_beyond(values: torch.Tensor, widths: torch.Tensor | None) -> torch.Tensor:
    """-inf for the positions `j >= widths[b]` of `values [B, K]` (mixed widths in a batch)."""
    if widths is None:
        return values
    rank = torch.arange(values.shape[1], device=values.device)
    return values.masked_fill(rank >= widths.unsqueeze(1), NEG_INF)


def follow_parents(history: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """`history [B, W, R]` rows reordered by `parents [B, K]` -> `[B, K, R]`."""
    index = parents.unsqueeze(-1).expand(-1, -1, history.shape[-1])
    return history.gather(1, index)
