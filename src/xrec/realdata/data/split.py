"""Leave-one-out split of interaction logs (see `Split`)."""

from __future__ import annotations

import numpy as np

from xrec.realdata.data.interactions import Interactions, Split

__all__ = ["leave_one_out"]


def leave_one_out(data: Interactions) -> Split:
    """Per user, interactions ordered by timestamp, equal timestamps in file order: the last is
    the test item, the second to last the validation item, the rest training. A user with
    fewer than 3 interactions keeps all of them in training and is not evaluated (-1)."""
    num_rows = len(data)
    # by user, then timestamp, then row: lexsort's last key is the primary one
    order = np.lexsort((np.arange(num_rows), data.timestamps, data.users))
    items = data.items[order].astype(np.int32, copy=False)                 # [n] grouped by user
    counts = np.bincount(data.users, minlength=data.num_users)             # [U]
    ends = np.cumsum(counts)
    starts = ends - counts
    is_evaluated = counts >= 3
    valid = np.full(data.num_users, -1, dtype=np.int32)
    test = np.full(data.num_users, -1, dtype=np.int32)
    valid[is_evaluated] = items[ends[is_evaluated] - 2]
    test[is_evaluated] = items[ends[is_evaluated] - 1]
    num_train = np.where(is_evaluated, counts - 2, counts)                 # [U]
    users = data.users[order]
    position = np.arange(num_rows) - starts[users]                         # rank within the user
    train_items = items[position < num_train[users]]
    train = tuple(np.split(train_items, np.cumsum(num_train)[:-1])) if data.num_users else ()
    return Split(data=data, train=train, valid=valid, test=test)
