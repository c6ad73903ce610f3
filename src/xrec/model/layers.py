"""Small building blocks: linear layers, RMSNorm, gated-SiLU feed-forward (T5 and Qwen names),
T5 position buckets. The element-wise chains (`rms_norm_low_precision`, `silu_mul`) are
plain functions that xrec.model.fusion may compile."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from xrec.model.gemm import cpu_fp32_gemm, onednn_linear


# Up to this many rows, a float32 product on a CPU is taken weight-first (see `linear`).
WEIGHT_FIRST_MAX_ROWS = 128  # pragma: no mutate


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x [..., K] @ weight[N, K].T (+ bias)` -> `[..., N]`, as `F.linear`.

    A float32 product on a CPU goes to the library `gemm.cpu_fp32_gemm` chose for this
    machine (oneDNN where it beats MKL, e.g. AVX-512 AMD CPUs; with a gradient where one
    is needed, for training). With MKL, products of 2 to `WEIGHT_FIRST_MAX_ROWS` rows are taken as
    `weight @ x.T`, then transposed back: with few rows MKL's sgemm packs the whole weight
    each call, and weight-first reads it faster (docs/decisions.md, Roofline). Rows of this
    size are the decoder prefix and the round-0 head of a batch (one row per request),
    the decoder rounds of one request of up to 128 beams, and a mixture's experts.
    """
    if x.device.type != "cpu" or x.dtype != torch.float32:  # pragma: no mutate
        return F.linear(x, weight, bias)
    if cpu_fp32_gemm() == "onednn":
        return onednn_linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    # which path is a matter of speed only: both give x @ W.T (+ b)
    if not 2 <= rows <= WEIGHT_FIRST_MAX_ROWS:  # pragma: no mutate
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).T                               # [K, rows]
    out = torch.mm(weight, flat) if bias is None else torch.addmm(bias.unsqueeze(1), weight, flat)
    return out.T.contiguous().view(*x.shape[:-1], weight.shape[0])


def stack_weights(tensors: dict[str, torch.Tensor], groups: tuple[tuple[str, ...], ...]) -> None:
    """Store each group of sibling tensors (names that differ only by the group's suffixes,
    e.g. one attention's q, k and v weights) one after another in one tensor, the dict's
    entries becoming views of it: names, shapes and values unchanged, no extra memory. Then
    `stacked` reads a group as one product's weight. In place."""
    for suffixes in groups:
        for name in [n for n in tensors if n.endswith(suffixes[0])]:
            names = [name[:-len(suffixes[0])] + suffix for suffix in suffixes]
            parts = [tensors.get(n) for n in names]
            if any(p is None or p.shape[1:] != parts[0].shape[1:] or p.dtype != parts[0].dtype
                   or p.device != parts[0].device for p in parts):
                continue
            whole = torch.cat(parts)
            for n, view in zip(names, whole.split([p.shape[0] for p in parts])):
                tensors[n] = view


def stacked(*weights: torch.Tensor) -> torch.Tensor | None:
    """`weights` as one tensor, their rows one after another, when they lie so in one
    storage (as `stack_weights` leaves them); else None. A view: nothing is copied."""
    first = weights[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for weight in weights:
        if (weight.untyped_storage().data_ptr() != storage or weight.storage_offset() != offset
                or not weight.is_contiguous() or weight.shape[1:] != first.shape[1:]):
            return None
        offset += weight.numel()
    return first.as_strided((sum(w.shape[0] for w in weights), *first.shape[1:]), first.stride())


def stacked_linear(x: torch.Tensor, projections: tuple[nn.Linear, ...]) -> list[torch.Tensor]:
    """`x` through each of `projections` (say a q, k and v of the same rows): one product
    where the loader stacked their weights and biases (`stack_weights`), wider and so faster
    on a CPU in bfloat16 (docs/decisions.md, "Stacked projections"); else one each."""
    weight = stacked(*(p.weight for p in projections))
    has_bias = projections[0].bias is not None
    bias = stacked(*(p.bias for p in projections)) if has_bias else None
    if weight is None or (has_bias and bias is None):
        return [p(x) for p in projections]
    return list(linear(x, weight, bias).split([p.weight.shape[0] for p in projections], -1))


class Embedding(nn.Embedding):
    """`nn.Embedding` (same parameter, names, checkpoints and init) that skips its random init
    on the `meta` device, where there are no values to draw: xrec builds a model there and
    then assigns every weight (a checkpoint's, or `random_init`'s draw), and `normal_` on a
    meta tensor imports torch._dynamo, over a second of every engine's start
    (docs/decisions.md, "An engine's start imports no compiler")."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, names and checkpoints) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def rms_norm_low_precision(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """T5 / Qwen RMSNorm of a bfloat16 or float16 `x`, as Hugging Face computes it: the
    statistics and the scaling in float32, rounded to `x`'s dtype, then times `weight`."""
    xf = x.float()
    # x * x, not x.pow(2): the same values; pow takes a slow generic path on a CPU
    inverse_rms = torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)
    return (xf * inverse_rms).to(x.dtype).mul_(weight)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, the gated feed-forward's activation, written into `gate` (a fresh
    product's output): no extra [.., d_ff] buffers."""
    return F.silu(gate, inplace=True).mul_(up)


class RMSNorm(nn.Module):
    """T5 layer norm: scale only, no mean subtraction, statistics in float32."""

    fusable = ("low_precision",)     # xrec.model.fusion
    low_precision = staticmethod(rms_norm_low_precision)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # the same arithmetic in one kernel, bit for bit on a CPU (docs/decisions.md, Roofline)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.low_precision(x, self.weight, self.eps)


class GatedSilu(nn.Module):
    """Base of the gated-SiLU feed-forwards: `gated(x, gate, up, down)` is
    down(silu(gate(x)) * up(x))."""

    fusable = ("silu_mul",)          # xrec.model.fusion
    silu_mul = staticmethod(silu_mul)

    def gated(self, x: torch.Tensor, gate: nn.Module, up: nn.Module, down: nn.Module) -> torch.Tensor:
        return down(self.silu_mul(gate(x), up(x)))


class GatedFFN(GatedSilu):
    """wo(silu(gate(x)) * up(x)), Hugging Face T5 names: wi_0 = gate, wi_1 = up."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.wi_0 = Linear(d_model, d_ff, bias=False)
        self.wi_1 = Linear(d_model, d_ff, bias=False)
        self.wo = Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gated(x, self.wi_0, self.wi_1, self.wo)


class SwiGLU(GatedSilu):
    """The same feed-forward with Hugging Face Qwen names: gate_proj, up_proj, down_proj."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.gate_proj = Linear(d_model, d_ff, bias=False)
        self.up_proj = Linear(d_model, d_ff, bias=False)
        self.down_proj = Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gated(x, self.gate_proj, self.up_proj, self.down_proj)


def relative_position_bucket(relative_position: torch.Tensor, *, bidirectional: bool,
                             num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's bucketing of `key_pos - query_pos`: exact for small distances, log-spaced beyond."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = (max_exact + (log_ratio * (num_buckets - max_exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)
