"""What round 0 of a batch reads: the model inputs of its requests, padded, on the host.

Built by `search/batch.py` from validated requests; a model family's `prefill`
uploads it to the device. Torch tensors, no requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class ModelInputs:
    """One batch's inputs, padded on the right to its longest request.

    `token_ids [B, L]` int64 (zeros past each length, and for requests that give
    embeddings); `lengths`: real positions per request. Encoder-decoder only:
    `embeddings [len(embedding_rows), L, D]` replace the embedded ids of
    `embedding_rows`; `contexts [len(context_rows), P, D]` replace BOS as the
    decoder prefix of `context_rows`; `prefix_lengths`: decoder-prefix rows per
    request (1 for BOS). Pinned when the batch goes to a GPU.
    """

    token_ids: torch.Tensor
    lengths: list[int]
    embedding_rows: list[int]
    embeddings: torch.Tensor | None
    context_rows: list[int]
    contexts: torch.Tensor | None
    prefix_lengths: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.lengths)

    def to(self, device: torch.device) -> ModelInputs:
        """The same inputs with their tensors on `device` (a non-blocking copy from pinned
        memory); the host-side lists stay."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=True)
        return replace(self, token_ids=move(self.token_ids), embeddings=move(self.embeddings),
                       contexts=move(self.contexts))

    @property
    def is_ragged(self) -> bool:
        """Some request is shorter than the padded length (a batch may be padded beyond its
        longest request: `prepare_batch(pad_lengths=True)`)."""
        return min(self.lengths) != self.token_ids.shape[1]
