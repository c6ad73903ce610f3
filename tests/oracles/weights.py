"""Random OneRec weights with canonical (Hugging Face T5) names, renaming to
the other checkpoint names the engine accepts (xllm's, with a prefix), and
writing a checkpoint directory. Test helper; imports only torch, safetensors
and `xrec.config`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from xrec.config import ModelConfig

__all__ = ["canonical_names", "random_state_dict", "to_xllm_names", "save_checkpoint"]


def canonical_names(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of `config` holds: canonical name -> shape."""
    c = config
    d, v = c.d_model, c.vocab_size
    out: dict[str, tuple[int, ...]] = {"shared.weight": (v, d)}
    stacks = (("encoder", c.num_encoder_layers, c.num_heads, c.num_kv_heads, c.head_dim),
              ("decoder", c.num_decoder_layers, c.decoder_num_heads, c.decoder_num_kv_heads, c.decoder_head_dim))
    for stack, layers, heads, kv, hd in stacks:
        for i in range(layers):
            p = f"{stack}.block.{i}.layer"
            attns = [f"{p}.0.SelfAttention"] + ([f"{p}.1.EncDecAttention"] if stack == "decoder" else [])
            for n, a in enumerate(attns):
                out[f"{p}.{n}.layer_norm.weight"] = (d,)
                out[f"{a}.q.weight"] = (heads * hd, d)
                out[f"{a}.k.weight"] = (kv * hd, d)
                out[f"{a}.v.weight"] = (kv * hd, d)
                out[f"{a}.o.weight"] = (d, heads * hd)
            if i == 0 and not c.use_absolute_position_embedding:
                out[f"{p}.0.SelfAttention.relative_attention_bias.weight"] = (c.relative_attention_num_buckets, heads)
            f = f"{p}.{len(attns)}"
            out[f"{f}.layer_norm.weight"] = (d,)
            if stack == "decoder" and c.use_moe:
                m = c.moe_inter_dim
                out[f"{f}.ffn.gate.weight"] = (c.moe_num_experts, d)
                for e in range(c.moe_num_experts):
                    out[f"{f}.ffn.experts.{e}.w1.weight"] = (m, d)
                    out[f"{f}.ffn.experts.{e}.w3.weight"] = (m, d)
                    out[f"{f}.ffn.experts.{e}.w2.weight"] = (d, m)
                if c.moe_use_shared_experts:
                    s = m * c.moe_num_shared_experts
                    out[f"{f}.ffn.shared_experts.w1.weight"] = (s, d)
                    out[f"{f}.ffn.shared_experts.w3.weight"] = (s, d)
                    out[f"{f}.ffn.shared_experts.w2.weight"] = (d, s)
            else:
                out[f"{f}.DenseReluDense.wi_0.weight"] = (c.d_ff, d)
                out[f"{f}.DenseReluDense.wi_1.weight"] = (c.d_ff, d)
                out[f"{f}.DenseReluDense.wo.weight"] = (d, c.d_ff)
        out[f"{stack}.final_layer_norm.weight"] = (d,)
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


def random_state_dict(config: ModelConfig, *, seed: int, gain: float = 1.4, embedding_std: float = 2.0,
                      bias_std: float = 2.0, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """A deterministic random canonical state dict for `config`.

    Linear weights [out, in] ~ N(0, gain / sqrt(in)) (for d_model 32 that is
    the std 0.25 of `hf.make_hf_t5`); shared ~ N(0, embedding_std) and
    lm_head ~ N(0, embedding_std / sqrt(d_model)) so the logits are well
    spread; relative bias tables ~ N(0, bias_std) so they matter; RMSNorm
    weights ~ 1 + N(0, 0.2); MoE router ~ N(0, gain / sqrt(d_model)).
    """
    gen = torch.Generator().manual_seed(int(seed))
    out = {}
    for name, shape in canonical_names(config).items():
        if name.endswith("layer_norm.weight"):
            t = 1.0 + 0.2 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif name == "shared.weight":
            t = embedding_std * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif name == "lm_head.weight":
            t = embedding_std * config.d_model ** -0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)
        elif name.endswith("relative_attention_bias.weight"):
            t = bias_std * torch.randn(shape, generator=gen, dtype=torch.float64)
        else:
            t = gain * shape[1] ** -0.5 * torch.randn(shape, generator=gen, dtype=torch.float64)
        out[name] = t.to(dtype).contiguous()
    return out


# canonical -> xllm names (docs/model.md, checkpoint names)
_XLLM_DENSE = {"DenseReluDense.wi_0": "gate_proj", "DenseReluDense.wi_1": "wi", "DenseReluDense.wo": "wo"}
_XLLM_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def to_xllm_names(state_dict: dict[str, torch.Tensor], *, prefix: str = "module.module3.t5_model.",
                  ffn_module: str = "ffn", router: str = "router", expert_names: bool = True) -> dict[str, torch.Tensor]:
    """Rename a canonical state dict to xllm's names under `prefix`.

    Dense FFN `DenseReluDense.{wi_0,wi_1,wo}` -> `{ffn_module}.{gate_proj,wi,wo}`
    (`ffn_module` "ffn" or "DenseReluDense"); MoE router `ffn.gate` ->
    `ffn.{router}` ("router" or "gate"); experts `w1/w3/w2` ->
    `gate_proj/up_proj/down_proj` when `expert_names`. Shared experts keep
    `w1/w3/w2`.
    """
    out = {}
    for name, t in state_dict.items():
        new = name
        for ours, theirs in _XLLM_DENSE.items():
            if f".{ours}." in new:
                new = new.replace(f".{ours}.", f".{ffn_module}.{theirs}.")
        new = re.sub(r"\.ffn\.gate\.weight$", f".ffn.{router}.weight", new)
        if expert_names:
            m = re.search(r"\.ffn\.experts\.(\d+)\.(w[123])\.weight$", new)
            if m:
                new = new[: m.start(2)] + _XLLM_EXPERT[m.group(2)] + ".weight"
        out[prefix + new] = t
    return out


def save_checkpoint(directory, config: ModelConfig, state_dict: dict[str, torch.Tensor], *,
                    config_dict: dict | None = None, filename: str = "model.safetensors") -> Path:
    """Write `config.json` (the "onerec" dialect, or `config_dict` verbatim) and
    one safetensors file holding `state_dict` (contiguous copies)."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    raw = config.to_dict() if config_dict is None else config_dict
    (directory / "config.json").write_text(json.dumps(raw, indent=2))
    save_file({k: v.detach().contiguous().clone() for k, v in state_dict.items()}, str(directory / filename))
    return directory
