"""Interaction histories as itemic-token sequences: the one prompt format that training,
validation, `xrec eval` and a client of the served model share, and the training batches of
both families.

Prompt format: `<|endoftext|>` then the semantic-ID tokens of the user's last `max_items`
items, oldest first (3 tokens per item, no separators). The model's answer is the next
item's 3 tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from xrec.catalog import ItemCatalog
from xrec.realdata.data import DataError
from xrec.catalog.sid_vocab import SidLayout

__all__ = ["IGNORE", "SID_FILES", "SidVocabulary", "causal_windows", "collate", "prompts",
           "seq2seq_windows"]

# what `xrec sid build` writes (sid/build.py, write_sid_dir): all a trained model directory
# takes from a sid directory, which may itself be a model directory, with weights of its own
SID_FILES = ("tokenizer.json", "tokenizer_config.json", "items.bin", "items.txt", "sids.tsv",
             "sid_report.json")
IGNORE = -100              # label of a position without a loss (torch's cross_entropy default)
BOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True, eq=False)
class SidVocabulary:
    """The semantic IDs of `xrec sid build`: the token layout and each item's 3 token ids."""

    directory: Path
    layout: SidLayout
    item_tokens: np.ndarray        # int64 [num_items, 3], row = item index

    @classmethod
    def read(cls, sid_dir: str | Path, item_ids: Sequence[str]) -> SidVocabulary:
        """Reads `sid_report.json` and the catalog of a sid directory (or of a model directory
        of `xrec train`, which holds the same files). `item_ids`: the data's item ids by item
        index (`Interactions.item_ids`); the catalog must give item index i the id
        `item_ids[i]` as its did, since item indices follow the data file's row order."""
        sid_dir = Path(sid_dir)
        report_path = sid_dir / "sid_report.json"
        if not report_path.is_file():
            raise DataError(f"{sid_dir} is not a semantic-ID directory (no sid_report.json): "
                            f"run `xrec sid build` first")
        layout = _read_layout(report_path)
        catalog = ItemCatalog.from_model_dir(sid_dir, layout.vocab_size)
        if catalog is None:
            raise DataError(f"{sid_dir}: no tokenizer_config.json naming its catalog "
                            f"(\"item_catalog\"): an incomplete semantic-ID directory; run "
                            f"`xrec sid build` again")
        rows = _check_items(sid_dir, catalog, item_ids)
        item_tokens = catalog.triples[rows].astype(np.int64)  # [n, 3]
        _check_tokens(sid_dir, layout, item_tokens)
        return cls(sid_dir, layout, item_tokens)

    @property
    def bos_id(self) -> int:
        return self.layout.first_special_id   # <|endoftext|>, Qwen3's first special token

    @property
    def vocab_size(self) -> int:
        return self.layout.vocab_size


def _read_layout(report_path: Path) -> SidLayout:
    """The token layout `sid_report.json` records; DataError naming the file when it is
    not one that `xrec sid build` wrote (torn, edited, or another program's)."""
    try:
        report = json.loads(report_path.read_text())
        return SidLayout(num_base_tokens=report["num_base_tokens"],
                         codebook_size=report["codebook_size"])
    except (ValueError, KeyError, TypeError) as e:   # bad JSON, a missing key, not an object
        said = f"no key {e}" if isinstance(e, KeyError) else str(e)
        raise DataError(f"{report_path}: not a report of `xrec sid build` ({said}); run it "
                        f"again") from None


def _check_items(sid_dir: Path, catalog: ItemCatalog, item_ids: Sequence[str]) -> np.ndarray:
    """The catalog rows of item indices 0 .. len(item_ids) - 1, after checking that the
    catalog was built from this data: the same item count, and item index i's did is
    `item_ids[i]` (the same file with its rows in another order numbers the items otherwise,
    and every item would silently get another item's semantic ID)."""
    num_items = len(item_ids)
    ids = catalog.item_ids
    if len(ids) != num_items:
        raise DataError(f"{sid_dir}: its catalog has {len(ids)} items, the data has "
                        f"{num_items}: the IDs were built from other data")
    missing = np.setdiff1d(np.arange(num_items), ids)
    if missing.size:   # as many items, but not item indices 0 .. n - 1 (another catalog)
        raise DataError(f"{sid_dir}: its catalog's item ids are not the item indices 0 .. "
                        f"{num_items - 1} that `xrec sid build` writes (item index "
                        f"{int(missing[0])} is missing, {missing.size} in all): not a catalog "
                        f"of `xrec sid build`; run it again")
    if catalog.dids is None:
        raise DataError(f"{sid_dir}: its catalog has no item ids (not an extended catalog) to "
                        f"check against the data's; rebuild it with `xrec sid build`")
    rows = np.argsort(ids)                                             # [n] item index -> row
    dids = np.array(catalog.dids, dtype=object)[rows]                 # [n]
    wrong = np.flatnonzero(dids != np.array(item_ids, dtype=object))
    if wrong.size:
        index = int(wrong[0])
        raise DataError(f"{sid_dir}: item index {index} is {dids[index]!r} in its catalog but "
                        f"{item_ids[index]!r} in the data ({wrong.size} of {num_items} items "
                        f"differ): the IDs were built from other data, or from this data with "
                        f"its rows in another order (item indices follow the order of first "
                        f"appearance); run `xrec sid build` on this data")
    return rows


def _check_tokens(sid_dir: Path, layout: SidLayout, item_tokens: np.ndarray) -> None:
    """Every item's level-l token is one of the level-l itemic tokens of the layout that
    `sid_report.json` records: a report whose codebook size or base vocabulary is not the
    catalog's (edited, or beside another build's catalog) numbered BOS and the vocabulary
    otherwise than the catalog, and training went on without a word."""
    starts = np.array([layout.level_start(level) for level in range(layout.num_levels)])  # [3]
    codes = item_tokens - starts  # [n, 3]
    bad = np.argwhere((codes < 0) | (codes >= layout.codebook_size))  # [m, 2]
    if bad.size:
        index, level = (int(v) for v in bad[0])
        start = int(starts[level])
        raise DataError(f"{sid_dir}: item index {index} has token t{level} = "
                        f"{int(item_tokens[index, level])} in its catalog, outside level "
                        f"{level}'s itemic tokens [{start}, {start + layout.codebook_size}) "
                        f"of sid_report.json's layout ({layout.num_base_tokens} base tokens, "
                        f"{layout.codebook_size} codes a level; {len(np.unique(bad[:, 0]))} "
                        f"items are outside): the catalog and sid_report.json are not from "
                        f"one build; run `xrec sid build` again")


def prompts(vocab: SidVocabulary, histories, max_items: int) -> list[list[int]]:
    """The prompt token ids of each history (item indices, time order): BOS, then the tokens
    of its last `max_items` items."""
    return [[vocab.bos_id, *vocab.item_tokens[h[-max_items:]].ravel().tolist()]
            for h in histories]


def causal_windows(vocab: SidVocabulary, train, max_items: int,
                   rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Decoder-only training sequences: each user's training items cut into windows of at
    most `max_items` items aligned to the end (the last window ends at the user's last
    training item, as the prompts of validation and test do), each window BOS + its items'
    tokens. Every token after BOS is a target: one pass trains every position. `rng`: the
    windows before the last shift by a random number of items (`_window_ends`)."""
    out = []
    for items in train:
        for end in _window_ends(len(items), max_items, 0, rng):
            window = items[max(0, end - max_items):end]
            out.append(np.concatenate(([vocab.bos_id], vocab.item_tokens[window].ravel())))
    return out


def seq2seq_windows(vocab: SidVocabulary, train, max_items: int,
                    rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Encoder-decoder training sequences: each user's training items cut into windows of at
    most `max_items + 1` items aligned to the end, consecutive windows sharing one item, each
    window BOS + its items' tokens. Item k >= 1 of a window is a target whose prompt is BOS
    + the window's items before it (at most `max_items`, as at serving): every training item
    but a user's first is a target once per epoch, all of a window in one pass
    (`xrec.realdata.train.models.seq2seq_inputs`). `rng`: as in `causal_windows`."""
    out = []
    for items in train:
        for end in _window_ends(len(items), max_items, 1, rng):
            window = items[max(0, end - max_items - 1):end]
            out.append(np.concatenate(([vocab.bos_id], vocab.item_tokens[window].ravel())))
    return out


def _window_ends(length: int, stride: int, stop: int,
                 rng: np.random.Generator | None) -> list[int]:
    """Where a sequence's windows end: every `stride` items back from its end while above
    `stop`. With `rng`, the window ending at the last item stays and the others end a random
    0 .. stride - 1 items earlier (one draw per sequence), so across epochs an item is trained
    after contexts of every length, not always the same one; the last window's items that a
    shifted window covers too are trained twice."""
    shift = int(rng.integers(stride)) if rng is not None else 0
    if not shift or length <= stop:
        return list(range(length, stop, -stride))
    return [length, *range(length - shift, stop, -stride)]


def collate(sequences: list[np.ndarray], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded int64 `[B, T]` ids and the attention mask (1 = real token)."""
    width = max(len(s) for s in sequences)
    ids = np.full((len(sequences), width), pad_id, dtype=np.int64)
    mask = np.zeros((len(sequences), width), dtype=np.int64)
    for row, s in enumerate(sequences):
        ids[row, :len(s)] = s
        mask[row, :len(s)] = 1
    return ids, mask
