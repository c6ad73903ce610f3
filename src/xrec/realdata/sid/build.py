"""Semantic IDs from embeddings (3-level residual k-means + the collision rule) and the
directory `xrec sid build` writes.

Collision rule (`collisions`):

- "reassign" (default, unique IDs): levels 1 and 2 keep their k-means codes; inside each
  (c1, c2) group the items get distinct third codes by an optimal assignment of the items to
  the K third-level centroids, minimising the total squared distance from each item's level-3
  residual to its centroid (scipy's linear_sum_assignment; TIGER's extra disambiguation token
  folded into the last level). An item alone in its group keeps its k-means code (its
  nearest centroid; with `balanced`, its capped assignment, and the assignment of a larger
  group ignores the cap). A group larger than K cannot be made unique: `DataError`.
- "share": the raw k-means codes are kept and several items may share one ID (OpenOneRec);
  the catalog lists every item of a triple.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xrec.catalog import ItemCatalog
from xrec.catalog.formats import MAX_VOCAB_SIZE, NUM_LEVELS, write_text
from xrec.realdata.data.interactions import DataError, Interactions, Split
from xrec.realdata.sequences import SID_FILES
from xrec.utils.files import atomic_directory
from xrec.realdata.sid.kmeans import residual_kmeans
from xrec.catalog.sid_vocab import SidLayout, write_sid_tokenizer

__all__ = ["COLLISION_RULES", "DEFAULT_CODEBOOK_SIZE", "SID_BASE_TOKENS", "SidResult",
           "build_sid_dir", "build_sids", "sid_layout", "write_sid_dir"]

COLLISION_RULES = ("reassign", "share")
DEFAULT_CODEBOOK_SIZE = 128  # docs/decisions.md, "Codebook size"
SID_BASE_TOKENS = 256  # the smallest legal regular vocabulary: the trained models use this one
MAX_BALANCED_ITEMS = 20_000  # --balanced: kmeans._balance's [n, ~n] float64 cost, 3.2 GB here
MAX_SEED = 2 ** 32 - NUM_LEVELS  # level l's k-means is seeded seed + l, and takes < 2**32
CATALOG_FILE, TEXT_CATALOG_FILE = "items.bin", "items.txt"


@dataclass(frozen=True, eq=False)
class SidResult:
    """codes: int32 [n, 3], item i's semantic ID after the collision rule; raw_codes: int32
    [n, 3], the k-means codes before it. `report()` has the statistics."""

    codes: np.ndarray
    raw_codes: np.ndarray
    codebook_size: int
    collisions: str
    seed: int

    def report(self) -> dict:
        """Collision rate before the rule (share of items whose raw triple another item also
        has), IDs and items per ID after it, distinct codes used per level."""
        _, raw_counts = np.unique(self.raw_codes, axis=0, return_counts=True)
        _, counts = np.unique(self.codes, axis=0, return_counts=True)
        num_items = len(self.codes)
        return {
            "num_items": num_items,
            "codebook_size": self.codebook_size,
            "collisions": self.collisions,
            "seed": self.seed,
            "raw_collision_rate": float(raw_counts[raw_counts > 1].sum() / max(num_items, 1)),
            "raw_num_ids": int(len(raw_counts)),
            "num_ids": int(len(counts)),
            "max_items_per_id": int(counts.max(initial=0)),
            "num_reassigned": int((self.codes != self.raw_codes).any(axis=1).sum()),
            "codebook_usage": [int(len(np.unique(self.codes[:, level])))
                               for level in range(NUM_LEVELS)],
        }


def sid_layout(codebook_size: int) -> SidLayout:
    """The vocabulary of IDs with `codebook_size` codes per level; ValueError naming
    codebook_size when that vocabulary is over what a catalog can hold."""
    layout = SidLayout(num_base_tokens=SID_BASE_TOKENS, codebook_size=codebook_size)
    if layout.vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(f"codebook_size: got {codebook_size}, whose vocabulary of "
                         f"{layout.vocab_size} ids is over a catalog's {MAX_VOCAB_SIZE}")
    return layout


def _reassign_last_level(codes: np.ndarray, residual: np.ndarray, centroids: np.ndarray,
                         codebook_size: int) -> np.ndarray:
    """Distinct third codes inside every (c1, c2) group (module docstring)."""
    from scipy.optimize import linear_sum_assignment
    from threadpoolctl import threadpool_limits

    prefixes = codes[:, 0].astype(np.int64) * codebook_size + codes[:, 1]  # [n]
    order = np.argsort(prefixes, kind="stable")  # [n]
    starts = np.flatnonzero(np.diff(prefixes[order], prepend=-1))  # [G]
    sizes = np.diff(np.append(starts, len(order)))  # [G]
    if sizes.max() > codebook_size:
        big = int(np.argmax(sizes))
        members = order[starts[big]:starts[big] + sizes[big]]  # [sizes[big]]
        c1, c2 = codes[members[0], :2]
        _, counts = np.unique(residual[members], axis=0, return_counts=True)
        shared = int(counts[counts > 1].sum())
        same = (f" ({shared} of them share their embedding with another: identical "
                f"embeddings, as items no user trained on have, always share their codes)"
                if shared else "")
        raise DataError(f"collisions='reassign': {sizes[big]} items share the first two codes "
                        f"({c1}, {c2}){same} but a level has only {codebook_size} codes, so "
                        f"their IDs cannot all differ; use a bigger codebook size (at least "
                        f"{sizes[big]}) or collisions='share'")
    # codes past the fitted centroids (a level with fewer distinct points than K) cost more
    # than any real one, so they are used only when a group runs out of real centroids
    out = codes.copy()
    centroids = centroids.astype(np.float64)  # [k, d]
    centroid_norms = (centroids ** 2).sum(1)  # [k]
    with threadpool_limits(limits=1, user_api="blas"):  # kmeans.ONE_BLAS_THREAD
        for start, size in zip(starts[sizes > 1], sizes[sizes > 1]):
            rows = order[start:start + size]  # [g]
            points = residual[rows].astype(np.float64)  # [g, d]
            cost = np.empty((size, codebook_size))  # [g, K] squared distances
            cost[:, :len(centroids)] = ((points ** 2).sum(1)[:, None]
                                        - 2 * points @ centroids.T + centroid_norms)
            cost[:, len(centroids):] = cost[:, :len(centroids)].max() + 1.0
            _, columns = linear_sum_assignment(cost)
            out[rows, 2] = columns
    return out


def build_sids(embeddings: np.ndarray, codebook_size: int = DEFAULT_CODEBOOK_SIZE,
               collisions: str = "reassign", seed: int = 0, balanced: bool = False) -> SidResult:
    """3-level semantic IDs of `embeddings` [num_items, d] (row i: item index i);
    `balanced`: balanced residual k-means (`kmeans.py`)."""
    if collisions not in COLLISION_RULES:
        raise ValueError(f"collisions: got {collisions!r}, allowed: {', '.join(COLLISION_RULES)}")
    quantized = residual_kmeans(embeddings, NUM_LEVELS, codebook_size, seed, balanced)
    raw = quantized.codes  # [n, 3]
    codes = raw
    if collisions == "reassign":
        codes = _reassign_last_level(raw, quantized.residuals[2], quantized.centroids[2],
                                     codebook_size)
    return SidResult(codes.astype(np.int32), raw.astype(np.int32), codebook_size, collisions,
                     seed)


def _cell(text: str) -> str:
    return " ".join(text.split())  # one line, no tabs


def check_out_dir(out_dir: Path, replace: bool) -> None:
    """An existing `out_dir` is an error unless `replace`, which takes the place of a
    semantic-ID directory only (its files and nothing else): `--force` given the run directory
    or a trained model's deleted the cached SASRec or the model with it."""
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not replace:
        raise DataError(f"{out_dir} exists: choose another directory or replace it (--force)")
    if not out_dir.is_dir() or out_dir.is_symlink():
        held = "it is not a directory"
    else:
        others = sorted(p.name for p in out_dir.iterdir() if p.name not in SID_FILES)
        if not others and (out_dir / "sid_report.json").is_file():
            return
        held = (f"it holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''}"
                if others else "it has no sid_report.json")
    raise DataError(f"{out_dir}: --force replaces a semantic-ID directory of `xrec sid build` "
                    f"only, and {held}; choose another --out")


def write_sid_dir(out_dir: str | os.PathLike, data: Interactions, result: SidResult,
                  layout: SidLayout | None = None, *, replace: bool = False,
                  info: dict | None = None) -> Path:
    """Writes the semantic-ID directory, whole or not at all (`atomic_directory`):

    - tokenizer.json, tokenizer_config.json: `layout`'s vocabulary (default
      `sid_layout(result.codebook_size)`); the config names the catalog (`"item_catalog":
      "items.bin"`, `"extended_item_info": true`);
    - items.bin: extended binary catalog, item_id = item index, did = the item's id in the
      data file, type = ""; items.txt: its text form (`item_id,t0,t1,t2`);
    - sids.tsv: item index, item id, title, c1, c2, c3 (codes, not token ids);
    - sid_report.json: `result.report()` and `info` (parameters, embedding source, times).

    The written catalog is read back and checked before the directory appears. An existing
    `out_dir` is an error unless `replace`.
    """
    layout = sid_layout(result.codebook_size) if layout is None else layout
    if layout.codebook_size != result.codebook_size or layout.num_levels != NUM_LEVELS:
        raise ValueError(f"layout: {layout.num_levels} levels of {layout.codebook_size} codes, "
                         f"the IDs have {NUM_LEVELS} of {result.codebook_size}")
    if len(result.codes) != data.num_items:
        raise ValueError(f"result: IDs for {len(result.codes)} items, the data has "
                         f"{data.num_items}")
    out_dir = Path(out_dir)
    check_out_dir(out_dir, replace)
    starts = np.array([layout.level_start(level) for level in range(NUM_LEVELS)])  # [3]
    triples = (result.codes + starts).astype(np.int32)  # [n, 3] token ids
    item_indices = np.arange(data.num_items, dtype=np.int64)  # [n]
    catalog = ItemCatalog.from_arrays(item_indices, triples, layout.vocab_size,
                                      dids=list(data.item_ids), types=[""] * data.num_items)
    titles = data.item_titles or ("",) * data.num_items
    report = {**(info or {}), **result.report(), "vocab_size": layout.vocab_size,
              "num_base_tokens": layout.num_base_tokens,
              "files": {"catalog": CATALOG_FILE, "text_catalog": TEXT_CATALOG_FILE,
                        "sids": "sids.tsv"}}
    with atomic_directory(out_dir, replace=replace) as tmp:
        catalog.write(tmp / CATALOG_FILE)
        write_text(tmp / TEXT_CATALOG_FILE, item_indices, triples)
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"item_catalog": CATALOG_FILE, "extended_item_info": True}) + "\n", encoding="utf-8")
        write_sid_tokenizer(tmp, layout)  # keeps the catalog keys
        lines = ["item_index\titem_id\ttitle\tc1\tc2\tc3"]
        lines += [f"{i}\t{_cell(item_id)}\t{_cell(title)}\t{c1}\t{c2}\t{c3}"
                 for i, (item_id, title, (c1, c2, c3))
                 in enumerate(zip(data.item_ids, titles, result.codes.tolist()))]
        (tmp / "sids.tsv").write_text("\n".join(lines) + "\n", encoding="utf-8")
        (tmp / "sid_report.json").write_text(json.dumps(report, indent=2) + "\n",
                                             encoding="utf-8")
        loaded = ItemCatalog.from_model_dir(tmp, layout.vocab_size)
        rows = None if loaded is None else loaded.find_rows(item_indices)  # [n]
        if (rows is None or len(loaded) != data.num_items or (rows < 0).any()
                or not np.array_equal(loaded.triples[rows], triples)):
            raise RuntimeError(f"{out_dir}: the written catalog does not read back as written")
    return out_dir


def build_sid_dir(split: Split, out_dir: str | os.PathLike, *, embeddings: str = "sasrec",
                  dim: int = 64, codebook_size: int = DEFAULT_CODEBOOK_SIZE,
                  collisions: str = "reassign", seed: int = 0, replace: bool = False,
                  progress: bool = False, sasrec_cache: str | os.PathLike | None = None,
                  balanced: bool = False) -> dict:
    """Embeddings → IDs → `write_sid_dir`, for `split` (SASRec and SVD use its training part).
    `embeddings`: "sasrec" (the item table of a SASRec trained on the training part; the
    default, docs/decisions.md "Semantic IDs from SASRec's item table"), "svd", "text" (item
    titles, all-MiniLM-L6-v2) or a `.npy` path. `progress`: SASRec's epochs on stderr;
    `sasrec_cache`: where the SASRec is kept for `xrec eval`, or found (`sasrec_cache.py`);
    `balanced`: balanced residual k-means. Returns the report written to sid_report.json."""
    from xrec.realdata.sid import embeddings as embed

    data = split.data
    started = time.perf_counter()
    check_out_dir(Path(out_dir), replace)   # these are refused before the embeddings train
    sid_layout(codebook_size)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed: got {seed!r}, expected an integer in [0, {MAX_SEED}]")
    if embeddings == "svd":
        embed.check_dim(dim)
    if balanced and data.num_items > MAX_BALANCED_ITEMS:
        raise ValueError(f"balanced: {data.num_items} items, over the {MAX_BALANCED_ITEMS} its "
                         f"optimal assignment can hold in memory (an items x items matrix)")
    if collisions not in COLLISION_RULES:
        raise ValueError(f"collisions: got {collisions!r}, allowed: {', '.join(COLLISION_RULES)}")
    if embeddings == "svd":
        vectors = embed.interaction_embeddings(split, dim=dim, seed=seed)
        source = {"embeddings": "svd", "dim": dim, "embedding_input": "training interactions"}
    elif embeddings == "sasrec":
        vectors = embed.sasrec_embeddings(split, seed=seed, progress=progress,
                                          cache=sasrec_cache)
        source = {"embeddings": "sasrec", "dim": int(vectors.shape[1]),
                  "embedding_input": "training interactions"}
    elif embeddings == "text":
        if data.item_titles is None:
            raise DataError(f"embeddings='text': dataset {data.name!r} has no item titles; use "
                            f"'svd' or a .npy file")
        vectors = embed.text_embeddings(list(data.item_titles))
        source = {"embeddings": "text", "dim": int(vectors.shape[1]),
                  "text_model": embed.TEXT_MODEL}
    else:
        if not Path(embeddings).exists() and Path(embeddings).suffix.lower() != ".npy":
            # a mistyped method ("SVD") read as a missing file named neither
            raise DataError(f"embeddings: got {embeddings!r}, expected svd, sasrec, text or "
                            f"the path of a .npy file")
        vectors = embed.load_embeddings(embeddings, data.num_items)
        source = {"embeddings": "file", "dim": int(vectors.shape[1]),
                  "embeddings_file": str(Path(embeddings).resolve())}
    embedded = time.perf_counter()
    result = build_sids(vectors, codebook_size=codebook_size, collisions=collisions, seed=seed,
                        balanced=balanced)
    quantized = time.perf_counter()
    info = {"dataset": data.name, **source, "balanced": balanced,
            "embedding_s": round(embedded - started, 3), "kmeans_s": round(quantized - embedded, 3)}
    write_sid_dir(out_dir, data, result, replace=replace, info=info)
    report = json.loads((Path(out_dir) / "sid_report.json").read_text(encoding="utf-8"))
    report["total_s"] = round(time.perf_counter() - started, 3)
    return report
