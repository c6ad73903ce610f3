"""The trainable form of each family: a Hugging Face model of the same architecture and the
same tensor names as xrec's (Qwen3ForCausalLM for the decoder-only family, T5 for OneRec's
encoder-decoder), created from xrec's config and written back as an xrec model directory.
The oracle tests already show xrec's models compute what these compute.

Both families train every item of a history window in one pass: the decoder-only one as a
causal LM, the encoder-decoder one with a causal encoder (`is_encoder_causal`) and the
masks of `seq2seq_inputs` (tests/test_train_onerec.py checks it against T5 run one target
at a time)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from xrec.config import ModelConfig
from xrec.model.layers import Linear
from xrec.model.loader import save_model
from xrec.config.qwen import QwenConfig
from xrec.realdata.train.options import FAMILIES
from xrec.realdata.sequences import IGNORE, collate
from xrec.realdata.train.lookahead import LookaheadHeads
from xrec.realdata.train.precision import autocast, compiled_pass, use_float32_attention
from xrec.realdata.train.repeats import seen_unlikelihood

__all__ = ["TrainableModel", "model_config", "seq2seq_inputs"]


def model_config(family: str, vocab_size: int, hidden: int, layers: int, heads: int,
                 max_positions: int, bos_id: int) -> ModelConfig | QwenConfig:
    """xrec's config of a small model of `family` (float32, tied embeddings, head_dim =
    hidden / heads, feed-forward 3 x hidden; onerec: a causal encoder, `seq2seq_inputs`)."""
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
                           vocab_size=vocab_size, bos_token_id=bos_id, is_encoder_causal=True,
                           torch_dtype="float32")
    raise ValueError(f"family: got {family!r}, allowed: {', '.join(FAMILIES)}")


@dataclass
class TrainableModel:
    """A Hugging Face model in training, its xrec config, and how a batch becomes a loss."""

    config: ModelConfig | QwenConfig
    hf: Any
    seen_unlikelihood: float = 0.0   # weight of `repeats.seen_unlikelihood`
    label_smoothing: float = 0.0     # of the cross-entropy, over the whole vocabulary
    lookahead: float = 0.0           # weight of the `LookaheadHeads` loss
    heads: LookaheadHeads | None = None
    dtype: torch.dtype = torch.float32   # of the forward pass (`precision.py`)
    _hidden: torch.Tensor | None = None   # the last forward's final states, for `heads`

    @classmethod
    def create(cls, config: ModelConfig | QwenConfig, seed: int, dropout: float = 0.0,
               seen_unlikelihood: float = 0.0, label_smoothing: float = 0.0,
               lookahead: float = 0.0, dtype: torch.dtype = torch.float32) -> TrainableModel:
        """A freshly initialised model; `dropout`: on the embeddings and on each attention and
        feed-forward output before its residual add (T5's own `dropout_rate`, which also drops
        attention weights; hooks on Qwen3, which has none). Training only: the written
        directory has no dropout to turn off. `seen_unlikelihood`: the weight of the term that
        pushes down items the window already holds (`repeats.py`); `label_smoothing`: of the
        cross-entropy, as `F.cross_entropy` takes it; `lookahead`: the weight of the
        training-only look-ahead heads (`lookahead.py`); `dtype`: bfloat16 trains in mixed
        precision, compiled (`precision.py`; the weights stay float32)."""
        torch.manual_seed(seed)
        if config.is_encoder_decoder:
            from transformers import T5ForConditionalGeneration

            from xrec.realdata.train.hf_models import hf_t5_config
            t5_config = hf_t5_config(config)
            t5_config.dropout_rate = dropout
            hf = T5ForConditionalGeneration(t5_config)
        else:
            from transformers import AutoConfig, AutoModelForCausalLM
            fields = config.to_dict()
            hf = AutoModelForCausalLM.from_config(AutoConfig.for_model(**fields))
            if dropout:
                _residual_dropout(hf, dropout)
        model = cls(config, hf.float().train(), seen_unlikelihood, label_smoothing, dtype=dtype)
        if lookahead:
            model.lookahead = lookahead
            model.heads = LookaheadHeads(hf.config.hidden_size)
            decoder = hf.decoder if config.is_encoder_decoder else hf.model
            decoder.register_forward_hook(
                lambda module, args, out: setattr(model, "_hidden", out.last_hidden_state))
        if dtype == torch.bfloat16:
            model._compile()
            return model
        for module in (hf, model.heads):
            if module is not None:
                _linears_as_xrec(module)
        return model

    def _compile(self) -> None:
        """Mixed precision's forward passes: float32 attention, each pass compiled. The
        look-ahead heads' loss stays eager: until 2026-12-05 dynamo skipped it (a branch on
        its targets), so every measured bfloat16 step ran it eagerly, and compiling it costs
        about 50 s more at a cold start on 2 cores for a gain not yet measured on a CPU with
        native bfloat16 (docs/decisions.md, "Training in bfloat16")."""
        if not self.config.is_encoder_decoder:
            use_float32_attention(self.hf)   # T5 computes its own attention, in products
        passes = [self.hf, self.hf.encoder] if self.config.is_encoder_decoder else [self.hf]
        for module in passes:
            module.forward = compiled_pass(module.forward)

    def parameters(self) -> list[torch.nn.Parameter]:
        """Everything the optimizer steps: the model's and the training-only heads'."""
        heads = [] if self.heads is None else list(self.heads.parameters())
        return list(self.hf.parameters()) + heads

    def training_state(self) -> dict[str, torch.Tensor]:
        """The training-only weights (the look-ahead heads), which `state` leaves out."""
        return {} if self.heads is None else dict(self.heads.state_dict())

    def load_training_state(self, state: dict[str, torch.Tensor]) -> None:
        if self.heads is not None:
            self.heads.load_state_dict(state)

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

    def loss(self, batch: list[np.ndarray]) -> tuple[torch.Tensor, int]:
        """Mean cross-entropy of a batch of training sequences (label-smoothed and plus the
        weighted seen-item unlikelihood, when asked) and its target count."""
        with autocast(self.dtype):
            return self._loss(batch)

    def _loss(self, batch: list[np.ndarray]) -> tuple[torch.Tensor, int]:
        out, labels = self.forward(batch)
        targets = int((labels != IGNORE).sum())
        loss = out.loss
        if self.label_smoothing:
            logits = out.logits if self.config.is_encoder_decoder else out.logits[:, :-1]
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                   labels.reshape(-1), ignore_index=IGNORE,
                                   label_smoothing=self.label_smoothing)
        if self.heads is not None:    # labels[:, t]: the token after position t
            if self.config.is_encoder_decoder:   # one block [start, c1, c2] per target
                term = self.heads.loss(self._hidden, labels, self._output, block=3)
            else:                                # a causal window's last position has none
                term = self.heads.loss(self._hidden[:, :-1], labels, self._output)
            loss = loss + self.lookahead * term
        if not self.seen_unlikelihood:
            return loss, targets
        second, third, tokens, real, first = self.item_logits(out.logits, batch)
        term = seen_unlikelihood(second, third, tokens, real, targets, first)
        return loss + self.seen_unlikelihood * term, targets

    def _output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits of final decoder states (T5 with tied embeddings scales them
        by d_model^-0.5 before its head, as `T5ForConditionalGeneration.forward` does)."""
        if getattr(self.hf.config, "scale_decoder_outputs", False):
            hidden = hidden * self.hf.model_dim ** -0.5
        return self.hf.lm_head(hidden)

    def item_logits(self, logits: torch.Tensor, batch: list[np.ndarray]) -> tuple:
        """A batch's logits per window item, as `seen_unlikelihood` reads them: (second
        [B, L, V], third [B, L, V], tokens [B, L, 3], real [B, L]) and `first_target`, the
        first item with a prediction (the encoder-decoder's item 0 is only a prompt)."""
        tokens, real = _item_tokens(batch)
        if self.config.is_encoder_decoder:    # block k - 1 = [start, c1, c2] of target item k
            return (F.pad(logits[:, 1::3], (0, 0, 1, 0)), F.pad(logits[:, 2::3], (0, 0, 1, 0)),
                    tokens, real, 1)
        # a causal window (BOS, then 3 tokens per item): position 1 + 3j holds item j's first
        # token and predicts its second, position 2 + 3j predicts its third
        items = tokens.shape[1]
        return logits[:, 1:3 * items:3], logits[:, 2:3 * items:3], tokens, real, 0

    def forward(self, batch: list[np.ndarray]) -> tuple[Any, torch.Tensor]:
        """The Hugging Face output (logits, loss) over a batch of training sequences
        (`causal_windows` or `seq2seq_windows`), and its labels (IGNORE where no target)."""
        if self.config.is_encoder_decoder:
            inputs = seq2seq_inputs(batch, self.config.bos_token_id)
            encoded = self.hf.encoder(input_ids=inputs.pop("input_ids"),
                                      attention_mask=inputs.pop("encoder_mask"))
            return self.hf(encoder_outputs=encoded, use_cache=False, **inputs), inputs["labels"]
        ids, mask = collate(list(batch))
        # right padding under a causal mask: real tokens never attend to the padding after them
        labels = torch.as_tensor(np.where(mask == 1, ids, IGNORE))
        out = self.hf(input_ids=torch.as_tensor(ids), labels=labels)
        return out, labels[:, 1:]


def _item_tokens(windows: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """Windows of BOS + 3 tokens per item -> their items' tokens [B, L, 3] (padded with 0)
    and which are real [B, L]."""
    ids, mask = collate([w[1:] for w in windows])                       # [B, 3L]
    return (torch.as_tensor(ids).view(len(windows), -1, 3),
            torch.as_tensor(mask[:, ::3] == 1))


def _linears_as_xrec(module: torch.nn.Module) -> None:
    """Every `nn.Linear` of `module` computes through xrec's `layers.linear` (the same
    parameters and names, a subclass without state): the float32 products, forward and
    backward, go to the library `xrec.model.gemm` chose for this CPU, which on AVX-512 AMD
    CPUs is oneDNN at about twice MKL's rate (docs/decisions.md)."""
    for linear in module.modules():
        if type(linear) is torch.nn.Linear:
            linear.__class__ = Linear


def _residual_dropout(hf, p: float) -> None:
    """Dropout on a Hugging Face causal LM's token embeddings and on every attention and MLP
    output (the first element where a module returns a tuple), in training mode only."""
    def drop(module, args, output):
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, module.training), *output[1:])
        return F.dropout(output, p, module.training)

    hf.model.embed_tokens.register_forward_hook(drop)
    for layer in hf.model.layers:
        layer.self_attn.register_forward_hook(drop)
        layer.mlp.register_forward_hook(drop)


def seq2seq_inputs(windows: list[np.ndarray], start_id: int) -> dict[str, torch.Tensor]:
    """The keyword arguments of one `T5ForConditionalGeneration` pass that trains every
    target of a batch of `seq2seq_windows` (`encoder_mask` goes to its encoder).

    A window of n + 1 items: the encoder reads BOS + items 0 .. n-1 under a causal mask
    (`input_ids [B, L]`, L = 1 + 3n at most). The decoder reads, for each target item
    k = 1 .. n, the block [start, c1, c2] predicting [c1, c2, c3], the blocks one after
    another (`decoder_input_ids`, `labels [B, T]`, T = 3n at most). Each block attends
    only to itself, causally, and to encoder positions 0 .. 3k (BOS and items 0 .. k-1):
    since the encoder is causal and T5's position biases depend on distance only, block k
    computes what a 3-token decoder over the prompt of items 0 .. k-1 computes at serving.

    Masks are additive float32 `[1, 1, Lq, Lk]`, shared by the batch: the right padding
    sits after every position a real query may see.
    """
    ids, _ = collate([w[:-3] for w in windows])
    targets = [w[4:].reshape(-1, 3) for w in windows]                  # [n, 3] each
    blocks = [np.concatenate([np.full((len(t), 1), start_id), t[:, :2]], 1).ravel() for t in targets]
    decoder_ids, _ = collate(blocks)
    labels, _ = collate([t.ravel() for t in targets], pad_id=IGNORE)
    step = torch.arange(decoder_ids.shape[1])
    block = step // 3                                                   # [T] target k - 1
    position = torch.arange(ids.shape[1])
    return {"input_ids": torch.as_tensor(ids),
            "encoder_mask": _additive(position[None, :] <= position[:, None]),           # [L, L]
            "decoder_input_ids": torch.as_tensor(decoder_ids),
            "decoder_attention_mask": _additive((block[None, :] == block[:, None])
                                                & (step[None, :] <= step[:, None])),     # [T, T]
            "attention_mask": _additive(position[None, :] <= 3 * (block[:, None] + 1)),  # [T, L]
            "labels": torch.as_tensor(labels)}


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    """A boolean `[Lq, Lk]` -> the additive float32 mask `[1, 1, Lq, Lk]` (0 or the float minimum)."""
    mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    return mask[None, None]


def batches(examples: list, batch_size: int, rng: np.random.Generator) -> list[list]:
    """Shuffled batches; examples of similar length are batched together (less padding):
    a random order, then sorted by length inside chunks of 50 batches. A lone example left
    over at the end joins the batch before it: a batch of one is a shape of its own to a
    compiled pass (dynamo specialises sizes of 1), and compiling it again cost a bfloat16
    run about as much as its first compile (docs/decisions.md, "Training in bfloat16")."""
    order = rng.permutation(len(examples))
    chunk = 50 * batch_size
    out = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start:start + chunk], key=lambda i: len(examples[i]))
        out.extend([examples[i] for i in part[b:b + batch_size]]
                   for b in range(0, len(part), batch_size))
    if batch_size > 1 and len(out) > 1 and len(out[-1]) == 1:
        out[-2].extend(out.pop())
    rng.shuffle(out)
    return out


def num_batches(num_examples: int, batch_size: int) -> int:
    """How many batches `batches` makes of `num_examples`."""
    whole, rest = divmod(num_examples, batch_size)
    return whole + (rest > 1 or (rest == 1 and whole == 0))
