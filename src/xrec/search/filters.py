"""A batch's item filters on the device: which children each request may still choose.

Built once per batch from the requests' resolved filters (`catalog/filters.py`) and
moved to the device with the batch's inputs; `allowed` is then one masked lookup per
round, vectorised over requests, beams and children, with no host synchronisation.
Requests without a filter cost nothing: a batch without any has no `SearchFilter`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from xrec.catalog.filters import NUM_DEPTHS, ItemFilter


@dataclass(frozen=True, eq=False)
class SearchFilter:
    """Per trie depth (the round that chooses its nodes): each request's dead nodes,
    `dead[d] [B, D]` int64 sorted and padded with the depth's node count (no real node),
    None when no request has one there; and for type allow-lists, the nodes alive under
    each distinct list, `alive[d] [T, n_d]` bool (row 0: every node), with each request's
    row `type_rows [B]`, None when no request has a list."""

    dead: tuple[torch.Tensor | None, ...]
    alive: tuple[torch.Tensor, ...] | None
    type_rows: torch.Tensor | None

    @classmethod
    def of(cls, filters: Sequence[ItemFilter | None], sizes: tuple[int, int, int],
           pin_memory: bool = False) -> SearchFilter | None:
        """The batch's filter from its requests' (None: unfiltered request), or None when
        no request has one. `sizes`: the catalog trie's node count per depth."""
        if all(f is None for f in filters):
            return None
        dead = []
        for depth in range(NUM_DEPTHS):
            lists = [np.zeros(0, dtype=np.int64) if f is None else f.dead[depth] for f in filters]
            width = max(len(d) for d in lists)
            if width == 0:
                dead.append(None)
                continue
            padded = np.full((len(lists), width), sizes[depth], dtype=np.int64)   # [B, D]
            for row, nodes in enumerate(lists):
                padded[row, :len(nodes)] = nodes
            dead.append(_tensor(padded, pin_memory))
        sets = {id(f.type_set): f.type_set for f in filters if f is not None and f.type_set}
        if not sets:
            return cls(tuple(dead), None, None)
        order = list(sets)
        type_rows = np.array([0 if f is None or f.type_set is None else 1 + order.index(id(f.type_set))
                              for f in filters], dtype=np.int64)                  # [B]
        alive = tuple(_tensor(np.stack([np.ones(sizes[depth], dtype=bool)]
                                       + [sets[key].alive[depth] for key in order]), pin_memory)
                      for depth in range(NUM_DEPTHS))                             # [T + 1, n_d]
        return cls(tuple(dead), alive, _tensor(type_rows, pin_memory))

    def to(self, device: torch.device) -> SearchFilter:
        """On `device` (a non-blocking copy on the current stream from pinned memory)."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)
        return replace(self, dead=tuple(move(d) for d in self.dead),
                       alive=None if self.alive is None else tuple(move(a) for a in self.alive),
                       type_rows=move(self.type_rows))

    def allowed(self, depth: int, nodes: torch.Tensor) -> torch.Tensor | None:
        """Which of `nodes [B, ...]` (children at trie depth `depth + 1`, one row per
        request) the request's filter keeps: bool of the same shape, None for all."""
        keep = None
        dead = self.dead[depth]
        if dead is not None:
            flat = nodes.reshape(nodes.shape[0], -1).contiguous()                 # [B, M]
            position = torch.searchsorted(dead, flat).clamp(max=dead.shape[1] - 1)
            keep = (dead.gather(1, position) != flat).view(nodes.shape)
        if self.alive is not None:
            rows = self.type_rows.view(-1, *([1] * (nodes.dim() - 1)))            # [B, 1, ...]
            alive = self.alive[depth][rows, nodes]
            keep = alive if keep is None else keep & alive
        return keep


def _tensor(array: np.ndarray, pin_memory: bool) -> torch.Tensor:
    tensor = torch.from_numpy(array)
    return tensor.pin_memory() if pin_memory else tensor
