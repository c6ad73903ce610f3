"""Host-side batch building: requests -> padded tensors (`StepBatch`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol, Sequence

import numpy as np
import torch

from xrec.model.inputs import ModelInputs
from xrec.search.filters import SearchFilter
from xrec.search.workspace import padded_len


class SearchRequest(Protocol):
    """What the search reads of a request (the engine's validated requests offer it):
    its input as arrays, and its search settings."""

    token_ids: np.ndarray | None          # [L] int64
    sparse_embedding: np.ndarray | None   # [L, D] float32
    context: np.ndarray | None            # [C, D] float32: decoder-context rows
    beam_width: int
    num_results: int
    normalize: str                        # "allowed" | "full"
    temperature: float
    prefix_len: int
    exclude_items: np.ndarray | None      # item filters (`search/filters.py`; None: none)
    item_types: tuple[str, ...] | None
    exclude_history: bool

    @property
    def input_len(self) -> int: ...


@dataclass(frozen=True)
class StepBatch:
    """One batch on the host: the model's inputs and each request's search settings."""

    inputs: ModelInputs
    beam_widths: list[int]
    num_results: list[int]
    full_rows: list[int]
    temperatures: list[float]
    filters: SearchFilter | None = None     # the requests' item filters (None: no request has one)

    @property
    def num_requests(self) -> int:
        return len(self.beam_widths)

    def to(self, device: torch.device) -> StepBatch:
        """The batch with its tensors (inputs, filter tables) on `device`; the settings stay
        on the host, where the step reads them."""
        return replace(self, inputs=self.inputs.to(device),
                       filters=None if self.filters is None else self.filters.to(device))


def prepare_batch(requests: Sequence[SearchRequest], d_model: int, pin_memory: bool = False,
                  filters: SearchFilter | None = None, pad_lengths: bool = False) -> StepBatch:
    """Pad a batch of requests into one `StepBatch` (pinned for a CUDA copy); `filters`:
    their item filters (`SearchFilter.of`). `pad_lengths`: pad the inputs to
    `padded_len` of the longest (fewer shapes for captured decode rounds)."""
    num_len = padded_len(max(r.input_len for r in requests), pad_lengths)
    token_ids = np.zeros((len(requests), num_len), dtype=np.int64)         # [B, L]
    embedding_rows = [i for i, r in enumerate(requests) if r.sparse_embedding is not None]
    embeddings = np.zeros((len(embedding_rows), num_len, d_model), dtype=np.float32) \
        if embedding_rows else None                                        # [Be, L, D]
    for i, r in enumerate(requests):
        if r.token_ids is not None:
            token_ids[i, :len(r.token_ids)] = r.token_ids
    for j, i in enumerate(embedding_rows):
        embeddings[j, :requests[i].input_len] = requests[i].sparse_embedding
    context_rows = [i for i, r in enumerate(requests) if r.context is not None]
    contexts = None
    if context_rows:
        num_prefix = max(requests[i].prefix_len for i in context_rows)
        contexts = np.zeros((len(context_rows), num_prefix, d_model), dtype=np.float32)  # [Bc, P, D]
        for j, i in enumerate(context_rows):
            contexts[j, :requests[i].prefix_len] = requests[i].context

    def tensor(array: np.ndarray | None) -> torch.Tensor | None:
        if array is None:
            return None
        t = torch.from_numpy(array)
        return t.pin_memory() if pin_memory else t

    inputs = ModelInputs(token_ids=tensor(token_ids), lengths=[r.input_len for r in requests],
                         embedding_rows=embedding_rows, embeddings=tensor(embeddings),
                         context_rows=context_rows, contexts=tensor(contexts),
                         prefix_lengths=[r.prefix_len for r in requests])
    return StepBatch(
        inputs=inputs,
        beam_widths=[r.beam_width for r in requests],
        num_results=[r.num_results for r in requests],
        full_rows=[i for i, r in enumerate(requests) if r.normalize == "full"],
        temperatures=[r.temperature for r in requests],
        filters=filters)
