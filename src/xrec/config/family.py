"""What the search, the workspace and the edge read of a model family's config, and the
config of either family from a `config.json`. No torch import here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from xrec.config.keys import read_json
from xrec.config.onerec import ModelConfig
from xrec.config.qwen import MODEL_TYPES as QWEN_MODEL_TYPES
from xrec.config.qwen import QwenConfig


class FamilyConfig(Protocol):
    """What the search, the workspace estimate and the edge read of a family's config
    (`ModelConfig`, `QwenConfig`); a new family's config class offers the same."""

    is_encoder_decoder: bool
    accepts_embeddings: bool   # sparse_embedding / decoder_context_embedding inputs
    decoder_start_len: int     # decoder-prefix rows before any context row (BOS: 1; none: 0)
    vocab_size: int
    torch_dtype: str

    @property
    def d_model(self) -> int: ...

    @property
    def max_positions(self) -> int | None:
        """The longest prompt + generated sequence the model's positions allow (None: no limit)."""

    @property
    def beam_kv_shape(self) -> tuple[int, int, int]:
        """(layers, kv heads, head dim) of the per-beam K/V."""

    @property
    def num_parameters(self) -> int: ...

    def context_bytes(self, num_requests: int, max_input_len: int, max_prefix_len: int,
                      elem: int) -> int:
        """Round 0's transient bytes: activations and the shared per-request K/V."""

    def decode_bytes(self, num_beams: int, max_input_len: int, elem: int) -> int:
        """One decode round's transient bytes for `num_beams` beams in all."""


def model_config_from_dict(raw: dict[str, Any]) -> ModelConfig | QwenConfig:
    """The config of either family, told apart by `model_type` (absent: xllm's "onerec")."""
    model_type = raw.get("model_type", "onerec")
    if model_type in ("onerec", "t5"):
        return ModelConfig.from_dict(raw)
    if model_type in QWEN_MODEL_TYPES:
        return QwenConfig.from_dict(raw)
    raise ValueError(f"config key 'model_type': got {model_type!r}, allowed: 'onerec', 't5' "
                     f"(encoder-decoder), {', '.join(map(repr, QWEN_MODEL_TYPES))} (decoder-only)")


def read_model_config(path: str | Path) -> ModelConfig | QwenConfig:
    """A model directory's config.json (`path` names the file) in either family. A T5
    config's decoder start comes from the generation_config.json beside it where that names
    one, as in transformers' `generate` (which reads config.json's only without that file)."""
    raw = read_json(path)
    generation = Path(path).with_name("generation_config.json")
    if raw.get("model_type") == "t5" and generation.is_file():
        generation_raw = read_json(generation)
        start = {key: generation_raw.get(key) for key in ("decoder_start_token_id", "bos_token_id")}
        if any(value is not None for value in start.values()):
            raw = {**raw, **start}
    return model_config_from_dict(raw)

