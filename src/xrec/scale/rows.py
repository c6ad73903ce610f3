"""`xrec batch` rows: input files -> requests, answers -> output records and files.

Input: one Parquet or JSONL file, one request per row: an id column (`--id-column`,
default `id`) and exactly one input of `token_ids` (list of ints), `prompt` (text,
models with a tokenizer) or `sparse_embedding` (rows of d_model floats). Optional:
`exclude_items`, the row's catalog item ids never to recommend (a JSON list; Parquet:
a list of integers; null or absent: none), as `RecRequest.exclude_items`.

Output: one record per input row, in input order:

    id       the row's id
    tokens   [N][rounds] the semantic ids, best first
    scores   [N] their scores (sum of the rounds' log-probs)
    items    [N][*] the catalog items of each semantic id
    error    null, or "CODE: message" for a row that failed (its lists are empty)

A row that fails (a malformed JSON line or one that is not UTF-8, a Parquet value Python
cannot hold: a string that is not UTF-8, a timestamp past year 9999; no input, a request the
engine refuses: a boolean among its ids, a bad `exclude_items`, an id that does not fit the
output's int64 id column, a JSON integer id past 64 bits, a NaN or infinite id, an array or
object id nested deeper than JSON output writes) gets an error record and the run goes on; a
file-level problem (no id column, no input column, an unreadable file, a Parquet
`exclude_items` column that is not a list of integers, a Parquet id column that JSONL output
cannot hold) stops the run before anything is written.

JSONL lines are split as Ray Data's `read_text` splits them (`str.splitlines`, blank
lines dropped), so both paths number the same rows; but a line that is not UTF-8 fails
`read_text`, and so a whole `--ray` run, where the in-process run fails that row. pyarrow
(Parquet) is imported only when a Parquet file is read or written.
"""

from __future__ import annotations

import json
import math
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import orjson

from xrec.api_types import RecRequest, RecResponse
from xrec.utils.files import fsync_path

INPUT_FIELDS = ("token_ids", "prompt", "sparse_embedding")
FILTER_FIELDS = ("exclude_items",)   # optional columns, RecRequest fields of the same names
OUTPUT_COLUMNS = ("id", "tokens", "scores", "items", "error")
SUFFIXES = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
            ".json": "jsonl"}
FORMATS = ("parquet", "jsonl")
# the deepest line a float id's line is read again at (`_check_float_id`): Python's json takes
# a level of the interpreter's recursion limit per level of nesting, so without a bound of its
# own whether a row read depended on that limit, which libraries raise (torch.compile does)
REREAD_MAX_DEPTH = 512
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NESTING_STEP = np.zeros(256, dtype=np.int64)     # by byte: +1 opens a level, -1 closes one
_NESTING_STEP[[ord("["), ord("{")]], _NESTING_STEP[[ord("]"), ord("}")]] = 1, -1


@dataclass(frozen=True)
class RowSettings:
    """How rows become requests: the id column and the search settings every row shares
    (None: the engine's defaults)."""

    id_column: str = "id"
    beam_width: int | None = None
    num_results: int | None = None
    normalize: str | None = None
    return_items: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.id_column, str) or not self.id_column:
            raise ValueError(f"--id-column: got {self.id_column!r}, expected a column name")
        if self.id_column in INPUT_FIELDS + FILTER_FIELDS:
            raise ValueError(f"--id-column: got {self.id_column!r}, which is an input column")


class RowError(Exception):
    """A row that cannot become a request: its id (None if unknown), code and message."""

    def __init__(self, row_id: Any, code: str, message: str):
        super().__init__(message)
        self.row_id, self.code, self.message = row_id, code, message


def file_format(path: str | os.PathLike, given: str | None = None, what: str = "--input") -> str:
    """`given`, or the format named by the file's suffix."""
    if given is not None:
        if given not in FORMATS:
            raise ValueError(f"{what} format: got {given!r}, allowed: {', '.join(FORMATS)}")
        return given
    suffix = Path(path).suffix.lower()
    if suffix not in SUFFIXES:
        raise ValueError(f"{what} {path}: cannot tell the format from the suffix {suffix!r} "
                         f"(known: {', '.join(SUFFIXES)}); give --format parquet|jsonl")
    return SUFFIXES[suffix]


def pyarrow_modules() -> tuple[Any, Any]:
    """(pyarrow, pyarrow.parquet), or a ValueError saying how to install them."""
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise ValueError("Parquet needs pyarrow: pip install 'xrec[parquet]' (it comes "
                         "with xrec[ray] too)") from None
    return pyarrow, pyarrow.parquet


# ---- input -----------------------------------------------------------------------------

@dataclass(frozen=True)
class InputInfo:
    """What `check_input` learnt: format, the input column, the rows, the columns to read
    (the id, the input, then the filter columns the file has)."""

    path: str
    format: str
    input_column: str
    num_rows: int
    columns: tuple[str, ...]


def check_input(path: str | os.PathLike, fmt: str, settings: RowSettings) -> InputInfo:
    """The file's columns checked before anything runs: the id column and exactly one
    input column must be there (Parquet: in the schema, rows or none; JSONL: in the first
    row); a Parquet filter column must hold lists of integers. ValueError names what is
    missing and what the file has."""
    path = str(path)
    if not os.path.isfile(path):
        raise ValueError(f"--input {path}: no such file")
    if fmt == "parquet":
        _, pq = pyarrow_modules()
        try:
            meta = pq.ParquetFile(path)
        except Exception as e:   # pyarrow's own errors: not a Parquet file, truncated, ...
            raise ValueError(f"--input {path}: not a readable Parquet file ({e})") from None
        names, num_rows = list(meta.schema_arrow.names), meta.metadata.num_rows
        _check_filter_types(path, meta.schema_arrow)
    else:
        first = next((line for _, line in jsonl_lines(path)), None)
        if first is None:
            names, num_rows = [], 0
        else:
            try:
                row = orjson.loads(first)
            except orjson.JSONDecodeError as e:
                raise ValueError(f"--input {path}: the first {_not_json(first, e)}") from None
            if not isinstance(row, dict):
                raise ValueError(f"--input {path}: rows must be JSON objects, the first is "
                                 f"{type(row).__name__}")
            names = list(row)
            num_rows = sum(1 for _ in jsonl_lines(path))
    has_columns = bool(num_rows) or fmt == "parquet"   # an empty JSONL file has no first row
    if has_columns and settings.id_column not in names:
        raise ValueError(f"--input {path}: no id column {settings.id_column!r} (columns: "
                         f"{', '.join(names) or 'none'}); name it with --id-column")
    given = [name for name in INPUT_FIELDS if name in names]
    if has_columns and len(given) != 1:
        raise ValueError(f"--input {path}: expected exactly one input column of "
                         f"{', '.join(INPUT_FIELDS)}, found {', '.join(given) or 'none'} "
                         f"(columns: {', '.join(names)})")
    column = given[0] if given else INPUT_FIELDS[0]
    filters = tuple(name for name in FILTER_FIELDS if name in names) if fmt == "parquet" else ()
    return InputInfo(path, fmt, column, num_rows, (settings.id_column, column, *filters))


def _check_filter_types(path: str, schema: Any) -> None:
    """A Parquet `exclude_items` column is a list of integers (one type for every row), or
    all null."""
    pa, _ = pyarrow_modules()
    for name in FILTER_FIELDS:
        if name not in schema.names:
            continue
        kind = schema.field(name).type
        is_list = pa.types.is_list(kind) or pa.types.is_large_list(kind)
        if not (pa.types.is_null(kind) or is_list and pa.types.is_integer(kind.value_type)):
            raise ValueError(f"--input {path}: column {name!r} is {kind}, expected a list of "
                             "integers (list<int64>)")


def jsonl_lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-blank lines, split as `str.splitlines` splits. Bytes
    that are not UTF-8 stay in the text as lone surrogates (`surrogateescape`): that row
    alone fails (`decode_row`)."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            for piece in raw.decode("utf-8", "surrogateescape").splitlines():
                if piece.strip():
                    yield number, piece


def iter_chunks(info: InputInfo, chunk_rows: int, start_chunk: int = 0,
                ) -> Iterator[tuple[int, list[Any]]]:
    """(chunk index, raw rows) from `start_chunk` on; chunk k holds rows
    [k * chunk_rows, (k + 1) * chunk_rows). A raw row is a dict (Parquet) or a line (JSONL)."""
    skip = start_chunk * chunk_rows
    if info.format == "parquet":
        rows: Iterator[Any] = _parquet_rows(info, skip)
    else:
        rows = (line for index, (_, line) in enumerate(jsonl_lines(info.path)) if index >= skip)
    index, chunk = start_chunk, []
    for row in rows:
        chunk.append(row)
        if len(chunk) == chunk_rows:
            yield index, chunk
            index, chunk = index + 1, []
    if chunk:
        yield index, chunk


def _parquet_rows(info: InputInfo, skip: int) -> Iterator[dict]:
    _, pq = pyarrow_modules()
    parquet = pq.ParquetFile(info.path)
    groups, seen = [], 0
    for group in range(parquet.num_row_groups):   # whole row groups before `skip` are not read
        size = parquet.metadata.row_group(group).num_rows
        if groups or seen + size > skip:   # every group from the first one read
            groups.append(group)
        else:
            seen += size
    if not groups:
        return
    for batch in parquet.iter_batches(batch_size=4096, row_groups=groups, columns=list(info.columns)):
        rows = table_rows(batch, info.columns[0])
        if seen < skip:
            drop = min(skip - seen, len(rows))
            rows, seen = rows[drop:], seen + drop
        yield from rows


def table_rows(table: Any, id_column: str) -> list[Any]:
    """A pyarrow table's (or record batch's) rows as dicts; a row holding a value Python cannot
    hold (a string that is not UTF-8: Parquet readers do not check what another writer stored;
    a timestamp past year 9999) is a RowError naming the column instead, so that row alone
    fails (`decode_row`), as a JSONL line that is not UTF-8 does; `to_pylist` failed the whole
    run, and every --resume at the same chunk."""
    try:
        return table.to_pylist()
    except (ValueError, OverflowError):   # UnicodeDecodeError is a ValueError
        return [_table_row(table, index, id_column) for index in range(table.num_rows)]


def _table_row(table: Any, index: int, id_column: str) -> Any:
    row, bad = {}, []
    for name in table.column_names:
        try:
            row[name] = table.column(name)[index].as_py()
        except UnicodeDecodeError:
            bad.append(f"column {name!r} is not UTF-8 text")
        except (ValueError, OverflowError) as e:
            bad.append(f"column {name!r}: {type(e).__name__}: {e}")
    if not bad:
        return row
    row_id = row.get(id_column)
    if type(row_id) is float and not math.isfinite(row_id):
        row_id = None
    return RowError(row_id, "INVALID_ARGUMENT", f"row cannot be read ({'; '.join(bad)})")


# ---- rows -> requests ------------------------------------------------------------------

def decode_row(raw: Any, settings: RowSettings) -> tuple[Any, RecRequest]:
    """(row id, request) of a raw row; RowError for a row that cannot be one. Messages do
    not name the row's position: a Ray Data batch does not know it, and both paths must
    write the same records."""
    if isinstance(raw, RowError):   # a Parquet row that could not be read (`table_rows`)
        raise raw
    line = None
    if isinstance(raw, (str, bytes)):
        line = raw
        try:
            raw = orjson.loads(line)
        except orjson.JSONDecodeError as e:
            raise RowError(None, "INVALID_ARGUMENT", _not_json(line, e)) from None
        if not isinstance(raw, dict):
            raise RowError(None, "INVALID_ARGUMENT",
                           f"row is not a JSON object but {type(raw).__name__}")
    row_id = raw.get(settings.id_column)
    if row_id is None:
        raise RowError(None, "INVALID_ARGUMENT", f"row has no {settings.id_column!r}")
    if type(row_id) is float:
        _check_float_id(row_id, line, settings.id_column)
    elif isinstance(row_id, (list, dict)):
        _check_nested_id(row_id)
    given = [name for name in INPUT_FIELDS if raw.get(name) is not None]
    if len(given) != 1:
        raise RowError(row_id, "INVALID_ARGUMENT",
                       f"row needs exactly one of {', '.join(INPUT_FIELDS)}, got "
                       f"{', '.join(given) or 'none'}")
    filters = {name: raw[name] for name in FILTER_FIELDS if raw.get(name) is not None}
    request = RecRequest(**{given[0]: raw[given[0]]}, beam_width=settings.beam_width,
                         num_return_sequences=settings.num_results, normalize=settings.normalize,
                         return_items=settings.return_items, **filters)
    return row_id, request


def _check_float_id(row_id: float, line: str | bytes | None, id_column: str) -> None:
    """RowError for a float id that names no row: NaN or infinite (JSON output writes it as
    null), or a JSON integer past 64 bits, which orjson reads as the nearest float (two
    such ids would come out as one id that neither row had). Only a whole float of 2**63 or
    more in magnitude can be one (orjson reads smaller integers as ints): the line is read
    again for it, with Python's json, which nests less deep than orjson."""
    if not math.isfinite(row_id):
        raise RowError(None, "INVALID_ARGUMENT", f"id {row_id!r} is not a finite number")
    if line is None or not (row_id.is_integer() and abs(row_id) >= 2 ** 63):
        return
    too_deep = RowError(None, "INVALID_ARGUMENT",
                        f"id {row_id!r}: the row nests more than {REREAD_MAX_DEPTH} levels deep, "
                        "too deep to tell whether the id is an integer past 64 bits; give it "
                        "as a JSON string")
    if _nesting_depth(line) > REREAD_MAX_DEPTH:
        raise too_deep
    try:
        exact = json.loads(line).get(id_column)
    except RecursionError:    # a recursion limit below the bound's needs
        raise too_deep from None
    if type(exact) is int:
        shown = str(exact) if len(str(exact)) <= 40 else str(exact)[:37] + "..."
        raise RowError(None, "INVALID_ARGUMENT",
                       f"id {shown} is an integer out of the range ids are read in "
                       "[-2**63, 2**64 - 1]; give it as a JSON string")


def _nesting_depth(line: str | bytes) -> int:
    """The deepest nesting of arrays and objects in a JSON text (brackets inside strings do
    not count)."""
    data = line.encode("utf-8", "surrogatepass") if isinstance(line, str) else line
    codes = np.frombuffer(_JSON_STRING.sub(b'""', data), dtype=np.uint8)
    return int(np.cumsum(_NESTING_STEP[codes]).max(initial=0))


def _check_nested_id(row_id: list | dict) -> None:
    """RowError for a JSON array or object id that the output cannot write back: orjson
    reads 1,024 levels of nesting and writes 254 (a deeper id failed the writer, and so the
    run and every --resume)."""
    try:
        orjson.dumps(row_id)
    except orjson.JSONEncodeError as e:
        raise RowError(None, "INVALID_ARGUMENT", f"id: a {_JSON_TYPES[type(row_id)]} nested too "
                       f"deep to write back ({e}); give ids as strings or integers") from None


def _not_json(raw: str | bytes, error: Exception) -> str:
    """Why a line is not JSON; a byte that is not UTF-8 (which `jsonl_lines` keeps as a lone
    surrogate, U+DC80 to U+DCFF) is named."""
    if isinstance(raw, str):
        bad = next((i for i, c in enumerate(raw) if "\udc80" <= c <= "\udcff"), None)
        if bad is not None:
            return f"row is not UTF-8 text (byte {ord(raw[bad]) - 0xDC00:#04x} at character {bad})"
    return f"row is not JSON ({error})"


# ---- answers -> records ----------------------------------------------------------------

def answer_record(row_id: Any, response: RecResponse) -> dict:
    results = response.results
    return {"id": row_id, "tokens": [list(c.tokens) for c in results],
            "scores": [c.score for c in results],
            "items": [[item.item_id for item in c.items] for c in results], "error": None}


def error_record(row_id: Any, code: str, message: str) -> dict:
    return {"id": row_id, "tokens": [], "scores": [], "items": [], "error": f"{code}: {message}"}


# ---- output files ----------------------------------------------------------------------

def output_schema(id_type: Any) -> Any:
    pa, _ = pyarrow_modules()
    return pa.schema([("id", id_type), ("tokens", pa.list_(pa.list_(pa.int64()))),
                      ("scores", pa.list_(pa.float64())), ("items", pa.list_(pa.list_(pa.int64()))),
                      ("error", pa.string())])


def output_schema_for(info: InputInfo, output_format: str) -> Any:
    """The output's Parquet schema (None: JSONL output), checked before anything runs: a
    Parquet id column that JSONL cannot hold (binary, decimal, timestamp...) is refused here,
    not by the writer once the model has loaded and the first chunk has run."""
    if output_format == "parquet":
        return output_schema(id_type_of(info))
    if info.format == "parquet":
        kind = id_type_of(info)
        if not _is_json_id_type(kind):
            raise ValueError(f"--input {info.path}: id column {info.columns[0]!r} is {kind}; "
                             "JSONL output takes integer, float, boolean or string ids; write "
                             "Parquet output (--output-format parquet), which keeps the column's "
                             "type")
    return None


def _is_json_id_type(kind: Any) -> bool:
    """Whether ids of this Arrow type come out of `to_pylist` as values orjson writes as
    JSON scalars (null: every row has no id, each an error record)."""
    pa, _ = pyarrow_modules()
    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    return any(test(kind) for test in (pa.types.is_integer, pa.types.is_floating,
                                       pa.types.is_boolean, pa.types.is_null, pa.types.is_string,
                                       pa.types.is_large_string, pa.types.is_string_view))


def id_type_of(info: InputInfo) -> Any:
    """The output's id type: the Parquet column's, or (JSONL) int64 when the first id is an
    integer, else string."""
    pa, pq = pyarrow_modules()
    if info.format == "parquet":
        return pq.ParquetFile(info.path).schema_arrow.field(info.columns[0]).type
    first = next((line for _, line in jsonl_lines(info.path)), None)
    value = orjson.loads(first).get(info.columns[0]) if first is not None else None
    return pa.int64() if isinstance(value, int) and not isinstance(value, bool) else pa.string()


def output_records(records: Sequence[dict], schema: Any) -> list[dict]:
    """`records` as the output file holds them (`schema`: Parquet's, None for JSONL): in a
    string id column an id is its text; in an int64 one (JSONL input whose first id is an
    integer), a row whose id is not an int64 integer becomes an error record, never a
    truncated id, nor a failed chunk that fails every --resume again. Both paths call this
    before writing, so they write, and count, the same records."""
    if schema is None:
        return list(records)
    pa, _ = pyarrow_modules()
    kind = schema.field("id").type
    if pa.types.is_string(kind):
        return [r if r["id"] is None or isinstance(r["id"], str) else {**r, "id": str(r["id"])}
                for r in records]
    if pa.types.is_int64(kind):
        return [_int64_id_record(r) for r in records]
    return list(records)


def _int64_id_record(record: dict) -> dict:
    """`record`, or an error record when its id does not fit an int64 column."""
    row_id = record["id"]
    if row_id is None or type(row_id) is int and -2 ** 63 <= row_id < 2 ** 63:
        return record
    what = "an integer out of int64's range" if type(row_id) is int else \
        f"a {_JSON_TYPES.get(type(row_id), type(row_id).__name__)}"
    shown = repr(row_id) if len(repr(row_id)) <= 40 else repr(row_id)[:37] + "..."
    return error_record(None, "INVALID_ARGUMENT",
                        f"id {shown} is {what}, but the first row's id typed the output's id "
                        "column as integers (int64); write JSONL output (--output-format jsonl) "
                        "or give every row an integer id")


_JSON_TYPES = {str: "string", float: "float", bool: "boolean", list: "list", dict: "JSON object"}


def records_table(records: Sequence[dict], schema: Any) -> Any:
    """`output_records(..., schema)` as a pyarrow table."""
    pa, _ = pyarrow_modules()
    return pa.Table.from_pylist(list(records), schema=schema)


def records_jsonl(records: Sequence[dict]) -> bytes:
    return b"".join(orjson.dumps(r) + b"\n" for r in records)


def write_records(path: Path, records: Sequence[dict], fmt: str, schema: Any = None) -> None:
    """One part file, written under a temporary name, fsynced and renamed (never half there),
    the rename made durable too: the manifest that counts the part is written next, and a
    power loss must not leave it counting a part whose data or name never reached the disk."""
    tmp = path.with_name(f".{path.name}.tmp")
    with naming_os_errors(path):
        with open(tmp, "wb") as f:
            if fmt == "parquet":
                _, pq = pyarrow_modules()
                pq.write_table(records_table(records, schema), f)
            else:
                f.write(records_jsonl(records))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_path(path.parent)


@contextmanager
def naming_os_errors(path: Path) -> Iterator[None]:
    """An OSError that names no file (a full disk: ENOSPC from a write or fsync) is raised
    again naming `path`."""
    try:
        yield
    except OSError as e:
        if e.filename is not None:
            raise
        if e.errno is None:   # pyarrow's
            raise OSError(f"writing {path}: {e}") from None
        raise OSError(e.errno, e.strerror, str(path)) from None


def read_output(directory: str | os.PathLike) -> list[dict]:
    """Every record of an output directory, its part files in name order (tests, bench)."""
    records: list[dict] = []
    for path in sorted(Path(directory).iterdir()):
        if path.name.startswith((".", "_")):
            continue
        if path.suffix == ".parquet":
            _, pq = pyarrow_modules()
            records.extend(pq.read_table(path).to_pylist())
        elif path.suffix == ".jsonl":
            records.extend(orjson.loads(line) for line in path.read_bytes().splitlines() if line)
    return records


def count_errors(directory: str | os.PathLike) -> int:
    """The error records of an output directory (a --ray run's summary), one part file at a
    time: Parquet's `error` column alone, JSONL line by line; never the whole output in memory
    (`read_output` holds every record)."""
    count = 0
    for path in Path(directory).iterdir():
        if path.name.startswith((".", "_")):
            continue
        if path.suffix == ".parquet":
            _, pq = pyarrow_modules()
            errors = pq.read_table(path, columns=["error"]).column("error")
            count += len(errors) - errors.null_count
        elif path.suffix == ".jsonl":
            with open(path, "rb") as f:
                count += sum(orjson.loads(line)["error"] is not None for line in f if line.strip())
    return count
