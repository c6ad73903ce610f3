"""Non-neural baselines ranked on a leave-one-out split: most-popular and item-kNN.

Both are fitted on the training part only, for either stage: the validation item is never
counted, so "valid" and "test" rank with the same model. What changes with the stage is the
history a user is scored from (and, with `exclude_seen`, what is removed): the training
items for "valid", the training items and the validation item for "test"
(`Split.history`). Ties are broken by the lower item index, among scores equal as floats:
item-kNN's cosines and their sums can differ in the last bit where they are equal as real
numbers (1 / (√2·√2) is not 1 / (√1·√4)), so another implementation may order such items
otherwise."""

from __future__ import annotations

from functools import partial
from typing import Callable, Sequence

import numpy as np
import scipy.sparse as sp

from xrec.realdata.data.interactions import Split

__all__ = ["BASELINES", "item_similarity", "rank_baseline", "top_k"]

BASELINES = ("most-popular", "item-knn")
MAX_BATCH_SCORES = 1 << 22      # scores held at once: [users per batch, num_items]
MAX_DENSE_SIMILARITY = 1 << 27  # item-item similarities held dense (1 GiB), else sparse


def rank_baseline(name: str, split: Split, stage: str, k: int,
                  exclude_seen: bool = False) -> np.ndarray:
    """int32 [num_users, k]: each user's k best items for `stage` ("valid" or "test"), best
    first, -1 where fewer than k items are left. Users without a target are ranked too.

    most-popular: the number of training interactions of the item. item-knn: the sum of the
    cosine similarities (over the training users, every neighbour kept, an item not its own
    neighbour) between the item and the items of the user's history."""
    if name not in BASELINES:
        raise ValueError(f"baseline: got {name!r}, allowed: {', '.join(BASELINES)}")
    if k < 1:
        raise ValueError(f"k: got {k}, expected >= 1")
    num_items = split.data.num_items
    history = _user_item_matrix(split.history(stage), num_items)               # [U, I]
    score: Callable[[sp.csr_matrix], np.ndarray]
    if name == "most-popular":
        popularity = np.bincount(np.concatenate(split.train + (np.zeros(0, np.int32),)),
                                 minlength=num_items).astype(np.float64)      # [I]
        score = partial(_popularity_scores, popularity)
    else:
        similarity = item_similarity(_user_item_matrix(split.train, num_items))
        if num_items ** 2 <= MAX_DENSE_SIMILARITY:
            similarity = similarity.toarray()     # sparse @ dense beats @ sparse (docs/decisions.md, Real data)
        score = partial(_knn_scores, similarity)
    return _rank(history, score, k, exclude_seen)


def item_similarity(user_items: sp.csr_matrix) -> sp.csr_matrix:
    """float64 [I, I]: cosine similarity of the items' user sets (`user_items` [U, I], 0/1),
    with a zero diagonal."""
    similarity = (user_items.T.tocsr() @ user_items).tocsr()                # [I, I] counts
    norms = np.sqrt(similarity.diagonal())
    rows = np.repeat(np.arange(similarity.shape[0]), np.diff(similarity.indptr))
    similarity.data /= norms[rows] * norms[similarity.indices]
    similarity.data[rows == similarity.indices] = 0.0
    similarity.eliminate_zeros()
    return similarity


def top_k(scores: np.ndarray, k: int) -> np.ndarray:
    """int64 [B, k] with k <= I: per row of `scores` [B, I], the indices of the k highest
    scores, highest first, equal scores by lower index (exact, without a full sort)."""
    num_rows, num_items = scores.shape
    kth = np.partition(scores, num_items - k, axis=1)[:, num_items - k, None]   # [B, 1]
    above = scores > kth
    tied = scores == kth
    num_tied_wanted = k - above.sum(axis=1, keepdims=True)
    chosen = above | (tied & (np.cumsum(tied, axis=1) <= num_tied_wanted))  # k per row
    columns = np.nonzero(chosen)[1].reshape(num_rows, k)                      # index order
    order = np.argsort(-np.take_along_axis(scores, columns, axis=1), axis=1, kind="stable")
    return np.take_along_axis(columns, order, axis=1)


def _user_item_matrix(items: Sequence[np.ndarray], num_items: int) -> sp.csr_matrix:
    """[U, I] float64 with 1 where the item is among the user's items (repeats count once)."""
    lengths = np.fromiter(map(len, items), np.int64, len(items))
    columns = np.concatenate(tuple(items) + (np.zeros(0, np.int32),))
    row_starts = np.concatenate([[0], np.cumsum(lengths)])
    matrix = sp.csr_matrix((np.ones(len(columns)), columns, row_starts),
                           shape=(len(items), num_items))
    matrix.sum_duplicates()
    matrix.data[:] = 1.0
    return matrix


def _rank(history: sp.csr_matrix, score: Callable[[sp.csr_matrix], np.ndarray], k: int,
          exclude_seen: bool) -> np.ndarray:
    num_users, num_items = history.shape
    num_kept = min(k, num_items)
    ranked = np.full((num_users, k), -1, dtype=np.int32)
    batch = max(1, MAX_BATCH_SCORES // max(num_items, 1))
    for start in range(0, num_users if num_kept else 0, batch):
        rows = history[start:start + batch]
        scores = score(rows)                                                  # [B, I]
        if exclude_seen:
            scores[rows.nonzero()] = -np.inf
        best = top_k(scores, num_kept)                                        # [B, k']
        best[np.take_along_axis(scores, best, axis=1) == -np.inf] = -1
        ranked[start:start + batch, :num_kept] = best
    return ranked


def _popularity_scores(popularity: np.ndarray, rows: sp.csr_matrix) -> np.ndarray:
    return np.tile(popularity, (rows.shape[0], 1))                             # [B, I]


def _knn_scores(similarity: np.ndarray | sp.csr_matrix, rows: sp.csr_matrix) -> np.ndarray:
    scores = rows @ similarity                                                  # [B, I]
    return scores.toarray() if sp.issparse(scores) else scores
