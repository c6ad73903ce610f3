"""ranking_metrics (HR / NDCG, leave-one-out), remove_seen, metrics_table."""

from __future__ import annotations

import math

import numpy as np
import pytest

from xrec.realdata.data.metrics import metrics_table, ranking_metrics, remove_seen

RANKED = np.array([[7, 1, 2, 3, 4],      # target 7 at rank 0
                   [0, 1, 9, 3, 4],      # target 9 at rank 2
                   [0, 1, 2, 3, 8],      # target 8 at rank 4
                   [0, 1, 2, 3, 4],      # target 6 absent
                   [5, -1, -1, -1, -1]])  # no target: not evaluated, padding never matches
TARGETS = np.array([7, 9, 8, 6, -1])


def test_hand_made_hr_and_ndcg():
    got = ranking_metrics(RANKED, TARGETS, ks=(1, 3, 5))
    assert got["users"] == 4
    assert got["hr@1"] == pytest.approx(1 / 4)
    assert got["hr@3"] == pytest.approx(2 / 4)
    assert got["hr@5"] == pytest.approx(3 / 4)
    assert got["ndcg@1"] == pytest.approx(1.0 / 4)
    assert got["ndcg@3"] == pytest.approx((1.0 + 0.5) / 4)              # 1/log2(2+2) = 0.5
    assert got["ndcg@5"] == pytest.approx((1.0 + 0.5 + 1 / math.log2(6)) / 4)
    assert list(got) == ["hr@1", "hr@3", "hr@5", "ndcg@1", "ndcg@3", "ndcg@5", "users"]


def test_first_occurrence_counts_and_no_users_gives_nan():
    got = ranking_metrics(np.array([[3, 2, 2]]), np.array([2]), ks=(1, 3))
    assert got["ndcg@3"] == pytest.approx(1 / math.log2(3))
    empty = ranking_metrics(RANKED, np.full(5, -1), ks=(5,))
    assert empty["users"] == 0 and math.isnan(empty["hr@5"])


def test_rejects_k_beyond_the_lists():
    with pytest.raises(ValueError, match="ks: got \\(5, 10\\)"):
        ranking_metrics(RANKED, TARGETS, ks=(5, 10))
    with pytest.raises(ValueError, match="shapes"):
        ranking_metrics(RANKED, TARGETS[:3])


def test_remove_seen_hand_made():
    ranked = np.array([[5, 1, 2, 3, -1], [0, 1, 2, 3, 4], [4, 3, 2, 1, 0]])
    histories = [np.array([1, 3]), np.array([], dtype=np.int32), np.array([0, 1, 2, 3, 4])]
    assert remove_seen(ranked, histories, 3).tolist() == [[5, 2, -1], [0, 1, 2], [-1, -1, -1]]
    assert remove_seen(ranked, histories, 7).tolist()[1] == [0, 1, 2, 3, 4, -1, -1]


def test_remove_seen_matches_a_loop():
    rng = np.random.default_rng(0)
    ranked = np.stack([rng.permutation(30)[:12] for _ in range(20)])
    histories = [rng.choice(30, size=rng.integers(0, 15), replace=False) for _ in range(20)]
    expected = []
    for row, history in zip(ranked.tolist(), histories):
        kept = [item for item in row if item not in set(history.tolist())][:8]
        expected.append(kept + [-1] * (8 - len(kept)))
    assert remove_seen(ranked, histories, 8).tolist() == expected


def test_metrics_table():
    table = metrics_table({"most-popular": {"hr@10": 0.5, "users": 1234},
                           "item-knn": {"hr@10": 0.25, "ndcg@10": 0.125, "users": 1234}})
    lines = table.splitlines()
    assert lines[0] == "| | hr@10 | users | ndcg@10 |"
    assert lines[2] == "| most-popular | 0.5000 | 1,234 |  |"
    assert lines[3] == "| item-knn | 0.2500 | 1,234 | 0.1250 |"
