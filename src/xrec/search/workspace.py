"""How many bytes one batch needs on its pipeline. Torch-free arithmetic.

The scheduler admits a batch only if `batch_bytes` fits the pipeline's
workspace; the executor uses the same function to report what it holds. It
counts the transient buffers of a step, not the weights: what the model family
keeps from round 0 (its config's `context_bytes`: encoder activations, cross and
prefix K/V, or the prompt's activations and K/V) and spends per decode round
(`decode_bytes`), and what the search holds for any family (the two beam K/V
buffers, logits and candidate buffers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from xrec.config import FamilyConfig


def padded_len(length: int, pad: bool = True) -> int:
    """The input length a batch is padded to when its decode rounds are captured (graphs
    are keyed by shape): 8 lengths per power of two, so at most 1/8 more positions
    (e.g. 151 -> 160, 1000 -> 1024), and at least a multiple of 8."""
    if not pad:
        return length
    step = max(8, 1 << max(0, length.bit_length() - 4))
    return -(-length // step) * step


@dataclass(frozen=True)
class BatchShape:
    """The sizes that drive a batch's memory: padded to its longest request."""

    num_requests: int
    max_input_len: int
    max_prefix_len: int
    max_beam_width: int
    max_results: int
    has_full_rows: bool
    num_filter_ids: int = 0      # ids the batch's filters name (excluded items, prompt positions)
    num_type_sets: int = 0       # distinct type allow-lists

    @classmethod
    def of(cls, requests: Sequence) -> "BatchShape":
        """From any objects with input_len, prefix_len, beam_width, num_results, normalize
        and the filters of `search.batch.SearchRequest`."""
        num_ids = sum((0 if r.exclude_items is None else len(r.exclude_items))
                      + (r.input_len if r.exclude_history else 0) for r in requests)
        type_sets = {r.item_types for r in requests if r.item_types is not None}
        return cls(len(requests), max(r.input_len for r in requests),
                   max(r.prefix_len for r in requests), max(r.beam_width for r in requests),
                   max(r.num_results for r in requests),
                   any(r.normalize == "full" for r in requests), num_ids, len(type_sets))


@dataclass(frozen=True)
class WorkspaceModel:
    """The model/catalog facts the estimate needs."""

    config: FamilyConfig
    dtype_bytes: int
    max_children: int          # widest catalog node after the first level (vocab when unconstrained)
    rounds: int
    num_nodes: int = 0         # nodes of the catalog's trie, all depths (0 when unconstrained)
    pad_lengths: bool = False  # inputs padded to `padded_len` (captured decode rounds)

    def batch_bytes(self, shape: BatchShape) -> int:
        cfg, elem = self.config, self.dtype_bytes
        num_b, num_w = shape.num_requests, shape.max_beam_width
        num_l = padded_len(shape.max_input_len, self.pad_lengths)
        context = cfg.context_bytes(num_b, num_l, shape.max_prefix_len, elem)
        beams = num_b * num_w
        layers, kv_heads, head_dim = cfg.beam_kv_shape
        beam_kv = 2 * layers * 2 * beams * max(self.rounds - 1, 1) * kv_heads * head_dim * elem
        decode = cfg.decode_bytes(beams, num_l, elem)
        d = cfg.d_model
        cands = max(self.max_children, shape.max_results)
        lm_rows = cfg.vocab_size if shape.has_full_rows or 4 * cands >= cfg.vocab_size else cands
        head = beams * lm_rows * 4 + beams * cands * (d * elem + 16)
        select = num_b * num_w * cands * 12
        return int(context + beam_kv + decode + head + select + self._filter_bytes(shape, cands))

    def _filter_bytes(self, shape: BatchShape, cands: int) -> int:
        """The filters' tables (dead nodes per depth, one live mask per type allow-list and
        one for the rest) and a round's lookup (positions and masks per candidate)."""
        if not (shape.num_filter_ids or shape.num_type_sets):
            return 0
        tables = 3 * 8 * shape.num_filter_ids + (shape.num_type_sets + 1) * self.num_nodes
        lookup = shape.num_requests * shape.max_beam_width * cands * 10
        return 2 * tables + lookup   # host (pinned) and device copies
