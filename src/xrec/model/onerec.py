"""The OneRec network (spec/model.md) as plain modules with Hugging Face T5 names.

The engine drives it piece by piece: `encode` over a padded batch,
`prepare_cross` once per request, `decode_prefix` once per request, then
`decode_step` once per round for all beams. Model code knows tensors, not
requests.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xrec.config import ModelConfig
from xrec.model.attention import (Attention, attend, attend_beams, merge_states, shared_stage,
                                  unshared_stage)
from xrec.model.kv import BeamKV, CrossKV, PrefixKV
from xrec.model.layers import GatedFFN, RMSNorm, relative_position_bucket
from xrec.model.moe import MoE


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
                FFNSublayer(config, is_moe=False)])


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

    def reversed_square_bias(self, length: int, device: torch.device,
                             dtype: torch.dtype) -> torch.Tensor | None:
        """The `[H, L, L]` bias of L positions attending to each other, queries in reverse
        order: row s holds query L-1-s. None without a bias table.

        The bias is Toeplitz (it depends on key - query only), so with the queries reversed
        row s is the window s .. s+L-1 of the `[H, 2L-1]` per-distance vector, and the
        whole matrix is a strided *view* of 2L-1 values per head: on a CPU the attention
        kernel reads it from cache instead of streaming H x L x L values per layer. Other
        devices get a contiguous copy (their kernels want aligned rows).
        """
        attn = self.block[0].layer[0].SelfAttention
        if not hasattr(attn, "relative_attention_bias"):
            return None
        distances = torch.arange(1 - length, length, device=device)     # key - query, [2L-1]
        buckets = relative_position_bucket(distances, bidirectional=not self.is_decoder,
                                           num_buckets=self.num_buckets, max_distance=self.max_distance)
        per_distance = attn.relative_attention_bias(buckets).to(dtype).T.contiguous()
        windows = per_distance.unfold(-1, length, 1)                     # [H, L, L] view
        return windows if device.type == "cpu" else windows.contiguous()


def padding_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """`[B]` lengths -> additive key mask `[B, 1, 1, max_len]` (0 inside, -inf past the end)."""
    inside = torch.arange(max_len, device=lengths.device) < lengths.unsqueeze(1)
    zero = torch.zeros((), dtype=torch.float32, device=lengths.device)
    return torch.where(inside, zero, float("-inf")).view(len(lengths), 1, 1, max_len)


class OneRecModel(nn.Module):
    """Encoder-decoder with shared embedding, optional decoder MoE, tied or untied LM head."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.shared = nn.Embedding(config.vocab_size, config.d_model)
        self.encoder = Stack(config, is_decoder=False)
        self.decoder = Stack(config, is_decoder=True)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)

    # ---- encoder ---------------------------------------------------------

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        return self.shared(token_ids)

    def encode(self, hidden: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        """`hidden [B, L, D]` (embedded ids or sparse embeddings), `key_mask [B, 1, 1, L]`
        additive or None. Returns the encoder output `[B, L, D]`."""
        bias = self.encoder.reversed_square_bias(hidden.shape[1], hidden.device, hidden.dtype)
        reverse = bias is not None       # the bias rows are in reverse query order: so are q's
        mask = _add_masks(None if bias is None else bias.unsqueeze(0), key_mask)
        scale = self.config.encoder_attention_scale
        for block in self.encoder.block:
            sub = block.layer[0]
            x = sub.layer_norm(hidden)
            q = sub.SelfAttention.project_q(x).transpose(1, 2)             # [B, H, L, Dh]
            k, v = (t.transpose(1, 2) for t in sub.SelfAttention.project_kv(x))
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
                      cross: CrossKV) -> tuple[torch.Tensor, PrefixKV]:
        """Causal decoder pass over the shared prefix `[B, P, D]` (BOS or context rows).
        Returns the hidden state of each request's last prefix position `[B, D]` and the
        prefix K/V that every beam of the request will share."""
        num_batch, num_len = prefix.shape[:2]
        positions = torch.arange(num_len, device=prefix.device)
        relative = positions.unsqueeze(0) - positions.unsqueeze(1)        # [P, P] key - query
        causal = torch.zeros(relative.shape, device=prefix.device).masked_fill(relative > 0, float("-inf"))
        bias = self.decoder.position_bias(relative)
        mask = causal if bias is None else bias + causal                  # [H?, P, P]
        mask = _add_masks(mask.unsqueeze(0) if mask.dim() == 3 else mask,
                          padding_mask(lengths, num_len) if is_ragged else None)
        scale = self.config.attention_scale
        hidden, ks, vs = prefix, [], []
        for index, block in enumerate(self.decoder.block):
            sub = block.layer[0]
            x = sub.layer_norm(hidden)
            q = sub.SelfAttention.project_q(x).transpose(1, 2)
            k, v = (t.transpose(1, 2) for t in sub.SelfAttention.project_kv(x))  # [B, kvH, P, Dh]
            ks.append(k)
            vs.append(v)
            hidden = hidden + sub.SelfAttention.o(attend(q, k, v, mask, scale).transpose(1, 2).flatten(2))
            hidden = self._cross_attention(block, index, hidden, cross)  # P plays the beam axis
            hidden = block.layer[2](hidden)
        last = hidden[torch.arange(num_batch, device=prefix.device), lengths - 1]   # [B, D]
        last = self.decoder.final_layer_norm(last)
        return last, PrefixKV(torch.stack(ks), torch.stack(vs), lengths, is_ragged)

    def decode_step(self, hidden: torch.Tensor, round_index: int, prefix: PrefixKV, beams: BeamKV,
                    cross: CrossKV) -> torch.Tensor:
        """One token per beam. `hidden [B, W, D]` embeds the tokens chosen in round
        `round_index - 1`; their K/V go to unshared slot `round_index - 1`.
        Returns the final decoder hidden state `[B, W, D]`."""
        slot = round_index - 1
        shared_bias, unshared_bias = self._step_biases(round_index, prefix, hidden.shape[0])
        scale = self.config.attention_scale
        for index, block in enumerate(self.decoder.block):
            sub = block.layer[0]
            x = sub.layer_norm(hidden)
            q = sub.SelfAttention.project_q(x)                            # [B, W, H, Dh]
            k_new, v_new = sub.SelfAttention.project_kv(x)                # [B, W, kvH, Dh]
            beam_k, beam_v = beams.layer(index)                           # [B, W, R-1, kvH, Dh]
            beam_k[:, :, slot] = k_new
            beam_v[:, :, slot] = v_new
            o_s, lse_s = shared_stage(q, prefix.k[index], prefix.v[index], shared_bias, scale)
            o_u, lse_u = unshared_stage(q, beam_k[:, :, :slot + 1], beam_v[:, :, :slot + 1],
                                        unshared_bias, scale)
            hidden = hidden + sub.SelfAttention.o(merge_states(o_s, lse_s, o_u, lse_u).flatten(2))
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
        return shared, None if unshared is None else unshared.squeeze(1)

    # ---- LM head ---------------------------------------------------------

    def _head_weight(self) -> tuple[torch.Tensor, float]:
        if self.config.tie_word_embeddings:
            return self.shared.weight, self.config.d_model ** -0.5 if self.config.scale_decoder_outputs else 1.0
        return self.lm_head.weight, 1.0

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits `[..., V]`, float32."""
        weight, scale = self._head_weight()
        return ((hidden * scale) @ weight.T).float()

    def logits_logsumexp(self, hidden: torch.Tensor, row_scale: torch.Tensor | None = None,
                         block_rows: int = 128) -> torch.Tensor:
        """log-sum-exp over the vocabulary of `logits(hidden) * row_scale`, `hidden [N, D]`,
        `row_scale [N]` or None -> `[N]` float32, without materialising `[N, V]`.

        Computed as `weight @ hidden.T` (`[V, rows]`: ~1.8x the GEMM speed of the `[rows, V]`
        product on a CPU) and reduced over the vocabulary axis. On a CPU the rows go through
        in blocks so that each block's logits stay in cache; on a GPU one block covers all.
        """
        weight, scale = self._head_weight()
        num_rows, vocab = hidden.shape[0], weight.shape[0]
        block = num_rows if hidden.device.type != "cpu" else min(block_rows, num_rows)
        buffer = torch.empty(vocab * block, dtype=hidden.dtype, device=hidden.device)
        out = torch.empty(num_rows, dtype=torch.float32, device=hidden.device)
        scaled = hidden * scale
        for start in range(0, num_rows, block):  # blocks of rows, a handful per round
            stop = min(start + block, num_rows)
            logits = torch.mm(weight, scaled[start:stop].T,
                              out=buffer[:vocab * (stop - start)].view(vocab, stop - start)).float()
            if row_scale is not None:
                logits = logits * row_scale[start:stop]
            torch.logsumexp(logits, dim=0, out=out[start:stop])
        return out

    def candidate_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor,
                         block_bytes: int = 2 << 20) -> torch.Tensor:
        """Logits of chosen tokens only: `hidden [N, D]`, `token_ids [N, C]` -> `[N, C]`.

        The gathered head rows `[N, C, D]` are multiplied in place and summed (~5x faster
        than a bmm of N matrix-vectors). On a CPU they go through in blocks of about
        `block_bytes`, so the gather stays in cache instead of faulting in N x C x D fresh
        values; on a GPU one block covers all rows.
        """
        weight, scale = self._head_weight()
        scaled = (hidden * scale).unsqueeze(1)                            # [N, 1, D]
        num_rows, num_cand = token_ids.shape
        row_bytes = max(1, num_cand * weight.shape[1] * weight.element_size())
        block = num_rows if hidden.device.type != "cpu" else max(1, block_bytes // row_bytes)
        out = torch.empty((num_rows, num_cand), dtype=hidden.dtype, device=hidden.device)
        for start in range(0, num_rows, block):  # blocks of rows, a handful per round
            rows = F.embedding(token_ids[start:start + block], weight)   # [n, C, D]
            torch.sum(rows.mul_(scaled[start:start + block]), -1, out=out[start:start + block])
        return out.float()


def _add_masks(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    if a is None:
        return b
    return a if b is None else a + b
