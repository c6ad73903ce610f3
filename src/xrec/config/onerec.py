"""Model configuration: `config.json` in its two dialects. No torch import here.

`ModelConfig.from_dict` accepts xllm's `"onerec"` keys (with xllm's defaults)
and Hugging Face's `"t5"` keys (gated-SiLU only). `to_dict` writes the
`"onerec"` dialect.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from xrec.config.keys import (DTYPES, MAX_EXPERTS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH, SILU_NAMES,
                              check_epsilon, check_positive, dtype_name, get_key, read_json)


@dataclass(frozen=True)
class ModelConfig:
    """The OneRec network's shape. Encoder and decoder may differ in heads."""

    d_model: int = 128
    d_ff: int = 256
    num_encoder_layers: int = 12
    num_decoder_layers: int = 4
    num_heads: int = 4
    head_dim: int = 32
    num_kv_heads: int = 4
    decoder_num_heads: int = 4
    decoder_head_dim: int = 32
    decoder_num_kv_heads: int = 4
    vocab_size: int = 8200
    layer_norm_epsilon: float = 1e-6
    use_absolute_position_embedding: bool = False
    tie_word_embeddings: bool = True
    scale_decoder_outputs: bool = True   # tied head only: multiply by d_model**-0.5 (HF T5)
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    is_encoder_causal: bool = False      # encoder position j attends to positions <= j only
    bos_token_id: int = 0
    use_moe: bool = False
    moe_num_experts: int = 8
    moe_topk: int = 2
    moe_inter_dim: int = 1024
    moe_route_scale: float = 1.0
    moe_use_shared_experts: bool = False
    moe_num_shared_experts: int = 0
    torch_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for name in ("d_model", "d_ff", "num_encoder_layers", "num_decoder_layers", "num_heads",
                     "head_dim", "num_kv_heads", "decoder_num_heads", "decoder_head_dim",
                     "decoder_num_kv_heads", "vocab_size", "relative_attention_num_buckets",
                     "relative_attention_max_distance"):
            most = MAX_LAYERS if name.endswith("layers") else MAX_VOCAB if name == "vocab_size" \
                else MAX_WIDTH
            check_positive(_ONEREC_RENAMES.get(name, name), getattr(self, name), most)  # its key
        for heads, kv, prefix in ((self.num_heads, self.num_kv_heads, ""),
                                  (self.decoder_num_heads, self.decoder_num_kv_heads, "decoder_")):
            if heads % kv:
                raise ValueError(
                    f"config key {prefix}num_key_value_heads: got {kv}, which does not divide "
                    f"{prefix}num_heads={heads}; allowed: a divisor of {prefix}num_heads")
        if not self.use_absolute_position_embedding:
            if self.relative_attention_num_buckets < 4:
                raise ValueError(
                    f"config key 'relative_attention_num_buckets': got "
                    f"{self.relative_attention_num_buckets}, expected >= 4 with relative position bias "
                    "(T5 bucketing needs at least one exact bucket per direction)")
            smallest = self.relative_attention_num_buckets // 2 + 1
            if self.relative_attention_max_distance < smallest:
                raise ValueError(
                    f"config key 'relative_attention_max_distance': got "
                    f"{self.relative_attention_max_distance}, must be > relative_attention_num_buckets"
                    f" / 2 = {self.relative_attention_num_buckets // 2} (log-spaced buckets)")
        if not 0 <= self.bos_token_id < self.vocab_size:
            raise ValueError(f"config key 'bos_token_id' ('decoder_start_token_id' in the t5 dialect): "
                             f"got {self.bos_token_id}, "
                             f"expected 0 <= id < vocab_size={self.vocab_size}")
        check_epsilon("layer_norm_epsilon", self.layer_norm_epsilon)
        if self.torch_dtype not in DTYPES:
            raise ValueError(f"config key 'torch_dtype': got {self.torch_dtype!r}, allowed: {DTYPES}")
        if self.use_moe:
            check_positive("moe_num_experts", self.moe_num_experts, MAX_EXPERTS)
            check_positive("moe_inter_dim", self.moe_inter_dim, MAX_WIDTH)
            if not 1 <= self.moe_topk <= self.moe_num_experts:
                raise ValueError(f"config key 'moe_topk': got {self.moe_topk}, expected "
                                 f"1 <= moe_topk <= moe_num_experts={self.moe_num_experts}")
            if not (math.isfinite(self.moe_route_scale) and self.moe_route_scale > 0):
                raise ValueError(f"config key 'moe_route_scale': got {self.moe_route_scale!r}, "
                                 "expected a finite number > 0")
            if self.moe_use_shared_experts and not 1 <= self.moe_num_shared_experts <= MAX_EXPERTS:
                raise ValueError("config key 'moe_num_shared_experts': got "
                                 f"{self.moe_num_shared_experts} with moe_use_shared_experts=true; "
                                 f"expected >= 1 and <= {MAX_EXPERTS}")

    # what the search and the edge need to know of a family
    is_encoder_decoder = True
    accepts_embeddings = True    # sparse_embedding / decoder_context_embedding inputs
    decoder_start_len = 1        # the decoder prefix is BOS unless context rows replace it
    max_positions = None         # relative positions: no limit from the model

    @property
    def beam_kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the decoder's per-beam K/V."""
        return self.num_decoder_layers, self.decoder_num_kv_heads, self.decoder_head_dim

    def context_bytes(self, num_requests: int, max_input_len: int, max_prefix_len: int,
                      elem: int) -> int:
        """Round 0 (bytes): encoder activations and scores, cross K/V, decoder-prefix K/V."""
        tokens = num_requests * max_input_len
        d, heads = self.d_model, max(self.num_heads, self.decoder_num_heads)
        kv_width = self.decoder_num_kv_heads * self.decoder_head_dim
        encoder = tokens * (6 * d + 3 * self.d_ff) * elem + num_requests * heads * max_input_len ** 2 * 4
        cross = self.num_decoder_layers * 2 * tokens * kv_width * elem
        prefix = self.num_decoder_layers * 2 * num_requests * max_prefix_len * kv_width * elem
        return encoder + cross + prefix

    def decode_bytes(self, num_beams: int, max_input_len: int, elem: int) -> int:
        """One decode round of `num_beams` beams in all: activations and cross-attention scores."""
        ffn = self.moe_inter_dim * self.moe_topk if self.use_moe else self.d_ff
        heads = max(self.num_heads, self.decoder_num_heads)
        return num_beams * (8 * self.d_model + 3 * ffn) * elem + num_beams * heads * max_input_len * 4

    @property
    def attention_scale(self) -> float:
        """T5 does not scale scores; xllm's shared-expert models use 1/sqrt(head_dim)."""
        return self.decoder_head_dim ** -0.5 if self.moe_use_shared_experts else 1.0

    @property
    def encoder_attention_scale(self) -> float:
        return self.head_dim ** -0.5 if self.moe_use_shared_experts else 1.0

    @property
    def num_parameters(self) -> int:
        """Parameter count (tied embedding counted once)."""
        d, v = self.d_model, self.vocab_size
        enc_attn = d * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        dec_attn = d * self.decoder_head_dim * (2 * self.decoder_num_heads + 2 * self.decoder_num_kv_heads)
        ffn = 3 * d * self.d_ff
        if self.use_moe:
            dec_ffn = d * self.moe_num_experts + 3 * d * self.moe_inter_dim * (
                self.moe_num_experts + (self.moe_num_shared_experts if self.moe_use_shared_experts else 0))
        else:
            dec_ffn = ffn
        total = v * d * (1 if self.tie_word_embeddings else 2)
        total += self.num_encoder_layers * (enc_attn + ffn + 2 * d) + d
        total += self.num_decoder_layers * (2 * dec_attn + dec_ffn + 3 * d) + d
        if not self.use_absolute_position_embedding:
            total += self.relative_attention_num_buckets * (self.num_heads + self.decoder_num_heads)
        return total

    # ---- config.json -------------------------------------------------------

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type", "onerec")
        if model_type == "onerec":
            return cls(**_onerec_fields(raw))
        if model_type == "t5":
            return cls(**_t5_fields(raw))
        raise ValueError(f"config key 'model_type': got {model_type!r}, allowed: 'onerec', 't5'")

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(read_json(path))

    def to_dict(self) -> dict[str, Any]:
        """The `"onerec"` dialect, readable by xllm and by `from_dict`."""
        d = asdict(self)
        out = {"model_type": "onerec"}
        for ours, theirs in _ONEREC_RENAMES.items():
            out[theirs] = d.pop(ours)
        out.update(d)
        return out

    def replace(self, **changes: Any) -> "ModelConfig":
        d = asdict(self)
        d.update(changes)
        return ModelConfig(**d)


# our field name -> xllm key
_ONEREC_RENAMES = {
    "num_encoder_layers": "num_layers",
    "head_dim": "d_kv",
    "decoder_head_dim": "decoder_d_kv",
    "num_kv_heads": "num_key_value_heads",
    "decoder_num_kv_heads": "decoder_num_key_value_heads",
}


def _common_fields(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "d_model": get_key(raw, "d_model", 128, int),
        "d_ff": get_key(raw, "d_ff", 256, int),
        "vocab_size": get_key(raw, "vocab_size", 8200, int),
        "layer_norm_epsilon": get_key(raw, "layer_norm_epsilon", 1e-6, float),
        "use_absolute_position_embedding": get_key(raw, "use_absolute_position_embedding", False, bool),
        "tie_word_embeddings": get_key(raw, "tie_word_embeddings", True, bool),
        "scale_decoder_outputs": get_key(raw, "scale_decoder_outputs", True, bool),
        "relative_attention_num_buckets": get_key(raw, "relative_attention_num_buckets", 32, int),
        "relative_attention_max_distance": get_key(raw, "relative_attention_max_distance", 128, int),
        "is_encoder_causal": get_key(raw, "is_encoder_causal", False, bool),
    }


def _onerec_fields(raw: dict[str, Any]) -> dict[str, Any]:
    score_func = raw.get("moe_score_func", "softmax")
    if score_func != "softmax":
        raise ValueError(f"config key 'moe_score_func': got {score_func!r}, allowed: 'softmax' "
                         "(xrec does not implement other router score functions)")
    heads = get_key(raw, "num_heads", 4, int)
    kv = get_key(raw, "num_key_value_heads", heads, int)
    dec_heads = get_key(raw, "decoder_num_heads", heads, int)
    d_kv = get_key(raw, "d_kv", 32, int)
    # xllm: decoder kv heads fall back to num_key_value_heads, then to the decoder's heads.
    dec_kv_default = raw.get("num_key_value_heads") or dec_heads
    out = _common_fields(raw)
    out.update(
        num_encoder_layers=get_key(raw, "num_layers", 12, int),
        num_decoder_layers=get_key(raw, "num_decoder_layers", 4, int),
        num_heads=heads,
        head_dim=d_kv,
        num_kv_heads=kv,
        decoder_num_heads=dec_heads,
        decoder_head_dim=get_key(raw, "decoder_d_kv", d_kv, int),
        decoder_num_kv_heads=get_key(raw, "decoder_num_key_value_heads", dec_kv_default, int),
        bos_token_id=get_key(raw, "bos_token_id", 0, int),
        use_moe=get_key(raw, "use_moe", False, bool),
        moe_num_experts=get_key(raw, "moe_num_experts", 8, int),
        moe_topk=get_key(raw, "moe_topk", 2, int),
        moe_inter_dim=get_key(raw, "moe_inter_dim", 1024, int),
        moe_route_scale=get_key(raw, "moe_route_scale", 1.0, float),
        moe_use_shared_experts=get_key(raw, "moe_use_shared_experts", False, bool),
        moe_num_shared_experts=get_key(raw, "moe_num_shared_experts", 0, int),
        torch_dtype=dtype_name(raw.get("torch_dtype", "bfloat16")),
    )
    return out


def _t5_fields(raw: dict[str, Any]) -> dict[str, Any]:
    proj = raw.get("feed_forward_proj", "relu")
    if proj not in tuple(f"gated-{name}" for name in SILU_NAMES):
        raise ValueError(f"config key 'feed_forward_proj': got {proj!r}, allowed: 'gated-silu' "
                         "or 'gated-swish' (the OneRec feed-forward is a gated SiLU)")
    # Hugging Face derives these two from feed_forward_proj, then sets them from config.json
    # (which holds them whenever transformers wrote it): there they win.
    act = raw.get("dense_act_fn", "silu")
    if act not in SILU_NAMES:
        raise ValueError(f"config key 'dense_act_fn': got {act!r}, allowed: 'silu' or 'swish' "
                         "(Hugging Face T5 uses it in place of feed_forward_proj's activation)")
    gated = raw.get("is_gated_act", True)
    if gated is not True:
        raise ValueError(f"config key 'is_gated_act': got {gated!r}, allowed: true (Hugging Face T5 "
                         "builds an ungated feed-forward without it)")
    for key in ("d_model", "d_kv", "num_heads", "num_layers", "vocab_size"):
        if key not in raw:
            raise ValueError(f"config key {key!r} is missing (required in the 't5' dialect)")
    heads = get_key(raw, "num_heads", 8, int)
    d_kv = get_key(raw, "d_kv", 64, int)
    layers = get_key(raw, "num_layers", 6, int)
    out = _common_fields(raw)
    if not out["tie_word_embeddings"] and raw.get("scale_decoder_outputs") is True:
        # transformers 5 scales the untied head by d_model**-0.5 then, 4.x (which scales a tied
        # head only) does not, nor does xrec
        raise ValueError("config keys 'tie_word_embeddings': false and 'scale_decoder_outputs': true "
                         "disagree: transformers 5 scales the untied head's input by d_model**-0.5, "
                         "transformers 4 and xrec do not; drop scale_decoder_outputs or set it false")
    out.update(
        d_ff=get_key(raw, "d_ff", 2048, int),   # T5Config's default (xllm's is 256)
        num_encoder_layers=layers,
        num_decoder_layers=get_key(raw, "num_decoder_layers", layers, int),
        num_heads=heads, head_dim=d_kv, num_kv_heads=heads,
        decoder_num_heads=heads, decoder_head_dim=d_kv, decoder_num_kv_heads=heads,
        # generate's decoder start: decoder_start_token_id, else bos_token_id
        bos_token_id=get_key(raw, "decoder_start_token_id", None, int)
        if raw.get("decoder_start_token_id") is not None else get_key(raw, "bos_token_id", 0, int),
        torch_dtype=dtype_name(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
    )
    return out
