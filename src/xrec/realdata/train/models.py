"""The trainable form of each family: a Hugging Face model of the same architecture and the
same tensor names as xrec's (Qwen3ForCausalLM for the decoder-only family, T5 for OneRec's
encoder-decoder), created from xrec's config and written back as an xrec model directory.
The oracle tests already show xrec's models compute what these compute."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from xrec.config import ModelConfig
from xrec.model.loader import save_model
from xrec.config.qwen import QwenConfig
from xrec.realdata.train.options import FAMILIES
from xrec.realdata.sequences import IGNORE, collate

__all__ = ["TrainableModel", "model_config"]


def model_config(family: str, vocab_size: int, hidden: int, layers: int, heads: int,
                 max_positions: int, bos_id: int) -> ModelConfig | QwenConfig:
    """xrec's config of a small model of `family` (float32, tied embeddings, head_dim =
    hidden / heads, feed-forward 3 x hidden)."""
    if hidden % heads:
        raise ValueError(f"hidden {hidden} is not a multiple of heads {heads}")
    head_dim = hidden // heads
    if family == "qwen3":
        return QwenConfig(model_type="qwen3", vocab_size=vocab_size, hidden_size=hidden,
                          intermediate_size=3 * hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=heads,
                          head_dim=head_dim, rope_theta=10_000.0,
                          max_position_embeddings=max_positions, tie_word_embeddings=True,
                          torch_dtype="float32")
    if family == "onerec":
        return ModelConfig(d_model=hidden, d_ff=3 * hidden, num_encoder_layers=layers,
                           num_decoder_layers=layers, num_heads=heads, head_dim=head_dim,
                           num_kv_heads=heads, decoder_num_heads=heads,
                           decoder_head_dim=head_dim, decoder_num_kv_heads=heads,
                           vocab_size=vocab_size, bos_token_id=bos_id, torch_dtype="float32")
    raise ValueError(f"family: got {family!r}, allowed: {', '.join(FAMILIES)}")


@dataclass
class TrainableModel:
    """A Hugging Face model in training, its xrec config, and how a batch becomes a loss."""

    config: ModelConfig | QwenConfig
    hf: Any

    @classmethod
    def create(cls, config: ModelConfig | QwenConfig, seed: int) -> TrainableModel:
        torch.manual_seed(seed)
        if config.is_encoder_decoder:
            from transformers import T5ForConditionalGeneration

            from xrec.realdata.train.hf_models import hf_t5_config
            hf = T5ForConditionalGeneration(hf_t5_config(config))
        else:
            from transformers import AutoConfig, AutoModelForCausalLM
            fields = config.to_dict()
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
        return cls(config, hf.float().train())

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        """Weights saved by `save` (xrec's names; tied copies restored)."""
        result = self.hf.load_state_dict(state, strict=False)
        unexpected = result.unexpected_keys
        missing = set(result.missing_keys) - self._tied_names()
        if unexpected or missing:
            raise ValueError(f"checkpoint does not fit: missing {sorted(missing)}, "
                             f"unexpected {sorted(unexpected)}")
        self.hf.tie_weights()

    def state(self) -> dict[str, torch.Tensor]:
        """xrec's canonical tensors: the HF state dict without tied copies."""
        tied = self._tied_names()
        return {k: v for k, v in self.hf.state_dict().items() if k not in tied}

    def save(self, model_dir: str | Path) -> None:
        save_model(model_dir, self.config, self.state())

    def _tied_names(self) -> set[str]:
        if self.config.is_encoder_decoder:
            from xrec.realdata.train.hf_models import HF_T5_TIED
            return set(HF_T5_TIED)
        return {"lm_head.weight"} if self.config.tie_word_embeddings else set()

    def loss(self, batch) -> tuple[torch.Tensor, int]:
        """Mean cross-entropy of a batch of `batches` items and its target count."""
        if self.config.is_encoder_decoder:
            prompts, targets = zip(*batch)
            ids, mask = collate(list(prompts))
            labels = torch.as_tensor(np.stack(targets))
            start = torch.full((len(batch), 1), self.config.bos_token_id, dtype=torch.long)
            out = self.hf(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                          decoder_input_ids=torch.cat([start, labels[:, :-1]], dim=1),
                          labels=labels)
            return out.loss, labels.numel()
        ids, mask = collate(list(batch))
        labels = np.where(mask == 1, ids, IGNORE)
        # right padding under a causal mask: real tokens never attend to the padding after them
        out = self.hf(input_ids=torch.as_tensor(ids), labels=torch.as_tensor(labels))
        return out.loss, int((labels[:, 1:] != IGNORE).sum())


def batches(examples: list, batch_size: int, rng: np.random.Generator) -> list[list]:
    """Shuffled batches; examples of similar length are batched together (less padding):
    a random order, then sorted by length inside chunks of 50 batches."""
    order = rng.permutation(len(examples))
    chunk = 50 * batch_size
    out = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start:start + chunk], key=lambda i: _length(examples[i]))
        out.extend([examples[i] for i in part[b:b + batch_size]]
                   for b in range(0, len(part), batch_size))
    rng.shuffle(out)
    return out


def _length(example) -> int:
    return len(example[0]) if isinstance(example, tuple) else len(example)
