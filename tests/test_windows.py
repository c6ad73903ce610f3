"""How `xrec train` cuts users' training items into windows (`causal_windows`,
`seq2seq_windows`), end-aligned or, with an rng (`--shifted-windows`), shifted each epoch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from xrec.realdata.sequences import causal_windows, seq2seq_windows

BOS, M = 1, 4
VOCAB = SimpleNamespace(bos_id=BOS, item_tokens=np.arange(300).reshape(100, 3) + 10)
USERS = [np.arange(n) for n in (1, 2, 3, 4, 5, 8, 9, 13, 30)]


def _items(window: np.ndarray) -> list[int]:
    assert window[0] == BOS
    return ((window[1:] - 10) // 3).reshape(-1, 3)[:, 0].tolist()


def _per_user(cut, rng) -> list[list[list[int]]]:
    """Each user's windows (as item lists), cut one user at a time with the same rng."""
    return [[_items(w) for w in cut(VOCAB, [u], M, rng)] for u in USERS]


@pytest.mark.parametrize("cut, size, first_target", [(causal_windows, M, 0),
                                                     (seq2seq_windows, M + 1, 1)])
def test_shifted_windows_keep_the_last_one_and_cover_every_target(cut, size, first_target):
    plain = _per_user(cut, None)
    starts = set()
    for seed in range(20):
        shifted = _per_user(cut, np.random.default_rng(seed))
        for user, windows, aligned in zip(USERS, shifted, plain):
            if len(user) <= first_target:         # no target: no window
                assert windows == aligned == []
                continue
            assert windows[0] == aligned[0] == user[-size:].tolist()   # as the prompts end
            assert all(0 < len(w) <= size and w == list(range(w[0], w[-1] + 1)) for w in windows)
            targets = {i for w in windows for i in w[first_target:]}
            assert targets == set(user[first_target:].tolist())       # none left out
            starts.update((len(user), w[0]) for w in windows[1:])
    # over the epochs the earlier windows start at every offset, not only the aligned ones
    assert {start % M for length, start in starts if length == 30} == set(range(M))


def test_without_an_rng_windows_are_end_aligned_and_disjoint():
    windows = _per_user(causal_windows, None)
    assert windows[6] == [[5, 6, 7, 8], [1, 2, 3, 4], [0]]          # 9 items
    for user, cut in zip(USERS, windows):
        assert sorted(i for w in cut for i in w) == user.tolist()
