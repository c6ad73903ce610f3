"""leave_one_out: time order with ties in file order, short histories, Split.history."""

from __future__ import annotations

import numpy as np
import pytest

from xrec.realdata.data import Interactions, leave_one_out


def interactions(rows: list[tuple[int, int, float]]) -> Interactions:
    users, items, timestamps = (np.array(column) for column in zip(*rows))
    return Interactions(name="hand", user_ids=tuple(f"u{u}" for u in range(users.max() + 1)),
                        item_ids=tuple(f"i{i}" for i in range(items.max() + 1)),
                        users=users.astype(np.int32), items=items.astype(np.int32),
                        timestamps=timestamps.astype(np.float64))


HAND = interactions([
    (0, 0, 5.0),   # user 0: tie at t=5 with the row below it: this one is earlier
    (1, 1, 2.0),
    (0, 1, 3.0),
    (0, 2, 5.0),
    (2, 3, 1.0),   # user 2: a single interaction
    (0, 3, 1.0),
    (1, 0, 2.0),   # user 1: two interactions, tied
    (3, 0, 7.0),   # user 3: three, all tied: file order decides everything
    (3, 1, 7.0),
    (3, 2, 7.0),
])


def test_hand_made_split():
    split = leave_one_out(HAND)
    assert [t.tolist() for t in split.train] == [[3, 1], [1, 0], [3], [0]]
    assert split.valid.tolist() == [0, -1, -1, 1]
    assert split.test.tolist() == [2, -1, -1, 2]
    assert split.valid.dtype == np.int32 and split.test.dtype == np.int32
    assert all(t.dtype == np.int32 for t in split.train)


def test_history_and_targets():
    split = leave_one_out(HAND)
    assert [h.tolist() for h in split.history("valid")] == [[3, 1], [1, 0], [3], [0]]
    assert [h.tolist() for h in split.history("test")] == [[3, 1, 0], [1, 0], [3], [0, 1]]
    assert split.targets("test").tolist() == [2, -1, -1, 2]
    with pytest.raises(ValueError):
        split.history("train")


def naive_leave_one_out(data: Interactions):
    rows = {}
    for r in range(len(data)):
        rows.setdefault(int(data.users[r]), []).append((data.timestamps[r], r, int(data.items[r])))
    train, valid, test = [], [], []
    for user in range(data.num_users):
        items = [item for _, _, item in sorted(rows.get(user, []))]
        if len(items) < 3:
            train.append(items), valid.append(-1), test.append(-1)
        else:
            train.append(items[:-2]), valid.append(items[-2]), test.append(items[-1])
    return train, valid, test


def test_matches_naive_split_with_many_ties():
    rng = np.random.default_rng(0)
    n = 2000
    data = interactions(list(zip(rng.integers(0, 150, n).tolist(), rng.integers(0, 40, n).tolist(),
                                 rng.integers(0, 5, n).astype(float).tolist())))
    split = leave_one_out(data)
    train, valid, test = naive_leave_one_out(data)
    assert [t.tolist() for t in split.train] == train
    assert split.valid.tolist() == valid and split.test.tolist() == test
    assert sum(map(len, split.train)) + (split.valid >= 0).sum() + (split.test >= 0).sum() == n
