"""Catalog file formats (docs/catalog.md): binary default, binary extended, text.

numpy only, no torch. Readers return the columns in file order, duplicates
included (`ItemCatalog` resolves them), after checking every record:

- default record, 20 bytes: `int64 item_id, int32 t0, int32 t1, int32 t2`;
- extended record: `int64 item_id, uint32 did_len, did, uint32 type_len, type,
  int32 t0, int32 t1, int32 t2`, each string UTF-8 and at most 1 MiB;
- text: one `item_id,t0,t1,t2` per line; blank lines and `#` lines ignored, and
  so is a header line (the first other line when it has four fields and none is an
  integer, as `item_id,t0,t1,t2`: the rule of `xrec catalog import`'s CSV, `is_header_row`).

All binary fields are little-endian, no header. Files are read with
`xrec.utils.files.read_regular_file`: a FIFO, a device or a directory is refused
before anything is read. A bad file raises `CatalogError` naming the file, the
byte offset of the record (line number for text) and the rule it breaks; it never
quotes the file's text (a server may be asked to read a file that is not a
catalog: docs/serving.md, "Catalog files").
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import numpy as np

from xrec.errors import InvalidArgument
from xrec.utils.files import FileRefused, read_regular_file, write_file_atomically

MAX_STRING_BYTES = 1 << 20
# Triples are packed into one int64 key t0*V*V + t1*V + t2, so V**3 must fit.
MAX_VOCAB_SIZE = 1 << 21
DEFAULT_RECORD = np.dtype([("item_id", "<i8"), ("tokens", "<i4", (3,))])  # 20 bytes
NUM_LEVELS = 3
_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
# ASCII digits only: `\d` would take other scripts' digits, which int() then reads too
_TEXT_LINE = re.compile(r"\s*(-?[0-9]+)\s*,\s*(-?[0-9]+)\s*,\s*(-?[0-9]+)\s*,\s*(-?[0-9]+)\s*")
_INTEGER = re.compile(r"-?[0-9]+")
_LINE_BREAK = re.compile(r"\r\n|\r|\n")
MAX_INT64_CHARS = len(str(-(1 << 63)))  # 20: a longer decimal is never an int64
_TEXT_FIELDS = ("item_id", "t0", "t1", "t2")
_EXTENDED_FIXED_BYTES = 8 + 4 + 4 + 12  # an extended record without its two strings
_UINT32 = struct.Struct("<I")
_STRING_FIELDS = ("did", "type")


class CatalogError(InvalidArgument):
    """A catalog file or catalog array that breaks the format of docs/catalog.md."""


@dataclass(frozen=True)
class CatalogColumns:
    """One catalog file's records in file order (duplicate item ids not yet resolved)."""

    item_ids: np.ndarray  # [n] int64
    triples: np.ndarray  # [n, 3] int32
    dids: list[str] | None = None
    types: list[str] | None = None


def check_vocab_size(vocab_size: object) -> int:
    if (not isinstance(vocab_size, (int, np.integer)) or isinstance(vocab_size, bool)
            or not 1 <= vocab_size <= MAX_VOCAB_SIZE):
        raise CatalogError(f"vocab_size: got {vocab_size!r}, expected an integer in "
                           f"[1, {MAX_VOCAB_SIZE}]")
    return int(vocab_size)


def first_bad_token(triples: np.ndarray, vocab_size: int) -> tuple[int, int] | None:
    """(row, level) of the first token outside [0, vocab_size), or None."""
    is_bad = (triples < 0) | (triples >= vocab_size)  # [n, 3]
    if not is_bad.any():
        return None
    row, level = np.argwhere(is_bad)[0]
    return int(row), int(level)


def _check_tokens(path: Path, triples: np.ndarray, vocab_size: int, record_offsets) -> None:
    bad = first_bad_token(triples, vocab_size)
    if bad is not None:
        row, level = bad
        raise CatalogError(f"catalog {path}: record at offset {record_offsets[row]}: token "
                           f"t{level} = {int(triples[row, level])} is outside [0, {vocab_size})")


def _read_bytes(path: Path) -> bytes:
    try:
        return read_regular_file(path)
    except FileRefused as exc:
        raise CatalogError(f"cannot read catalog file {path}: {exc}") from None


def is_header_row(fields: list[str]) -> bool:
    """A CSV or text catalog's first row is a header when it has an item's four fields and
    none of them is an integer (`item_id,t0,t1,t2`; the same rule for `read_text` and
    `xrec catalog import`)."""
    return (len(fields) == 1 + NUM_LEVELS
            and not any(_INTEGER.fullmatch(field.strip()) for field in fields))


def _text_line_problem(line: str) -> str:
    """What is wrong with a text catalog line, without quoting it."""
    fields = [field.strip() for field in line.split(",")]
    if len(fields) != len(_TEXT_FIELDS):
        return f"{len(fields)} comma-separated field(s)"
    names = [name for name, field in zip(_TEXT_FIELDS, fields) if not _INTEGER.fullmatch(field)]
    return f"field {names[0]} is not an integer" if names else "stray characters"


def read_binary(path: str | os.PathLike, vocab_size: int) -> CatalogColumns:
    """Reads 20-byte default records, vectorised."""
    path = Path(path)
    data = _read_bytes(path)
    num_items, num_left = divmod(len(data), DEFAULT_RECORD.itemsize)
    if num_left:
        raise CatalogError(
            f"catalog {path}: trailing partial record at offset {num_items * DEFAULT_RECORD.itemsize}"
            f": {num_left} bytes left, a record is {DEFAULT_RECORD.itemsize} bytes")
    records = np.frombuffer(data, dtype=DEFAULT_RECORD, count=num_items)  # [n]
    triples = records["tokens"].astype(np.int32)  # [n, 3]
    _check_tokens(path, triples, vocab_size, np.arange(num_items) * DEFAULT_RECORD.itemsize)
    return CatalogColumns(records["item_id"].astype(np.int64), triples)


def read_extended(path: str | os.PathLike, vocab_size: int) -> CatalogColumns:
    """Reads extended records (with did and type strings): one walk over the length fields
    (`_walk_records`), then numpy over the whole buffer. A bad file raises the first problem
    in file order (inside a record, in the order of its fields)."""
    path = Path(path)
    data = _read_bytes(path)
    buffer = np.frombuffer(data, dtype=np.uint8)  # [size]
    bounds = np.array(_walk_records(data), dtype=np.int64)  # [n + 1]
    starts, ends = bounds[:-1], bounds[1:]  # [n] record k is data[starts[k]:ends[k]]
    num_inside = _num_leading_true(ends <= len(data))
    starts, ends = starts[:num_inside], ends[:num_inside]
    did_lens = _values_at(buffer, starts + 8, "<u4")[:, 0].astype(np.int64)  # [n]
    type_lens = ends - starts - _EXTENDED_FIXED_BYTES - did_lens  # [n]
    num_whole = _num_leading_true((did_lens <= MAX_STRING_BYTES) & (type_lens <= MAX_STRING_BYTES))
    starts, ends = starts[:num_whole], ends[:num_whole]
    did_starts = starts + 12  # [n]
    dids, types = _decode_strings(path, data, starts, did_starts, did_lens[:num_whole],
                                  did_starts + did_lens[:num_whole] + 4, type_lens[:num_whole])
    if num_whole < len(bounds) - 1:
        _raise_record_problem(path, data, int(bounds[num_whole]))
    item_ids = _values_at(buffer, starts, "<i8")[:, 0].astype(np.int64)  # [n]
    triples = _values_at(buffer, ends - 12, "<i4", NUM_LEVELS).astype(np.int32)  # [n, 3]
    _check_tokens(path, triples, vocab_size, starts)
    return CatalogColumns(item_ids, triples, dids, types)


def _walk_records(data: bytes) -> list[int]:
    """Where each extended record starts, and last where the walk ended: record k is
    `data[bounds[k]:bounds[k + 1]]`. The serial part of `read_extended` (a record's place
    depends on every length before it), so it reads the two lengths and nothing else: the
    records from the first bad one on (a length over the limit, past the end) are checked
    and cut by the caller. A length field past the end makes the last bound len(data) + 1."""
    read_uint32, size = _UINT32.unpack_from, len(data)
    bounds, offset = [], 0
    try:
        while offset < size:
            bounds.append(offset)
            type_at = offset + 12 + read_uint32(data, offset + 8)[0]
            offset = type_at + 16 + read_uint32(data, type_at)[0]
    except struct.error:
        offset = size + 1
    bounds.append(offset)
    return bounds


def _num_leading_true(is_ok: np.ndarray) -> int:
    return int(is_ok.argmin()) if len(is_ok) and not is_ok.all() else len(is_ok)


def _values_at(buffer: np.ndarray, offsets: np.ndarray, dtype: str, count: int = 1) -> np.ndarray:
    """The `count` values of `dtype` from each byte offset of `buffer`, unaligned: [n, count]."""
    num_bytes = np.dtype(dtype).itemsize * count
    if len(offsets) == 0:   # the buffer may be shorter than one window
        return np.empty((0, count), dtype)
    windows = np.lib.stride_tricks.sliding_window_view(buffer, num_bytes)  # [size - bytes + 1, bytes]
    return windows[offsets].view(dtype)  # [n, count]


def _decode_strings(path: Path, data: bytes, starts: np.ndarray, did_starts: np.ndarray,
                    did_lens: np.ndarray, type_starts: np.ndarray, type_lens: np.ndarray,
                    ) -> tuple[list[str], list[str]]:
    """The did and type strings of whole extended records, in file order, decoded at once:
    every string's bytes with a NUL after each are one buffer, UTF-8 as a whole exactly when
    each string is (a NUL is never part of another character), split at the NULs. A string
    that is not UTF-8, or holds a NUL, has them decoded one by one (which names the first
    that is not)."""
    begins = np.stack([did_starts, type_starts], axis=1).ravel()  # [2n] did, type, did, ...
    lengths = np.stack([did_lens, type_lens], axis=1).ravel()  # [2n]
    # the file as runs: skipped, a string and the byte after it, skipped, ...
    edges = np.stack([begins, begins + lengths + 1], axis=1).ravel()  # [4n]
    run_lengths = np.diff(edges, prepend=0, append=len(data))  # [4n + 1]
    is_string = np.arange(len(run_lengths)) % 2 == 1  # [4n + 1]
    joined = np.frombuffer(data, dtype=np.uint8)[np.repeat(is_string, run_lengths)]  # [sum + 2n]
    joined[np.cumsum(lengths + 1) - 1] = 0   # over the first byte of type_len or tokens
    try:
        strings = joined.tobytes().decode("utf-8").split("\0")  # [2n + 1] the last one empty
    except UnicodeDecodeError:
        strings = []
    if len(strings) != len(begins) + 1:
        strings = [_decode_string(path, data, int(starts[row // 2]), _STRING_FIELDS[row % 2],
                                  begin, begin + length)
                   for row, (begin, length) in enumerate(zip(begins.tolist(), lengths.tolist()))]
        strings.append("")
    return strings[0:-1:2], strings[1:-1:2]


def _decode_string(path: Path, data: bytes, start: int, field: str, begin: int, end: int) -> str:
    """`data[begin:end]`, the `field` string of the record at `start`, from UTF-8."""
    try:
        return data[begin:end].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CatalogError(f"catalog {path}: record at offset {start}: {field} at offset "
                           f"{begin} is not UTF-8 ({exc.reason})") from exc


def _raise_record_problem(path: Path, data: bytes, start: int) -> NoReturn:
    """Raises the first problem of the extended record at `start`, one `_walk_records` could
    not take whole, found by reading its fields in order: past its two strings, only its
    tokens can be missing."""
    offset, size = start, len(data)

    def partial(field: str, num_bytes: int) -> CatalogError:
        return CatalogError(f"catalog {path}: trailing partial record at offset {start}: "
                            f"{field} needs bytes [{offset}, {offset + num_bytes}) but the file "
                            f"ends at {size}")

    if offset + 8 > size:
        raise partial("item_id", 8)
    offset += 8
    for field in _STRING_FIELDS:
        if offset + 4 > size:
            raise partial(f"{field}_len", 4)
        (length,) = _UINT32.unpack_from(data, offset)
        if length > MAX_STRING_BYTES:
            raise CatalogError(f"catalog {path}: record at offset {start}: {field}_len = "
                               f"{length} at offset {offset} exceeds the limit of "
                               f"{MAX_STRING_BYTES} bytes")
        offset += 4
        if offset + length > size:
            raise partial(field, length)
        _decode_string(path, data, start, field, offset, offset + length)
        offset += length
    raise partial("tokens", 12)


def read_text(path: str | os.PathLike, vocab_size: int) -> CatalogColumns:
    """Reads `item_id,t0,t1,t2` lines; blank lines, lines starting with # and a header line
    (`is_header_row`) are skipped."""
    path = Path(path)
    try:
        text = _read_bytes(path).decode("utf-8-sig")   # a BOM is dropped
    except UnicodeDecodeError as exc:
        raise CatalogError(f"catalog {path}: byte offset {exc.start} is not UTF-8") from None
    rows = []
    is_first = True
    # \r\n, \r and \n end a line (as the CSV importer and editors count them); str.splitlines
    # would also break at form feeds, \x1c-\x1e, NEL and U+2028
    for line_number, line in enumerate(_LINE_BREAK.split(text), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        is_header, is_first = is_first and is_header_row(stripped.split(",")), False
        if is_header:
            continue
        match = _TEXT_LINE.fullmatch(stripped)
        if match is None:
            raise CatalogError(f"catalog {path}: line {line_number}: the line is not "
                               f"'item_id,t0,t1,t2' (four integers): "
                               f"{_text_line_problem(stripped)}")
        long_field = next((name for name, field in zip(_TEXT_FIELDS, match.groups())
                           if len(field) > MAX_INT64_CHARS), None)
        if long_field is not None:   # int() of thousands of digits raises a bare ValueError
            raise CatalogError(f"catalog {path}: line {line_number}: {long_field} has more "
                               f"than {MAX_INT64_CHARS} characters: it does not fit in int64")
        item_id, *triple = (int(field) for field in match.groups())
        if not _INT64_MIN <= item_id <= _INT64_MAX:
            raise CatalogError(f"catalog {path}: line {line_number}: item_id = {item_id} "
                               f"does not fit in int64")
        for level, token in enumerate(triple):
            if not 0 <= token < vocab_size:
                raise CatalogError(f"catalog {path}: line {line_number}: token t{level} = "
                                   f"{token} is outside [0, {vocab_size})")
        rows.append((item_id, *triple))
    table = np.array(rows, dtype=np.int64).reshape(-1, 1 + NUM_LEVELS)  # [n, 4]
    return CatalogColumns(table[:, 0].copy(), table[:, 1:].astype(np.int32))


def as_integer_array(values: Any, name: str) -> np.ndarray:
    array = np.asarray(values)
    if array.size == 0 and array.dtype.kind == "f":  # np.asarray([]) is float64
        return array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise CatalogError(f"{name}: got dtype {array.dtype}, expected integers")
    if array.dtype == np.uint64 and array.size and array.max() > _INT64_MAX:
        raise CatalogError(f"{name}: value {int(array.max())} does not fit in int64")
    return array


def prepare_columns(item_ids: Any, triples: Any, vocab_size: int, dids: Any = None,
                    types: Any = None) -> CatalogColumns:
    """Checks catalog arrays and applies the file rules: an item id listed more
    than once keeps only its last record, at the position of that record."""
    item_ids = as_integer_array(item_ids, "item_ids")
    triples = as_integer_array(triples, "triples")
    num_rows = len(item_ids)
    if num_rows == 0 and triples.size == 0:
        triples = triples.reshape(0, NUM_LEVELS)  # [0, 3]
    if item_ids.ndim != 1 or triples.shape != (num_rows, NUM_LEVELS):
        raise CatalogError(f"item_ids {item_ids.shape} and triples {triples.shape}: expected "
                           f"shapes [n] and [n, {NUM_LEVELS}]")
    bad = first_bad_token(triples, vocab_size)
    if bad is not None:
        raise CatalogError(f"triples row {bad[0]}: token t{bad[1]} = {int(triples[bad])} is "
                           f"outside [0, {vocab_size})")
    if (dids is None) != (types is None):
        raise CatalogError("dids and types: give both (extended catalog) or neither")
    if dids is not None:
        for name, values in (("dids", dids), ("types", types)):
            if isinstance(values, (str, bytes)):   # list() would make one string per character
                raise CatalogError(f"{name}: got a {type(values).__name__}, expected a sequence "
                                   f"of one str per item")
        dids, types = list(dids), list(types)
        if len(dids) != num_rows or len(types) != num_rows:
            raise CatalogError(f"dids ({len(dids)}) and types ({len(types)}): expected one per "
                               f"item ({num_rows})")
        _check_strings(dids, "did")
        _check_strings(types, "type")

    id_order = np.argsort(item_ids, kind="stable")  # [n] equal ids stay in file order
    sorted_ids = item_ids[id_order]  # [n]
    is_last = np.ones(num_rows, dtype=bool)  # [n] the last record of its id
    is_last[:-1] = sorted_ids[:-1] != sorted_ids[1:]
    if not is_last.all():
        kept_rows = np.sort(id_order[is_last])  # [n'] file order
        item_ids, triples = item_ids[kept_rows], triples[kept_rows]
        if dids is not None:
            dids, types = [dids[row] for row in kept_rows], [types[row] for row in kept_rows]
    return CatalogColumns(item_ids.astype(np.int64), triples.astype(np.int32), dids, types)


def _check_strings(values: list[Any], field: str) -> None:
    """Each value is a str that UTF-8 encodes (no lone surrogate) in at most 1 MiB; the first
    bad one is named (`encode_string`). One join and one encode, not a loop over items."""
    try:
        joined = "".join(values)
    except TypeError:   # not every value is a str
        row = next(row for row, value in enumerate(values) if not isinstance(value, str))
        encode_string(values[row], field, row)
    lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))  # [n]
    try:
        joined.encode("utf-8")
    except UnicodeEncodeError as exc:   # the row whose characters hold exc.start
        row = int(np.searchsorted(np.cumsum(lengths), exc.start, side="right"))
        encode_string(values[row], field, row)
    # a str of at most MAX/4 characters always fits in MAX UTF-8 bytes
    for row in np.flatnonzero(lengths > MAX_STRING_BYTES // 4).tolist():
        encode_string(values[row], field, row)


def encode_string(value: str, field: str, row: int) -> bytes:
    """UTF-8 bytes of a did/type string, checked against the 1 MiB limit."""
    if not isinstance(value, str):
        raise CatalogError(f"{field} of row {row}: got {type(value).__name__}, expected str")
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise CatalogError(f"{field} of row {row}: character {exc.start} "
                           f"({value[exc.start]!r}) cannot be written in UTF-8 (a lone "
                           f"surrogate)") from None
    if len(encoded) > MAX_STRING_BYTES:
        raise CatalogError(f"{field} of row {row}: {len(encoded)} bytes in UTF-8, at most "
                           f"{MAX_STRING_BYTES} allowed")
    return encoded


def write_binary(path: str | os.PathLike, item_ids: np.ndarray, triples: np.ndarray) -> None:
    records = np.empty(len(item_ids), dtype=DEFAULT_RECORD)  # [n]
    records["item_id"] = item_ids
    records["tokens"] = triples
    write_file_atomically(path, records.tobytes())


def write_extended(path: str | os.PathLike, item_ids: np.ndarray, triples: np.ndarray,
                   dids: list[str], types: list[str]) -> None:
    parts = []
    for row, (item_id, did, type_, triple) in enumerate(zip(item_ids.tolist(), dids, types,
                                                            triples.tolist())):
        did_bytes = encode_string(did, "did", row)
        type_bytes = encode_string(type_, "type", row)
        parts += [struct.pack("<qI", item_id, len(did_bytes)), did_bytes,
                  struct.pack("<I", len(type_bytes)), type_bytes, struct.pack("<3i", *triple)]
    write_file_atomically(path, b"".join(parts))


def write_text(path: str | os.PathLike, item_ids: np.ndarray, triples: np.ndarray) -> None:
    lines = ["# item_id,t0,t1,t2"]
    lines += [f"{item_id},{t0},{t1},{t2}"
              for item_id, (t0, t1, t2) in zip(item_ids.tolist(), triples.tolist())]
    write_file_atomically(path, ("\n".join(lines) + "\n").encode("utf-8"))
