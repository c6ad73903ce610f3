"""Step output (host arrays) -> `RecResponse`s, with item conversion through the catalog."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import numpy as np

from xrec.api_types import RecCandidate, RecItem, RecResponse, ValidRequest
from xrec.catalog import ItemCatalog
from xrec.search.step import StepOutput


def build_responses(output: StepOutput, requests: Sequence[ValidRequest], catalog: ItemCatalog | None,
                    each_threshold: int, total_threshold: int,
                    timings: Sequence[dict[str, float]],
                    token_text: Callable[[list[int]], str] | None = None) -> list[RecResponse]:
    """One response per request: its finite-score results, best first, with items (and
    each result's tokens as text when `token_text` is given)."""
    responses = []
    for b, request in enumerate(requests):
        num = request.num_results
        scores = output.scores[b, :num]                                   # [N]
        keep = int(np.isfinite(scores).sum())      # -inf sorts last: the first `keep` are real
        tokens = output.tokens[b, :keep]                                  # [n, R]
        # only whole semantic IDs have items (free decoding may run another number of rounds)
        is_whole = catalog is not None and tokens.shape[1] == catalog.triples.shape[1]
        items: list[list[RecItem]] = [[] for _ in range(keep)]
        if is_whole and request.return_items and keep:
            items = _items(catalog, *catalog.convert_flat(tokens, each_threshold, total_threshold,
                                                          seed=request.seed))
        token_lists = tokens.tolist()
        score_list, lp_lists = scores[:keep].tolist(), output.token_logprobs[b, :keep].tolist()
        texts = [token_text(t) for t in token_lists] if token_text is not None else [None] * keep
        results = [RecCandidate(tuple(token_lists[i]), score_list[i], tuple(lp_lists[i]), items[i],
                                texts[i]) for i in range(keep)]
        responses.append(RecResponse(
            request_id=request.request_id, results=results,
            usage={"input_tokens": request.input_len, "beams": request.beam_width},
            timing=timings[b]))
    return responses


def _items(catalog: ItemCatalog, rows: np.ndarray, offsets: np.ndarray) -> list[list[RecItem]]:
    """Per triple its items, from `convert_flat`'s rows and offsets (one gather for all)."""
    ids = catalog.item_ids[rows].tolist()
    if catalog.is_extended:
        dids, types = catalog.dids, catalog.types
        flat = [RecItem(item_id, dids[row], types[row]) for item_id, row in zip(ids, rows.tolist())]
    else:
        flat = [RecItem(item_id) for item_id in ids]
    bounds = offsets.tolist()
    return [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3) if math.isfinite(seconds) else seconds
