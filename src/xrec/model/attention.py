"""Attention: projections, plain attention, and xAttention's two stages and merge.

xAttention (docs/model.md): the W beams of one request share the decoder
prefix and the encoder output. Their keys are stored once per request and
attended by all W beam queries at once (the *shared* stage); each beam's own
generated tokens are attended separately (the *unshared* stage); the two
partial softmaxes are merged exactly through their log-sum-exps.

Layouts: beam queries `q` are `[B, W, H, Dh]`; shared keys `[B, kvH, P, Dh]`;
unshared keys `[B, W, S, kvH, Dh]`. Query head h reads kv head h // G with
G = H / kvH. Softmax statistics are float32 whatever the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xrec.model.layers import Embedding, Linear, stacked_linear


class Attention(nn.Module):
    """q/k/v/o projections with Hugging Face T5 names; block 0 owns the relative bias table."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 num_buckets: int | None = None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q = Linear(d_model, num_heads * head_dim, bias=False)  # pragma: no mutate
        self.k = Linear(d_model, num_kv_heads * head_dim, bias=False)  # pragma: no mutate
        self.v = Linear(d_model, num_kv_heads * head_dim, bias=False)  # pragma: no mutate
        self.o = Linear(num_heads * head_dim, d_model, bias=False)  # pragma: no mutate
        if num_buckets is not None:
            self.relative_attention_bias = Embedding(num_buckets, num_heads)

    def project_q(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x).unflatten(-1, (self.num_heads, self.head_dim))        # [..., H, Dh]

    def project_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_kv_heads, self.head_dim)
        k, v = stacked_linear(x, (self.k, self.v))
        return k.unflatten(-1, shape), v.unflatten(-1, shape)                  # [..., kvH, Dh]

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[..., H, Dh]`, k and v `[..., kvH, Dh]` of the same rows, in one product where
        the loader stacked the weights (`layers.stacked_linear`)."""
        q, k, v = stacked_linear(x, (self.q, self.k, self.v))
        shape = (self.num_kv_heads, self.head_dim)
        return (q.unflatten(-1, (self.num_heads, self.head_dim)), k.unflatten(-1, shape),
                v.unflatten(-1, shape))


def padding_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """`[B]` lengths -> additive key mask `[B, 1, 1, max_len]` (0 inside, -inf past the end)."""
    inside = torch.arange(max_len, device=lengths.device) < lengths.unsqueeze(1)
    zero = torch.zeros((), dtype=torch.float32, device=lengths.device)  # pragma: no mutate
    return torch.where(inside, zero, float("-inf")).view(len(lengths), 1, 1, max_len)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
           scale: float, is_causal: bool = False) -> torch.Tensor:
    """Plain attention, `q [B, H, Lq, Dh]`, `k/v [B, kvH, Lk, Dh]`, additive float mask
    broadcastable to `[B, H, Lq, Lk]` (bias and -inf padding), or `is_causal` without a
    mask. Returns `[B, H, Lq, Dh]`."""
    if mask is not None:
        mask = mask.to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=is_causal,
                                          enable_gqa=k.shape[1] != q.shape[1])


def attend_beams(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """The W beam queries of each request against that request's keys, no per-beam copy.

    `q [B, W, H, Dh]`, `k/v [B, kvH, L, Dh]`, `key_mask [B, 1, 1, L]` additive or None.
    The G query heads of a kv head and the W beams fold into one query axis, so one
    kernel call serves every beam. Returns `[B, W, H, Dh]`.
    """
    num_batch, num_beams, num_heads, head_dim = q.shape
    num_kv = k.shape[1]
    group = num_heads // num_kv
    qg = q.view(num_batch, num_beams, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(num_batch, num_kv, group * num_beams, head_dim)      # [B, kvH, G*W, Dh]
    out = attend(qg, k, v, key_mask, scale)
    out = out.view(num_batch, num_kv, group, num_beams, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(num_batch, num_beams, num_heads, head_dim)


def shared_stage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Shared stage: `q [B, W, H, Dh]` against the request's prefix `k/v [B, kvH, P, Dh]`,
    non-causal; `bias [B, H, P]` additive (position bias and -inf padding), `[B, 1, P]`
    (padding only, every head) or None.
    Returns `o [B, W, H, Dh]` and `lse [B, W, H]` (float32)."""
    num_batch, num_beams, num_heads, head_dim = q.shape
    num_kv, num_keys = k.shape[1], k.shape[2]
    group = num_heads // num_kv
    qg = q.view(num_batch, num_beams, num_kv, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(num_batch, num_kv, group * num_beams, head_dim)      # [B, kvH, G*W, Dh]
    if q.device.type == "cpu" and (bias is None or bias.shape[1] == 1):
        # the same head-independent mask for every query: PyTorch's CPU flash kernel, which
        # also returns the log-sum-exp, so the scores are never written out and re-read
        mask = None if bias is None else bias.view(num_batch, 1, 1, num_keys).to(q.dtype)
        out, lse = _cpu_flash_attention(qg, k, v, 0.0, False, attn_mask=mask, scale=scale)
        out = out.view(num_batch, num_kv, group, num_beams, head_dim).permute(0, 3, 1, 2, 4)
        lse = lse.view(num_batch, num_kv, group, num_beams).permute(0, 3, 1, 2)
        return (out.reshape(num_batch, num_beams, num_heads, head_dim),
                lse.reshape(num_batch, num_beams, num_heads))
    scores = (qg @ k.transpose(-1, -2)).float() * scale                  # [B, kvH, G*W, P]
    scores = scores.view(num_batch, num_kv, group, num_beams, num_keys)
    if bias is not None:
        bias = bias.expand(num_batch, num_heads, num_keys)
        scores = scores + bias.reshape(num_batch, num_kv, group, 1, num_keys)
    lse = torch.logsumexp(scores, dim=-1)                                 # [B, kvH, G, W]
    probs = torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype)
    out = probs.view(num_batch, num_kv, group * num_beams, num_keys) @ v  # [B, kvH, G*W, Dh]
    out = out.view(num_batch, num_kv, group, num_beams, head_dim).permute(0, 3, 1, 2, 4)
    return (out.reshape(num_batch, num_beams, num_heads, head_dim),
            lse.permute(0, 3, 1, 2).reshape(num_batch, num_beams, num_heads))


_cpu_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def unshared_stage(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None,
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Unshared stage: each beam's query against its own generated slots,
    `q [..., H, Dh]`, `k/v [..., S, kvH, Dh]` (the same leading beam axes: `[B, W]`, or
    `[B * W]` as the models pass them), `bias [H, S]` or None.
    Returns `o [..., H, Dh]` and `lse [..., H]`, both float32: the weighted sum over
    the slots is taken in float32 (a bfloat16 sum over a middle axis ran 1.6x slower here,
    and `merge_states` reads float32 anyway).

    Every reshape splits or joins the head axes only, never the leading ones: compiled
    (`xrec.model.fusion`), a view over the beam axes made dynamo guard on how their strides
    relate, and every layout of q (a view of the q/k/v product, or a tensor of its own) and
    every batch or beam axis of size 1 was a variant compiled apart."""
    num_heads = q.shape[-2]
    num_kv = k.shape[-2]
    group = num_heads // num_kv
    # S is a handful of slots: broadcast products beat batched S-wide matmuls. The slot
    # axis stays where the cache keeps it, so every operand is read in storage order.
    qg = q.unflatten(-2, (num_kv, group)).unsqueeze(-4)                   # [..., 1, kvH, G, Dh]
    scores = (qg * k.unsqueeze(-2)).sum(-1).float() * scale               # [..., S, kvH, G]
    if bias is not None:
        scores = scores + bias.unflatten(0, (num_kv, group)).permute(2, 0, 1)  # pragma: no mutate
    lse = torch.logsumexp(scores, dim=-3)                                 # [..., kvH, G]
    probs = torch.exp(scores - lse.unsqueeze(-3))
    out = (probs.unsqueeze(-1) * v.unsqueeze(-2)).sum(-4)                 # [..., kvH, G, Dh] float32
    return out.flatten(-3, -2), lse.flatten(-2)


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor,
                 lse_b: torch.Tensor) -> torch.Tensor:
    """Exact softmax over the union of two key sets from their partial results (float32
    math), in `o_a`'s dtype. B's share of the weight, `e^lse_b / (e^lse_a + e^lse_b)`, is
    `sigmoid(lse_b - lse_a)`; one `lerp` then blends the two outputs."""
    share_b = torch.sigmoid(lse_b - lse_a).unsqueeze(-1)
    return torch.lerp(o_a.float(), o_b.float(), share_b).to(o_a.dtype)
