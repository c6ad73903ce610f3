"""Named model sizes for `xrec make-model` and the benchmarks (random weights)."""

from __future__ import annotations

import numbers

from xrec.config.onerec import ModelConfig
from xrec.config.qwen import QwenConfig

_ONEREC_01B = ModelConfig(d_model=1024, d_ff=2048, num_encoder_layers=4, num_decoder_layers=4,
                          num_heads=8, head_dim=128, num_kv_heads=8, decoder_num_heads=8,
                          decoder_head_dim=128, decoder_num_kv_heads=8, vocab_size=8192,
                          torch_dtype="float32")
# OpenOneRec's vocabulary: 151,669 Qwen3 tokens, 3 x 8192 itemic tokens, 2 markers, padded to 256
_QWEN3_SID_TINY = QwenConfig(model_type="qwen3", vocab_size=176_384, hidden_size=512,
                             intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                             num_key_value_heads=4, head_dim=64, rope_theta=1_000_000.0,
                             max_position_embeddings=40960, tie_word_embeddings=True,
                             torch_dtype="float32")
MODEL_SIZES: dict[str, ModelConfig | QwenConfig] = {
    "tiny": ModelConfig(d_model=32, d_ff=64, num_encoder_layers=2, num_decoder_layers=2, num_heads=4,
                        head_dim=8, num_kv_heads=2, decoder_num_heads=4, decoder_head_dim=8,
                        decoder_num_kv_heads=2, vocab_size=64, relative_attention_max_distance=32,
                        torch_dtype="float32"),
    "onerec-0.015b": ModelConfig(d_model=128, d_ff=256, num_encoder_layers=2, num_decoder_layers=2,
                                 num_heads=4, head_dim=32, num_kv_heads=4, decoder_num_heads=4,
                                 decoder_head_dim=32, decoder_num_kv_heads=4, vocab_size=8192,
                                 torch_dtype="float32"),
    "onerec-0.1b": _ONEREC_01B,
    "onerec-1b-moe": _ONEREC_01B.replace(use_moe=True, moe_num_experts=24, moe_topk=2,
                                         moe_inter_dim=2048),
    "qwen3-sid-tiny": _QWEN3_SID_TINY,
    # Qwen3-0.6B's widths with 8 of its 28 layers
    "qwen3-sid-small": _QWEN3_SID_TINY.replace(hidden_size=1024, intermediate_size=3072,
                                               num_hidden_layers=8, num_attention_heads=16,
                                               num_key_value_heads=8, head_dim=128),
    # Qwen3-1.7B's shapes (Hugging Face Qwen/Qwen3-1.7B config.json) in OpenOneRec's vocabulary:
    # NVIDIA sid-gr-inference's benchmark model; 1.77B parameters, bfloat16 as Qwen3 ships (3.5 GB)
    "qwen3-sid-1.7b": _QWEN3_SID_TINY.replace(hidden_size=2048, intermediate_size=6144,
                                              num_hidden_layers=28, num_attention_heads=16,
                                              num_key_value_heads=8, head_dim=128,
                                              rms_norm_eps=1e-6, torch_dtype="bfloat16"),
    # smoke tests: a 768-token vocabulary (512 base tokens, 3 x 16 itemic tokens)
    "qwen3-sid-test": _QWEN3_SID_TINY.replace(vocab_size=768, hidden_size=32, intermediate_size=64,
                                              num_hidden_layers=2, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=8),
}
# decoder-only sizes: (regular BPE tokens, codes per semantic-ID level) of their vocabulary,
# OpenOneRec's layout (catalog/sid_vocab.py `SidLayout`)
SID_VOCABULARIES: dict[str, tuple[int, int]] = {
    "qwen3-sid-tiny": (151_643, 8192), "qwen3-sid-small": (151_643, 8192),
    "qwen3-sid-1.7b": (151_643, 8192), "qwen3-sid-test": (512, 16)}


def size_config(size: str, num_items: int, sizes: dict | None = None,
                seed: int = 0) -> ModelConfig | QwenConfig:
    """The config of the named size (from `sizes`, default `MODEL_SIZES`) that a random model
    with a catalog of `num_items` items is built from with `seed`; ValueError for an unknown
    size, a negative item count, or a seed outside [0, 2**64 - 1] (torch's generator wraps a
    negative seed, NumPy's refuses it; neither takes 2**64)."""
    sizes = MODEL_SIZES if sizes is None else sizes
    if size not in sizes:
        raise ValueError(f"size: got {size!r}, allowed: {', '.join(sizes)}")
    if num_items < 0:
        raise ValueError(f"num_items: got {num_items}, expected >= 0")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 1 << 64:
        raise ValueError(f"seed: got {seed!r}, expected an integer in [0, 2**64 - 1]")
    return sizes[size]
