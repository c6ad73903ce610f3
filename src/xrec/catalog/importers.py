"""Item catalogs from what semantic-ID projects ship (docs/catalog.md), via the tokenizer.

- OpenOneRec `sid2pid.json`: `{"<c1*K*K + c2*K + c3>": [items]}` (K the codebook
  size, 8192), an item an integer or `{"pid": ..}` / `{"iid": ..}` (OpenOneRec's
  files hold `{"pid", "count", "count_after_downsample"}`, most popular first);
  codes become the tokens `<s_a_c1>`, `<s_b_c2>`, `<s_c_c3>`.
- a JSON map item id -> token strings (MiniOneRec's index: `{"0": ["<a_12>", "<b_7>", "<c_200>"]}`).
- a CSV `item_id,token,token,token` (an optional header line: a first row of four
  fields, none an integer; the rule of the text catalog reader, `formats.is_header_row`).

Token strings become ids through the model's tokenizer, one lookup per distinct
string. Rows keep file order (sid2pid: key order, then list order), which the
catalog keeps per triple; an item id listed twice keeps its last triple
(docs/catalog.md). Every bad entry is a `CatalogError` naming the file, the
item or key, and the token.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import os
import re
from pathlib import Path
from typing import Any, Callable

import numpy as np

from xrec.catalog.items import ItemCatalog
from xrec.catalog.formats import (
    MAX_INT64_CHARS, NUM_LEVELS, CatalogError, check_vocab_size, is_header_row)
from xrec.tokenizer import PromptTokenizer
from xrec.utils.files import FileRefused, read_regular_file

__all__ = ["import_sid2pid", "import_token_csv", "import_token_map"]

MAX_CODEBOOK_SIZE = 1 << 20  # K**3 keys must fit in int64
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_INTEGER = re.compile(r"-?[0-9]+")
_INTEGER_LINES = re.compile(r"(?:-?[0-9]+\n)*")
_UNSIGNED_LINES = re.compile(r"(?:[0-9]+\n)*")
_LEVEL_LETTERS = "abc"
_MAX_KEY_DIGITS = 1000  # a longer semantic ID key is only named by its first digits


def _read_text(path: Path) -> str:
    try:
        return read_regular_file(path).decode("utf-8-sig")   # a BOM (Excel's CSV) is dropped
    except FileRefused as exc:
        raise CatalogError(f"cannot read {path}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise CatalogError(f"{path}: byte offset {exc.start} is not UTF-8") from None


class _RepeatedKeys(dict):
    """A JSON object that names a key more than once: the last value per key, as `json`
    gives, and every (key, value) pair in file order (`pairs`)."""

    pairs: list[tuple[str, Any]]


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`object_pairs_hook`: a dict, which keeps the pairs when a key repeats."""
    made = dict(pairs)
    if len(made) == len(pairs):
        return made
    repeated = _RepeatedKeys(made)
    repeated.pairs = pairs
    return repeated


def _read_json_object(path: Path) -> list[tuple[str, Any]]:
    """The top-level object's (key, value) pairs in file order, a repeated key included."""
    try:
        data = json.loads(_read_text(path), object_pairs_hook=_json_object)
    except json.JSONDecodeError as exc:
        raise CatalogError(f"{path}: not valid JSON ({exc})") from exc
    except RecursionError:
        raise CatalogError(f"{path}: JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise CatalogError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data.pairs if isinstance(data, _RepeatedKeys) else list(data.items())


def _item_id(path: Path, text: str, where: str) -> int:
    """An item id written as decimal text (a JSON key or a CSV field), checked for int64."""
    if (len(text) > MAX_INT64_CHARS or not _INTEGER.fullmatch(text)
            or not _INT64_MIN <= int(text) <= _INT64_MAX):
        raise CatalogError(f"{path}: {where}item id {text!r} is not an integer in int64")
    return int(text)


def _parse_integers(texts: list[str], lines: re.Pattern = _INTEGER_LINES) -> np.ndarray | None:
    """[n] int64 of decimal texts in one pass, or None when one is not (callers then find it)."""
    if texts and lines.fullmatch("\n".join(texts) + "\n") is None:
        return None
    try:
        return np.fromiter(map(int, texts), dtype=np.int64, count=len(texts))  # [n]
    except (OverflowError, ValueError):
        return None


def _item_ids(path: Path, texts: list[str], where_of: Callable[[int], str]) -> np.ndarray:
    """Item ids written as decimal texts: [n] int64; the first bad one is an error."""
    item_ids = _parse_integers(texts)
    if item_ids is None:  # one by one, to name the bad one
        item_ids = np.array([_item_id(path, text, where_of(row)) for row, text in enumerate(texts)],
                            dtype=np.int64)  # [n]
    return item_ids


def _itemic_token(level: int, code: int) -> str:
    return f"<s_{_LEVEL_LETTERS[level]}_{code}>"


def _token_error(path: Path, name: str, token: str, token_id: int, vocab_size: int) -> CatalogError:
    """A token unknown to the tokenizer (token_id -1) or outside the model's vocabulary."""
    if token_id < 0:
        return CatalogError(f"{path}: {name}: token {token!r} is not in the model's tokenizer")
    return CatalogError(f"{path}: {name}: token {token!r} has id {token_id}, outside the "
                        f"model's vocabulary [0, {vocab_size})")


def _token_ids(path: Path, tokens: list[str], name_of: Callable[[int], str],
               tokenizer: PromptTokenizer, vocab_size: int) -> np.ndarray:
    """Ids of `tokens` ([n * 3] strings; name_of(i) names item i in errors): [n, 3] int32."""
    lookup = {token: tokenizer.token_to_id(token) for token in dict.fromkeys(tokens)}
    for token, token_id in lookup.items():  # distinct tokens in file order
        if token_id is None or token_id >= vocab_size:
            name = name_of(tokens.index(token) // NUM_LEVELS)
            raise _token_error(path, name, token, -1 if token_id is None else token_id,
                               vocab_size)
    ids = np.fromiter(map(lookup.__getitem__, tokens), dtype=np.int64, count=len(tokens))  # [n*3]
    return ids.reshape(-1, NUM_LEVELS).astype(np.int32)  # [n, 3]


def _flat_tokens(path: Path, values: list[Any], where_of: Callable[[int], str]) -> list[str]:
    """[n * 3] token strings of n lists of 3; the first bad list is an error."""
    if all(type(value) is list and len(value) == NUM_LEVELS for value in values):
        tokens = list(itertools.chain.from_iterable(values))
        if set(map(type, tokens)) <= {str}:
            return tokens
    for row, value in enumerate(values):  # one by one, to name the bad one
        if (not isinstance(value, list) or len(value) != NUM_LEVELS
                or not all(isinstance(token, str) for token in value)):
            raise CatalogError(f"{path}: {where_of(row)}: got {value!r:.120}, expected a list "
                               f"of {NUM_LEVELS} token strings")
    return [str(token) for value in values for token in value]


def import_token_map(path: str | os.PathLike, tokenizer: PromptTokenizer,
                     vocab_size: int) -> ItemCatalog:
    """A JSON object item id -> [token, token, token] (MiniOneRec's index)."""
    path, vocab_size = Path(path), check_vocab_size(vocab_size)
    pairs = _read_json_object(path)
    keys = [key for key, _ in pairs]
    item_ids = _item_ids(path, keys, lambda row: "")  # [n]
    tokens = _flat_tokens(path, [value for _, value in pairs], lambda row: f"item {keys[row]}")
    triples = _token_ids(path, tokens, lambda row: f"item {keys[row]}", tokenizer,
                         vocab_size)  # [n, 3]
    return ItemCatalog(item_ids, triples, vocab_size)


def import_token_csv(path: str | os.PathLike, tokenizer: PromptTokenizer,
                     vocab_size: int) -> ItemCatalog:
    """`item_id,token,token,token` lines; blank and `#` lines skipped; a first line of four
    fields, none an integer, is a header and skipped (`is_header_row`, as the text catalog
    reader)."""
    path, vocab_size = Path(path), check_vocab_size(vocab_size)
    id_texts, line_numbers, rows = [], [], []
    is_first = True
    reader = csv.reader(io.StringIO(_read_text(path), newline=""))
    try:
        for row in reader:
            fields = [field.strip() for field in row]
            if not any(fields) or fields[0].startswith("#"):
                continue
            is_header = is_first and is_header_row(fields)
            is_first = False
            if not is_header:
                id_texts.append(fields[0])
                line_numbers.append(reader.line_num)
                rows.append(fields[1:])
    except csv.Error as exc:
        raise CatalogError(f"{path}: line {reader.line_num}: {exc}") from exc

    def where(row: int) -> str:
        return f"line {line_numbers[row]}: item {id_texts[row]}"

    item_ids = _item_ids(path, id_texts, lambda row: f"line {line_numbers[row]}: ")  # [n]
    tokens = _flat_tokens(path, rows, where)
    triples = _token_ids(path, tokens, where, tokenizer, vocab_size)  # [n, 3]
    return ItemCatalog(item_ids, triples, vocab_size)


def _pid(path: Path, key: str, item: Any) -> int:
    value = item.get("pid", item.get("iid")) if isinstance(item, dict) else item
    if (not isinstance(value, int) or isinstance(value, bool)
            or not _INT64_MIN <= value <= _INT64_MAX):
        raise CatalogError(f"{path}: key {key}: item {item!r:.80} is not an integer item id in "
                           f"int64 (or an object with one under \"pid\" or \"iid\")")
    return value


def import_sid2pid(path: str | os.PathLike, tokenizer: PromptTokenizer, vocab_size: int,
                   codebook_size: int = 8192) -> ItemCatalog:
    """OpenOneRec's sid2pid.json: decimal key c1*K*K + c2*K + c3 -> list of items."""
    path, vocab_size = Path(path), check_vocab_size(vocab_size)
    if (not isinstance(codebook_size, int) or isinstance(codebook_size, bool)
            or not 1 <= codebook_size <= MAX_CODEBOOK_SIZE):
        raise CatalogError(f"codebook_size: got {codebook_size!r}, expected an integer in "
                           f"[1, {MAX_CODEBOOK_SIZE}]")
    pairs = _read_json_object(path)
    keys, values = [key for key, _ in pairs], [value for _, value in pairs]
    sids = _parse_integers(keys, _UNSIGNED_LINES)  # [K]
    if sids is None or (sids >= codebook_size ** 3).any():
        for key in keys:  # one by one, to name the bad one
            if not (key.isascii() and key.isdigit()):
                raise CatalogError(f"{path}: key {key!r} is not a decimal semantic ID "
                                   f"(c1*{codebook_size}**2 + c2*{codebook_size} + c3)")
            if len(key) > _MAX_KEY_DIGITS:   # int() of thousands of digits raises ValueError
                raise CatalogError(f"{path}: key {key:.24}... ({len(key)} digits): code c1 is "
                                   f"outside the codebook [0, {codebook_size})")
            if int(key) >= codebook_size ** 3:
                raise CatalogError(f"{path}: key {key}: code c1 = {int(key) // codebook_size ** 2}"
                                   f" is outside the codebook [0, {codebook_size})")
    if not all(type(value) is list for value in values):
        key, value = next((k, v) for k, v in pairs if not isinstance(v, list))
        raise CatalogError(f"{path}: key {key}: got {value!r:.80}, expected a list of items")
    codes = np.stack([sids // codebook_size ** 2, sids // codebook_size % codebook_size,
                      sids % codebook_size], axis=1)  # [K, 3]
    triples = np.empty(codes.shape, dtype=np.int64)  # [K, 3], -1 where the token is unknown
    for level in range(NUM_LEVELS):  # one tokenizer lookup per distinct code
        unique_codes, inverse = np.unique(codes[:, level], return_inverse=True)  # [C], [K]
        ids = [tokenizer.token_to_id(_itemic_token(level, code)) for code in unique_codes.tolist()]
        triples[:, level] = np.array([-1 if i is None else i for i in ids], dtype=np.int64)[inverse]
    is_bad = (triples < 0) | (triples >= vocab_size)  # [K, 3]
    if is_bad.any():
        row, level = np.argwhere(is_bad)[0].tolist()  # the first bad key in file order
        raise _token_error(path, f"key {keys[row]}", _itemic_token(level, int(codes[row, level])),
                           int(triples[row, level]), vocab_size)
    counts = np.fromiter(map(len, values), dtype=np.int64, count=len(values))  # [K]
    items = list(itertools.chain.from_iterable(values))
    item_ids = None
    if all(type(item) is int for item in items):  # the fast path: plain integers
        try:
            item_ids = np.array(items, dtype=np.int64)  # [n]
        except OverflowError:
            pass
    if item_ids is None:  # {"pid": ...} objects, or a bad item somewhere: one by one
        key_of = np.repeat(np.arange(len(keys)), counts).tolist()  # [n]
        item_ids = np.array([_pid(path, keys[key_of[row]], item)
                             for row, item in enumerate(items)], dtype=np.int64)  # [n]
    return ItemCatalog(item_ids, np.repeat(triples, counts, axis=0), vocab_size)
