"""Decoder mixture of experts: softmax over all experts, top-k, route scale, no renormalisation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xrec.config import ModelConfig


class ExpertFFN(nn.Module):
    """One gated-SiLU expert, xllm names: w1 = gate, w3 = up, w2 = down."""

    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, d_ff, bias=False)
        self.w3 = nn.Linear(d_model, d_ff, bias=False)
        self.w2 = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoE(nn.Module):
    """Routed experts plus optional shared experts (one FFN `moe_inter_dim × num_shared` wide)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        d = config.d_model
        self.gate = nn.Linear(d, config.moe_num_experts, bias=False)
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
        weights, experts = probs.topk(self.top_k, dim=-1)                 # [N, k]
        weights = (weights * self.route_scale).to(x.dtype)
        out = torch.zeros_like(tokens)
        flat_experts = experts.reshape(-1)                                # [N*k]
        order = flat_experts.argsort(stable=True)
        counts = torch.bincount(flat_experts, minlength=len(self.experts)).tolist()
        token_of = order // self.top_k
        start = 0
        # one loop over experts (not tokens): each expert runs on the tokens routed to it
        for expert, count in zip(self.experts, counts):
            if count:
                rows = token_of[start:start + count]
                w = weights.reshape(-1)[order[start:start + count]].unsqueeze(-1)
                out.index_add_(0, rows, expert(tokens[rows]) * w)
            start += count
        if self.shared_experts is not None:
            out = out + self.shared_experts(tokens)
        return out.reshape(shape)
