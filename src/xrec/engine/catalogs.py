"""The served catalog and its hot reload (`Engine.load_catalog`, `POST /v1/admin/catalog`).

A `ServedCatalog` is everything derived from one catalog: the catalog itself (item
conversion), the `RecStep` over its constraint tables, the workspace model (its widest
node) and its `CatalogVersion`. It is immutable. The engine launches every batch with
the current one and the batch holds that reference until its answers are built, so a
swap never changes a running batch: a batch finishes on the catalog it started with,
and its answers carry that catalog's `content_hash`.

`CatalogSlots` holds two: the current one and the previous one (restorable). A load
first lets go of the previous one and waits until no batch still runs on it, then
builds the new one beside the current one, then swaps (the current one becomes the
previous). So no more than two catalogs are in memory at any moment, batches in flight
included. A new catalog that fails a check raises before the swap and the current one
keeps serving; the previous one is gone by then (the price of the two-catalog bound).
"""

from __future__ import annotations

import gc
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from xrec.api_types import CatalogVersion, ValidRequest
from xrec.catalog import ItemCatalog
from xrec.catalog.filters import FilterIndex, ItemFilter
from xrec.catalog.formats import first_bad_token
from xrec.engine.requests import ScheduledRequest
from xrec.errors import NotFound, Unavailable, XrecError
from xrec.model.family import RecModel
from xrec.search.step import RecStep
from xrec.search.workspace import BatchShape, WorkspaceModel
from xrec.tokenizer import PromptTokenizer

RELEASE_WAIT_S = 30.0   # how long a load waits for batches still running on the previous catalog


class _FilterIndexSlot:
    """A catalog's `FilterIndex`, built by the first batch whose requests filter (catalog-
    sized arrays that a catalog never filtered on does not pay for); a lock, because two
    pipelines may ask at once, and each served catalog has its own (no process-wide cache)."""

    def __init__(self) -> None:
        self._index: FilterIndex | None = None
        self._lock = threading.Lock()

    def get(self, catalog: ItemCatalog) -> FilterIndex:
        with self._lock:
            if self._index is None:
                self._index = FilterIndex(catalog)
            return self._index


@dataclass(frozen=True, eq=False)
class ServedCatalog:
    """One catalog as the pipelines use it. `catalog` and `version` are None when the
    engine serves without a catalog (free decoding)."""

    catalog: ItemCatalog | None
    step: RecStep
    workspace: WorkspaceModel
    version: CatalogVersion | None
    _filter_index: _FilterIndexSlot = field(default_factory=_FilterIndexSlot, repr=False)

    @property
    def content_hash(self) -> str | None:
        return None if self.version is None else self.version.content_hash

    @property
    def trie_sizes(self) -> tuple[int, int, int]:
        """Nodes of the constraint trie per depth (the filters' node ranges)."""
        return tuple(len(tokens) for tokens in self.step.tables.tokens)

    def resolve_filters(self, requests: Sequence[ValidRequest],
                        ) -> list[ItemFilter | XrecError | None]:
        """Each request's item filter on this catalog: None for a request without one, an
        `XrecError` for one this catalog cannot apply (types on a catalog without types),
        which fails that request only."""
        if not any(r.has_filter for r in requests):
            return [None] * len(requests)
        index = self._filter_index.get(self.catalog)
        resolved: list[ItemFilter | XrecError | None] = []
        for request in requests:   # per request, at batch formation (never in a round)
            if not request.has_filter:
                resolved.append(None)
                continue
            try:
                resolved.append(index.resolve(request.exclude_items, request.item_types,
                                              request.token_ids if request.exclude_history else None))
            except XrecError as exc:   # without its traceback: its frames hold this catalog
                resolved.append(exc.with_traceback(None))
        return resolved

    def batch_bytes(self, requests: Sequence[ScheduledRequest[ValidRequest]]) -> int:
        """The workspace these requests need as one batch on this catalog (the scheduler's
        admission figure: `BatchCatalog`)."""
        return self.workspace.batch_bytes(BatchShape.of([r.request for r in requests]))


class CatalogSlots:
    """The current and the previous `ServedCatalog`; loads and restores one at a time.

    Readers take `current` without a lock: the pair is one tuple, replaced whole.
    """

    def __init__(self, first: ServedCatalog, release_wait_s: float = RELEASE_WAIT_S):
        self._slots: tuple[ServedCatalog, ServedCatalog | None] = (first, None)
        self._lock = threading.Lock()
        self.release_wait_s = release_wait_s
        # set when the catalog a load let go of is freed; kept until it is, so that a load
        # retried after giving up waits for it too (else three would be in memory)
        self._released: threading.Event | None = None

    @property
    def current(self) -> ServedCatalog:
        return self._slots[0]

    @property
    def previous(self) -> ServedCatalog | None:
        return self._slots[1]

    def versions(self) -> tuple[CatalogVersion | None, CatalogVersion | None]:
        """The current and the previous catalog's versions from one read of the pair: two
        reads could straddle a restore and name one version as both."""
        current, previous = self._slots
        return current.version, None if previous is None else previous.version

    def replace(self, build: Callable[[], ServedCatalog]) -> ServedCatalog:
        """Let go of the previous catalog, `build()` the new one (it raises to refuse it:
        nothing is swapped) and make it current; the current one becomes the previous."""
        with self._lock:
            self._release_previous()
            new = build()
            self._slots = (new, self._slots[0])
            return new

    def restore(self) -> ServedCatalog:
        """Swap the current and the previous catalog (a second restore undoes the first)."""
        with self._lock:
            current, previous = self._slots
            if previous is None:
                raise NotFound("no previous catalog version to restore (none was loaded, or the "
                               "last load was refused after letting it go)")
            self._slots = (previous, current)
            return previous

    def _release_previous(self) -> None:
        """Drop the previous catalog; wait until the batches still running on it are done
        (their references are the last ones: it is freed when the last goes). A catalog let
        go of by an earlier load that gave up is waited for the same way."""
        if self._slots[1] is not None:
            self._released = threading.Event()
            weakref.finalize(self._slots[1], self._released.set)
            self._slots = (self._slots[0], None)
        released = self._released
        if released is None:
            return
        if not released.is_set():   # a reference cycle (an exception's frames) may hold it
            gc.collect()
        if not released.wait(self.release_wait_s):
            raise Unavailable(f"a batch launched on the previous catalog is still running after "
                              f"{self.release_wait_s:g} s; retry the load")
        self._released = None


def serve_catalog(catalog: ItemCatalog | None, source: str | None, model: RecModel, rounds: int,
                  is_constrained: bool, tokenizer: PromptTokenizer | None,
                  pad_lengths: bool = False) -> ServedCatalog:
    """Everything the pipelines derive from `catalog` (None: free decoding), checked against
    the model, its tokenizer and the engine's `rounds` (`ValueError` naming what does not fit).
    `pad_lengths`: the pipelines pad inputs for captured decode rounds (the workspace
    estimate counts the padding)."""
    config = model.config
    if catalog is not None:
        bad = first_bad_token(catalog.triples, config.vocab_size)
        if bad is not None:
            row, level = bad
            raise ValueError(f"catalog: item {catalog.item_ids[row]} has token "
                             f"{catalog.triples[row, level]} at level {level}, outside the model's "
                             f"vocabulary [0, {config.vocab_size})")
        if tokenizer is not None:
            check_catalog_tokens(catalog, tokenizer)
    tables = catalog.constraint_tables(model.device) if is_constrained else None
    if tables is not None and rounds > tables.num_levels:
        raise ValueError(f"option rounds: got {rounds}, the catalog has {tables.num_levels} "
                         "token levels")
    step = RecStep(model, tables, rounds)
    widest = max(tables.max_children[1:], default=1) if tables else config.vocab_size
    num_nodes = sum(len(tokens) for tokens in tables.tokens) if tables else 0
    workspace = WorkspaceModel(config, model.dtype.itemsize, widest, rounds, num_nodes, pad_lengths)
    version = None if catalog is None else CatalogVersion(
        catalog.content_hash(), catalog.num_items, time.time(), source, catalog.is_extended)
    return ServedCatalog(catalog, step, workspace, version)


def check_catalog_tokens(catalog: ItemCatalog, tokenizer: PromptTokenizer) -> None:
    """Every token of every semantic ID must be one the tokenizer knows (else the catalog was
    built for another vocabulary). The tokenizer is asked about the catalog's distinct tokens
    only: a few codebooks of a vocabulary that may be 176k ids (OpenOneRec)."""
    is_known = np.zeros(catalog.vocab_size, dtype=bool)                   # [V]
    is_known[catalog.triples] = True
    used_ids = np.flatnonzero(is_known)                                   # [U]
    is_known[used_ids] = tokenizer.known_ids(used_ids)
    is_unknown = ~is_known[catalog.triples]                               # [n, 3]
    if is_unknown.any():
        row, level = np.argwhere(is_unknown)[0]
        raise ValueError(f"catalog: item {catalog.item_ids[row]} has token {catalog.triples[row, level]} "
                         f"at level {level}, which the model's tokenizer.json does not know "
                         f"({int(is_unknown.any(axis=1).sum())} items have unknown tokens); build the "
                         "catalog through the model's tokenizer (xrec catalog import)")
