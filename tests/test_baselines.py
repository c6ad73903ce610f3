"""Baselines: most-popular order, item-kNN against a dense numpy computation, exclude_seen,
exact top-k with ties by index."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("scipy")

from xrec.realdata.data import Interactions, Split  # noqa: E402
from xrec.realdata.data import baselines  # noqa: E402
from xrec.realdata.data.baselines import BASELINES, item_similarity, rank_baseline, top_k  # noqa: E402


def make_split(train: list[list[int]], valid: list[int], test: list[int], num_items: int) -> Split:
    data = Interactions(name="hand", user_ids=tuple(f"u{u}" for u in range(len(train))),
                        item_ids=tuple(f"i{i}" for i in range(num_items)),
                        users=np.zeros(0, np.int32), items=np.zeros(0, np.int32),
                        timestamps=np.zeros(0))
    return Split(data=data, train=tuple(np.array(t, dtype=np.int32) for t in train),
                 valid=np.array(valid, dtype=np.int32), test=np.array(test, dtype=np.int32))


# training counts: item 0: 3, item 1: 2, item 2: 2, item 3: 1, item 4: 0 (4 is only ever a
# validation item, which must not count)
POPULAR = make_split(train=[[0, 1], [0, 2], [0, 1, 3], [2]], valid=[4, 4, 4, -1],
                     test=[3, 3, 2, -1], num_items=5)


def test_most_popular_order_ties_by_index():
    ranked = rank_baseline("most-popular", POPULAR, "test", k=5)
    assert ranked.dtype == np.int32 and ranked.shape == (4, 5)
    assert ranked.tolist() == [[0, 1, 2, 3, 4]] * 4


def test_most_popular_exclude_seen_uses_the_stage_history():
    valid = rank_baseline("most-popular", POPULAR, "valid", k=4, exclude_seen=True)
    assert valid.tolist() == [[2, 3, 4, -1], [1, 3, 4, -1], [2, 4, -1, -1], [0, 1, 3, 4]]
    test = rank_baseline("most-popular", POPULAR, "test", k=2, exclude_seen=True)
    assert test.tolist() == [[2, 3], [1, 3], [2, -1], [0, 1]]     # item 4 seen in valid


def test_k_beyond_the_catalog_is_padded():
    ranked = rank_baseline("most-popular", POPULAR, "valid", k=7)
    assert ranked[0].tolist() == [0, 1, 2, 3, 4, -1, -1]


# items 1 and 2 are watched together; item 0 is the most popular
KNN = make_split(train=[[1, 2], [1, 2], [0, 3], [0, 4], [0, 3], [1]], valid=[-1] * 6,
                 test=[-1] * 6, num_items=5)


def test_item_knn_ranks_the_co_watched_item_first():
    assert rank_baseline("most-popular", KNN, "valid", k=1)[5].tolist() == [0]
    ranked = rank_baseline("item-knn", KNN, "valid", k=5)
    # user 5 saw item 1: item 2 scores 2 / sqrt(3 * 2), every other item 0 (item 1 is not
    # its own neighbour), ties by index
    assert ranked[5].tolist() == [2, 0, 1, 3, 4]
    # user 2 saw items 0 and 3: 0 and 3 score 2 / sqrt(3 * 2) (each other), item 4
    # 1 / sqrt(3 * 1) (with item 0), items 1 and 2 nothing
    assert ranked[2].tolist() == [0, 3, 4, 1, 2]
    seen_removed = rank_baseline("item-knn", KNN, "valid", k=5, exclude_seen=True)
    assert seen_removed[5].tolist() == [2, 0, 3, 4, -1]
    assert seen_removed[2].tolist() == [4, 1, 2, -1, -1]


def dense_item_knn(train: np.ndarray, history: np.ndarray) -> np.ndarray:
    """Scores [U, I] by the textbook formula on dense 0/1 matrices [U, I]."""
    co = train.T @ train
    norms = np.sqrt(np.diag(co))
    with np.errstate(invalid="ignore", divide="ignore"):
        similarity = np.nan_to_num(co / np.outer(norms, norms))
    np.fill_diagonal(similarity, 0.0)
    return history @ similarity


@pytest.mark.parametrize("dense", [True, False])
@pytest.mark.parametrize("exclude_seen", [False, True])
def test_item_knn_matches_dense_numpy(monkeypatch, dense, exclude_seen):
    monkeypatch.setattr(baselines, "MAX_BATCH_SCORES", 7 * 40)      # several user batches
    monkeypatch.setattr(baselines, "MAX_DENSE_SIMILARITY", 1 << 30 if dense else 0)
    rng = np.random.default_rng(1)
    num_users, num_items, k = 50, 40, 10
    train = [rng.choice(num_items, size=rng.integers(1, 12), replace=False).tolist()
             for _ in range(num_users)]
    valid = rng.integers(0, num_items, num_users)
    valid[::7] = -1
    split = make_split(train, valid.tolist(), [0] * num_users, num_items)
    train_dense = np.zeros((num_users, num_items))
    history_dense = np.zeros((num_users, num_items))
    for u, items in enumerate(split.train):
        train_dense[u, items] = 1
    for u, items in enumerate(split.history("test")):
        history_dense[u, items] = 1
    expected = dense_item_knn(train_dense, history_dense)                   # [U, I]
    np.testing.assert_allclose(item_similarity(baselines._user_item_matrix(split.train, num_items))
                               .toarray(), dense_item_knn(train_dense, np.eye(num_items)),
                               atol=1e-12)
    if exclude_seen:
        expected[history_dense > 0] = -np.inf
    ranked = rank_baseline("item-knn", split, "test", k=k, exclude_seen=exclude_seen)
    assert (ranked >= 0).all()
    best = -np.sort(-expected, axis=1)[:, :k]
    np.testing.assert_allclose(np.take_along_axis(expected, ranked, axis=1), best, atol=1e-12)
    assert all(len(set(row)) == k for row in ranked.tolist())
    if exclude_seen:
        assert not history_dense[np.arange(num_users)[:, None], ranked].any()


def test_top_k_ties_by_lower_index():
    scores = np.array([[1.0, 3.0, 3.0, 0.0, 3.0], [-np.inf, 2.0, 2.0, 2.0, 2.0]])
    assert top_k(scores, 2).tolist() == [[1, 2], [1, 2]]
    assert top_k(scores, 4).tolist() == [[1, 2, 4, 0], [1, 2, 3, 4]]
    rng = np.random.default_rng(2)
    many_ties = rng.integers(0, 4, size=(30, 25)).astype(float)
    for k in (1, 7, 25):
        expected = np.argsort(-many_ties, axis=1, kind="stable")[:, :k]
        assert top_k(many_ties, k).tolist() == expected.tolist()


def test_bad_arguments():
    assert BASELINES == ("most-popular", "item-knn")
    with pytest.raises(ValueError, match="baseline: got 'bpr'"):
        rank_baseline("bpr", POPULAR, "test", k=5)
    with pytest.raises(ValueError, match="stage"):
        rank_baseline("most-popular", POPULAR, "train", k=5)
    with pytest.raises(ValueError, match="k: got 0"):
        rank_baseline("most-popular", POPULAR, "test", k=0)
