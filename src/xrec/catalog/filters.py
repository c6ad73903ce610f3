"""Per-request item filters resolved on one catalog (docs/beam-search.md, "Filters").

A filter removes items; the search must then answer exactly as over a catalog without
them. In the trie of the catalog's semantic IDs that means: a depth-3 node (a semantic
ID) dies when its last allowed item goes, a depth-2 node when its last live child goes,
a depth-1 node likewise. `FilterIndex` holds the catalog-wide arrays this needs (each
item's semantic ID, each node's parent and live count), built once per catalog;
`resolve` turns one request's filter into the dead nodes per depth, in work
proportional to the ids the request names. A type allow-list is the exception: which
nodes hold an item of the allowed types is a catalog-sized mask, computed once per
distinct allow-list and kept (`max_type_sets` of them).

Numpy only, torch-free; the search puts the result on its device (`search/filters.py`).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from xrec.catalog.items import ItemCatalog
from xrec.errors import InvalidArgument

NUM_DEPTHS = 3
MAX_TYPE_SETS = 64   # distinct allow-lists whose masks a catalog keeps


@dataclass(frozen=True, eq=False)
class TypeSet:
    """What one type allow-list leaves of the catalog: per depth, each node's live count
    (items of allowed types at depth 3, live children above) and the live mask."""

    types: tuple[str, ...]
    counts: tuple[np.ndarray, np.ndarray, np.ndarray]   # [F], [P], [U] int64
    alive: tuple[np.ndarray, np.ndarray, np.ndarray]    # [F], [P], [U] bool
    allowed_codes: np.ndarray                           # [num type names] bool


@dataclass(frozen=True, eq=False)
class ItemFilter:
    """One request's filter on one catalog.

    `dead[d]`: sorted depth-(d + 1) nodes that lose every item to the exclusions (with a
    type set: every item the allow-list left them). `type_set`: the allow-list's masks,
    or None (every type), and `type_codes [n]` each row's type. `excluded_rows`: sorted
    catalog rows never returned. `num_unknown`: excluded ids the catalog does not hold.
    """

    dead: tuple[np.ndarray, np.ndarray, np.ndarray]
    type_set: TypeSet | None
    type_codes: np.ndarray | None
    excluded_rows: np.ndarray
    num_unknown: int

    @property
    def num_dead(self) -> int:
        return sum(len(d) for d in self.dead)

    def allowed_rows(self, rows: np.ndarray) -> np.ndarray:
        """Which of `rows` (`[M]` catalog rows) the filter keeps: `[M]` bool."""
        keep = ~_is_member(rows, self.excluded_rows)
        if self.type_set is not None:
            keep &= self.type_set.allowed_codes[self.type_codes[rows]]
        return keep


class FilterIndex:
    """The catalog-wide arrays filters are resolved with, built once per catalog."""

    def __init__(self, catalog: ItemCatalog, max_type_sets: int = MAX_TYPE_SETS):
        self.catalog = catalog
        trie = catalog.trie()
        self.parents = trie.parents                                   # per depth [F], [P], [U]
        self.rows_triple, items = catalog.triple_rows()               # [n], [U]
        children = [np.bincount(trie.parents[d], minlength=trie.sizes[d - 1])
                    for d in (1, 2)]                                  # [F], [P]
        self.counts = (children[0], children[1], items)
        self.sizes = trie.sizes
        self.type_names: tuple[str, ...] = ()
        self.type_codes: np.ndarray | None = None                     # [n] int64
        if catalog.types is not None:
            # over the strings themselves: a fixed-width str array would take items x the
            # longest type x 4 bytes, and drops trailing NULs
            names, codes = np.unique(np.asarray(catalog.types, dtype=object), return_inverse=True)
            self.type_names, self.type_codes = tuple(names.tolist()), codes.astype(np.int64)
        self.max_type_sets = max_type_sets
        self._type_sets: OrderedDict[tuple[str, ...], TypeSet] = OrderedDict()
        self._lock = threading.Lock()   # the type-set cache is shared by every pipeline

    @property
    def num_nodes(self) -> int:
        return sum(self.sizes)

    def resolve(self, exclude_ids: np.ndarray | None, item_types: tuple[str, ...] | None,
                prompt_ids: np.ndarray | None) -> ItemFilter:
        """One request's filter: `exclude_ids` (sorted int64 ids), the type allow-list, and
        the prompt whose semantic IDs to exclude (None: exclude_history off)."""
        type_set = None if item_types is None else self.type_set(item_types)
        num_unknown = 0
        rows = np.zeros(0, dtype=np.int64)
        if exclude_ids is not None and len(exclude_ids):
            found = self.catalog.find_rows(exclude_ids)               # [E], -1: unknown
            num_unknown = int((found < 0).sum())
            rows = np.sort(found[found >= 0])
        named = self._named_triples(prompt_ids)                       # [H] dead whole
        dead_triples = self._dead_triples(rows, named, type_set)
        excluded_rows = rows
        if len(named):   # every item of a named semantic ID is excluded too
            excluded_rows = np.union1d(rows, self._rows_of(named))
        dead = [np.zeros(0, dtype=np.int64)] * NUM_DEPTHS
        dead[2] = dead_triples
        for depth in (1, 0):   # a node dies with its last live child
            dead[depth] = self._dead_parents(dead[depth + 1], depth, type_set)
        return ItemFilter(tuple(dead), type_set, self.type_codes, excluded_rows, num_unknown)

    def type_set(self, item_types: tuple[str, ...]) -> TypeSet:
        """The masks of one allow-list (cached; `InvalidArgument` on a catalog without types)."""
        if self.type_codes is None:
            raise InvalidArgument("item_types: this catalog has no item types (an extended "
                                  "catalog gives each item a type); drop item_types")
        with self._lock:
            cached = self._type_sets.get(item_types)
            if cached is not None:
                self._type_sets.move_to_end(item_types)
                return cached
        allowed_codes = np.isin(np.asarray(self.type_names, dtype=object),
                                np.asarray(item_types, dtype=object))   # [T]
        is_allowed_row = allowed_codes[self.type_codes]                 # [n]
        items = np.bincount(self.rows_triple[is_allowed_row], minlength=self.sizes[2])   # [U]
        counts, alive = [None] * NUM_DEPTHS, [None] * NUM_DEPTHS
        counts[2], alive[2] = items, items > 0
        for depth in (1, 0):
            counts[depth] = np.bincount(self.parents[depth + 1][alive[depth + 1]],
                                        minlength=self.sizes[depth])
            alive[depth] = counts[depth] > 0
        made = TypeSet(item_types, tuple(counts), tuple(alive), allowed_codes)
        with self._lock:
            self._type_sets[item_types] = made
            while len(self._type_sets) > self.max_type_sets:
                self._type_sets.popitem(last=False)
        return made

    def _named_triples(self, prompt_ids: np.ndarray | None) -> np.ndarray:
        """The catalog's semantic IDs that appear in the prompt (any 3 consecutive ids),
        as sorted depth-3 nodes."""
        if prompt_ids is None or len(prompt_ids) < NUM_DEPTHS:
            return np.zeros(0, dtype=np.int64)
        windows = np.lib.stride_tricks.sliding_window_view(prompt_ids, NUM_DEPTHS)  # [L-2, 3]
        found = self.catalog.find_triples(windows)
        return np.unique(found[found >= 0])

    def _rows_of(self, triples: np.ndarray) -> np.ndarray:
        """Every catalog row of the given depth-3 nodes, sorted."""
        return np.flatnonzero(_is_member(self.rows_triple, triples))

    def _dead_triples(self, rows: np.ndarray, named: np.ndarray,
                      type_set: TypeSet | None) -> np.ndarray:
        """Semantic IDs whose every (allowed) item is in `rows`, and the `named` ones."""
        if type_set is not None:   # items of other types are gone already: not counted twice
            rows = rows[type_set.allowed_codes[self.type_codes[rows]]]
        triples, num_excluded = np.unique(self.rows_triple[rows], return_counts=True)
        live = self.counts[2] if type_set is None else type_set.counts[2]
        dead = triples[num_excluded >= live[triples]]
        return np.union1d(dead, named) if len(named) else dead

    def _dead_parents(self, dead_children: np.ndarray, depth: int,
                      type_set: TypeSet | None) -> np.ndarray:
        """Depth-(depth + 1) nodes whose every live child is in `dead_children`."""
        if type_set is not None:   # children the allow-list killed already are not counted
            dead_children = dead_children[type_set.alive[depth + 1][dead_children]]
        parents, num_dead = np.unique(self.parents[depth + 1][dead_children], return_counts=True)
        live = self.counts[depth] if type_set is None else type_set.counts[depth]
        return parents[num_dead >= live[parents]]


def _is_member(values: np.ndarray, sorted_set: np.ndarray) -> np.ndarray:
    """`values[i] in sorted_set` for each i, by binary search (`[M]` bool)."""
    if len(sorted_set) == 0:
        return np.zeros(len(values), dtype=bool)
    positions = np.searchsorted(sorted_set, values).clip(max=len(sorted_set) - 1)
    return sorted_set[positions] == values
