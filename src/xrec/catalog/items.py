"""The item catalog: semantic-ID triples ↔ items, and the constraint tables (docs/catalog.md).

File formats live in `formats.py`. Everything here is vectorised numpy; torch
is imported only by `ItemCatalog.constraint_tables` and `ConstraintTables.to`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from xrec.catalog import formats as catalog_io
from xrec.catalog.formats import MAX_VOCAB_SIZE, NUM_LEVELS, CatalogError
from xrec.config.keys import read_json
from xrec.errors import InvalidArgument

if TYPE_CHECKING:
    import torch

__all__ = ["CatalogError", "ConstraintTables", "ItemCatalog", "MAX_VOCAB_SIZE", "Trie", "random_catalog"]

TEXT_SUFFIXES = (".txt", ".csv")
# a vocab_file with one of these suffixes is a tokenizer vocabulary (from_model_dir)
TOKENIZER_VOCABULARY_SUFFIXES = (".json", ".model", ".tiktoken", ".vocab")
_CATALOG_TEXT_LINE = re.compile(r"-?\d+(\s*,\s*-?\d+){3}")
# numbers and separators only: a catalog row in the wrong shape (5 fields, `;`), not a token
_CATALOG_LIKE_LINE = re.compile(r"[-+\d]+([\s,;|]+[-+\d]+)+")
logger = logging.getLogger(__name__)
_MAX_RANDOM_ITEM_ID = 1 << 62
_MAX_INT64 = (1 << 63) - 1


def _triple_keys(triples: np.ndarray, vocab_size: int) -> np.ndarray:
    """One int64 per triple, ordered like the triples lexicographically: t0*V*V + t1*V + t2."""
    wide = triples.astype(np.int64)  # [n, 3]
    return (wide[:, 0] * vocab_size + wide[:, 1]) * vocab_size + wide[:, 2]  # [n]


def _csr_offsets(parents: np.ndarray, num_nodes: int) -> np.ndarray:
    """Offsets [num_nodes + 1] of a CSR whose children are sorted by parent index."""
    return np.searchsorted(parents, np.arange(num_nodes + 1)).astype(np.int64)


def _group_starts(sorted_values: np.ndarray) -> np.ndarray:
    """Index where each run of equal values starts in a sorted array ([U] int64)."""
    is_first = np.ones(len(sorted_values), dtype=bool)  # [n]
    is_first[1:] = sorted_values[1:] != sorted_values[:-1]
    return np.flatnonzero(is_first)


def _unique_sorted(sorted_values: np.ndarray) -> np.ndarray:
    return sorted_values[_group_starts(sorted_values)]


def _find_sorted(sorted_values: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """Index of each query in a sorted array without duplicates ([N] int64), -1 if absent."""
    positions = np.searchsorted(sorted_values, queries)  # [N]
    is_inside = positions < len(sorted_values)
    is_found = np.zeros(len(queries), dtype=bool)  # [N]
    is_found[is_inside] = sorted_values[positions[is_inside]] == queries[is_inside]
    return np.where(is_found, positions, -1)


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """`starts[i], starts[i] + 1, ..., starts[i] + counts[i] - 1` for every i, flat ([sum] int64)."""
    before = np.cumsum(counts) - counts  # [N]
    return np.repeat(starts - before, counts) + np.arange(int(counts.sum()))


def _is_tokenizer_vocabulary(path: Path) -> bool:
    """A `vocab_file` that is a tokenizer's vocabulary, not a catalog (see from_model_dir)."""
    suffix = path.suffix.lower()
    if suffix in TOKENIZER_VOCABULARY_SUFFIXES:
        return True
    if suffix != ".txt":
        return False
    try:
        if not path.is_file():   # OSError past ENOENT (a name too long): read() names it
            return False
        with open(path, encoding="utf-8-sig", errors="replace") as lines:
            first = True
            for line in lines:
                stripped = line.strip()
                if not stripped or stripped.startswith("#"):
                    continue
                if first and catalog_io.is_header_row(stripped.split(",")):
                    first = False   # a catalog's header (`item_id,t0,t1,t2`): look further
                    continue
                return _CATALOG_TEXT_LINE.fullmatch(stripped) is None and \
                    _CATALOG_LIKE_LINE.fullmatch(stripped) is None
    except OSError:
        return False  # read() names the error
    return False


def _tokenizer_config(config_path: Path) -> dict[str, Any]:
    """A model directory's `tokenizer_config.json` ({} when it has none)."""
    if not config_path.is_file():
        return {}
    try:
        return read_json(config_path)
    except ValueError as exc:
        raise CatalogError(str(exc)) from None


def _extended_item_info(config_path: Path, config: dict[str, Any]) -> bool:
    """Whether the directory's catalog is extended (`"extended_item_info"`, default false)."""
    extended = config.get("extended_item_info", False)
    if not isinstance(extended, bool):
        raise CatalogError(f"{config_path}: extended_item_info = {extended!r}, "
                           f"expected true or false")
    return extended


def _read_only(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


@dataclass(frozen=True, eq=False)  # tensors have no truth value: compare fields
class ConstraintTables:
    """The catalog's trie of unique triples, one CSR level per round, for constrained decoding.

    Depth 0 has one node, the root. A node at depth l >= 1 is an index into
    `tokens[l - 1]`. The children of node n at depth l are
    `tokens[l][offsets[l][n]:offsets[l][n + 1]]`, sorted ascending; a beam at
    node n that picks the child at position j of that segment moves to node
    `offsets[l][n] + j` at depth l + 1. A node at depth 3 (an index into
    `tokens[2]`) is the rank of its triple among the catalog's sorted unique
    triples.

    tokens[0]: [F] int64, offsets[0]: [2] = [0, F]
    tokens[1]: [P] int64, offsets[1]: [F + 1]   (P distinct (t0, t1) prefixes)
    tokens[2]: [U] int64, offsets[2]: [P + 1]   (U distinct triples)

    The host-side facts (`max_children`, `root_run`) are known when the tables are built,
    so a step over tables on any device never reads them back from it.
    """

    tokens: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    offsets: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    max_children: tuple[int, int, int]  # the longest segment at each depth, on the host
    vocab_size: int
    num_levels: int = NUM_LEVELS
    # the root's children `tokens[0]` as the id range (low, high + 1) when they are one run of
    # consecutive ids (OpenOneRec's `<s_a_*>`), else None; on the host
    root_run: tuple[int, int] | None = None

    @property
    def device(self) -> torch.device:
        return self.tokens[0].device

    def to(self, device: str | torch.device) -> ConstraintTables:
        """A copy with every tensor on `device`."""
        return replace(self, tokens=tuple(t.to(device) for t in self.tokens),
                       offsets=tuple(o.to(device) for o in self.offsets))


@dataclass(frozen=True, eq=False)
class Trie:
    """The catalog's unique triples as a trie, on the host: per depth 1..3 the node's token
    (`tokens[d - 1]`, nodes sorted like `ConstraintTables`) and its parent at the depth
    above (`parents[d - 1]`; 0, the root, at depth 1). Depth-3 node u is the rank of its
    triple among the sorted unique triples."""

    tokens: tuple[np.ndarray, np.ndarray, np.ndarray]   # [F], [P], [U] int64
    parents: tuple[np.ndarray, np.ndarray, np.ndarray]  # [F], [P], [U] int64

    @property
    def sizes(self) -> tuple[int, int, int]:
        return tuple(len(t) for t in self.tokens)


class ItemCatalog:
    """Items and their semantic-ID triples; immutable once built.

    Rows are in file order, except that an item id listed more than once keeps
    only its last record, at the position of that last record. Several items
    may share a triple. `item_ids` [n] int64 and `triples` [n, 3] int32 are
    read-only arrays; `dids` and `types` are tuples of str (extended catalogs)
    or None.
    """

    def __init__(self, item_ids: Any, triples: Any, vocab_size: int,
                 dids: Any = None, types: Any = None):
        vocab_size = catalog_io.check_vocab_size(vocab_size)
        columns = catalog_io.prepare_columns(item_ids, triples, vocab_size, dids, types)
        num_items = len(columns.item_ids)
        self._vocab_size = vocab_size
        self._item_ids = _read_only(columns.item_ids)  # [n] int64
        self._triples = _read_only(columns.triples)  # [n, 3] int32
        self._dids = None if columns.dids is None else tuple(columns.dids)
        self._types = None if columns.types is None else tuple(columns.types)
        # item id -> row
        self._id_order = _read_only(np.argsort(self._item_ids))  # [n]
        self._sorted_item_ids = _read_only(self._item_ids[self._id_order])  # [n]
        # triple -> rows: rows sorted by key (file order inside a key), CSR over the unique keys
        keys = _triple_keys(self._triples, vocab_size)  # [n]
        self._key_order = _read_only(np.argsort(keys, kind="stable"))  # [n]
        sorted_keys = keys[self._key_order]  # [n]
        group_starts = _group_starts(sorted_keys)  # [U]
        self._unique_keys = _read_only(sorted_keys[group_starts])  # [U] sorted
        self._row_offsets = _read_only(np.append(group_starts, num_items))  # [U + 1]

    # --- constructors -----------------------------------------------------------------

    @classmethod
    def from_arrays(cls, item_ids: Any, triples: Any, vocab_size: int,
                    dids: Any = None, types: Any = None) -> ItemCatalog:
        """Builds a catalog from arrays ([n] ids, [n, 3] tokens), with the file rules."""
        return cls(item_ids, triples, vocab_size, dids, types)

    @staticmethod
    def is_text_path(path: str | os.PathLike) -> bool:
        """Whether `read` and `write` take `path` for the text form (a .txt/.csv suffix),
        which has no did/type strings."""
        return Path(path).suffix.lower() in TEXT_SUFFIXES

    @classmethod
    def read(cls, path: str | os.PathLike, vocab_size: int, extended: bool = False) -> ItemCatalog:
        """Reads a catalog file: text form for a .txt/.csv suffix, binary otherwise."""
        path = Path(path)
        vocab_size = catalog_io.check_vocab_size(vocab_size)
        if cls.is_text_path(path):
            if extended:
                raise CatalogError(f"catalog {path}: the text form has no did/type strings; "
                                   f"an extended catalog must be binary")
            columns = catalog_io.read_text(path, vocab_size)
        elif extended:
            columns = catalog_io.read_extended(path, vocab_size)
        else:
            columns = catalog_io.read_binary(path, vocab_size)
        return cls(columns.item_ids, columns.triples, vocab_size, columns.dids, columns.types)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike, vocab_size: int) -> ItemCatalog | None:
        """The catalog named by the directory's `tokenizer_config.json`, or None.

        `"item_catalog"` (xrec's key, safe beside Hugging Face's tokenizer keys)
        names it; without it, `"vocab_file"` (xllm's key) does, unless that is
        a tokenizer's own vocabulary, which some tokenizer configs name with the
        same key: a `.json`, `.model`, `.tiktoken` or `.vocab` file (never a
        catalog format), or a `.txt` file whose first line that is not blank or
        a `#` comment is not `item_id,t0,t1,t2` (BERT's vocab.txt holds one token
        per line). Everything else is read as a catalog (binary, or text for
        .txt/.csv) and a file that is missing or bad is an error.
        `"extended_item_info": true` reads extended records.
        """
        config_path = Path(model_dir) / "tokenizer_config.json"
        config = _tokenizer_config(config_path)
        key = "item_catalog" if "item_catalog" in config else "vocab_file"
        if key not in config:
            return None
        catalog_file = config[key]
        if not isinstance(catalog_file, str) or not catalog_file:
            raise CatalogError(f"{config_path}: {key} = {catalog_file!r}, expected a path")
        extended = _extended_item_info(config_path, config)
        path = Path(model_dir) / catalog_file
        if key == "vocab_file" and _is_tokenizer_vocabulary(path):
            logger.warning("%s: vocab_file %s is a tokenizer vocabulary, not an item catalog; "
                           "no catalog, decoding is unconstrained (name one with "
                           "\"item_catalog\")", config_path, catalog_file)
            return None
        return cls.read(path, vocab_size, extended)

    @classmethod
    def read_for_model(cls, path: str | os.PathLike, model_dir: str | os.PathLike,
                       vocab_size: int, extended: bool | None = None) -> ItemCatalog:
        """`path` served in place of the catalog of the model in `model_dir` (`--catalog
        FILE`). `extended` None reads it in the form the directory declares for its own
        (`"extended_item_info"` of `tokenizer_config.json`), and never a text file as
        extended: as a load with `"extended": null` keeps the current catalog's form."""
        if extended is None:
            config_path = Path(model_dir) / "tokenizer_config.json"
            extended = not cls.is_text_path(path) and _extended_item_info(
                config_path, _tokenizer_config(config_path))
        return cls.read(path, vocab_size, extended)

    # --- writing ------------------------------------------------------------------------

    def write(self, path: str | os.PathLike) -> None:
        """Writes the form `read` reads back from `path`: text for a .txt/.csv suffix
        (`write_text`), else binary, extended records when the catalog is extended. Whole or
        not at all: a failed write leaves the file that was there."""
        if self.is_text_path(path):
            self.write_text(path)
        elif self.is_extended:
            catalog_io.write_extended(path, self._item_ids, self._triples, self._dids, self._types)
        else:
            catalog_io.write_binary(path, self._item_ids, self._triples)

    def write_text(self, path: str | os.PathLike) -> None:
        """Writes `item_id,t0,t1,t2` lines (not for extended catalogs: no did/type there)."""
        if self.is_extended:
            raise CatalogError(f"write_text({path}): the text form has no did/type strings; "
                               f"write an extended catalog with write()")
        catalog_io.write_text(path, self._item_ids, self._triples)

    # --- attributes ---------------------------------------------------------------------

    @property
    def item_ids(self) -> np.ndarray:
        return self._item_ids

    @property
    def triples(self) -> np.ndarray:
        return self._triples

    @property
    def dids(self) -> tuple[str, ...] | None:
        return self._dids

    @property
    def types(self) -> tuple[str, ...] | None:
        return self._types

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def num_items(self) -> int:
        return len(self._item_ids)

    @property
    def num_triples(self) -> int:
        """Distinct triples."""
        return len(self._unique_keys)

    @property
    def is_extended(self) -> bool:
        return self._dids is not None

    def __len__(self) -> int:
        return self.num_items

    def __repr__(self) -> str:
        return (f"ItemCatalog(num_items={self.num_items}, num_triples={self.num_triples}, "
                f"vocab_size={self.vocab_size}, is_extended={self.is_extended})")

    def content_hash(self) -> str:
        """16 hex digits of the SHA-256 of the content, in row order: item ids (int64 LE),
        triples (int32 LE) and, when extended, each did and type (UTF-8, length-prefixed).
        Equal content has an equal hash whichever file form it came from."""
        digest = hashlib.sha256()
        digest.update(self._item_ids.astype("<i8").tobytes())
        digest.update(self._triples.astype("<i4").tobytes())
        if self.is_extended:
            for strings in (self._dids, self._types):
                encoded = [text.encode() for text in strings]
                digest.update(np.array([len(b) for b in encoded], dtype="<u4").tobytes())
                digest.update(b"".join(encoded))
        return digest.hexdigest()[:16]

    # --- lookups ------------------------------------------------------------------------

    def find_rows(self, item_ids: Any) -> np.ndarray:
        """Row of each item id ([N] int64), -1 where the id is not in the catalog."""
        queries = catalog_io.as_integer_array(item_ids, "item_ids").astype(np.int64)
        positions = _find_sorted(self._sorted_item_ids, queries.reshape(-1))  # [N]
        rows = np.full(len(positions), -1, dtype=np.int64)  # [N]
        rows[positions >= 0] = self._id_order[positions[positions >= 0]]
        return rows

    def convert(self, triples: Any, each_conversion_threshold: int = 50,
                total_conversion_threshold: int = 1000, seed: int | None = None) -> list[np.ndarray]:
        """Rows (into item_ids/dids/types) of the items of each triple ([N, 3]).

        At most `each_conversion_threshold` rows per triple and
        `total_conversion_threshold` over the call, earlier triples first. Rows
        are in file order; when a cap cuts a triple's items, the first ones are
        kept, or with a `seed` a random sample of them (in file order). A
        triple not in the catalog gets an empty array.
        """
        rows, offsets = self.convert_flat(triples, each_conversion_threshold,
                                          total_conversion_threshold, seed)
        bounds = offsets.tolist()
        return [rows[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def convert_flat(self, triples: Any, each_conversion_threshold: int = 50,
                     total_conversion_threshold: int = 1000, seed: int | None = None,
                     keep_rows: Callable[[np.ndarray], np.ndarray] | None = None,
                     ) -> tuple[np.ndarray, np.ndarray]:
        """`convert` as one flat array: rows `[M]` int64 and offsets `[N + 1]` (triple i's
        rows are `rows[offsets[i]:offsets[i + 1]]`). Vectorised unless a seed samples.
        `keep_rows(rows [K]) -> [K] bool`: only the rows it keeps count, before the caps (a
        request's item filter: as if the catalog held only those)."""
        for name, value in (("each_conversion_threshold", each_conversion_threshold),
                            ("total_conversion_threshold", total_conversion_threshold)):
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise InvalidArgument(f"{name}: got {value!r}, expected an integer >= 0")
        # a cap past the catalog's size cuts nothing; numpy's int64 arithmetic cannot take 2**63
        each_conversion_threshold = min(int(each_conversion_threshold), self.num_items)
        total_conversion_threshold = min(int(total_conversion_threshold), _MAX_INT64)
        if seed is not None and (not isinstance(seed, (int, np.integer)) or seed < 0):
            raise InvalidArgument(f"seed: got {seed!r}, expected an integer >= 0 or None")
        queries = catalog_io.as_integer_array(triples, "triples")
        if queries.ndim != 2 or queries.shape[1] != NUM_LEVELS:
            raise InvalidArgument(f"triples: got shape {queries.shape}, expected [N, {NUM_LEVELS}]")
        positions = self.find_triples(queries)  # [N]
        is_found = positions >= 0  # [N]
        starts = np.where(is_found, self._row_offsets[positions], 0)  # [N]
        num_rows = np.where(is_found, self._row_offsets[positions + 1] - starts, 0)  # [N]
        rows_of = self._key_order   # a triple's rows: rows_of[starts[i]:starts[i] + num_rows[i]]
        if keep_rows is not None:   # the same, over the rows the filter keeps
            every = _ranges(starts, num_rows)  # [K]
            kept = keep_rows(self._key_order[every])  # [K]
            num_rows = np.bincount(np.repeat(np.arange(len(num_rows)), num_rows)[kept],
                                   minlength=len(num_rows))  # [N]
            rows_of, starts = self._key_order[every[kept]], np.cumsum(num_rows) - num_rows
        num_taken = np.minimum(num_rows, each_conversion_threshold)  # [N]
        num_before = np.cumsum(num_taken) - num_taken  # [N]
        num_taken = np.clip(total_conversion_threshold - num_before, 0, num_taken)  # [N]
        offsets = np.concatenate([[0], np.cumsum(num_taken)]).astype(np.int64)  # [N + 1]
        # the first num_taken rows of each triple: start + 0, 1, ... (one vectorised pass)
        picks = np.repeat(starts - offsets[:-1], num_taken) + np.arange(offsets[-1])  # [M]
        if seed is not None:
            rng = np.random.default_rng(seed)
            for index in np.flatnonzero(num_taken < num_rows).tolist():  # only triples a cap cut
                sample = np.sort(rng.choice(num_rows[index], num_taken[index], replace=False))
                picks[offsets[index]:offsets[index + 1]] = starts[index] + sample
        return rows_of[picks], offsets

    # --- constrained decoding -----------------------------------------------------------

    def trie(self) -> Trie:
        """The trie of the unique triples as host arrays: the levels `constraint_tables` puts
        on the device, and each node's parent (what filters need)."""
        vocab_size = self._vocab_size
        triple_keys = self._unique_keys  # [U] sorted
        prefix_keys = triple_keys // vocab_size  # [U] t0*V + t1, sorted
        unique_prefixes = _unique_sorted(prefix_keys)  # [P]
        first_tokens = _unique_sorted(unique_prefixes // vocab_size)  # [F]
        prefix_parents = np.searchsorted(first_tokens, unique_prefixes // vocab_size)  # [P]
        triple_parents = np.searchsorted(unique_prefixes, prefix_keys)  # [U]
        return Trie(tokens=(first_tokens, unique_prefixes % vocab_size, triple_keys % vocab_size),
                    parents=(np.zeros(len(first_tokens), dtype=np.int64), prefix_parents,
                             triple_parents))

    def triple_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """Each row's triple (its index among the sorted unique triples, `[n]`), and each
        triple's item count (`[U]`)."""
        counts = np.diff(self._row_offsets)  # [U]
        rows_triple = np.empty(self.num_items, dtype=np.int64)  # [n]
        rows_triple[self._key_order] = np.repeat(np.arange(len(counts)), counts)
        return rows_triple, counts

    def find_triples(self, triples: np.ndarray) -> np.ndarray:
        """Index of each triple (`[N, 3]`) among the catalog's sorted unique triples (the
        trie's depth-3 node), -1 where the catalog does not hold it."""
        queries = np.asarray(triples).reshape(-1, NUM_LEVELS)
        is_valid = ((queries >= 0) & (queries < self._vocab_size)).all(axis=1)  # [N]
        keys = np.where(is_valid, _triple_keys(np.where(is_valid[:, None], queries, 0),
                                               self._vocab_size), -1)  # [N]
        return _find_sorted(self._unique_keys, keys)

    def constraint_tables(self, device: str | torch.device = "cpu") -> ConstraintTables:
        """Builds the CSR trie of the unique triples (see `ConstraintTables`) on `device`."""
        import torch

        trie = self.trie()
        level_offsets = (np.array([0, len(trie.tokens[0])], dtype=np.int64),  # [2]
                         _csr_offsets(trie.parents[1], len(trie.tokens[0])),  # [F + 1]
                         _csr_offsets(trie.parents[2], len(trie.tokens[1])))  # [P + 1]
        max_children = tuple(int(np.diff(o).max()) if len(o) > 1 else 0 for o in level_offsets)
        first = trie.tokens[0]   # sorted and unique: the ends say whether it is one run
        is_run = len(first) > 0 and int(first[-1]) - int(first[0]) + 1 == len(first)
        return ConstraintTables(
            tokens=tuple(torch.as_tensor(t.astype(np.int64), device=device) for t in trie.tokens),
            offsets=tuple(torch.as_tensor(o, device=device) for o in level_offsets),
            max_children=max_children, vocab_size=self._vocab_size,
            root_run=(int(first[0]), int(first[-1]) + 1) if is_run else None)


def random_catalog(num_items: int, vocab_size: int, seed: int = 0) -> ItemCatalog:
    """A catalog of `num_items` unique ids in [1, 2**62] with uniform tokens at every level."""
    if not isinstance(num_items, (int, np.integer)) or isinstance(num_items, bool) or num_items < 0:
        raise InvalidArgument(f"num_items: got {num_items!r}, expected an integer >= 0")
    vocab_size = catalog_io.check_vocab_size(vocab_size)
    rng = np.random.default_rng(seed)
    item_ids = rng.choice(_MAX_RANDOM_ITEM_ID, size=num_items, replace=False) + 1  # [n] int64
    triples = rng.integers(0, vocab_size, size=(num_items, NUM_LEVELS), dtype=np.int32)  # [n, 3]
    return ItemCatalog(item_ids, triples, vocab_size)
