"""Decoder-only model configuration: Hugging Face `qwen2` / `qwen3` / `qwen3_moe` config.json.

No torch import here. `QwenConfig.from_dict` reads the keys of
docs/model.md with Hugging Face's defaults; settings xrec does not
implement (rope scaling, sliding windows, another activation) are refused with
a message naming the key. `to_dict` writes a config.json that Hugging Face
loads as the same model.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from xrec.config.keys import (MAX_EXPERTS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, SILU_NAMES,
                              check_epsilon, check_positive, dtype_name, get_key)

MODEL_TYPES = ("qwen2", "qwen3", "qwen3_moe")
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM"}


@dataclass(frozen=True)
class QwenConfig:
    """A Qwen causal LM's shape. `num_experts` 0 means dense (qwen2, qwen3)."""

    model_type: str = "qwen3"
    vocab_size: int = 151936
    hidden_size: int = 1024
    intermediate_size: int = 3072
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    attention_bias: bool = False          # qwen3: bias on q, k, v and o (qwen2: q, k, v always)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = field(default_factory=tuple)
    torch_dtype: str = "bfloat16"

    # what the search and the edge need to know of a family
    is_encoder_decoder = False
    accepts_embeddings = False   # inputs are token ids (a prompt), never embeddings
    decoder_start_len = 0        # the prompt is the whole shared prefix: no BOS row

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"config key 'model_type': got {self.model_type!r}, allowed: "
                             f"{', '.join(MODEL_TYPES)}")
        most = {"num_hidden_layers": MAX_LAYERS, "vocab_size": MAX_VOCAB,
                "max_position_embeddings": None, "decoder_sparse_step": None}   # else MAX_WIDTH
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings", "decoder_sparse_step"):
            check_positive(name, getattr(self, name), most.get(name, MAX_WIDTH))
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"config key 'num_key_value_heads': got {self.num_key_value_heads}, which "
                             f"does not divide num_attention_heads={self.num_attention_heads}")
        if self.head_dim % 2:
            raise ValueError(f"config key 'head_dim': got {self.head_dim}, RoPE needs an even head_dim")
        if not (math.isfinite(self.rope_theta) and self.rope_theta >= 1):
            # below 1 the frequencies theta^(-2i/head_dim) exceed 1: at 1e-300 (0 in float32) they
            # were inf, every score NaN and every request answered with no results
            raise ValueError(f"config key 'rope_theta': got {self.rope_theta!r}, expected a finite "
                             "number >= 1 (RoPE's base: 10,000 to 10^6 in public models)")
        check_epsilon("rms_norm_eps", self.rms_norm_eps)
        if self.model_type == "qwen3_moe":
            check_positive("num_experts", self.num_experts, MAX_EXPERTS)
            check_positive("moe_intermediate_size", self.moe_intermediate_size, MAX_WIDTH)
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"config key 'num_experts_per_tok': got {self.num_experts_per_tok}, "
                                 f"expected 1 <= num_experts_per_tok <= num_experts={self.num_experts}")
        elif self.num_experts:
            raise ValueError(f"config key 'num_experts': got {self.num_experts} for model_type "
                             f"{self.model_type!r}; experts need model_type 'qwen3_moe'")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad:
            raise ValueError(f"config key 'mlp_only_layers': layer {bad[0]} is not in "
                             f"[0, {self.num_hidden_layers - 1}]")

    # ---- what the model code asks -------------------------------------------

    @property
    def d_model(self) -> int:
        return self.hidden_size

    @property
    def has_qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def has_o_bias(self) -> bool:
        return self.model_type != "qwen2" and self.attention_bias

    @property
    def has_qk_norm(self) -> bool:
        return self.model_type != "qwen2"

    def is_moe_layer(self, index: int) -> bool:
        """Hugging Face's rule: experts unless listed in mlp_only_layers, every sparse_step-th layer."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings

    @property
    def beam_kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the per-beam K/V."""
        return self.num_hidden_layers, self.num_key_value_heads, self.head_dim

    @property
    def num_parameters(self) -> int:
        d, heads, kv, hd = self.hidden_size, self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * hd * (2 * heads + 2 * kv) + (2 * hd if self.has_qk_norm else 0)
        attn += hd * (heads + 2 * kv) if self.has_qkv_bias else 0
        attn += d if self.has_o_bias else 0
        total = self.vocab_size * d * (1 if self.tie_word_embeddings else 2) + d
        for index in range(self.num_hidden_layers):
            if self.is_moe_layer(index):
                ffn = d * self.num_experts + 3 * d * self.moe_intermediate_size * self.num_experts
            else:
                ffn = 3 * d * self.intermediate_size
            total += attn + ffn + 2 * d
        return total

    # ---- workspace estimate (bytes; see search/workspace.py) ----------------------

    def _ffn_width(self) -> int:
        dense = self.intermediate_size
        moe = self.moe_intermediate_size * self.num_experts_per_tok if self.num_experts else 0
        return max(dense, moe)

    def context_bytes(self, num_requests: int, max_input_len: int, max_prefix_len: int,
                      elem: int) -> int:
        """Round 0: prompt activations, causal attention scores, the prompt K/V kept for all rounds."""
        tokens = num_requests * max_input_len
        d, heads = self.hidden_size, self.num_attention_heads
        kv_width = self.num_key_value_heads * self.head_dim
        activations = tokens * (6 * d + 3 * self._ffn_width()) * elem
        scores = num_requests * heads * max_input_len * max_input_len * 4
        prompt_kv = self.num_hidden_layers * 2 * tokens * kv_width * elem
        return activations + scores + prompt_kv

    def decode_bytes(self, num_beams: int, max_input_len: int, elem: int) -> int:
        """One decode round of `num_beams` beams in all: activations and shared-stage scores."""
        d = self.hidden_size
        return (num_beams * (8 * d + 3 * self._ffn_width()) * elem
                + num_beams * self.num_attention_heads * max_input_len * 4)

    # ---- config.json ---------------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "QwenConfig":
        model_type = raw.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ValueError(f"config key 'model_type': got {model_type!r}, allowed: "
                             f"{', '.join(MODEL_TYPES)}")
        _refuse_unsupported(raw)
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size"):
            if key not in raw:
                raise ValueError(f"config key {key!r} is missing (required for {model_type})")
        heads = get_key(raw, "num_attention_heads", 16, int)
        hidden = get_key(raw, "hidden_size", 1024, int)
        out: dict[str, Any] = dict(
            model_type=model_type,
            vocab_size=get_key(raw, "vocab_size", 151936, int),
            hidden_size=hidden,
            intermediate_size=get_key(raw, "intermediate_size", 3072, int),
            num_hidden_layers=get_key(raw, "num_hidden_layers", 28, int),
            num_attention_heads=heads,
            num_key_value_heads=_kv_heads(raw, model_type, heads),
            head_dim=_head_dim(raw, model_type, hidden, heads),
            rms_norm_eps=get_key(raw, "rms_norm_eps", 1e-6, float),
            rope_theta=_rope_theta(raw),
            max_position_embeddings=get_key(raw, "max_position_embeddings", 32768, int),
            tie_word_embeddings=get_key(raw, "tie_word_embeddings", False, bool),
            attention_bias=get_key(raw, "attention_bias", False, bool) if model_type != "qwen2" else False,
            torch_dtype=dtype_name(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16"),
        )
        if model_type == "qwen3_moe":
            # transformers 5 writes num_local_experts; released checkpoints say num_experts
            experts_key = "num_experts" if "num_experts" in raw else "num_local_experts"
            if raw.get("num_experts") is not None and raw.get("num_local_experts") is not None and \
                    raw["num_experts"] != raw["num_local_experts"]:
                raise ValueError(f"config keys num_experts={raw['num_experts']!r}, num_local_experts="
                                 f"{raw['num_local_experts']!r} disagree: transformers 5 reads "
                                 "num_local_experts, transformers 4 num_experts; give one value")
            layers = raw.get("mlp_only_layers") or []
            if not isinstance(layers, list) or \
                    not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
                raise ValueError(f"config key 'mlp_only_layers': got {layers!r}, expected a list "
                                 "of layer indices")
            out.update(num_experts=get_key(raw, experts_key, 128, int),
                       num_experts_per_tok=get_key(raw, "num_experts_per_tok", 8, int),
                       moe_intermediate_size=get_key(raw, "moe_intermediate_size", 768, int),
                       norm_topk_prob=get_key(raw, "norm_topk_prob", False, bool),
                       decoder_sparse_step=get_key(raw, "decoder_sparse_step", 1, int),
                       mlp_only_layers=tuple(layers))
        return cls(**out)

    def to_dict(self) -> dict[str, Any]:
        """Hugging Face config.json keys (transformers 4.x and 5.x load it as this model)."""
        d = asdict(self)
        out = {"architectures": [_ARCHITECTURES[self.model_type]], "hidden_act": "silu",
               "rope_scaling": None, "use_sliding_window": False, "sliding_window": None,
               "bos_token_id": None, "eos_token_id": None, **d}
        out["mlp_only_layers"] = list(self.mlp_only_layers)
        if self.model_type != "qwen3_moe":
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                        "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"):
                del out[key]
        if self.model_type == "qwen2":
            del out["attention_bias"]
        return out

    def replace(self, **changes: Any) -> "QwenConfig":
        d = asdict(self)
        d.update(changes)
        return QwenConfig(**d)


# transformers' values for keys config.json lacks (Qwen2Config, Qwen3Config, Qwen3MoeConfig, 4.x and
# 5.x alike); a null value means num_attention_heads and hidden_size / num_attention_heads instead
_MISSING_KV_HEADS = {"qwen2": 32, "qwen3": 32, "qwen3_moe": 4}
_MISSING_HEAD_DIM = {"qwen3": 128}


def _kv_heads(raw: dict[str, Any], model_type: str, heads: int) -> int:
    """`num_key_value_heads`; without the key, transformers' default, which must divide the heads."""
    if "num_key_value_heads" in raw:
        return get_key(raw, "num_key_value_heads", heads, int)
    kv = _MISSING_KV_HEADS[model_type]
    if heads >= 1 and heads % kv:
        raise ValueError(f"config key 'num_key_value_heads' is missing: transformers then takes {kv} for "
                         f"{model_type}, which does not divide num_attention_heads={heads}; give "
                         "num_key_value_heads")
    return kv


def _head_dim(raw: dict[str, Any], model_type: str, hidden: int, heads: int) -> int:
    """`head_dim`; without the key, transformers' default (qwen3: 128), else hidden / heads."""
    if raw.get("head_dim") is not None:
        return get_key(raw, "head_dim", None, int)
    if "head_dim" not in raw and model_type in _MISSING_HEAD_DIM:
        return _MISSING_HEAD_DIM[model_type]
    return _default_head_dim(hidden, heads)


def _default_head_dim(hidden: int, heads: int) -> int:
    """`head_dim` as hidden_size / num_attention_heads (config.json's is null, or absent outside
    qwen3). A head count
    below 1 is left to `check_positive` (it divided by zero here); a hidden size the heads do
    not divide is an error naming both keys."""
    if heads < 1:
        return hidden
    if hidden % heads:
        raise ValueError(f"config key 'head_dim' is missing, and hidden_size={hidden} is not a "
                         f"multiple of num_attention_heads={heads}; give head_dim")
    return hidden // heads


def _rope_theta(raw: dict[str, Any]) -> float:
    """`rope_theta` as transformers 5 reads it: inside `rope_scaling` when that is set (it then
    replaces `rope_parameters`), else inside `rope_parameters`, else the top-level key.

    transformers 4 reads the top-level key only: where both are given and differ, it is
    refused, as serving either would score differently from one of the two (a top-level
    `rope_theta` edited in a file transformers 5 wrote was silently used here, not by it)."""
    scaling = raw.get("rope_scaling")
    name = "rope_scaling" if scaling else "rope_parameters"
    inner = raw.get(name)
    top = get_key(raw, "rope_theta", None, float) if raw.get("rope_theta") is not None else None
    if not (isinstance(inner, dict) and inner.get("rope_theta") is not None):
        return 10000.0 if top is None else top
    theta = get_key(inner, "rope_theta", None, float)
    if top is not None and top != theta:
        raise ValueError(f"config keys rope_theta={top!r}, {name}.rope_theta={theta!r} disagree: "
                         f"transformers 5 reads the value inside {name}, transformers 4 the "
                         "top-level rope_theta; give one value")
    return theta


def _every_layer_full(raw: dict[str, Any], layer_types: list[str] | None) -> bool:
    """Whether transformers gives every layer full attention despite use_sliding_window: qwen2
    and qwen3 window only the layers `layer_types` says (when absent: those from
    max_window_layers on, none with sliding_window null); qwen3_moe windows every layer."""
    if raw.get("model_type") == "qwen3_moe":
        return raw.get("sliding_window", 4096) is None
    if layer_types:
        return True   # checked above: all full_attention
    num_layers, first_windowed = raw.get("num_hidden_layers"), raw.get("max_window_layers", 28)
    return raw.get("sliding_window", 4096) is None or (
        isinstance(num_layers, int) and isinstance(first_windowed, int)
        and not isinstance(first_windowed, bool) and first_windowed >= num_layers)


def _refuse_unsupported(raw: dict[str, Any]) -> None:
    """Settings that change the network in ways xrec does not implement: a clear error each."""
    act = raw.get("hidden_act", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"config key 'hidden_act': got {act!r}, allowed: 'silu' or 'swish'")
    scaling = raw.get("rope_scaling")
    if scaling not in (None, {}) and not (isinstance(scaling, dict)
                                           and scaling.get("rope_type", scaling.get("type")) == "default"):
        raise ValueError(f"config key 'rope_scaling': got {scaling!r}; xrec implements plain RoPE "
                         "only (rope_scaling null)")
    params = raw.get("rope_parameters")
    if isinstance(params, dict):
        nested = sorted(key for key, value in params.items() if isinstance(value, dict))
        if nested:
            raise ValueError(f"config key 'rope_parameters': got RoPE settings per layer type "
                             f"({', '.join(nested)}); xrec implements one plain RoPE for all layers")
        # transformers 5 reads the older key "type" where "rope_type" is absent
        key = "rope_type" if "rope_type" in params or "type" not in params else "type"
        if params.get(key, "default") != "default":
            raise ValueError(f"config key 'rope_parameters.{key}': got {params.get(key)!r}, "
                             "allowed: 'default' (plain RoPE)")
    layer_types = raw.get("layer_types")
    if layer_types is not None and not (isinstance(layer_types, list)
                                        and all(isinstance(t, str) for t in layer_types)):
        raise ValueError(f"config key 'layer_types': got {str(layer_types)[:80]}, expected a list "
                         "of strings")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ValueError(f"config key 'layer_types': got {sorted(set(layer_types))}, allowed: "
                         "'full_attention' only")
    if raw.get("use_sliding_window") and not _every_layer_full(raw, layer_types):
        raise ValueError("config key 'use_sliding_window': got true, with layers from "
                         f"max_window_layers={raw.get('max_window_layers', 28)} on windowed; xrec "
                         "implements full attention only (use_sliding_window false)")
    if raw.get("shared_expert_intermediate_size"):
        raise ValueError("config key 'shared_expert_intermediate_size': shared experts are not part "
                         "of qwen3_moe; xrec does not implement them")
