"""Decoder-only Qwen2 / Qwen3 / Qwen3-MoE LMs (docs/model.md) with Hugging Face names.

A `RecModel` family (family.py). Round 0 (`prefill`) runs each request's prompt
once, causally, and keeps its K/V: the *shared* prefix of all its beams. Rounds
r >= 1 (`decode_step`) feed one token per beam at RoPE position
`prompt_len + r - 1`; the beams' queries attend to the shared prompt K/V (one
copy per request) and to their own generated tokens (the per-beam K/V), merged by
log-sum-exp (xAttention, attention.py).

    h = embed_tokens(ids)
    per layer:  h += o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v))   (input_layernorm first)
                h += mlp(post_attention_layernorm(h))                     (SwiGLU or SparseMoE)
    norm(h) -> LM head (tied: embed_tokens)
"""

from __future__ import annotations

import torch
from torch import nn

from xrec.model.attention import attend, attend_beams, padding_mask
from xrec.model.family import RecModel, merge_tied_copy
from xrec.model.inputs import ModelInputs
from xrec.model.kv import Allocate, BeamKV, PrefixKV
from xrec.model.layers import Embedding, Linear, RMSNorm, SwiGLU, stacked_linear
from xrec.model.moe import SparseMoE
from xrec.model.rope import apply_rope, rope_tables
from xrec.config.qwen import QwenConfig


class QwenAttention(nn.Module):
    """q/k/v/o projections (biases as the model type has them) and Qwen3's per-head q/k norms."""

    def __init__(self, config: QwenConfig):
        super().__init__()
        d, heads, kv, hd = (config.hidden_size, config.num_attention_heads,
                            config.num_key_value_heads, config.head_dim)
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv, hd
        self.q_proj = Linear(d, heads * hd, bias=config.has_qkv_bias)
        self.k_proj = Linear(d, kv * hd, bias=config.has_qkv_bias)
        self.v_proj = Linear(d, kv * hd, bias=config.has_qkv_bias)
        self.o_proj = Linear(heads * hd, d, bias=config.has_o_bias)
        if config.has_qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps)

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`x [..., D]` -> q `[..., H, Dh]`, normed and rotated (`cos`/`sin` broadcast over heads)."""
        return self._rotated_q(self.q_proj(x), cos, sin)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x [..., D]` -> k (normed and rotated) and v, `[..., kvH, Dh]` each (one product
        where the loader stacked the weights: `layers.stacked_linear`)."""
        return self._rotated_kv(*stacked_linear(x, (self.k_proj, self.v_proj)), cos, sin)

    def project(self, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[..., H, Dh]`, k and v `[..., kvH, Dh]` of `x [..., D]`, in one product where
        the loader stacked the weights."""
        q, k, v = stacked_linear(x, (self.q_proj, self.k_proj, self.v_proj))
        return (self._rotated_q(q, cos, sin), *self._rotated_kv(k, v, cos, sin))

    def _rotated_q(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        return apply_rope(self.q_norm(q) if hasattr(self, "q_norm") else q, cos, sin)

    def _rotated_kv(self, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_kv_heads, self.head_dim)
        k, v = k.unflatten(-1, shape), v.unflatten(-1, shape)
        return apply_rope(self.k_norm(k) if hasattr(self, "k_norm") else k, cos, sin), v


class QwenLayer(nn.Module):
    def __init__(self, config: QwenConfig, index: int):
        super().__init__()
        self.self_attn = QwenAttention(config)
        self.mlp = SparseMoE(config) if config.is_moe_layer(index) else \
            SwiGLU(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def feed_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class QwenBody(nn.Module):
    """`model.*` of a Hugging Face checkpoint: embeddings, layers, final norm."""

    def __init__(self, config: QwenConfig):
        super().__init__()
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(QwenLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class QwenModel(RecModel):
    """A Qwen causal LM whose vocabulary holds itemic tokens, driven by the search."""

    family = "qwen"
    cpu_auto_bf16 = True    # "auto" is bfloat16 on CPUs with native bf16: the gate held (docs/decisions.md)
    stacked = tuple((f".q_proj.{kind}", f".k_proj.{kind}", f".v_proj.{kind}")   # one product
                    for kind in ("weight", "bias"))

    def __init__(self, config: QwenConfig):
        super().__init__()
        self.config = config
        self.model = QwenBody(config)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.scale = config.head_dim ** -0.5

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(token_ids)

    def head_weight(self) -> tuple[torch.Tensor, float]:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.weight, 1.0
        return self.lm_head.weight, 1.0

    @classmethod
    def prepare_checkpoint(cls, tensors: dict[str, torch.Tensor], config: QwenConfig) -> None:
        if config.tie_word_embeddings:   # some exporters write the tied head out
            merge_tied_copy(tensors, "model.embed_tokens.weight", "lm_head.weight",
                            "config.json says tie_word_embeddings=true")

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_tables(positions, self.config.head_dim, self.config.rope_theta, self.dtype)

    def prefill(self, inputs: ModelInputs, allocate: Allocate | None = None,
                ) -> tuple[torch.Tensor, PrefixKV]:
        """Each prompt once, causally (right padding: a real position never sees a padded
        one). Returns the final hidden state of each prompt's last position `[B, D]` and
        the prompt K/V `[layers, B, kvH, L, Dh]` every beam of the request will share.

        The last layer runs its queries, attention output and MLP for the last position
        of each prompt only: no other position's output is read."""
        device = self.device
        token_ids = inputs.token_ids.to(device, non_blocking=True)        # [B, L]
        num_batch, num_len = token_ids.shape
        cfg = self.config
        hidden = self.embed(token_ids)                                    # [B, L, D]
        cos, sin = self._rope(torch.arange(num_len, device=device))       # [L, Dh]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)                     # [L, 1, Dh]
        lengths = torch.tensor(inputs.lengths, device=device)
        rows = torch.arange(num_batch, device=device)
        shape = (2, cfg.num_hidden_layers, num_batch, cfg.num_key_value_heads, num_len, cfg.head_dim)
        kv = torch.empty(shape, dtype=hidden.dtype, device=device) if allocate is None else \
            allocate("prompt_kv", shape, hidden.dtype)                    # [2, layers, B, kvH, L, Dh]
        layers = self.model.layers
        for index, layer in enumerate(layers):
            attn, x = layer.self_attn, layer.input_layernorm(hidden)
            is_last = index == len(layers) - 1
            # every position's k and v; its q too, but in the last layer only the last's
            q, k, v = (None, *attn.project_kv(x, cos, sin)) if is_last else \
                attn.project(x, cos, sin)                                 # [B, L, H|kvH, Dh]
            keys, values = kv[0, index], kv[1, index]
            keys.copy_(k.transpose(1, 2))
            values.copy_(v.transpose(1, 2))
            if not is_last:
                out = attend(q.transpose(1, 2), keys, values, None, self.scale, is_causal=True)
                hidden = hidden + attn.o_proj(out.transpose(1, 2).flatten(2))
            else:  # only the last position of each prompt goes on
                last = lengths - 1
                key_mask = padding_mask(lengths, num_len) if inputs.is_ragged else None
                q = attn.project_q(x[rows, last].unsqueeze(1), cos[last].unsqueeze(1),
                                   sin[last].unsqueeze(1))                # [B, 1, H, Dh]
                out = attend_beams(q, keys, values, key_mask, self.scale)
                hidden = hidden[rows, last].unsqueeze(1) + attn.o_proj(out.flatten(2))
            hidden = layer.feed_forward(hidden)
        last = self.model.norm(hidden[:, -1])                             # [B, D]
        return last, PrefixKV(kv[0], kv[1], lengths, inputs.is_ragged)

    def decode_step(self, token_ids: torch.Tensor, round_index: int, context: PrefixKV,
                    beams: BeamKV) -> torch.Tensor:
        """One token per beam at position `prompt_len + round_index - 1` of its request:
        shared stage over the prompt K/V, unshared stage over the beam's own tokens."""
        prompt, slot = context, round_index - 1
        hidden = self.embed(token_ids)                                    # [B, W, D]
        num_batch, num_prompt = hidden.shape[0], prompt.k.shape[3]
        cos, sin = self._rope(prompt.lengths + slot)                      # [B, Dh]
        cos, sin = cos.view(num_batch, 1, 1, -1), sin.view(num_batch, 1, 1, -1)
        pad = padding_mask(prompt.lengths, num_prompt).view(num_batch, 1, num_prompt) \
            if prompt.is_ragged else None                                 # [B, 1, P]
        for index, layer in enumerate(self.model.layers):
            q, k_new, v_new = layer.self_attn.project(layer.input_layernorm(hidden), cos, sin)
            beam_k, beam_v = beams.layer(index)                           # [B, W, R-1, kvH, Dh]
            beam_k[:, :, slot] = k_new
            beam_v[:, :, slot] = v_new
            out = self.beam_attention(q, (prompt.k[index], prompt.v[index]), pad,
                                      (beam_k[:, :, :slot + 1], beam_v[:, :, :slot + 1]),
                                      None, self.scale)
            hidden = hidden + layer.self_attn.o_proj(out)
            hidden = layer.feed_forward(hidden)
        return self.model.norm(hidden)
