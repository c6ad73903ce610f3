"""Rankings of a generative model through the normal `Engine` API: one constrained
beam-search request per user, its candidates' items in score order.

A user's seen items (`Split.history(stage)`, item indices = the catalog's item ids) can be
left out two ways: `exclude_seen` drops them from the answer after the search (the beam may
have been spent on them), `exclude_seen_in_search` sends them as the request's
`exclude_items`, so the search answers as over a catalog without them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from xrec.api_types import RecRequest
from xrec.realdata.data import DataError, Split
from xrec.realdata.sequences import SidVocabulary, prompts

__all__ = ["GenerativeRanker", "ranked_items", "PROMPT_FILE"]

PROMPT_FILE = "xrec_prompt.json"   # in a trained model's directory: how its prompts are made


@dataclass
class GenerativeRanker:
    """An engine over a trained model directory, and that model's prompt format."""

    engine: object
    vocab: SidVocabulary
    max_items: int

    @classmethod
    def open(cls, model_dir: str | Path, item_ids: Sequence[str],
             **engine_options) -> GenerativeRanker:
        """The model of `xrec train` in `model_dir`, for data whose item ids by item index
        are `item_ids` (`Interactions.item_ids`; checked against the model's catalog)."""
        from xrec import Engine

        model_dir = Path(model_dir)
        spec_path = model_dir / PROMPT_FILE
        if not spec_path.is_file():
            raise DataError(f"{model_dir} has no {PROMPT_FILE}: not a model of `xrec train`")
        max_items = _prompt_items(spec_path)
        vocab = SidVocabulary.read(model_dir, item_ids)
        return cls(Engine.from_pretrained(model_dir, isolation="thread",
                                          **engine_options), vocab, max_items)

    def close(self) -> None:
        self.engine.close()

    def rank(self, split: Split, stage: str, k: int, beam_width: int, normalize: str = "full",
             exclude_seen: bool = False, users: np.ndarray | None = None,
             chunk: int = 256, bar=None, exclude_seen_in_search: bool = False) -> np.ndarray:
        """int64 `[len(users), k]` item indices, best first, -1 where fewer than k items
        came back; `users` default: every user with a target at `stage`. `exclude_seen`:
        the user's history removed from the answer; `exclude_seen_in_search`: excluded
        inside the search (`RecRequest.exclude_items`)."""
        histories = split.history(stage)
        if users is None:
            users = np.flatnonzero(split.targets(stage) >= 0)
        out = np.full((len(users), k), -1, dtype=np.int64)
        for start in range(0, len(users), chunk):
            part = users[start:start + chunk]
            seen = [histories[u] for u in part]
            requests = [RecRequest(token_ids=p, beam_width=beam_width,
                                   num_return_sequences=beam_width, normalize=normalize,
                                   exclude_items=history if exclude_seen_in_search else None)
                        for p, history in zip(prompts(self.vocab, seen, self.max_items), seen)]
            for row, (history, response) in enumerate(zip(seen, self.engine.recommend(requests))):
                out[start + row] = ranked_items(response, k, history if exclude_seen else ())
            if bar is not None:
                bar.update(len(part))
        return out


def _prompt_items(spec_path: Path) -> int:
    """`max_items` of a model's prompt file: an integer >= 1 (a hand-written file without it
    failed with a bare KeyError, a string or 0 deep in the prompts or as every item)."""
    try:
        spec = json.loads(spec_path.read_text())
    except ValueError as e:
        raise DataError(f"{spec_path}: not JSON ({e})") from None
    max_items = spec.get("max_items") if isinstance(spec, dict) else None
    if not isinstance(max_items, int) or isinstance(max_items, bool) or max_items < 1:
        raise DataError(f"{spec_path}: max_items: got {max_items!r}, expected an integer >= 1 "
                        f"(the history items in a prompt)")
    return max_items


def ranked_items(response, k: int, seen=()) -> np.ndarray:
    """The first k distinct items of a response's candidates (best first; the items of one
    semantic ID in catalog order), without `seen`; padded with -1."""
    ranked, taken = [], set(int(i) for i in seen)
    for candidate in response.results:
        for item in candidate.items:
            if item.item_id not in taken:
                taken.add(item.item_id)
                ranked.append(item.item_id)
    ranked = ranked[:k]
    return np.array(ranked + [-1] * (k - len(ranked)), dtype=np.int64)
