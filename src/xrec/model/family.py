"""The interface a model family offers the search (`RecStep`), and the LM head they share.

A family is one `RecModel` subclass: OneRec's encoder-decoder (`onerec.py`)
or a decoder-only Qwen LM (`qwen.py`). `RecStep` drives every family the same way:

    last, context = model.prefill(inputs, allocate)  # round 0: [B, D], shared state
    hidden = model.decode_step(tokens, r, context, beams)   # round r >= 1: [B, W, D]
    model.logits / logits_logsumexp / candidate_logits      # the LM head

`context` is the family's own per-request state (cross and prefix K/V, or the
prompt K/V): the search passes it back without looking inside. `allocate(name, shape,
dtype)` is the pipeline's workspace (`search/workspace_buffers.py`): the prefix or prompt
K/V, like the beam K/V, then sits at the same address for every batch of one shape. `beams` is the
per-beam K/V (`BeamKV`) that the search reorders by parent after each round.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from xrec.config import FamilyConfig
from xrec.model.inputs import ModelInputs
from xrec.model.gemm import cpu_fp32_gemm, onednn_linear
from xrec.model.attention import merge_states, shared_stage, unshared_stage
from xrec.model.dtype import cpu_native_bf16
from xrec.model.kv import Allocate, BeamKV
from xrec.model.layers import linear

_LOG2_E, _LN_2 = 1.0 / math.log(2.0), math.log(2.0)


class RecModel(nn.Module):
    """Base class of the model families: the search interface and the LM head.

    `family`: the family's name (metrics, logs). `cpu_auto_bf16`: whether dtype "auto"
    may pick bfloat16 on a CPU with native bf16 (`xrec.model.dtype.resolve_dtype`); True
    only once the family's bf16 quality gate held on a trained model (issue 23).
    `stacked`: groups of weight-name suffixes the loader stores one after another
    (`layers.stack_weights`), so that one product serves them all. `merge_states` and
    `unshared_stage` (attention.py) are the decode rounds' element-wise attention chains,
    attributes so that xrec.model.fusion may compile them (`fusable`)."""

    config: FamilyConfig
    family: ClassVar[str] = ""
    cpu_auto_bf16: ClassVar[bool] = False
    stacked: ClassVar[tuple[tuple[str, ...], ...]] = ()
    fusable: ClassVar[tuple[str, ...]] = ("merge_states", "unshared_stage")
    merge_states = staticmethod(merge_states)
    unshared_stage = staticmethod(unshared_stage)

    def beam_attention(self, q: torch.Tensor, shared: tuple[torch.Tensor, torch.Tensor],
                       shared_bias: torch.Tensor | None, own: tuple[torch.Tensor, torch.Tensor],
                       own_bias: torch.Tensor | None, scale: float) -> torch.Tensor:
        """A decode round's self-attention of `q [B, W, H, Dh]` (xAttention): the shared
        stage over the request's `shared` K/V `[B, kvH, P, Dh]`, the unshared stage over each
        beam's `own` slots `[B, W, S, kvH, Dh]`, merged. Returns `[B, W, H * Dh]`.

        Compiled (`xrec.model.fusion`), a chain is compiled apart for each layout of its
        inputs, and a layout that depends on the batch (a view whose strides change where a
        batch or beam axis has size 1) multiplies the variants a load compiles. So the
        unshared stage reads rows `[B * W, ...]` (views: `attention.unshared_stage`), and
        the merge a contiguous copy of the shared stage's log-sum-exp (`[B, W, H]` float32,
        one value per Dh of the output)."""
        o_s, lse_s = shared_stage(q, *shared, shared_bias, scale)
        o_u, lse_u = self.unshared_stage(*(t.flatten(0, 1) for t in (q, *own)), own_bias, scale)
        beams = q.shape[:2]
        return self.merge_states(o_s, lse_s.contiguous(), o_u.unflatten(0, beams),
                                 lse_u.unflatten(0, beams)).flatten(2)

    # ---- what a family implements -------------------------------------------------

    def head_weight(self) -> tuple[torch.Tensor, float]:
        """The LM head `[V, D]` and the scale applied to the hidden state before it."""
        raise NotImplementedError

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, inputs: ModelInputs, allocate: Allocate | None = None) -> tuple[torch.Tensor, Any]:
        """Round 0 of a batch: the final hidden state of each request's last position
        `[B, D]` and the family's shared per-request state for the decode rounds (its
        prefix or prompt K/V in `allocate`'s buffers when given, else fresh tensors)."""
        raise NotImplementedError

    def decode_step(self, token_ids: torch.Tensor, round_index: int, context: Any,
                    beams: BeamKV) -> torch.Tensor:
        """Round `round_index` >= 1: `token_ids [B, W]` were chosen in the round before; their
        K/V go to beam slot `round_index - 1`. Returns the final hidden state `[B, W, D]`."""
        raise NotImplementedError

    @classmethod
    def canonical_name(cls, name: str, config: FamilyConfig) -> str:
        """A checkpoint tensor's name as this family's `state_dict` spells it."""
        return name

    @classmethod
    def prepare_checkpoint(cls, tensors: dict[str, torch.Tensor], config: FamilyConfig) -> None:
        """Drop or alias tensors a checkpoint may carry beyond the family's own (in place)."""

    # ---- shared ---------------------------------------------------------------------

    @property
    def device(self) -> torch.device:
        return self.head_weight()[0].device

    @property
    def dtype(self) -> torch.dtype:
        return self.head_weight()[0].dtype

    @property
    def is_capturable(self) -> bool:
        """No module reads a tensor value on the host in a step (`reads_host_values`: the
        mixtures of experts), so its decode rounds can be captured as a CUDA graph."""
        return not any(getattr(m, "reads_host_values", False) for m in self.modules())

    def new_beam_kv(self, num_batch: int, num_beams: int, rounds: int,
                    allocate: Allocate | None = None) -> BeamKV:
        """The per-beam K/V of a batch (`allocate`: a pipeline's reusable workspace)."""
        layers, kv_heads, head_dim = self.config.beam_kv_shape
        return BeamKV(layers, num_batch, num_beams, rounds - 1, kv_heads, head_dim, self.dtype,
                      self.device, allocate)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits `[..., V]`, float32."""
        weight, scale = self.head_weight()
        if scale != 1.0:
            hidden = hidden * scale
        return linear(hidden, weight).float()

    def logits_logsumexp(self, hidden: torch.Tensor, row_scale: torch.Tensor | None = None,
                         block_rows: int = 512, block_vocab: int = 4096) -> torch.Tensor:
        """log-sum-exp over the vocabulary of `logits(hidden) * row_scale`, `hidden [N, D]`,
        `row_scale [N]` or None -> `[N]` float32, without materialising `[N, V]`.

        On a CPU the head goes through in blocks of `block_vocab` rows against up to
        `block_rows` hidden rows as `weight[block] @ hidden.T` (`[v, rows]`, the faster
        orientation), which stays in cache; each block's log-sum-exp goes to a `[blocks, N]`
        table, reduced once at the end. On a GPU one block of rows goes against vocabulary
        blocks of at least 32,768 (large kernels, and no `[V, N]` buffer).

        Each block's log-sum-exp is taken in base 2 and in place (hidden rows scaled by
        log2(e) before the product, then subtract a shift, `exp2_`, sum): nothing is
        allocated per block. On a CPU the shift is the first block's max for every block; a
        block whose sum overflows (a logit 2^127 times that max) is computed again with its
        own max. On a GPU each block takes its own max (no host synchronisation). The
        accuracy is that of `torch.logsumexp`. Measurements: docs/decisions.md, Search and
        Decoder-only family.

        A bfloat16 model on a CPU with native bfloat16 takes each block's products relative
        to the first block's max (`addmm` of minus that max, rounded once): the logits near
        the max, which make the sum, keep float32-like precision instead of bfloat16's 2^-9
        of their size (docs/decisions.md, bf16 scores). The first block is computed once
        more for that. A CPU without it converts each block to float32 instead: its emulated
        bfloat16 products ran at ~1 GFLOP/s, the whole head 14x float32's.
        """
        weight, scale = self.head_weight()
        num_rows, vocab = hidden.shape[0], weight.shape[0]
        is_host = hidden.device.type == "cpu"
        # a CPU without native bfloat16 emulates its products at ~1 GFLOP/s: there a
        # bfloat16 model's blocks are taken in float32 (exact products, float32's speed)
        is_upcast = is_host and hidden.dtype == torch.bfloat16 and not cpu_native_bf16()
        if is_upcast:
            hidden = hidden.float()
        if not is_host:
            block_rows, block_vocab = num_rows, max(block_vocab, 32768)
        block_rows, block_vocab = min(block_rows, num_rows), min(block_vocab, vocab)
        num_blocks = -(-vocab // block_vocab)
        is_relative = is_host and hidden.dtype != torch.float32
        # float32 on a CPU whose products oneDNN computes faster: `weight[block] @ rows` as a
        # linear of the hidden rows, a fresh [v, rows] per block (oneDNN takes no `out=`)
        is_onednn = is_host and not is_relative and cpu_fp32_gemm() == "onednn"
        buffer = torch.empty(0 if is_onednn else block_vocab * block_rows, dtype=hidden.dtype,
                             device=hidden.device)
        parts = torch.empty((num_blocks, num_rows), dtype=torch.float32, device=hidden.device)
        # the float32 copy of a vocabulary block (upcast only): one buffer for every block
        block_copy = torch.empty((block_vocab, weight.shape[1]) if is_upcast else 0,
                                 dtype=torch.float32, device=hidden.device)
        factor = scale * _LOG2_E
        # float32: the factor goes into the hidden rows (no pass over a block); a bfloat16
        # model keeps its hidden rows exact and scales the float32 products instead
        scaled = hidden if is_relative else hidden * factor
        for start in range(0, num_rows, block_rows):  # blocks of rows and of the vocabulary:
            stop = min(start + block_rows, num_rows)  # a few dozen per round, never per beam
            rows = scaled[start:stop].T                                   # [D, rows]
            onednn_rows = scaled[start:stop] if is_onednn else None       # [rows, D]
            scales = None if row_scale is None else row_scale[start:stop]
            base = None
            if is_relative:   # the first block's max products, in the model's dtype
                scales = torch.full((stop - start,), factor, device=hidden.device) \
                    if scales is None else scales * factor
                out = buffer[:min(block_vocab, vocab) * (stop - start)].view(-1, stop - start)
                base = torch.mm(weight[:block_vocab], rows, out=out).amax(dim=0)   # [rows]
            for index, first in enumerate(range(0, vocab, block_vocab)):
                last = min(first + block_vocab, vocab)
                out = None if is_onednn else \
                    buffer[:(last - first) * (stop - start)].view(last - first, stop - start)
                block = block_copy[:last - first].copy_(weight[first:last]) if is_upcast \
                    else weight[first:last]
                logits = _head_block(block, rows, out, scales, base, onednn_rows)   # base 2
                if index == 0 or not is_host:
                    shift = logits.amax(dim=0)                                 # [rows]
                part = parts[index, start:stop]
                _log2_sum_exp2(logits, shift, part)
                if is_host and bool(part.isinf().any()):  # rare: this block again, own max
                    logits = _head_block(block, rows, out, scales, base, onednn_rows)
                    _log2_sum_exp2(logits, logits.amax(dim=0), part)
                if base is not None:
                    part.add_(base.float() * scales)
        return torch.logsumexp(parts.mul_(_LN_2), dim=0)

    def shared_candidate_logits(self, hidden: torch.Tensor,
                                token_ids: torch.Tensor | slice) -> torch.Tensor:
        """Logits of ONE set of tokens for every row: `hidden [N, D]`, `token_ids [C]` (or a
        slice of consecutive ids) -> `[N, C]` float32 (round 0: every request's beam sits at
        the catalog's root). Computed in float32 whatever the model's dtype: one row per
        request, and a logit rounded to bfloat16 is off by up to 2^-9 of its size, enough
        to reorder near-tied items (docs/decisions.md, bf16 scores)."""
        weight, scale = self.head_weight()
        rows = weight[token_ids] if isinstance(token_ids, slice) else F.embedding(token_ids, weight)
        return linear(hidden.float() * scale, rows.float())

    def candidate_logits(self, hidden: torch.Tensor, token_ids: torch.Tensor,
                         block_bytes: int = 2 << 20) -> torch.Tensor:
        """Logits of chosen tokens only: `hidden [N, D]`, `token_ids [N, C]` -> `[N, C]`.

        The gathered head rows `[N, C, D]` are multiplied in place and summed (faster than a
        bmm of N matrix-vectors: docs/decisions.md, Search). On a CPU they go through in
        blocks of about `block_bytes`, so the gather stays in cache instead of faulting in
        N x C x D fresh values; on a GPU one block covers all rows. The products and their
        sums are float32 whatever the model's dtype: bfloat16 products or logits reordered
        near-tied items (docs/decisions.md, bf16 scores).
        """
        weight, scale = self.head_weight()
        scaled = (hidden.float() * scale).unsqueeze(1)                    # [N, 1, D]
        num_rows, num_cand = token_ids.shape
        row_bytes = max(1, num_cand * weight.shape[1] * 4)
        block = num_rows if hidden.device.type != "cpu" else max(1, block_bytes // row_bytes)
        out = torch.empty((num_rows, num_cand), dtype=torch.float32, device=hidden.device)
        for start in range(0, num_rows, block):  # blocks of rows, a handful per round
            rows = F.embedding(token_ids[start:start + block], weight).float()  # [n, C, D]
            torch.sum(rows.mul_(scaled[start:start + block]), -1, out=out[start:start + block])
        return out


def merge_tied_copy(tensors: dict[str, torch.Tensor], source: str, copy: str, why: str) -> None:
    """Fold `copy`, a checkpoint's written-out copy of `source` (`why`: what ties them), into
    `source`, in place: an equal copy is dropped, and a copy standing alone becomes
    `source` (transformers ties them the same way round). A copy that differs is refused: the
    checkpoint holds two weights where the config ties one, and transformers 5 serves the copy
    untied (with a warning) where 4.x served `source`; xrec dropped the copy without a word."""
    if copy not in tensors:
        return
    if source not in tensors:
        tensors[source] = tensors.pop(copy)
        return
    first, second = tensors[source], tensors.pop(copy)
    wide = torch.promote_types(first.dtype, second.dtype)
    if first.shape != second.shape or not torch.equal(first.to(wide), second.to(wide)):
        raise ValueError(f"tensor {copy!r} {list(second.shape)} differs from {source!r} "
                         f"{list(first.shape)}, but {why}: one weight, and this checkpoint holds "
                         f"two; remove {copy!r} to serve {source!r}, or fix config.json if the "
                         "weights are really separate")


def _head_block(weight: torch.Tensor, rows: torch.Tensor, out: torch.Tensor | None,
                scales: torch.Tensor | None, base: torch.Tensor | None = None,
                onednn_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`weight [v, D] @ rows [D, n]` into `out`, float32, times `scales [n]` if given;
    with `base [n]`, minus `base` (subtracted inside the product, rounded once);
    `onednn_rows` (`rows.T`, contiguous; `out` None): the product is oneDNN's, in a new
    tensor."""
    if onednn_rows is not None:
        products = onednn_linear(weight, onednn_rows)
    else:
        products = torch.mm(weight, rows, out=out) if base is None else \
            torch.addmm(base.neg(), weight, rows, out=out)
    logits = products.float()
    return logits if scales is None else logits.mul_(scales)


def _log2_sum_exp2(logits: torch.Tensor, shift: torch.Tensor, out: torch.Tensor) -> None:
    """`out [n] = log2(sum_v 2^(logits [v, n] - shift)) + shift`, overwriting `logits`."""
    torch.sum(logits.sub_(shift).exp2_(), dim=0, out=out)
    out.log2_().add_(shift)
