"""A plain, slow, obviously-correct reference of the decoder-only family
(Qwen2 / Qwen3 / Qwen3-MoE causal LMs, docs/model.md) and
of its fixed-round constrained beam search. Test oracle only: written for
clarity, independently of the engine (`xrec.model`, `xrec.search`) and of
`transformers`, and never fast.

* The network (`NaiveCausalLM`) reads the model directory's config.json dict
  and tensors with Hugging Face names. Everything runs in float64, one
  request at a time, no padding, no KV cache: `logits` recomputes the whole
  sequence on every call (positions 0..T-1), and attention is a plain causal
  softmax over all keys, one head at a time.
* The search (`naive_causal_beam_search`) is `fixed_round_beam_search` of
  oracles/naive.py (docs/beam-search.md): per beam, the logits of the next token are
  a full recompute over prompt + that beam's generated tokens.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from oracles.naive import StateDictWeights, fixed_round_beam_search, gated_silu_ffn, rms_norm

__all__ = ["NaiveCausalLM", "naive_causal_beam_search", "rope", "causal_moe_ffn"]

KINDS = ("qwen2", "qwen3", "qwen3_moe")


# ---------------------------------------------------------------------------
# building blocks (float64)
# ---------------------------------------------------------------------------

def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding, rotate-half layout, of x [T, heads, d] at `positions` [T].

    inv_freq[i] = 1 / theta^(2i/d), i < d/2; angle[t, i] = positions[t] * inv_freq[i];
    x * cos + rotate_half(x) * sin, where cos/sin repeat the d/2 angles twice and
    rotate_half(x) = (-x[d/2:], x[:d/2]).
    """
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)      # [d/2]
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]               # [T, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[:, None, :]               # [T, 1, d]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[:, None, :]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def causal_moe_ffn(x: torch.Tensor, router: torch.Tensor, experts, *, top_k: int, norm_topk_prob: bool) -> torch.Tensor:
    """Qwen3-MoE sparse block, one token row at a time.

    probs = softmax over ALL experts' router logits; the top-k experts (ties:
    lower expert index) each contribute prob_e * expert_e(x); the k probs are
    divided by their sum only when `norm_topk_prob`.
    `experts[e]` = (gate, up, down) weights [out, in].
    """
    rows = []
    for row in x.reshape(-1, x.shape[-1]):
        probs = torch.softmax(router @ row, dim=-1)                                 # [E]
        chosen = sorted(range(len(experts)), key=lambda e: (-float(probs[e]), e))[:top_k]
        total = sum(float(probs[e]) for e in chosen)
        out = torch.zeros_like(row)
        for e in chosen:
            weight = probs[e] / total if norm_topk_prob else probs[e]
            out = out + weight * gated_silu_ffn(row, *experts[e])
        rows.append(out)
    return torch.stack(rows).reshape(x.shape)


# ---------------------------------------------------------------------------
# the network
# ---------------------------------------------------------------------------

class NaiveCausalLM(StateDictWeights):
    """A Qwen2 / Qwen3 / Qwen3-MoE causal LM in float64, one prompt at a time, no cache.

    `config`: the config.json dict. `state_dict`: Hugging Face names
    (`model.embed_tokens.weight`, `model.layers.N.self_attn.{q,k,v,o}_proj.*`,
    `...self_attn.{q_norm,k_norm}.weight`, `...mlp.{gate,up,down}_proj.weight`
    or, for MoE layers, `...mlp.gate.weight` + `...mlp.experts.E.{gate,up,down}_proj.weight`,
    `...{input,post_attention}_layernorm.weight`, `model.norm.weight`,
    `lm_head.weight` unless tied). Fused in-memory experts
    (`mlp.experts.gate_up_proj` [E, 2I, D] gate rows first, `mlp.experts.down_proj`
    [E, D, I]) are split into those names. Extra tensors are ignored; a missing
    or mis-shaped one is a KeyError / ValueError naming it; a config feature
    this reference does not implement is a ValueError naming the key.
    """

    def __init__(self, config: dict, state_dict: dict[str, torch.Tensor]):
        self.raw_config = dict(config)
        c = self.raw_config
        self.kind = c.get("model_type")
        if self.kind not in KINDS:
            raise ValueError(f"model_type: got {self.kind!r}, allowed: {KINDS}")
        self.vocab_size = int(c["vocab_size"])
        self.hidden_size = int(c["hidden_size"])
        self.num_layers = int(c["num_hidden_layers"])
        self.num_heads = int(c["num_attention_heads"])
        self.num_kv_heads = int(c.get("num_key_value_heads") or self.num_heads)
        self.head_dim = int(c.get("head_dim") or self.hidden_size // self.num_heads)
        self.intermediate_size = int(c["intermediate_size"])
        self.eps = float(c.get("rms_norm_eps", 1e-6))
        self.tie_word_embeddings = bool(c.get("tie_word_embeddings", False))
        self.rope_theta = self._rope_theta(c)
        if c.get("use_sliding_window"):
            raise ValueError(f"use_sliding_window: got {c['use_sliding_window']!r}, allowed: false")
        if any(t != "full_attention" for t in c.get("layer_types") or []):
            raise ValueError(f"layer_types: got {c['layer_types']!r}, allowed: only 'full_attention'")
        if c.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act: got {c['hidden_act']!r}, allowed: 'silu'")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} is not a multiple of num_key_value_heads "
                             f"{self.num_kv_heads}")
        # qwen2: q/k/v biases, no o bias; qwen3(-moe): q/k/v/o biases iff attention_bias
        self.qkv_bias = self.kind == "qwen2" or bool(c.get("attention_bias", False))
        self.o_bias = self.kind != "qwen2" and bool(c.get("attention_bias", False))
        self.qk_norm = self.kind != "qwen2"
        self.num_experts = 0
        if self.kind == "qwen3_moe":
            self.num_experts = int(c["num_experts"] if "num_experts" in c else c["num_local_experts"])
            self.top_k = int(c["num_experts_per_tok"])
            self.moe_intermediate_size = int(c["moe_intermediate_size"])
            self.norm_topk_prob = bool(c.get("norm_topk_prob", False))
            self.decoder_sparse_step = int(c.get("decoder_sparse_step", 1))
            self.mlp_only_layers = {int(i) for i in (c.get("mlp_only_layers") or [])}
        self.sd = {name: t.detach().to(torch.float64).clone() for name, t in state_dict.items()
                   if torch.is_tensor(t) and t.is_floating_point()}
        self._split_fused_experts()
        self._check_shapes()

    @classmethod
    def from_dir(cls, path) -> "NaiveCausalLM":
        """Read config.json and every *.safetensors file of a model directory."""
        from safetensors.torch import load_file

        directory = Path(path)
        config = json.loads((directory / "config.json").read_text())
        tensors: dict[str, torch.Tensor] = {}
        for file in sorted(directory.glob("*.safetensors")):
            tensors.update(load_file(str(file)))
        if not tensors:
            raise ValueError(f"{directory}: no *.safetensors files")
        return cls(config, tensors)

    @staticmethod
    def _rope_theta(c: dict) -> float:
        if c.get("rope_scaling") is not None:
            raise ValueError(f"rope_scaling: got {c['rope_scaling']!r}, allowed: null")
        params = c.get("rope_parameters")
        if params is not None:
            if params.get("rope_type", "default") != "default":
                raise ValueError(f"rope_parameters.rope_type: got {params['rope_type']!r}, allowed: 'default'")
            if params.get("partial_rotary_factor", 1.0) != 1.0:
                raise ValueError(f"rope_parameters.partial_rotary_factor: got {params['partial_rotary_factor']!r}, "
                                 "allowed: 1.0")
            if "rope_theta" in params:
                return float(params["rope_theta"])
        if "rope_theta" not in c:
            raise ValueError("config has neither rope_theta nor rope_parameters.rope_theta")
        return float(c["rope_theta"])

    # ---- weights -------------------------------------------------------------

    def is_moe_layer(self, i: int) -> bool:
        """Qwen3-MoE: layer i is sparse iff not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    def _split_fused_experts(self) -> None:
        for i in range(self.num_layers):
            p = f"model.layers.{i}.mlp.experts"
            if f"{p}.gate_up_proj" in self.sd:
                gate_up, down = self.sd.pop(f"{p}.gate_up_proj"), self.sd.pop(f"{p}.down_proj")
                inter = gate_up.shape[1] // 2
                for e in range(gate_up.shape[0]):
                    self.sd[f"{p}.{e}.gate_proj.weight"] = gate_up[e, :inter]
                    self.sd[f"{p}.{e}.up_proj.weight"] = gate_up[e, inter:]
                    self.sd[f"{p}.{e}.down_proj.weight"] = down[e]

    def _check_shapes(self) -> None:
        d, v, hd = self.hidden_size, self.vocab_size, self.head_dim
        q_out, kv_out = self.num_heads * hd, self.num_kv_heads * hd
        self._expect("model.embed_tokens.weight", (v, d))
        self._expect("model.norm.weight", (d,))
        if not self.tie_word_embeddings:
            self._expect("lm_head.weight", (v, d))
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            self._expect(f"{p}.input_layernorm.weight", (d,))
            self._expect(f"{p}.post_attention_layernorm.weight", (d,))
            for name, out in (("q", q_out), ("k", kv_out), ("v", kv_out)):
                self._expect(f"{p}.self_attn.{name}_proj.weight", (out, d))
                if self.qkv_bias:
                    self._expect(f"{p}.self_attn.{name}_proj.bias", (out,))
            self._expect(f"{p}.self_attn.o_proj.weight", (d, q_out))
            if self.o_bias:
                self._expect(f"{p}.self_attn.o_proj.bias", (d,))
            if self.qk_norm:
                self._expect(f"{p}.self_attn.q_norm.weight", (hd,))
                self._expect(f"{p}.self_attn.k_norm.weight", (hd,))
            if self.is_moe_layer(i):
                m = self.moe_intermediate_size
                self._expect(f"{p}.mlp.gate.weight", (self.num_experts, d))
                for e in range(self.num_experts):
                    self._expect(f"{p}.mlp.experts.{e}.gate_proj.weight", (m, d))
                    self._expect(f"{p}.mlp.experts.{e}.up_proj.weight", (m, d))
                    self._expect(f"{p}.mlp.experts.{e}.down_proj.weight", (d, m))
            else:
                self._expect(f"{p}.mlp.gate_proj.weight", (self.intermediate_size, d))
                self._expect(f"{p}.mlp.up_proj.weight", (self.intermediate_size, d))
                self._expect(f"{p}.mlp.down_proj.weight", (d, self.intermediate_size))

    # ---- pieces ----------------------------------------------------------------

    def _linear(self, x: torch.Tensor, prefix: str, has_bias: bool) -> torch.Tensor:
        y = x @ self.w(f"{prefix}.weight").T
        return y + self.w(f"{prefix}.bias") if has_bias else y

    def self_attention(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Causal GQA self-attention of layer i over x [T, D] at positions 0..T-1."""
        p = f"model.layers.{i}.self_attn"
        t, hd = x.shape[0], self.head_dim
        q = self._linear(x, f"{p}.q_proj", self.qkv_bias).reshape(t, self.num_heads, hd)
        k = self._linear(x, f"{p}.k_proj", self.qkv_bias).reshape(t, self.num_kv_heads, hd)
        v = self._linear(x, f"{p}.v_proj", self.qkv_bias).reshape(t, self.num_kv_heads, hd)
        if self.qk_norm:   # per head, over head_dim, before RoPE
            q = rms_norm(q, self.w(f"{p}.q_norm.weight"), self.eps)
            k = rms_norm(k, self.w(f"{p}.k_norm.weight"), self.eps)
        positions = torch.arange(t)
        q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
        group = self.num_heads // self.num_kv_heads
        causal = torch.ones(t, t, dtype=torch.bool).tril()          # [T, T]: query i sees key j iff j <= i
        outputs = []
        for h in range(self.num_heads):
            j = h // group
            scores = (q[:, h, :] @ k[:, j, :].T) / math.sqrt(hd)                    # [T, T]
            scores = scores.masked_fill(~causal, -math.inf)
            outputs.append(torch.softmax(scores, dim=-1) @ v[:, j, :])              # [T, hd]
        return self._linear(torch.cat(outputs, dim=-1), f"{p}.o_proj", self.o_bias)

    def mlp(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp"
        if self.is_moe_layer(i):
            experts = [(self.w(f"{p}.experts.{e}.gate_proj.weight"), self.w(f"{p}.experts.{e}.up_proj.weight"),
                        self.w(f"{p}.experts.{e}.down_proj.weight")) for e in range(self.num_experts)]
            return causal_moe_ffn(x, self.w(f"{p}.gate.weight"), experts, top_k=self.top_k,
                                  norm_topk_prob=self.norm_topk_prob)
        return gated_silu_ffn(x, self.w(f"{p}.gate_proj.weight"), self.w(f"{p}.up_proj.weight"),
                              self.w(f"{p}.down_proj.weight"))

    # ---- whole network -----------------------------------------------------------

    def hidden(self, token_ids) -> torch.Tensor:
        """Final hidden states [T, D] (after model.norm) of one unpadded sequence."""
        ids = torch.as_tensor(list(token_ids) if not torch.is_tensor(token_ids) else token_ids,
                              dtype=torch.long).reshape(-1)
        if ids.numel() == 0:
            raise ValueError("token_ids is empty")
        h = self.w("model.embed_tokens.weight")[ids]                                # [T, D]
        for i in range(self.num_layers):
            p = f"model.layers.{i}"
            h = h + self.self_attention(i, rms_norm(h, self.w(f"{p}.input_layernorm.weight"), self.eps))
            h = h + self.mlp(i, rms_norm(h, self.w(f"{p}.post_attention_layernorm.weight"), self.eps))
        return rms_norm(h, self.w("model.norm.weight"), self.eps)

    def logits(self, token_ids) -> torch.Tensor:
        """float64 logits [T, V] of every position (tied head: h @ embed_tokens.T, no scaling)."""
        head = self.w("model.embed_tokens.weight") if self.tie_word_embeddings else self.w("lm_head.weight")
        return self.hidden(token_ids) @ head.T


# ---------------------------------------------------------------------------
# constrained fixed-round beam search
# ---------------------------------------------------------------------------

def naive_causal_beam_search(model: NaiveCausalLM, *, token_ids, beam_width: int,
                             num_return_sequences: int | None = None, normalize: str = "allowed",
                             catalog_triples=None, rounds: int = 3,
                             temperature: float = 1.0) -> list[tuple[tuple[int, ...], float, list[float]]]:
    """Fixed-round beam search of one prompt, per docs/beam-search.md
    (`fixed_round_beam_search`): up to N (default W, any N >= 1) results
    (tokens, score, per-round log-probs), best first; round r keeps the best W
    (the best N in the last round) of all finite candidates ordered by
    (-score, parent beam index, token id). A beam's next-token logits are the
    last row of a full recompute over prompt + its generated tokens.
    """
    prompt = [int(t) for t in (token_ids.tolist() if torch.is_tensor(token_ids) else token_ids)]
    if not prompt:
        raise ValueError("token_ids is empty")

    def next_logits(tokens: tuple[int, ...]) -> torch.Tensor:
        return model.logits(prompt + list(tokens))[-1]

    return fixed_round_beam_search(next_logits, beam_width=beam_width, num_return_sequences=num_return_sequences,
                                   normalize=normalize, catalog_triples=catalog_triples, rounds=rounds,
                                   temperature=temperature)
