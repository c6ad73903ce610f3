"""How many bytes one batch needs on its pipeline. Torch-free arithmetic.

The scheduler admits a batch only if `batch_bytes` fits the pipeline's
workspace; the executor uses the same function to report what it holds. It
counts the transient buffers of a step (encoder activations and attention
scores, cross/prefix K/V, the two beam K/V buffers, decode-round activations,
logits and candidate buffers), not the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from xrec.config import ModelConfig


@dataclass(frozen=True)
class BatchShape:
    """The sizes that drive a batch's memory: padded to its longest request."""

    num_requests: int
    max_input_len: int
    max_prefix_len: int
    max_beam_width: int
    max_results: int
    has_full_rows: bool

    @classmethod
    def of(cls, requests: Sequence) -> "BatchShape":
        """From any objects with input_len, prefix_len, beam_width, num_results, normalize."""
        return cls(len(requests), max(r.input_len for r in requests),
                   max(r.prefix_len for r in requests), max(r.beam_width for r in requests),
                   max(r.num_results for r in requests),
                   any(r.normalize == "full" for r in requests))


@dataclass(frozen=True)
class WorkspaceModel:
    """The model/catalog facts the estimate needs."""

    config: ModelConfig
    dtype_bytes: int
    max_children: int          # widest catalog node after the first level (vocab when unconstrained)
    rounds: int

    def batch_bytes(self, shape: BatchShape) -> int:
        cfg, elem = self.config, self.dtype_bytes
        num_b, num_l, num_w = shape.num_requests, shape.max_input_len, shape.max_beam_width
        tokens = num_b * num_l
        d, heads = cfg.d_model, max(cfg.num_heads, cfg.decoder_num_heads)
        ffn = cfg.moe_inter_dim * cfg.moe_topk if cfg.use_moe else cfg.d_ff
        kv_width = cfg.decoder_num_kv_heads * cfg.decoder_head_dim
        encoder = tokens * (6 * d + 3 * max(cfg.d_ff, 1)) * elem + num_b * heads * num_l * num_l * 4
        cross = cfg.num_decoder_layers * 2 * tokens * kv_width * elem
        prefix = cfg.num_decoder_layers * 2 * num_b * shape.max_prefix_len * kv_width * elem
        beams = num_b * num_w
        beam_kv = 2 * cfg.num_decoder_layers * 2 * beams * max(self.rounds - 1, 1) * kv_width * elem
        decode = beams * (8 * d + 3 * ffn) * elem + beams * heads * num_l * 4
        cands = max(self.max_children, shape.max_results)
        lm_rows = cfg.vocab_size if shape.has_full_rows or 4 * cands >= cfg.vocab_size else cands
        head = beams * lm_rows * 4 + beams * cands * (d * elem + 16)
        select = num_b * num_w * cands * 12
        return int(encoder + cross + prefix + beam_kv + decode + head + select)
