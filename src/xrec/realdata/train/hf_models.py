"""Hugging Face equivalents of xrec's models (transformers needed): the oracle and baseline
of tests and bench, and the trainable form of `xrec train`. An encoder-decoder OneRec model
without GQA, MoE or xllm-only options is exactly a `T5ForConditionalGeneration` (xrec's
canonical tensor names are T5's); with `is_encoder_causal` it is T5 whose encoder is given
the causal mask on every call (`xrec train` does; `export_hf_t5` refuses it). A decoder-only
model is its own HF directory."""

from __future__ import annotations

from pathlib import Path

from xrec.config import ModelConfig

__all__ = ["HF_T5_TIED", "export_hf_t5", "hf_t5_config"]

# T5 keeps copies of the shared embedding that xrec's canonical state dict does not hold.
HF_T5_TIED = {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}


def hf_t5_config(config: ModelConfig):
    """The `T5Config` of an xrec model; ValueError for what T5 cannot express."""
    from transformers import T5Config

    problems = []
    if config.num_kv_heads != config.num_heads or config.decoder_num_kv_heads != config.decoder_num_heads:
        problems.append("grouped kv heads (T5 needs num_kv_heads == num_heads)")
    if (config.decoder_num_heads, config.decoder_head_dim) != (config.num_heads, config.head_dim):
        problems.append("different encoder and decoder heads")
    if config.use_moe:
        problems.append("a decoder MoE")
    if not (config.tie_word_embeddings and config.scale_decoder_outputs):
        problems.append("an untied or unscaled LM head")
    if config.use_absolute_position_embedding:
        problems.append("absolute position mode")
    if config.attention_scale != 1.0:
        problems.append("scaled attention scores")
    if problems:
        raise ValueError("this model has no Hugging Face T5 equivalent: " + ", ".join(problems))
    return T5Config(
        vocab_size=config.vocab_size, d_model=config.d_model, d_kv=config.head_dim,
        d_ff=config.d_ff, num_layers=config.num_encoder_layers,
        num_decoder_layers=config.num_decoder_layers, num_heads=config.num_heads,
        relative_attention_num_buckets=config.relative_attention_num_buckets,
        relative_attention_max_distance=config.relative_attention_max_distance,
        feed_forward_proj="gated-silu", dropout_rate=0.0,
        layer_norm_epsilon=config.layer_norm_epsilon, tie_word_embeddings=True,
        decoder_start_token_id=config.bos_token_id, pad_token_id=0, eos_token_id=None)


def export_hf_t5(model, out_dir: str | Path | None = None):
    """An eval-mode `T5ForConditionalGeneration` holding the weights of xrec's `OneRecModel`
    (float32, on the model's device), with EOS off so that no beam ends early.
    `out_dir`: also `save_pretrained` it there (safetensors)."""
    import torch
    from transformers import T5ForConditionalGeneration

    if model.config.is_encoder_causal:
        raise ValueError("this model has no Hugging Face T5 equivalent: a causal encoder "
                         "(T5's encoder is bidirectional unless each call passes the mask)")
    hf = T5ForConditionalGeneration(hf_t5_config(model.config))
    state = {k: v.detach().to("cpu", torch.float32) for k, v in model.state_dict().items()}
    result = hf.load_state_dict(state, strict=False)
    missing = set(result.missing_keys) - HF_T5_TIED
    if missing or result.unexpected_keys:
        raise ValueError(f"HF T5 export: missing {sorted(missing)}, "
                         f"unexpected {sorted(result.unexpected_keys)}")
    hf.tie_weights()
    for cfg in (hf.config, hf.generation_config):
        cfg.eos_token_id = None
        cfg.bos_token_id = None
        cfg.pad_token_id = 0
        cfg.decoder_start_token_id = model.config.bos_token_id
    hf = hf.to(model.shared.weight.device).eval().requires_grad_(False)
    if out_dir is not None:
        hf.save_pretrained(str(out_dir), safe_serialization=True)
    return hf
