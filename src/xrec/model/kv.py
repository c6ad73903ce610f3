"""Shape contracts of the decoder's key/value state (xAttention layout).

Shared state is stored once per request; only the unshared K/V has a beam axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# a pipeline's reusable buffers (`Workspace.take`): (name, shape, dtype) -> an uninitialised view
Allocate = Callable[[str, tuple[int, ...], torch.dtype], torch.Tensor]


@dataclass(frozen=True)
class CrossKV:
    """Cross-attention K/V, computed once per request at round 0.

    `k`, `v`: per decoder layer `[B, kvH, L, Dh]` (encoder positions padded to the
    longest; strided views of the projections, not copied into one tensor);
    `key_mask`: `[B, 1, 1, L]` additive (0 / -inf) or None when no row is padded.
    """

    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]
    key_mask: torch.Tensor | None


@dataclass(frozen=True)
class PrefixKV:
    """Self-attention K/V of the prefix every beam of a request shares: the decoder prefix
    (BOS or context rows) of an encoder-decoder, or the whole prompt of a decoder-only model.

    `k`, `v`: `[layers, B, kvH, P, Dh]`; `lengths`: `[B]` int64 on the device;
    `is_ragged`: some request's prefix is shorter than P (host-known at batch build).
    """

    k: torch.Tensor
    v: torch.Tensor
    lengths: torch.Tensor
    is_ragged: bool


class BeamKV:
    """Per-beam K/V of generated tokens, ping-pong pair of `[layers, 2, B*W, R-1, kvH, Dh]`.

    Slot s holds the token generated in round s (input of round s+1). Reordering by
    parent gathers into the other buffer, so no ordering constraint on parents.
    """

    def __init__(self, num_layers: int, num_batch: int, num_beams: int, num_slots: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 allocate: Allocate | None = None):
        """`allocate(name, shape, dtype)` supplies the two buffers (a pipeline's reusable
        workspace); by default they are fresh tensors."""
        shape = (num_layers, 2, num_batch * num_beams, max(num_slots, 1), num_kv_heads, head_dim)
        if allocate is None:
            def allocate(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
                return torch.empty(shape, dtype=dtype, device=device)
        self.buffers = (allocate("beam_kv", shape, dtype), allocate("beam_kv_next", shape, dtype))
        self.current = 0  # pragma: no mutate
        self.num_batch, self.num_beams = num_batch, num_beams

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one layer, `[B, W, R-1, kvH, Dh]` views into the current buffer."""
        buf = self.buffers[self.current][index]
        shape = (self.num_batch, self.num_beams) + buf.shape[2:]
        return buf[0].view(shape), buf[1].view(shape)

    def reorder(self, flat_parents: torch.Tensor, num_written: int) -> None:
        """Beam j takes the history of beam `flat_parents[j]` (an index into B*W), for every
        layer, K and V, of the `num_written` slots written so far (the others are written
        before they are read)."""
        src, dst = self.buffers[self.current], self.buffers[1 - self.current]
        torch.index_select(src[:, :, :, :num_written], 2, flat_parents,
                           out=dst[:, :, :, :num_written])
        self.current = 1 - self.current
