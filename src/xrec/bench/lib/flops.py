"""The FLOPs a faithful constrained beam search must do, per component (`xrec bench roofline`).

A faithful implementation runs every layer the model defines over every position it
must see, once: no shortcut that changes the results, and no work a result does not
read. One multiply-add is 2 FLOPs; a GEMM `[m, k] @ [k, n]` is 2mkn. Element-wise
work (norms, RoPE, SiLU, softmax, the beam update) is not counted: it is memory
traffic, not FLOPs, and shows up as time without FLOPs (top-k, host).

Per request, with input (prompt) length L, decoder prefix P (encoder-decoder: 1, the
BOS), W beams, R rounds, mean catalog fan-out C_r at round r, model width D, FFN width
F, attention width A = H x Dh, K/V width A_kv = kvH x Dh:

    projections of one position  proj = 2D(A + 2 A_kv) + 2AD       (q, k, v, o)
    FFN of one position          ffn  = 6DF  (MoE: top-k experts x 6DF_e + 2DE router,
                                               + 6DF_s of the shared experts)
    encoder      L x layers_enc x (proj + ffn)
    cross K/V    L x layers_dec x 2D x 2A_kv                        (once per request)
    decoder      (P + (R-1) W) x layers_dec x (proj + 4AD + ffn)    (self + cross q, o)
    prompt       (L - 1) x (layers - 1) x (proj + ffn)              (decoder-only: the last
                 + L x 2D x 2A_kv + (proj - 2D x 2A_kv + ffn)        layer reads only the
                 + layers x (proj + ffn) for the last position        last position's output)
    decoder      (R-1) W x layers x (proj + ffn)                    (decoder-only rounds)
    attention    4A per query-key pair: scores and values, every layer: encoder L^2,
                 prefix P(P+1)/2 causal + P L cross, round r: W (P + r) self + W L cross
                 (decoder-only: prompt L(L+1)/2 causal per layer but the last, L there;
                 round r: W (L + r))
    LM head      2D (C_0 + W (C_1 + ... + C_{R-1}))   ("allowed" normalisation: the
                 logits of the valid children only; the root's children once per request)
    top-k        0 (selection and the beam update move data; their cost is time)

Summed over the requests of the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

COMPONENTS = ("encoder / prompt", "cross K/V", "decoder", "attention", "LM head", "top-k")


@dataclass(frozen=True)
class SearchShape:
    """The workload as the count sees it: equal-length requests, the catalog's fan-out."""

    num_requests: int
    input_len: int
    beam_width: int
    fan_out: tuple[float, ...]   # mean candidates per beam at each round (len = rounds)
    prefix_len: int = 1          # encoder-decoder decoder prefix (BOS); unused by decoder-only

    @property
    def rounds(self) -> int:
        return len(self.fan_out)


def fan_out(tables: Any) -> tuple[float, ...]:
    """Mean children of a trie node at each depth of a catalog's `ConstraintTables`."""
    nodes = [1] + [len(t) for t in tables.tokens[:-1]]
    return tuple(len(t) / n for t, n in zip(tables.tokens, nodes))


# each term of the count, and the component it belongs to
STAGES = {"encoder": "encoder / prompt", "prompt": "encoder / prompt", "cross K/V": "cross K/V",
          "decoder prefix": "decoder", "decoder rounds": "decoder",
          "encoder attention": "attention", "prompt attention": "attention",
          "decoder attention": "attention", "LM head": "LM head"}


def search_flops(config: Any, shape: SearchShape) -> dict[str, float]:
    """FLOPs per component (COMPONENTS) of one batch; the formulas of the module's docstring."""
    totals = dict.fromkeys(COMPONENTS, 0.0)
    for stage, flops in search_terms(config, shape).items():
        totals[STAGES[stage]] += flops
    return totals


def search_terms(config: Any, shape: SearchShape) -> dict[str, float]:
    """FLOPs of one batch per stage (STAGES), summed over its requests."""
    count = _encoder_decoder if config.is_encoder_decoder else _decoder_only
    per_request = count(config, shape)
    per_request["LM head"] = 2.0 * _width(config) * (
        shape.fan_out[0] + shape.beam_width * sum(shape.fan_out[1:]))
    return {stage: shape.num_requests * flops for stage, flops in per_request.items()}


def _width(config: Any) -> int:
    return config.d_model if config.is_encoder_decoder else config.hidden_size


def _projections(d: int, heads: int, kv_heads: int, head_dim: int) -> float:
    attn, attn_kv = heads * head_dim, kv_heads * head_dim
    return 2.0 * d * (attn + 2 * attn_kv) + 2.0 * attn * d


def _gated_ffn(d: int, d_ff: int) -> float:
    return 6.0 * d * d_ff


def _encoder_decoder(c: Any, s: SearchShape) -> dict[str, float]:
    length, prefix, width = s.input_len, s.prefix_len, s.beam_width
    enc_attn, dec_attn = c.num_heads * c.head_dim, c.decoder_num_heads * c.decoder_head_dim
    dec_kv = c.decoder_num_kv_heads * c.decoder_head_dim
    enc = _projections(c.d_model, c.num_heads, c.num_kv_heads, c.head_dim) + _gated_ffn(c.d_model, c.d_ff)
    if c.use_moe:
        ffn = (c.moe_topk * _gated_ffn(c.d_model, c.moe_inter_dim) + 2.0 * c.d_model * c.moe_num_experts
               + (_gated_ffn(c.d_model, c.moe_inter_dim * c.moe_num_shared_experts)
                  if c.moe_use_shared_experts else 0.0))
    else:
        ffn = _gated_ffn(c.d_model, c.d_ff)
    dec = (_projections(c.d_model, c.decoder_num_heads, c.decoder_num_kv_heads, c.decoder_head_dim)
           + 4.0 * dec_attn * c.d_model + ffn)
    pairs_prefix = prefix * (prefix + 1) / 2 + prefix * length
    pairs_rounds = sum(width * (prefix + r + length) for r in range(1, s.rounds))
    return {
        "encoder": length * c.num_encoder_layers * enc,
        "cross K/V": length * c.num_decoder_layers * 4.0 * c.d_model * dec_kv,
        "decoder prefix": prefix * c.num_decoder_layers * dec,
        "decoder rounds": (s.rounds - 1) * width * c.num_decoder_layers * dec,
        "encoder attention": 4.0 * enc_attn * length * length * c.num_encoder_layers,
        "decoder attention": 4.0 * dec_attn * (pairs_prefix + pairs_rounds) * c.num_decoder_layers,
    }


def _decoder_only(c: Any, s: SearchShape) -> dict[str, float]:
    length, width, layers = s.input_len, s.beam_width, c.num_hidden_layers
    attn = c.num_attention_heads * c.head_dim
    kv = 4.0 * c.hidden_size * c.num_key_value_heads * c.head_dim        # k and v of one position
    proj = _projections(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    ffn = [_qwen_ffn(c, index) for index in range(layers)]
    prompt = ((length - 1) * sum(proj + f for f in ffn[:-1])            # every position but the last
              + (length - 1) * kv                                       # the last layer: K/V only
              + sum(proj + f for f in ffn))                             # the last position
    return {"prompt": prompt,
            "decoder rounds": (s.rounds - 1) * width * sum(proj + f for f in ffn),
            "prompt attention": 4.0 * attn * ((layers - 1) * length * (length + 1) / 2 + length),
            "decoder attention": 4.0 * attn * layers * sum(width * (length + r)
                                                           for r in range(1, s.rounds))}


def _qwen_ffn(c: Any, index: int) -> float:
    if c.is_moe_layer(index):
        return c.num_experts_per_tok * _gated_ffn(c.hidden_size, c.moe_intermediate_size) \
            + 2.0 * c.hidden_size * c.num_experts
    return _gated_ffn(c.hidden_size, c.intermediate_size)
