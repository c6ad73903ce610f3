"""Leave-one-out ranking metrics: each evaluated user has one target item.

HR@k is 1 when the target is among the first k items, NDCG@k is 1 / log2(rank + 2) there
(rank 0-based; one relevant item, so the ideal DCG is 1), both 0 otherwise, averaged over
the users that have a target."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

__all__ = ["metrics_table", "ranking_metrics", "remove_seen"]


def ranking_metrics(ranked: np.ndarray, targets: np.ndarray,
                    ks: Sequence[int] = (5, 10, 50)) -> dict[str, float | int]:
    """{"hr@k": .., "ndcg@k": .. for each k, "users": count} from `ranked` int [U, K] (item
    indices, best first, -1 = padding) and `targets` int [U] (-1 = user not evaluated).
    The means are NaN when no user has a target."""
    ranked, targets = np.asarray(ranked), np.asarray(targets)
    if ranked.ndim != 2 or targets.shape != ranked.shape[:1]:
        raise ValueError(f"ranked, targets: got shapes {ranked.shape}, {targets.shape}, "
                         f"expected [U, K] and [U]")
    num_ranked = ranked.shape[1]
    if not ks or min(ks) < 1 or max(ks) > num_ranked:
        raise ValueError(f"ks: got {tuple(ks)}, expected values in 1..{num_ranked} (the length "
                         f"of the ranked lists)")
    is_evaluated = targets >= 0
    hits = ranked[is_evaluated] == targets[is_evaluated, None]               # [u, K]
    rank = np.where(hits.any(axis=1), hits.argmax(axis=1), num_ranked)       # [u]; K: absent
    gain = 1.0 / np.log2(rank + 2.0)
    num_users = int(is_evaluated.sum())
    result: dict[str, float | int] = {}
    for k in ks:
        result[f"hr@{k}"] = _mean(rank < k)
    for k in ks:
        result[f"ndcg@{k}"] = _mean(np.where(rank < k, gain, 0.0))
    result["users"] = num_users
    return result


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else float("nan")


def remove_seen(ranked: np.ndarray, histories: Sequence[np.ndarray], k: int) -> np.ndarray:
    """int [U, k]: each row of `ranked` [U, K] without the items of that user's history (and
    without padding), order kept, cut to k and padded with -1."""
    ranked = np.asarray(ranked)
    num_users = len(ranked)
    if ranked.ndim != 2 or len(histories) != num_users:
        raise ValueError(f"ranked, histories: got shape {ranked.shape} and {len(histories)} "
                         f"histories, expected [U, K] and U histories")
    if k < 0:
        raise ValueError(f"k: got {k}, expected >= 0")
    lengths = np.fromiter(map(len, histories), np.int64, num_users)
    seen_items = (np.concatenate(histories).astype(np.int64) if lengths.sum()
                  else np.zeros(0, np.int64))
    seen_users = np.repeat(np.arange(num_users), lengths)
    width = int(max(ranked.max(initial=-1), seen_items.max(initial=-1))) + 1
    seen = np.unique(seen_users * width + seen_items)                        # (user, item) keys
    keys = np.arange(num_users)[:, None] * width + ranked                    # [U, K]
    is_kept = (ranked >= 0) & ~np.isin(keys, seen)                           # [U, K]
    order = np.argsort(~is_kept, axis=1, kind="stable")                      # kept ones first
    result = np.take_along_axis(ranked, order, axis=1)
    result[~np.take_along_axis(is_kept, order, axis=1)] = -1
    if result.shape[1] >= k:
        return result[:, :k]
    padding = np.full((num_users, k - result.shape[1]), -1, dtype=result.dtype)
    return np.concatenate([result, padding], axis=1)


def metrics_table(rows: Mapping[str, Mapping[str, float | int]]) -> str:
    """A Markdown table: one row per name, one column per metric (in the first row's order)."""
    columns: list[str] = []
    for metrics in rows.values():
        columns += [c for c in metrics if c not in columns]
    lines = ["| | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for name, metrics in rows.items():
        cells = [_cell(metrics.get(c)) for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(value: float | int | None) -> str:
    if value is None:
        return ""
    if isinstance(value, (int, np.integer)):
        return f"{value:,}"
    return f"{value:.4f}"
