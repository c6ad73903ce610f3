"""Progress bars only where someone watches them."""

from __future__ import annotations

__all__ = ["bar_disabled"]


def bar_disabled(progress: bool) -> bool | None:
    """tqdm's `disable` for a bar the caller asked for (`progress`) or not. None: tqdm shows it
    on a terminal only. Redirected to a file, a bar is a stream of carriage-return updates
    (3.5 MB in the log of one ML-1M `xrec demo movielens`), and the commands that use this
    print a line of their own for each epoch or stage anyway."""
    return None if progress else True
