"""A pipeline's reusable device buffers (the part of its workspace that outlives a batch).

Grow-only, keyed by name: a batch takes views of the buffers; the next batch on
the same pipeline reuses them. The search keeps the beam K/V pair here (`beam_kv`,
`beam_kv_next`) and the model its prefix or prompt K/V (`prefix_kv`, `prompt_kv`), so a
batch no larger than an earlier one gets the same addresses (what a captured graph
replays against). One `Workspace` per pipeline, never shared, so
on CUDA every buffer is only ever used on that pipeline's stream (stream order
makes reuse safe without `record_stream`).
"""

from __future__ import annotations

import math

import torch


class Workspace:
    def __init__(self, device: torch.device):
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised `shape` view of buffer `name`, grown if it is too small."""
        numel = math.prod(shape)
        buffer = self._buffers.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[(name, dtype)] = buffer
        return buffer[:numel].view(shape)

    def buffers(self) -> tuple[torch.Tensor, ...]:
        """The buffers themselves (a captured graph holds them: it reads their addresses)."""
        return tuple(self._buffers.values())

    def addresses(self) -> dict[tuple[str, torch.dtype], int]:
        """Each buffer's address (`data_ptr`), by name and dtype."""
        return {key: buffer.data_ptr() for key, buffer in self._buffers.items()}

    @property
    def num_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
