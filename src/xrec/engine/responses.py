"""Step output (host arrays) -> `RecResponse`s, with item conversion through the catalog.

In two stages: `response_data` (on the pipeline) gathers each response as arrays and
flat lists, `ResponseData.to_response` makes the dataclass objects. An in-process
engine does both on the pipeline; a process-isolated one sends `ResponseData` across
(a few arrays pickle in microseconds; thousands of small objects do not) and makes
the objects on the caller's side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from xrec.api_types import RecCandidate, RecItem, RecResponse, ValidRequest
from xrec.catalog import ItemCatalog
from xrec.catalog.filters import ItemFilter
from xrec.search.step import StepOutput


@dataclass(frozen=True)
class ResponseData:
    """One response as arrays: n results (finite scores, best first), their items flat."""

    request_id: str
    tokens: np.ndarray                 # [n, R] int64
    scores: np.ndarray                 # [n] float32
    token_logprobs: np.ndarray         # [n, R] float32
    item_ids: np.ndarray               # [m] int64, the items of every result in order
    item_offsets: np.ndarray           # [n + 1]: result i's items are item_ids[a_i:a_i+1]
    dids: list | None                  # [m] (extended catalogs)
    types: list | None                 # [m]
    texts: list | None                 # [n] each result's tokens as text
    usage: dict[str, int]
    timing: dict[str, float]
    catalog_version: str | None = None  # the content hash of the catalog the batch ran on

    def to_response(self) -> RecResponse:
        keep = len(self.scores)
        token_lists, score_list = self.tokens.tolist(), self.scores.tolist()
        lp_lists = self.token_logprobs.tolist()
        ids = self.item_ids.tolist()
        if self.dids is not None:
            flat = [RecItem(i, did, t) for i, did, t in zip(ids, self.dids, self.types)]
        else:
            flat = [RecItem(i) for i in ids]
        bounds = self.item_offsets.tolist()
        texts = self.texts if self.texts is not None else [None] * keep
        results = [RecCandidate(tuple(token_lists[i]), score_list[i], tuple(lp_lists[i]),
                                flat[bounds[i]:bounds[i + 1]], texts[i]) for i in range(keep)]
        return RecResponse(self.request_id, results, self.usage, self.timing, self.catalog_version)


def response_data(output: StepOutput, requests: Sequence[ValidRequest], catalog: ItemCatalog | None,
                  each_threshold: int, total_threshold: int,
                  timings: Sequence[dict[str, float]],
                  token_text: Callable[[list[int]], str] | None = None,
                  catalog_version: str | None = None,
                  filters: Sequence[ItemFilter | None] | None = None) -> list[ResponseData]:
    """One `ResponseData` per request: its finite-score results, best first, with items (and
    each result's tokens as text when `token_text` is given). A request's filter keeps the
    items it removed out of `items`, and its usage counts the excluded ids the catalog
    does not hold."""
    out = []
    for b, request in enumerate(requests):
        item_filter = None if filters is None else filters[b]
        num = request.num_results
        scores = output.scores[b, :num]                                   # [N]
        keep = int(np.isfinite(scores).sum())      # -inf sorts last: the first `keep` are real
        tokens = output.tokens[b, :keep]                                  # [n, R]
        # only whole semantic IDs have items (free decoding may run another number of rounds)
        is_whole = catalog is not None and tokens.shape[1] == catalog.triples.shape[1]
        rows, offsets = np.zeros(0, dtype=np.int64), np.zeros(keep + 1, dtype=np.int64)
        if is_whole and request.return_items and keep:
            rows, offsets = catalog.convert_flat(
                tokens, each_threshold, total_threshold, seed=request.seed,
                keep_rows=None if item_filter is None else item_filter.allowed_rows)
        dids = types = None
        if catalog is not None and catalog.is_extended:
            row_list = rows.tolist()
            dids = [catalog.dids[row] for row in row_list]
            types = [catalog.types[row] for row in row_list]
        item_ids = catalog.item_ids[rows] if catalog is not None else rows
        texts = [token_text(t) for t in tokens.tolist()] if token_text is not None else None
        usage = {"input_tokens": request.input_len, "beams": request.beam_width}
        if item_filter is not None and request.exclude_items is not None:
            usage["excluded_items_unknown"] = item_filter.num_unknown
        out.append(ResponseData(request.request_id, tokens, scores[:keep],
                                output.token_logprobs[b, :keep], item_ids, offsets, dids, types,
                                texts, usage, timings[b], catalog_version))
    return out


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3) if math.isfinite(seconds) else seconds
