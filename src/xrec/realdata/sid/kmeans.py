"""Residual k-means (RQ-KMeans): level 1 clusters the embeddings, level l clusters what
levels 1 .. l-1 left unexplained (the residuals), one global codebook of `codebook_size`
centroids per level. scikit-learn's KMeans does the clustering.

`balanced=True`: no cluster holds more than ceil(n / k) points (before `build.py`'s collision
rule, which may move third codes). After k-means, the points
are assigned to the centroids by an optimal assignment (least total squared distance) with
each centroid offered that many times, and the centroids move to their points' means;
`BALANCE_ROUNDS` times (~10 s a round for ML-1M's 3,706 items at k = 128)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["ResidualCodes", "residual_kmeans"]

N_INIT = 3  # k-means++ restarts per level (the best inertia is kept)
BALANCE_ROUNDS = 2  # balanced assignment, then centroids to the means, this many times
# ONE_BLAS_THREAD: k-means++ seeding and the SVD are BLAS products of a few thousand rows;
# OpenBLAS's extra threads spin while they wait and slow them down on a loaded machine
# (docs/decisions.md, Real data). One BLAS thread; scikit-learn's own OpenMP loops stay parallel.


@dataclass(frozen=True, eq=False)
class ResidualCodes:
    """codes: int32 [n, levels], code of item i at level l; centroids[l]: float32 [k_l, d]
    with k_l <= codebook_size (k_l < codebook_size only when level l's input had fewer distinct
    points than that: then every distinct point is its own centroid and codes k_l .. K-1 are
    unused); residuals[l]: float32 [n, d], the input of level l (residuals[0] = the
    embeddings, times a power of two where they are far from 1: `in_float32_range`)."""

    codes: np.ndarray
    centroids: tuple[np.ndarray, ...]
    residuals: tuple[np.ndarray, ...]
    codebook_size: int

    @property
    def num_levels(self) -> int:
        return self.codes.shape[1]


def _cluster(points: np.ndarray, codebook_size: int, seed: int,
             balanced: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(labels [n] int32, centroids [k, d] float32) of one level."""
    distinct, inverse = np.unique(points, axis=0, return_inverse=True)  # [m, d], [n]
    if len(distinct) <= codebook_size:  # KMeans needs more points than clusters: exact codes
        labels = inverse.reshape(-1)  # [n]
        counts = np.bincount(labels)  # [m]
        if not balanced or counts.max() <= -(-len(points) // codebook_size):
            return labels.astype(np.int32), distinct.astype(np.float32)
        # balanced: crowded points must share out over more codes than one; start from every
        # distinct point, then copies of the most crowded ones up to `codebook_size` codes
        crowded_first = np.argsort(-counts, kind="stable")  # [m]
        labels, centroids = _balance(points, distinct[np.resize(crowded_first, codebook_size)])
        return labels.astype(np.int32), centroids.astype(np.float32)
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    kmeans = KMeans(n_clusters=codebook_size, n_init=N_INIT, random_state=seed)
    with threadpool_limits(limits=1, user_api="blas"):  # see ONE_BLAS_THREAD
        labels = kmeans.fit_predict(points)  # [n]
        centroids = kmeans.cluster_centers_
        if balanced:
            labels, centroids = _balance(points, centroids)
    return labels.astype(np.int32), centroids.astype(np.float32)


def _balance(points: np.ndarray, centroids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Labels with at most ceil(n / k) points per centroid, and the centroids moved to
    their points' means (module docstring)."""
    from scipy.optimize import linear_sum_assignment

    points = points.astype(np.float64)
    num_points, num_centroids = len(points), len(centroids)
    capacity = -(-num_points // num_centroids)
    for _ in range(BALANCE_ROUNDS):
        centroids = np.asarray(centroids, dtype=np.float64)
        cost = ((points ** 2).sum(1)[:, None] - 2 * points @ centroids.T
                + (centroids ** 2).sum(1))                              # [n, k]
        _, slots = linear_sum_assignment(np.repeat(cost, capacity, axis=1))
        labels = slots // capacity                                      # [n]
        sums = np.zeros_like(centroids)
        np.add.at(sums, labels, points)
        counts = np.bincount(labels, minlength=num_centroids)[:, None]
        centroids = np.where(counts > 0, sums / np.maximum(counts, 1), centroids)
    return labels, centroids


def in_float32_range(points: np.ndarray) -> np.ndarray:
    """`points` scaled by a power of two when their largest magnitude is far from 1, where
    float32 squared distances would overflow (~1e19) or lose every digit to underflow, and
    every point would fall in one cluster. k-means does not depend on the scale, and a power
    of two changes no digit; the usual inputs (normalised rows, SVD factors) are left as
    they are."""
    largest = float(np.abs(points).max())
    if largest == 0 or 2.0 ** -20 <= largest <= 2.0 ** 20:
        return points
    return np.ldexp(points.astype(np.float64), -math.frexp(largest)[1])  # largest in [0.5, 1)


def residual_kmeans(embeddings: np.ndarray, levels: int = 3, codebook_size: int = 64,
                    seed: int = 0, balanced: bool = False) -> ResidualCodes:
    """Codes of `levels` levels of residual k-means over `embeddings` [n, d] (seeded:
    the same input and seed give the same codes); `balanced`: capped cluster sizes."""
    for name, value in (("levels", levels), ("codebook_size", codebook_size)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}: got {value!r}, expected an integer >= 1")
    points = np.asarray(embeddings)
    if (points.ndim != 2 or points.shape[0] == 0 or points.shape[1] == 0
            or points.dtype.kind not in "fiu"):
        raise ValueError(f"embeddings: got a {points.dtype} array of shape {points.shape}, "
                         f"expected a non-empty 2-D numeric array [num_items, dim]")
    if not np.isfinite(points).all():
        raise ValueError("embeddings: NaN or infinite values")
    residual = in_float32_range(points).astype(np.float32)  # [n, d]
    codes, centroids, residuals = [], [], []
    for level in range(levels):
        labels, level_centroids = _cluster(residual, codebook_size, seed + level, balanced)
        codes.append(labels)
        centroids.append(level_centroids)
        residuals.append(residual)
        residual = residual - level_centroids[labels]  # [n, d]
    return ResidualCodes(np.stack(codes, axis=1), tuple(centroids), tuple(residuals),
                         codebook_size)
