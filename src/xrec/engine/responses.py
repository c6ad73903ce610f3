"""Step output (host arrays) -> `RecResponse`s, with item conversion through the catalog."""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from xrec.api_types import RecCandidate, RecItem, RecResponse, ValidRequest
from xrec.catalog import ItemCatalog
from xrec.search.step import StepOutput


def build_responses(output: StepOutput, requests: Sequence[ValidRequest], catalog: ItemCatalog | None,
                    each_threshold: int, total_threshold: int,
                    timings: Sequence[dict[str, float]]) -> list[RecResponse]:
    """One response per request: its finite-score results, best first, with items."""
    responses = []
    for b, request in enumerate(requests):
        num = request.num_results
        scores = output.scores[b, :num]                                   # [N]
        keep = int(np.isfinite(scores).sum())      # -inf sorts last: the first `keep` are real
        tokens = output.tokens[b, :keep]                                  # [n, R]
        logprobs = output.token_logprobs[b, :keep]
        item_rows: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * keep
        # only whole semantic IDs have items (free decoding may run another number of rounds)
        is_whole = catalog is not None and tokens.shape[1] == catalog.triples.shape[1]
        if is_whole and request.return_items and keep:
            item_rows = catalog.convert(tokens, each_threshold, total_threshold, seed=request.seed)
        token_lists, score_list, lp_lists = tokens.tolist(), scores[:keep].tolist(), logprobs.tolist()
        results = [RecCandidate(tuple(token_lists[i]), score_list[i], tuple(lp_lists[i]),
                                _items(catalog, item_rows[i]))
                   for i in range(keep)]
        responses.append(RecResponse(
            request_id=request.request_id, results=results,
            usage={"input_tokens": request.input_len, "beams": request.beam_width},
            timing=timings[b]))
    return responses


def _items(catalog: ItemCatalog | None, rows: np.ndarray) -> list[RecItem]:
    if catalog is None or not len(rows):
        return []
    ids = catalog.item_ids[rows].tolist()
    if not catalog.is_extended:
        return [RecItem(item_id) for item_id in ids]
    dids, types = catalog.dids, catalog.types
    return [RecItem(item_id, dids[row], types[row]) for item_id, row in zip(ids, rows.tolist())]


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3) if math.isfinite(seconds) else seconds
