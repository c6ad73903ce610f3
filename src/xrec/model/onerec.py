"""The OneRec network (docs/model.md) as plain modules with Hugging Face T5 names.

A `RecModel` family (family.py): `prefill` runs `encode` over the padded batch,
`prepare_cross` and `decode_prefix` once per request; `decode_step` runs once per
round for all beams. Model code knows tensors, not requests.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from xrec.config import ModelConfig
from xrec.model.attention import Attention, attend, attend_beams, padding_mask
from xrec.model.family import RecModel, merge_tied_copy
from xrec.model.inputs import ModelInputs
from xrec.model.kv import Allocate, BeamKV, CrossKV, PrefixKV
from xrec.model.layers import Embedding, GatedFFN, Linear, RMSNorm, relative_position_bucket
from xrec.model.moe import MoE

PREFIXES = ("module.module3.t5_model.", "model.")
# Copies of `shared.weight` that some T5 checkpoints carry; equal by construction.
EMBEDDING_ALIASES = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_RENAMES = [
    # xllm dense FFN: gate_proj = gate, wi = up, wo = down
    (re.compile(r"\.(?:DenseReluDense|ffn)\.gate_proj\.weight$"), ".DenseReluDense.wi_0.weight"),
    (re.compile(r"\.(?:DenseReluDense|ffn)\.wi\.weight$"), ".DenseReluDense.wi_1.weight"),
    (re.compile(r"\.ffn\.wo\.weight$"), ".DenseReluDense.wo.weight"),
    # xllm MoE: router, experts' gate_proj/up_proj/down_proj
    (re.compile(r"\.ffn\.router\.weight$"), ".ffn.gate.weight"),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.gate_proj\.weight$"), r".\1.w1.weight"),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.up_proj\.weight$"), r".\1.w3.weight"),
    (re.compile(r"\.(experts\.\d+|shared_experts)\.down_proj\.weight$"), r".\1.w2.weight"),
]


@dataclass(frozen=True)
class EncoderDecoderContext:
    """What every decode round of a batch reads: the cross K/V and the decoder-prefix K/V."""

    cross: CrossKV
    prefix: PrefixKV


class SelfAttentionSublayer(nn.Module):
    def __init__(self, d_model: int, eps: float, attention: Attention):
        super().__init__()
        self.layer_norm = RMSNorm(d_model, eps)
        self.SelfAttention = attention


class CrossAttentionSublayer(nn.Module):
    def __init__(self, d_model: int, eps: float, attention: Attention):
        super().__init__()
        self.layer_norm = RMSNorm(d_model, eps)
        self.EncDecAttention = attention


class FFNSublayer(nn.Module):
    def __init__(self, config: ModelConfig, is_moe: bool):
        super().__init__()
        self.layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        if is_moe:
            self.ffn = MoE(config)
        else:
            self.DenseReluDense = GatedFFN(config.d_model, config.d_ff)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        ffn = self.ffn if hasattr(self, "ffn") else self.DenseReluDense
        return h + ffn(self.layer_norm(h))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, is_decoder: bool, has_bias_table: bool):
        super().__init__()
        d, eps = config.d_model, config.layer_norm_epsilon
        buckets = config.relative_attention_num_buckets if has_bias_table else None
        if is_decoder:
            heads = (config.decoder_num_heads, config.decoder_num_kv_heads, config.decoder_head_dim)
            self.layer = nn.ModuleList([
                SelfAttentionSublayer(d, eps, Attention(d, *heads, num_buckets=buckets)),
                CrossAttentionSublayer(d, eps, Attention(d, *heads)),
                FFNSublayer(config, is_moe=config.use_moe)])
        else:
            heads = (config.num_heads, config.num_kv_heads, config.head_dim)
            self.layer = nn.ModuleList([
                SelfAttentionSublayer(d, eps, Attention(d, *heads, num_buckets=buckets)),
                FFNSublayer(config, is_moe=False)])  # pragma: no mutate


class Stack(nn.Module):
    def __init__(self, config: ModelConfig, is_decoder: bool):
        super().__init__()
        num_layers = config.num_decoder_layers if is_decoder else config.num_encoder_layers
        has_bias = not config.use_absolute_position_embedding
        self.block = nn.ModuleList(Block(config, is_decoder, has_bias and i == 0)
                                   for i in range(num_layers))
        self.final_layer_norm = RMSNorm(config.d_model, config.layer_norm_epsilon)
        self.is_decoder = is_decoder
        self.num_buckets = config.relative_attention_num_buckets
        self.max_distance = config.relative_attention_max_distance

    def position_bias(self, relative_position: torch.Tensor) -> torch.Tensor | None:
        """`[..., Lq, Lk]` relative positions -> `[..., H, Lq, Lk]` float32 bias, or None."""
        attn = self.block[0].layer[0].SelfAttention
        if not hasattr(attn, "relative_attention_bias"):
            return None
        buckets = relative_position_bucket(relative_position, bidirectional=not self.is_decoder,
                                           num_buckets=self.num_buckets, max_distance=self.max_distance)
        return attn.relative_attention_bias(buckets).float().movedim(-1, -3)

    def reversed_square_bias(self, length: int, device: torch.device, dtype: torch.dtype,
                             is_causal: bool = False) -> torch.Tensor | None:
        """The `[H, L, L]` bias of L positions attending to each other, queries in reverse
        order: row s holds query L-1-s. With `is_causal`, -inf where the key comes after the
        query (`[1, L, L]` without a bias table). None without a table or a causal mask.

        The bias is Toeplitz (it depends on key - query only), so with the queries reversed
        row s is the window s .. s+L-1 of the `[H, 2L-1]` per-distance vector, and the
        whole matrix is a strided *view* of 2L-1 values per head: on a CPU the attention
        kernel reads it from cache instead of streaming H x L x L values per layer. The
        causal mask is a function of key - query too, so it lives in the same vector.
        Other devices get a contiguous copy (their kernels want aligned rows).
        """
        attn = self.block[0].layer[0].SelfAttention
        has_table = hasattr(attn, "relative_attention_bias")
        if not (has_table or is_causal):
            return None
        distances = torch.arange(1 - length, length, device=device)     # key - query, [2L-1]
        if has_table:
            buckets = relative_position_bucket(distances, bidirectional=not self.is_decoder,
                                               num_buckets=self.num_buckets, max_distance=self.max_distance)
            per_distance = attn.relative_attention_bias(buckets).to(dtype).T   # [H, 2L-1]
        else:
            per_distance = torch.zeros(1, 2 * length - 1, device=device, dtype=dtype)
        if is_causal:
            per_distance = per_distance.masked_fill(distances > 0, float("-inf"))
        windows = per_distance.contiguous().unfold(-1, length, 1)        # [H, L, L] view
        return windows if device.type == "cpu" else windows.contiguous()  # pragma: no mutate


class OneRecModel(RecModel):
    """Encoder-decoder with shared embedding, optional decoder MoE, tied or untied LM head."""

    family = "onerec"
    cpu_auto_bf16 = True    # "auto" is bfloat16 on CPUs with native bf16: the gate held (docs/decisions.md)
    stacked = ((".q.weight", ".k.weight", ".v.weight"),)   # Attention.project_qkv / project_kv

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.shared = Embedding(config.vocab_size, config.d_model)
        self.encoder = Stack(config, is_decoder=False)  # pragma: no mutate
        self.decoder = Stack(config, is_decoder=True)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.d_model, config.vocab_size, bias=False)

    # ---- the family interface ------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.shared(token_ids)

    def head_weight(self) -> tuple[torch.Tensor, float]:
        if self.config.tie_word_embeddings:
            return self.shared.weight, self.config.d_model ** -0.5 if self.config.scale_decoder_outputs else 1.0
        return self.lm_head.weight, 1.0

    def prefill(self, inputs: ModelInputs, allocate: Allocate | None = None,
                ) -> tuple[torch.Tensor, EncoderDecoderContext]:
        """Encoder, cross K/V and the causal pass over each request's decoder prefix (its
        K/V in `allocate`'s buffer when given)."""
        hidden, key_mask = self._encoder_input(inputs)
        cross = self.prepare_cross(self.encode(hidden, key_mask), key_mask)
        prefix, lengths, is_ragged = self._prefix(inputs)
        last, prefix_kv = self.decode_prefix(prefix, lengths, is_ragged, cross, allocate)
        return last, EncoderDecoderContext(cross, prefix_kv)

    @classmethod
    def canonical_name(cls, name: str, config: ModelConfig) -> str:
        """Hugging Face T5 names: prefixes `module.module3.t5_model.` / `model.` stripped,
        xllm's FFN and MoE names mapped."""
        for prefix in PREFIXES:
            if name.startswith(prefix):
                name = name[len(prefix):]
                break
        for pattern, replacement in _RENAMES:
            name = pattern.sub(replacement, name)
        if config.use_moe and re.match(r"decoder\.block\.\d+\.layer\.2\.DenseReluDense\.", name):
            raise ValueError(f"tensor {name!r} is a dense FFN, but config.json says use_moe=true")
        return name

    @classmethod
    def prepare_checkpoint(cls, tensors: dict[str, torch.Tensor], config: ModelConfig) -> None:
        for name in EMBEDDING_ALIASES:   # T5 shares one embedding (the encoder's and decoder's)
            merge_tied_copy(tensors, "shared.weight", name, "the encoder and decoder share it")
        if config.tie_word_embeddings:   # some exporters write the tied head out; it is `shared`
            merge_tied_copy(tensors, "shared.weight", "lm_head.weight",
                            "config.json says tie_word_embeddings=true")
        if config.use_absolute_position_embedding:
            # a T5 checkpoint switched to absolute mode may still carry zeroed bias tables
            for name in [n for n in tensors if n.endswith("relative_attention_bias.weight")]:
                if tensors[name].count_nonzero():
                    raise ValueError(f"tensor {name!r} holds a non-zero relative position bias, "
                                     "but config.json says use_absolute_position_embedding=true")
                del tensors[name]

    def _encoder_input(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = self.device
        hidden = self.embed(inputs.token_ids.to(device, non_blocking=True))   # [B, L, D]
        if inputs.embedding_rows:
            index = torch.tensor(inputs.embedding_rows, device=device)
            hidden.index_copy_(0, index, inputs.embeddings.to(device, hidden.dtype, non_blocking=True))
        if not inputs.is_ragged:
            return hidden, None
        return hidden, padding_mask(torch.tensor(inputs.lengths, device=device), hidden.shape[1])

    def _prefix(self, inputs: ModelInputs) -> tuple[torch.Tensor, torch.Tensor, bool]:
        device = self.device
        num_prefix = max(inputs.prefix_lengths)
        bos = torch.full((inputs.num_requests, num_prefix), self.config.bos_token_id, device=device)
        prefix = self.embed(bos)                                           # [B, P, D]
        if inputs.context_rows:
            index = torch.tensor(inputs.context_rows, device=device)
            prefix.index_copy_(0, index, inputs.contexts.to(device, prefix.dtype, non_blocking=True))
        lengths = torch.tensor(inputs.prefix_lengths, device=device)
        return prefix, lengths, min(inputs.prefix_lengths) != num_prefix

    # ---- encoder ---------------------------------------------------------

    def encode(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """`hidden [B, L, D]` (embedded ids or sparse embeddings), `key_mask [B, 1, 1, L]`
        additive or None. Returns the encoder output `[B, L, D]`. With
        `config.is_encoder_causal`, position j attends to positions <= j only: the output
        of a prompt's first n positions is that of those n positions alone."""
        bias = self.encoder.reversed_square_bias(hidden.shape[1], hidden.device, hidden.dtype,
                                                 self.config.is_encoder_causal)
        reverse = bias is not None       # the bias rows are in reverse query order: so are q's
        mask = _add_masks(None if bias is None else bias.unsqueeze(0), key_mask)
        scale = self.config.encoder_attention_scale
        for block in self.encoder.block:
            sub = block.layer[0]
            x = sub.layer_norm(hidden)
            q, k, v = (t.transpose(1, 2) for t in sub.SelfAttention.project_qkv(x))  # [B, H, L, Dh]
            out = attend(q.flip(2) if reverse else q, k, v, mask, scale)
            out = (out.flip(2) if reverse else out).transpose(1, 2).flatten(2)  # [B, L, H*Dh]
            hidden = hidden + sub.SelfAttention.o(out)
            hidden = block.layer[1](hidden)
        return self.encoder.final_layer_norm(hidden)

    def prepare_cross(self, encoder_output: torch.Tensor, key_mask: torch.Tensor | None) -> CrossKV:
        """Cross-attention K/V of every decoder layer, once per request."""
        ks, vs = [], []
        for block in self.decoder.block:
            k, v = block.layer[1].EncDecAttention.project_kv(encoder_output)  # [B, L, kvH, Dh]
            ks.append(k.transpose(1, 2))
            vs.append(v.transpose(1, 2))
        return CrossKV(tuple(ks), tuple(vs), key_mask)                       # [B, kvH, L, Dh] each

    # ---- decoder ---------------------------------------------------------

    def decode_prefix(self, prefix: torch.Tensor, lengths: torch.Tensor, is_ragged: bool,
                      cross: CrossKV, allocate: Allocate | None = None) -> tuple[torch.Tensor, PrefixKV]:
        """Causal decoder pass over the shared prefix `[B, P, D]` (BOS or context rows).
        Returns the hidden state of each request's last prefix position `[B, D]` and the
        prefix K/V that every beam of the request will share (in `allocate`'s buffer when
        given)."""
        num_batch, num_len = prefix.shape[:2]
        positions = torch.arange(num_len, device=prefix.device)
        relative = positions.unsqueeze(0) - positions.unsqueeze(1)        # [P, P] key - query
        causal = torch.zeros(relative.shape, device=prefix.device).masked_fill(relative > 0, float("-inf"))
        bias = self.decoder.position_bias(relative)
        mask = causal if bias is None else bias + causal                  # [H?, P, P]
        mask = _add_masks(mask.unsqueeze(0) if mask.dim() == 3 else mask,  # pragma: no mutate
                          padding_mask(lengths, num_len) if is_ragged else None)
        scale = self.config.attention_scale
        hidden, ks, vs = prefix, [], []
        for index, block in enumerate(self.decoder.block):
            sub = block.layer[0]
            x = sub.layer_norm(hidden)
            q, k, v = (t.transpose(1, 2) for t in sub.SelfAttention.project_qkv(x))  # [B, kvH, P, Dh]
            ks.append(k)
            vs.append(v)
            hidden = hidden + sub.SelfAttention.o(attend(q, k, v, mask, scale).transpose(1, 2).flatten(2))
            hidden = self._cross_attention(block, index, hidden, cross)  # P plays the beam axis
            hidden = block.layer[2](hidden)
        last = hidden[torch.arange(num_batch, device=prefix.device), lengths - 1]   # [B, D]
        last = self.decoder.final_layer_norm(last)
        if allocate is None:
            return last, PrefixKV(torch.stack(ks), torch.stack(vs), lengths, is_ragged)
        kv = allocate("prefix_kv", (2, len(ks), *ks[0].shape), ks[0].dtype)  # [2, layers, B, kvH, P, Dh]
        torch.stack(ks, out=kv[0])
        torch.stack(vs, out=kv[1])
        return last, PrefixKV(kv[0], kv[1], lengths, is_ragged)

    def decode_step(self, token_ids: torch.Tensor, round_index: int, context: EncoderDecoderContext,
                    beams: BeamKV) -> torch.Tensor:
        """One token per beam: `token_ids [B, W]` were chosen in round `round_index - 1`;
        their K/V go to unshared slot `round_index - 1`. Returns the final decoder hidden
        state `[B, W, D]`."""
        hidden = self.embed(token_ids)                                    # [B, W, D]
        prefix, cross = context.prefix, context.cross
        slot = round_index - 1
        shared_bias, unshared_bias = self._step_biases(round_index, prefix, hidden.shape[0])
        scale = self.config.attention_scale
        for index, block in enumerate(self.decoder.block):
            sub = block.layer[0]
            x = sub.layer_norm(hidden)
            q, k_new, v_new = sub.SelfAttention.project_qkv(x)            # [B, W, H|kvH, Dh]
            beam_k, beam_v = beams.layer(index)                           # [B, W, R-1, kvH, Dh]
            beam_k[:, :, slot] = k_new
            beam_v[:, :, slot] = v_new
            out = self.beam_attention(q, (prefix.k[index], prefix.v[index]), shared_bias,
                                      (beam_k[:, :, :slot + 1], beam_v[:, :, :slot + 1]),
                                      unshared_bias, scale)
            hidden = hidden + sub.SelfAttention.o(out)
            hidden = self._cross_attention(block, index, hidden, cross)
            hidden = block.layer[2](hidden)
        return self.decoder.final_layer_norm(hidden)

    def _cross_attention(self, block: Block, index: int, hidden: torch.Tensor,
                         cross: CrossKV) -> torch.Tensor:
        """`hidden [B, W, D]`: the W queries of a request against its encoder K/V."""
        sub = block.layer[1]
        q = sub.EncDecAttention.project_q(sub.layer_norm(hidden))         # [B, W, H, Dh]
        out = attend_beams(q, cross.k[index], cross.v[index], cross.key_mask, self.config.attention_scale)
        return hidden + sub.EncDecAttention.o(out.flatten(2))

    def _step_biases(self, round_index: int, prefix: PrefixKV,
                     num_batch: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Position bias (and prefix padding) of a decode round: shared `[B, H, P]`,
        unshared `[H, round_index]`. The query sits at position `prefix_len + round - 1`."""
        num_prefix = prefix.k.shape[3]
        device = prefix.k.device
        query_pos = (prefix.lengths + (round_index - 1)).unsqueeze(1)     # [B, 1]
        relative = torch.arange(num_prefix, device=device).unsqueeze(0) - query_pos  # [B, P]
        shared = self.decoder.position_bias(relative.unsqueeze(1))       # [B, H, 1, P] or None
        if shared is not None:
            shared = shared.squeeze(2)
        if prefix.is_ragged:
            pad = padding_mask(prefix.lengths, num_prefix).view(num_batch, 1, num_prefix)
            shared = pad if shared is None else shared + pad
        slots = torch.arange(round_index, device=device)
        unshared = self.decoder.position_bias((slots - (round_index - 1)).unsqueeze(0))  # [H, 1, S]
        return shared, None if unshared is None else unshared.squeeze(1)  # pragma: no mutate


def _add_masks(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b
