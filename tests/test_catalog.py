"""Item catalog: file formats, item conversion, constraint tables (docs/catalog.md)."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from xrec.catalog import CatalogError, ItemCatalog, random_catalog  # noqa: E402
from xrec.catalog.formats import read_extended  # noqa: E402
from xrec.errors import InvalidArgument  # noqa: E402

WORKED_TRIPLES = [(1, 2, 3), (1, 2, 4), (1, 5, 6), (7, 8, 9), (7, 8, 10)]


def children(tables, prefix: tuple[int, ...]) -> list[int]:
    """Walks the CSR trie from the root along `prefix`; the allowed next tokens."""
    node = 0
    for level, token in enumerate(prefix):
        segment = tables.tokens[level][tables.offsets[level][node]:tables.offsets[level][node + 1]]
        matches = (segment == token).nonzero()
        if len(matches) == 0:
            return []
        node = int(tables.offsets[level][node]) + int(matches[0])
    level = len(prefix)
    return tables.tokens[level][tables.offsets[level][node]:tables.offsets[level][node + 1]].tolist()


def all_paths(tables) -> set[tuple[int, int, int]]:
    """Every root-to-leaf path of the trie."""
    paths = set()
    for t0 in children(tables, ()):
        for t1 in children(tables, (t0,)):
            for t2 in children(tables, (t0, t1)):
                paths.add((t0, t1, t2))
    return paths


def test_worked_example():
    catalog = ItemCatalog.from_arrays([10, 11, 12, 13, 14], WORKED_TRIPLES, vocab_size=16)
    tables = catalog.constraint_tables()
    assert tables.tokens[0].tolist() == [1, 7]
    assert tables.offsets[0].tolist() == [0, 2]
    assert tables.tokens[1].tolist() == [2, 5, 8]
    assert tables.offsets[1].tolist() == [0, 2, 3]
    assert tables.tokens[2].tolist() == [3, 4, 6, 9, 10]
    assert tables.offsets[2].tolist() == [0, 2, 3, 5]
    assert all(t.dtype == torch.int64 for t in tables.tokens + tables.offsets)
    assert children(tables, (1,)) == [2, 5]
    assert children(tables, (7,)) == [8]
    assert children(tables, (1, 2)) == [3, 4]
    assert children(tables, (1, 5)) == [6]
    assert children(tables, (7, 8)) == [9, 10]
    assert children(tables, (2,)) == [] and children(tables, (1, 8)) == []
    assert tables.max_children == (2, 2, 2)
    assert (tables.num_levels, tables.vocab_size) == (3, 16)
    moved = tables.to("meta")
    assert moved.device.type == "meta" and tables.device.type == "cpu"
    assert moved.max_children == tables.max_children


def test_empty_catalog_tables():
    tables = ItemCatalog.from_arrays([], [], vocab_size=4).constraint_tables()
    assert tables.offsets[0].tolist() == [0, 0] and tables.max_children == (0, 0, 0)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(*[st.integers(0, 5)] * 3), min_size=1, max_size=40))
def test_tables_hold_exactly_the_catalog_triples(triples):
    catalog = ItemCatalog.from_arrays(np.arange(len(triples)), triples, vocab_size=6)
    tables = catalog.constraint_tables()
    assert all_paths(tables) == set(triples)
    for level in range(3):
        offsets = tables.offsets[level]
        assert tables.max_children[level] == int((offsets[1:] - offsets[:-1]).max())
        for node in range(len(offsets) - 1):
            segment = tables.tokens[level][offsets[node]:offsets[node + 1]]
            assert torch.all(segment[1:] > segment[:-1])  # sorted, no repeats


def test_binary_round_trip(tmp_path):
    catalog = ItemCatalog.from_arrays([5, -1, 2**40], [(0, 1, 2), (3, 3, 3), (0, 1, 2)], 4)
    path = tmp_path / "catalog.bin"
    catalog.write(path)
    data = path.read_bytes()
    assert len(data) == 60
    assert struct.unpack_from("<q3i", data, 20) == (-1, 3, 3, 3)
    again = ItemCatalog.read(path, vocab_size=4)
    assert again.item_ids.tolist() == [5, -1, 2**40]
    assert again.triples.tolist() == [[0, 1, 2], [3, 3, 3], [0, 1, 2]]
    assert again.dids is None and not again.is_extended
    assert again.item_ids.dtype == np.int64 and again.triples.dtype == np.int32


def test_extended_round_trip(tmp_path):
    dids, types = ["", "dévice-北京", "x"], ["video", "", ""]
    catalog = ItemCatalog.from_arrays([1, 2, 3], [(0, 1, 2), (3, 3, 3), (2, 1, 0)], 4, dids, types)
    path = tmp_path / "catalog.bin"
    catalog.write(path)
    data = path.read_bytes()
    # record 0: id, did_len 0, type_len 5 "video", tokens
    assert struct.unpack_from("<qII", data, 0) == (1, 0, 5)
    assert data[16:21] == b"video" and struct.unpack_from("<3i", data, 21) == (0, 1, 2)
    did = "dévice-北京".encode()
    assert struct.unpack_from("<qI", data, 33) == (2, len(did)) and data[45:45 + len(did)] == did
    again = ItemCatalog.read(path, vocab_size=4, extended=True)
    assert again.is_extended
    assert list(again.dids) == dids and list(again.types) == types
    assert again.triples.tolist() == catalog.triples.tolist()
    with pytest.raises(CatalogError, match="text form"):
        again.write_text(tmp_path / "catalog.txt")


def test_text_round_trip_and_hand_written(tmp_path):
    path = tmp_path / "catalog.txt"
    path.write_text("# item_id,t0,t1,t2\n\n7, 1,2,3\n  # note\n-8,0,0,0\r\n9,3,2,1")
    catalog = ItemCatalog.read(path, vocab_size=4)
    assert catalog.item_ids.tolist() == [7, -8, 9]
    assert catalog.triples.tolist() == [[1, 2, 3], [0, 0, 0], [3, 2, 1]]
    out = tmp_path / "out.csv"
    catalog.write_text(out)
    again = ItemCatalog.read(out, vocab_size=4)
    assert again.item_ids.tolist() == [7, -8, 9]
    assert again.triples.tolist() == catalog.triples.tolist()


def test_duplicate_item_keeps_last_triple_at_last_position(tmp_path):
    catalog = ItemCatalog.from_arrays([10, 11, 10, 12, 11], [(0, 0, 1), (0, 0, 2), (0, 0, 3),
                                                            (0, 0, 4), (0, 0, 5)], 8,
                                      dids=list("abcde"), types=list("ABCDE"))
    assert catalog.item_ids.tolist() == [10, 12, 11]
    assert catalog.triples[:, 2].tolist() == [3, 4, 5]
    assert catalog.dids == ("c", "d", "e") and catalog.types == ("C", "D", "E")
    path = tmp_path / "dup.bin"
    path.write_bytes(_default_records([(1, 0, 0, 1), (2, 0, 0, 2), (1, 0, 0, 3)]))
    catalog = ItemCatalog.read(path, 8)
    assert catalog.item_ids.tolist() == [2, 1] and catalog.triples[:, 2].tolist() == [2, 3]
    catalog.write(path)
    assert len(path.read_bytes()) == 40


def test_catalog_is_immutable():
    catalog = ItemCatalog.from_arrays([1], [(0, 0, 0)], 2)
    with pytest.raises(ValueError):
        catalog.triples[0, 0] = 1
    with pytest.raises(AttributeError):
        catalog.item_ids = np.array([2])


def _default_records(rows) -> bytes:
    return b"".join(struct.pack("<q3i", *row) for row in rows)


def _extended_record(item_id, did: bytes, type_: bytes, triple) -> bytes:
    return (struct.pack("<qI", item_id, len(did)) + did + struct.pack("<I", len(type_)) + type_
            + struct.pack("<3i", *triple))


def test_truncated_default_record(tmp_path):
    path = tmp_path / "c.bin"
    path.write_bytes(_default_records([(1, 0, 0, 0), (2, 0, 0, 0)]) + b"\x00" * 7)
    with pytest.raises(CatalogError, match=r"offset 40\b.*7 bytes") as info:
        ItemCatalog.read(path, 4)
    assert str(path) in str(info.value)
    assert isinstance(info.value, InvalidArgument) and info.value.http_status == 400


@pytest.mark.parametrize("bad_token", [4, -1])
def test_token_outside_vocab(tmp_path, bad_token):
    path = tmp_path / "c.bin"
    path.write_bytes(_default_records([(1, 0, 0, 0), (2, 3, 3, 3), (3, 0, bad_token, 0)]))
    with pytest.raises(CatalogError, match=rf"offset 40\b.*t1 = {bad_token}\b.*\[0, 4\)"):
        ItemCatalog.read(path, 4)
    extended = tmp_path / "e.bin"
    first = _extended_record(1, b"ab", b"", (0, 0, 0))  # 30 bytes
    extended.write_bytes(first + _extended_record(2, b"", b"", (bad_token, 0, 0)))
    with pytest.raises(CatalogError, match=rf"offset 30\b.*t0 = {bad_token}\b"):
        ItemCatalog.read(extended, 4, extended=True)
    with pytest.raises(CatalogError, match=rf"row 0: token t2 = {bad_token}\b"):
        ItemCatalog.from_arrays([1], [(0, 0, bad_token)], 4)


def test_truncated_extended_record(tmp_path):
    path = tmp_path / "c.bin"
    first = _extended_record(1, b"ab", b"cd", (0, 0, 0))  # 32 bytes
    second = _extended_record(2, b"hello", b"", (1, 1, 1))
    for cut in (3, 10, 14, len(second) - 1):  # in the id, did_len, did, tokens
        path.write_bytes(first + second[:cut])
        with pytest.raises(CatalogError, match=r"partial record at offset 32\b"):
            ItemCatalog.read(path, 4, extended=True)


def test_oversize_string(tmp_path):
    path = tmp_path / "c.bin"
    first = _extended_record(1, b"", b"", (0, 0, 0))  # 28 bytes
    path.write_bytes(first + struct.pack("<qI", 2, (1 << 20) + 1) + b"x" * 16)
    with pytest.raises(CatalogError, match=r"offset 28\b.*did_len = 1048577 at offset 36\b"):
        ItemCatalog.read(path, 4, extended=True)
    path.write_bytes(_extended_record(1, b"", b"t" * (1 << 20), (0, 0, 0)))  # at the limit
    assert len(ItemCatalog.read(path, 4, extended=True).types[0]) == 1 << 20
    path.write_bytes(first + _extended_record(2, b"\xff", b"", (0, 0, 0)))
    with pytest.raises(CatalogError, match=r"offset 28\b.*did at offset 40 is not UTF-8"):
        ItemCatalog.read(path, 4, extended=True)
    with pytest.raises(CatalogError, match="did of row 0"):
        ItemCatalog.from_arrays([1], [(0, 0, 0)], 4, dids=["é" * (1 << 19) + "x"], types=[""])


def _read_extended_one_by_one(path, vocab_size: int):
    """The extended reader as it was, record by record: the oracle of the vectorised one."""
    data, records, offset = path.read_bytes(), [], 0
    while offset < len(data):
        start = offset

        def take(size, field):
            nonlocal offset
            if offset + size > len(data):
                raise CatalogError(f"catalog {path}: trailing partial record at offset {start}: "
                                   f"{field} needs bytes [{offset}, {offset + size}) but the "
                                   f"file ends at {len(data)}")
            offset += size
            return data[offset - size:offset]

        record = [struct.unpack("<q", take(8, "item_id"))[0]]
        for field in ("did", "type"):
            (size,) = struct.unpack("<I", take(4, f"{field}_len"))
            if size > 1 << 20:
                raise CatalogError(f"catalog {path}: record at offset {start}: {field}_len = "
                                   f"{size} at offset {offset - 4} exceeds the limit of "
                                   f"{1 << 20} bytes")
            try:
                record.append(take(size, field).decode("utf-8"))
            except UnicodeDecodeError as exc:
                raise CatalogError(f"catalog {path}: record at offset {start}: {field} at "
                                   f"offset {offset - size} is not UTF-8 ({exc.reason})") from exc
        tokens = struct.unpack("<3i", take(12, "tokens"))
        for level, token in enumerate(tokens):
            if not 0 <= token < vocab_size:   # reported after every record is read
                record.append((start, level, token))
                break
        records.append((record, tokens))
    bad = next((r[-1] for r, _ in records if len(r) == 4), None)
    if bad is not None:
        raise CatalogError(f"catalog {path}: record at offset {bad[0]}: token t{bad[1]} = "
                           f"{bad[2]} is outside [0, {vocab_size})")
    return ([r[0] for r, _ in records], [t for _, t in records], [r[1] for r, _ in records],
            [r[2] for r, _ in records])


_STRINGS = st.one_of(st.text(max_size=6).map(lambda s: s.encode("utf-8", "surrogatepass")),
                     st.binary(max_size=4), st.sampled_from([b"\xc3", b"\xa9", b"\x00", b"\xff"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(-(1 << 63), (1 << 63) - 1), _STRINGS, _STRINGS,
                          st.tuples(*[st.integers(-1, 4)] * 3)), max_size=6),
       st.one_of(st.none(), st.integers(0, 200)), st.binary(max_size=30),
       st.one_of(st.none(), st.sampled_from([(1 << 20) + 1, 1 << 31, (1 << 32) - 1])))
def test_the_extended_reader_reads_and_refuses_as_record_by_record(
        tmp_path_factory, records, cut, tail, oversize):
    """Byte for byte what the record-by-record reader gave, or its error: a string that is
    not UTF-8 (alone: b"\xc3" then b"\xa9" is not two halves of "é"), one that holds a
    NUL, a cut anywhere, trailing bytes, a length over the limit, a token outside [0, 4)."""
    data = b"".join(_extended_record(item_id, did, type_, triple)
                    for item_id, did, type_, triple in records)
    if oversize is not None and records:   # the last record's did_len
        data = data[:len(data) - len(_extended_record(0, records[-1][1], records[-1][2], (0, 0, 0)))
                    ] + struct.pack("<qI", 1, oversize) + b"x" * 20
    data = (data if cut is None else data[:cut]) + (tail if cut is None else b"")
    path = tmp_path_factory.mktemp("ext") / "c.bin"
    path.write_bytes(data)
    try:
        expected = _read_extended_one_by_one(path, 4)
    except CatalogError as exc:
        with pytest.raises(CatalogError) as info:
            ItemCatalog.read(path, 4, extended=True)
        assert str(info.value) == str(exc)
        return
    columns = read_extended(path, 4)
    assert columns.item_ids.dtype == np.int64 and columns.triples.dtype == np.int32
    assert columns.triples.shape == (len(expected[0]), 3) and columns.triples.flags.c_contiguous
    assert (columns.item_ids.tolist(), columns.triples.tolist(), columns.dids,
            columns.types) == (expected[0], [list(t) for t in expected[1]], expected[2], expected[3])


@pytest.mark.parametrize("line", ["5,1,2", "5,1,2,x", "5;1;2;3", "5,1,2,3,4", "5,1.5,2,3"])
def test_malformed_text_line(tmp_path, line):
    path = tmp_path / "c.txt"
    path.write_text(f"# header\n1,0,0,0\n{line}\n")
    with pytest.raises(CatalogError, match=r"line 3\b") as info:
        ItemCatalog.read(path, 4)
    assert "the line is not 'item_id,t0,t1,t2'" in str(info.value)
    assert line not in str(info.value)   # a file's content is never quoted back (admin loads)


@pytest.mark.parametrize("separator", ["\x0b", "\x0c", "\x1c", "\x1e", "\x85", "\u2028"])
def test_text_lines_are_counted_at_line_breaks_only(tmp_path, separator):
    """str.splitlines also breaks at form feeds, \\x1c-\\x1e, NEL and U+2028: an error named
    a line past the one an editor or `wc -l` shows, and a separator inside a line split one
    record into two."""
    path = tmp_path / "c.txt"
    path.write_text(f"1,0,0,0{separator}\n2,0,0,1\n3,0,{separator}0,9\n4,0,0,9\n",
                    encoding="utf-8")
    with pytest.raises(CatalogError, match=r"line 3: token t2 = 9 is outside"):
        ItemCatalog.read(path, 4)
    path.write_text(f"1,0,0,0\r\n2,0,0,1\r3,0,0,2\n\n4,0,0,{separator}9\n", encoding="utf-8")
    with pytest.raises(CatalogError, match=r"line 5: "):   # \r\n, \r and \n end a line
        ItemCatalog.read(path, 4)


def test_text_token_outside_vocab(tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("1,0,0,0\n\n2,0,0,9\n")
    with pytest.raises(CatalogError, match=r"line 3\b.*t2 = 9\b"):
        ItemCatalog.read(path, 4)


def test_missing_file_and_bad_vocab(tmp_path):
    (tmp_path / "c.txt").write_text("1,0,0,0\n")
    with pytest.raises(CatalogError, match="text form has no did/type"):
        ItemCatalog.read(tmp_path / "c.txt", 4, extended=True)
    with pytest.raises(CatalogError, match="cannot read"):
        ItemCatalog.read(tmp_path / "nope.bin", 4)
    with pytest.raises(CatalogError, match="vocab_size"):
        ItemCatalog.from_arrays([1], [(0, 0, 0)], 0)


def test_from_model_dir(tmp_path):
    assert ItemCatalog.from_model_dir(tmp_path, 16) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    assert ItemCatalog.from_model_dir(tmp_path, 16) is None

    (tmp_path / "items").mkdir()
    ItemCatalog.from_arrays([10, 11], [(1, 2, 3), (4, 5, 6)], 16).write(tmp_path / "items/c.bin")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"vocab_file": "items/c.bin"}))
    catalog = ItemCatalog.from_model_dir(tmp_path, 16)
    assert catalog.item_ids.tolist() == [10, 11] and not catalog.is_extended

    ItemCatalog.from_arrays([12], [(1, 2, 3)], 16, dids=["d"], types=["t"]).write(
        tmp_path / "items/e.bin")
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"vocab_file": "items/e.bin", "extended_item_info": True}))
    catalog = ItemCatalog.from_model_dir(tmp_path, 16)
    assert catalog.dids == ("d",) and catalog.types == ("t",)


def test_convert_caps_and_unknown():
    # triple A = (1, 1, 1) has items at rows 0, 2, 4, 5; triple B = (2, 2, 2) at rows 1, 3
    triples = [(1, 1, 1), (2, 2, 2), (1, 1, 1), (2, 2, 2), (1, 1, 1), (1, 1, 1)]
    catalog = ItemCatalog.from_arrays([100, 101, 102, 103, 104, 105], triples, 4)
    a, b, unknown, outside = [1, 1, 1], [2, 2, 2], [3, 3, 3], [1, 1, 9]
    rows = catalog.convert(np.array([a, b, unknown, outside]))
    assert [r.tolist() for r in rows] == [[0, 2, 4, 5], [1, 3], [], []]
    assert all(r.dtype == np.int64 for r in rows)
    rows = catalog.convert(np.array([a, b]), each_conversion_threshold=3)
    assert [r.tolist() for r in rows] == [[0, 2, 4], [1, 3]]
    rows = catalog.convert(np.array([b, a, a]), each_conversion_threshold=3,
                           total_conversion_threshold=4)
    assert [r.tolist() for r in rows] == [[1, 3], [0, 2], []]
    assert catalog.item_ids[catalog.convert([b])[0]].tolist() == [101, 103]
    assert catalog.convert(np.zeros((0, 3), dtype=np.int32)) == []
    with pytest.raises(InvalidArgument, match="each_conversion_threshold"):
        catalog.convert([a], each_conversion_threshold=-1)
    with pytest.raises(InvalidArgument, match=r"shape \(3,\)"):
        catalog.convert(np.array(a))


def test_convert_caps_past_int64_do_not_cut():
    """A cap over int64 (as "no cap": 2**64, 10**30) raised OverflowError inside numpy."""
    catalog = ItemCatalog.from_arrays([100, 101, 102], [(1, 1, 1), (2, 2, 2), (1, 1, 1)], 4)
    for big in (2**63, 2**64, 10**30, np.uint64(2**64 - 1)):
        rows = catalog.convert(np.array([[1, 1, 1], [2, 2, 2]]), each_conversion_threshold=big,
                               total_conversion_threshold=big, seed=0)
        assert [r.tolist() for r in rows] == [[0, 2], [1]]
    rows = catalog.convert(np.array([[1, 1, 1], [2, 2, 2]]), each_conversion_threshold=10**30,
                           total_conversion_threshold=2)
    assert [r.tolist() for r in rows] == [[0, 2], []]


def test_convert_out_of_range_tokens_never_alias_a_real_item():
    """A triple with a token outside [0, vocab) is unknown, even where its mixed-radix key
    equals a real triple's: at V = 4, (1, -1, 2) "means" (0, 3, 2) and (0, 4, 2) (1, 0, 2)."""
    catalog = ItemCatalog.from_arrays([100, 101], [(0, 3, 2), (1, 0, 2)], 4)
    rows = catalog.convert(np.array([[1, -1, 2], [0, 4, 2], [0, 3, 2], [1, 0, 2]]))
    assert [r.tolist() for r in rows] == [[], [], [0], [1]]


def test_convert_with_seed():
    catalog = ItemCatalog.from_arrays(np.arange(20), [(0, 1, 2)] * 20, 4)
    first = catalog.convert([(0, 1, 2)], each_conversion_threshold=5, seed=7)[0]
    again = catalog.convert([(0, 1, 2)], each_conversion_threshold=5, seed=7)[0]
    assert first.tolist() == again.tolist()
    assert len(set(first.tolist())) == 5 and set(first.tolist()) <= set(range(20))
    assert first.tolist() == sorted(first.tolist())
    samples = {tuple(catalog.convert([(0, 1, 2)], 5, seed=s)[0].tolist()) for s in range(10)}
    assert len(samples) > 1  # a sample, not always the first five
    # no cut: the seed changes nothing
    assert catalog.convert([(0, 1, 2)], 50, seed=3)[0].tolist() == list(range(20))


def test_find_rows():
    catalog = ItemCatalog.from_arrays([30, 10, 20], [(0, 0, 0)] * 3, 2)
    assert catalog.find_rows([10, 20, 30, 40]).tolist() == [1, 2, 0, -1]
    assert ItemCatalog.from_arrays([], [], 2).find_rows([1]).tolist() == [-1]


def test_random_catalog():
    catalog = random_catalog(5000, vocab_size=37, seed=3)
    again = random_catalog(5000, vocab_size=37, seed=3)
    other = random_catalog(5000, vocab_size=37, seed=4)
    assert np.array_equal(catalog.item_ids, again.item_ids)
    assert np.array_equal(catalog.triples, again.triples)
    assert not np.array_equal(catalog.triples, other.triples)
    assert catalog.num_items == 5000 and len(np.unique(catalog.item_ids)) == 5000
    assert catalog.triples.min() >= 0 and catalog.triples.max() < 37
    for level in range(3):  # uniform: every token shows up at every level
        assert len(np.unique(catalog.triples[:, level])) == 37
    assert all_paths(catalog.constraint_tables()) == set(map(tuple, catalog.triples.tolist()))
