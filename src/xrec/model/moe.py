"""Mixtures of experts: OneRec's decoder MoE and Qwen3-MoE's sparse block, one expert loop.

OneRec (docs/model.md): softmax over all experts, top-k, times the route scale,
no renormalisation, optional shared experts added ungated. Qwen3-MoE: softmax in
float32, top-k, renormalised over the k only when `norm_topk_prob`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xrec.config import ModelConfig
from xrec.model.layers import GatedSilu, Linear, SwiGLU
from xrec.config.qwen import QwenConfig


def run_experts(tokens: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                experts: nn.ModuleList) -> torch.Tensor:
    """sum_k weights[n, k] * experts[chosen[n, k]](tokens[n]): `tokens [N, D]`, `weights`
    and `chosen [N, k]`. One loop over experts (never over tokens): each expert runs
    once on the tokens routed to it. On CUDA the per-expert counts cost one host read."""
    top_k = chosen.shape[1]
    out = torch.zeros_like(tokens)
    flat = chosen.reshape(-1)                                             # [N*k]
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=len(experts)).tolist()
    token_of = order // top_k
    flat_weights = weights.reshape(-1)
    start = 0
    for expert, count in zip(experts, counts):
        if count:
            rows = token_of[start:start + count]
            w = flat_weights[order[start:start + count]].unsqueeze(-1)
            out.index_add_(0, rows, expert(tokens[rows]) * w)
        start += count
    return out


class ExpertFFN(GatedSilu):
    """One gated-SiLU expert, xllm names: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, bias=False)
        self.w3 = Linear(d_model, d_ff, bias=False)
        self.w2 = Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gated(x, self.w1, self.w3, self.w2)


class MoE(nn.Module):
    """OneRec's routed experts plus optional shared experts (one FFN `moe_inter_dim × num_shared` wide)."""

    reads_host_values = True   # per-expert token counts (`run_experts`): not capturable

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.gate = Linear(d, config.moe_num_experts, bias=False)
        self.experts = nn.ModuleList(ExpertFFN(d, config.moe_inter_dim)
                                     for _ in range(config.moe_num_experts))
        self.shared_experts = (ExpertFFN(d, config.moe_inter_dim * config.moe_num_shared_experts)
                               if config.moe_use_shared_experts else None)
        self.top_k = config.moe_topk
        self.route_scale = config.moe_route_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])                                 # [N, D]
        probs = torch.softmax(self.gate(tokens).float(), dim=-1)          # [N, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)                  # [N, k]
        out = run_experts(tokens, (weights * self.route_scale).to(x.dtype), chosen, self.experts)
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.reshape(shape)


class SparseMoE(nn.Module):
    """Qwen3-MoE's block, Hugging Face names: `gate` (router), `experts.E.{gate,up,down}_proj`."""

    reads_host_values = True   # per-expert token counts (`run_experts`): not capturable

    def __init__(self, config: QwenConfig):
        super().__init__()
        d = config.hidden_size
        self.gate = Linear(d, config.num_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(d, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.top_k = config.num_experts_per_tok
        self.is_renormalized = config.norm_topk_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])                                 # [N, D]
        probs = F.softmax(self.gate(tokens), dim=-1, dtype=torch.float32)  # [N, E]
        weights, chosen = probs.topk(self.top_k, dim=-1)                  # [N, k]
        if self.is_renormalized:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return run_experts(tokens, weights.to(x.dtype), chosen, self.experts).reshape(shape)
