"""Interaction logs and their leave-one-out split: the plain data every real-data stage
(`xrec sid`, `xrec train`, `xrec eval`) reads. Item and user *indices* are dense ints; the
ids as written in the data file are kept beside them for output."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

__all__ = ["DataError", "Interactions", "Split"]


class DataError(ValueError):
    """Bad or missing input data (a message for the user, not a traceback)."""


@dataclass(frozen=True, eq=False)
class Interactions:
    """Interaction logs in file order: row r says user `users[r]` met item `items[r]` at
    `timestamps[r]`. Item index i is the i-th distinct item id in order of first appearance in
    the file (likewise users); every item of `item_ids` occurs at least once."""

    name: str                       # "ml-1m", "ml-100k", or the file's name
    user_ids: tuple[str, ...]       # user index -> id as in the file
    item_ids: tuple[str, ...]       # item index -> id as in the file (the ranking universe)
    users: np.ndarray               # int32 [n]
    items: np.ndarray               # int32 [n]
    timestamps: np.ndarray          # [n] int64 where the file's are all integers, else float64
    item_titles: tuple[str, ...] | None = None   # item index -> display text (title, genres)

    @property
    def num_users(self) -> int:
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        return len(self.item_ids)

    def __len__(self) -> int:
        return len(self.items)


@dataclass(frozen=True, eq=False)
class Split:
    """Leave-one-out split: per user, interactions ordered by timestamp, ties kept in file
    order; the last is the test item, the second to last the validation item, the rest is
    training. A user with fewer than 3 interactions has all of them in training and
    `valid`/`test` = -1 (not evaluated)."""

    data: Interactions
    train: tuple[np.ndarray, ...]   # user index -> int32 item indices of training, time order
    valid: np.ndarray               # int32 [num_users]: validation item, -1 where none
    test: np.ndarray                # int32 [num_users]: test item, -1 where none

    def history(self, stage: str) -> tuple[np.ndarray, ...]:
        """Per user, what is known when predicting `stage`'s item: the training items for
        "valid", the training items and the validation item for "test" (time order)."""
        if stage == "valid":
            return self.train
        if stage == "test":
            return tuple(t if v < 0 else np.append(t, np.int32(v))
                         for t, v in zip(self.train, self.valid))
        raise ValueError(f"stage: got {stage!r}, expected 'valid' or 'test'")

    def without_validation(self) -> Split:
        """The split a model ranked on the test stage trains on once validation has chosen
        its schedule: every item but the test one in training, no validation stage (the
        training data of the published ML-1M protocol, which has no validation stage)."""
        return replace(self, train=self.history("test"), valid=np.full_like(self.valid, -1))

    def update_digest(self, digest) -> None:
        """Feed what a model trained on this split reads into `digest` (a hashlib object):
        the item count, every training sequence, the validation and test items."""
        digest.update(np.int64(self.data.num_items).tobytes())
        digest.update(np.array([len(items) for items in self.train], np.int64).tobytes())
        for part in (*self.train, self.valid, self.test):
            digest.update(np.ascontiguousarray(part, dtype=np.int32).tobytes())

    def check_evaluated(self, needed_by: str) -> None:
        """DataError unless some user has a test item, i.e. 3 or more interactions (none
        has a validation item either then: every metric would be the NaN of zero users);
        `needed_by` says what needs them."""
        if (self.test >= 0).any():
            return
        most = int(np.bincount(self.data.users, minlength=1).max())
        raise DataError(f"{self.data.name}: no user has the 3 interactions the leave-one-out "
                        f"split needs to evaluate anyone (a test item, a validation item and "
                        f"one to learn from; the most any of its {self.data.num_users} users "
                        f"has is {most}), and {needed_by}")

    def targets(self, stage: str) -> np.ndarray:
        """int32 [num_users]: each user's item of `stage` (-1: user not evaluated)."""
        if stage not in ("valid", "test"):
            raise ValueError(f"stage: got {stage!r}, expected 'valid' or 'test'")
        return self.valid if stage == "valid" else self.test
