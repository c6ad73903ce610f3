"""Boundaries of the catalog formats and helpers, on tiny files (milliseconds).

test_catalog.py and test_catalog_import.py check the formats and the importers; these
pin the edges a mutation run found unchecked (issue 15): int64 and vocabulary bounds
(inclusive where they should be), the field a truncated record names, table copies.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from xrec.catalog import ItemCatalog
from xrec.catalog.cli import _name_catalog
from xrec.catalog.importers import _item_ids
from xrec.catalog.formats import CatalogError, read_text, write_extended, write_text

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


def test_text_catalog_accepts_the_int64_and_vocabulary_bounds(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text(f"{INT64_MIN},0,0,0\n{INT64_MAX},9,9,9\n")
    columns = read_text(path, vocab_size=10)
    assert columns.item_ids.tolist() == [INT64_MIN, INT64_MAX]
    assert columns.item_ids.dtype == np.int64 and columns.triples.dtype == np.int32
    assert columns.triples.tolist() == [[0, 0, 0], [9, 9, 9]]


@pytest.mark.parametrize("line, words", [
    (f"{INT64_MAX + 1},0,0,0", "does not fit in int64"),
    (f"{INT64_MIN - 1},0,0,0", "does not fit in int64"),
    ("1,0,10,0", "token t1 = 10 is outside [0, 10)"),
    ("1,0,0,-1", "token t2 = -1 is outside [0, 10)"),
    ("1,0,0", "is not 'item_id,t0,t1,t2'"),
])
def test_text_catalog_refuses_what_is_past_the_bounds(tmp_path, line, words):
    path = tmp_path / "c.txt"
    path.write_text(f"# header\n\n{line}\n")
    with pytest.raises(CatalogError, match=r"line 3: ") as info:
        read_text(path, vocab_size=10)
    assert words in str(info.value)


def test_empty_text_catalog_has_the_shapes_of_one(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("# nothing\n")
    columns = read_text(path, vocab_size=10)
    assert columns.item_ids.shape == (0,) and columns.triples.shape == (0, 3)


def test_text_catalog_round_trip(tmp_path):
    path = tmp_path / "c.txt"
    write_text(path, np.array([5, -3]), np.array([[1, 2, 3], [4, 5, 6]]))
    assert path.read_text() == "# item_id,t0,t1,t2\n5,1,2,3\n-3,4,5,6\n"


def _extended(tmp_path: Path) -> Path:
    path = tmp_path / "c.bin"
    write_extended(path, np.array([-7]), np.array([[1, 2, 3]]), ["dé"], ["t"])
    return path


@pytest.mark.parametrize("size, field", [
    (5, "item_id"), (10, "did_len"), (13, "did"), (16, "type_len"), (19, "type"),
    (25, "tokens")])
def test_truncated_extended_record_names_the_missing_field(tmp_path, size, field):
    path = _extended(tmp_path)
    data = path.read_bytes()
    assert len(data) == 8 + 4 + 3 + 4 + 1 + 12                    # "dé" is 3 bytes in UTF-8
    path.write_bytes(data[:size])
    with pytest.raises(CatalogError, match=rf"partial record at offset 0: {field} needs bytes"):
        ItemCatalog.read(path, vocab_size=10, extended=True)


def test_extended_catalog_round_trip_keeps_utf8_strings(tmp_path):
    catalog = ItemCatalog.read(_extended(tmp_path), vocab_size=10, extended=True)
    assert catalog.dids == ("dé",) and catalog.types == ("t",)
    assert catalog.item_ids.tolist() == [-7] and catalog.triples.tolist() == [[1, 2, 3]]


@pytest.mark.parametrize("dids, types, words", [
    ([1], ["t"], "did of row 0: got int"), (["d", "d"], ["t", None], "type of row 1: got NoneType")])
def test_extended_strings_are_checked_by_field_and_row(tmp_path, dids, types, words):
    with pytest.raises(CatalogError, match=words):
        write_extended(tmp_path / "c.bin", np.arange(len(dids)), np.zeros((len(dids), 3), int),
                       dids, types)


def test_extended_strings_that_utf8_cannot_encode_are_refused_when_the_catalog_is_built(tmp_path):
    """A lone surrogate (what os.fsdecode makes of a byte that is not UTF-8) used to build a
    catalog whose content_hash() and write() raised UnicodeEncodeError; a str given for dids
    was taken as one string per character."""
    triples = np.zeros((3, 3), int)
    with pytest.raises(CatalogError, match=r"type of row 2: character 1 .*'\\udcff'.* UTF-8"):
        ItemCatalog.from_arrays([1, 2, 3], triples, 10, ["a", "b", "c"], ["t", "t", "x\udcffy"])
    with pytest.raises(CatalogError, match=r"did of row 0: character 0 .*'\\ud800'"):
        ItemCatalog.from_arrays([1, 2, 3], triples, 10, ["\ud800", "b", "c"], ["t", "t", "t"])
    with pytest.raises(CatalogError, match=r"did of row 1: got int, expected str"):
        ItemCatalog.from_arrays([1, 2, 3], triples, 10, ["a", 5, "c"], ["t", "t", "t"])
    with pytest.raises(CatalogError, match=r"dids: got a str, expected a sequence of one str per item"):
        ItemCatalog.from_arrays([1, 2, 3], triples, 10, "abc", ["t", "t", "t"])
    with pytest.raises(CatalogError, match=r"types: got a bytes"):
        ItemCatalog.from_arrays([1, 2, 3], triples, 10, ["a", "b", "c"], b"ttt")
    catalog = ItemCatalog.from_arrays([1, 2, 3], triples, 10, ["", "ä,\n\x00", "c"], ["t"] * 3)
    catalog.write(tmp_path / "c.bin")
    again = ItemCatalog.read(tmp_path / "c.bin", 10, extended=True)
    assert again.dids == ("", "ä,\n\x00", "c") and again.content_hash() == catalog.content_hash()


def test_item_ids_at_the_int64_bounds_are_valid_and_the_bad_one_is_named():
    assert _item_ids(Path("f"), [str(INT64_MIN), str(INT64_MAX)], str).tolist() == [
        INT64_MIN, INT64_MAX]
    with pytest.raises(CatalogError, match=r"f: 2item id 'x' is not an integer in int64"):
        _item_ids(Path("f"), [str(INT64_MIN), str(INT64_MAX), "x"], str)
    with pytest.raises(CatalogError, match=rf"item id '{INT64_MAX + 1}'"):
        _item_ids(Path("f"), ["0", str(INT64_MAX + 1)], str)


def test_find_rows_of_an_array_of_any_shape():
    catalog = ItemCatalog.from_arrays(np.array([30, 10, 20]), np.array([[1, 1, 1], [2, 2, 2],
                                                                        [3, 3, 3]]), 10)
    rows = catalog.find_rows(np.array([[10, 99], [30, 20]], dtype=np.int32))
    assert rows.tolist() == [1, -1, 0, 2] and rows.dtype == np.int64
    assert catalog.find_rows([]).tolist() == []


def test_constraint_tables_to_a_device_keep_every_table():
    tables = ItemCatalog.from_arrays(np.array([1, 2]), np.array([[1, 2, 3], [1, 4, 5]]), 10) \
        .constraint_tables()
    moved = tables.to(torch.device("cpu"))
    for got, want in zip(moved.tokens + moved.offsets, tables.tokens + tables.offsets):
        assert torch.equal(got, want)
    assert moved.max_children == tables.max_children and moved.device.type == "cpu"


def test_naming_the_catalog_keeps_other_keys_and_writes_readable_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"name": "模型", "extended_item_info": True}), encoding="utf-8")
    _name_catalog(tmp_path, "catalog.bin")
    text = (tmp_path / "tokenizer_config.json").read_text(encoding="utf-8")
    assert json.loads(text) == {"name": "模型", "extended_item_info": False,
                                "item_catalog": "catalog.bin"}
    assert "模型" in text and text.endswith("}\n") and '\n  "name"' in text
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer_config.json"]


def test_naming_the_catalog_without_a_tokenizer_config_creates_one(tmp_path):
    _name_catalog(tmp_path, "c.bin")
    assert json.loads((tmp_path / "tokenizer_config.json").read_text()) == {"item_catalog": "c.bin"}


def test_catalog_cli_options():
    import argparse

    from xrec.catalog.cli import add_catalog_parser

    parser = argparse.ArgumentParser(prog="xrec")
    add_catalog_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["catalog", "import", "--model", "m", "--format", "csv", "f.csv",
                              "-v"])
    assert (args.command, args.catalog_command, args.model, args.format, args.input) == (
        "catalog", "import", "m", "csv", "f.csv")
    assert args.verbose is True and args.out is None
    for argv in (["catalog"], ["catalog", "import", "--format", "csv", "f"],
                 ["catalog", "import", "--model", "m", "f"],
                 ["catalog", "import", "--model", "m", "--format", "xml", "f"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)


@pytest.fixture(scope="module")
def sid_tokenizer(tmp_path_factory):
    from xrec.catalog.sid_vocab import SidLayout, write_sid_tokenizer
    from xrec.tokenizer import PromptTokenizer

    layout = SidLayout(num_base_tokens=512, codebook_size=16)
    directory = tmp_path_factory.mktemp("sid")
    write_sid_tokenizer(directory, layout)
    return PromptTokenizer.from_model_dir(directory), layout


def test_sid2pid_codebook_and_key_bounds_are_inclusive(tmp_path, sid_tokenizer):
    from xrec.catalog.importers import MAX_CODEBOOK_SIZE, import_sid2pid

    tokenizer, layout = sid_tokenizer
    path = tmp_path / "s.json"
    path.write_text(json.dumps({str(16 ** 3 - 1): [1], "291": [2]}))   # (15,15,15), (1,2,3)
    catalog = import_sid2pid(path, tokenizer, layout.vocab_size, codebook_size=16)
    assert catalog.item_ids.tolist() == [1, 2]
    path.write_text(json.dumps({"0": [1]}))
    for size in (1, MAX_CODEBOOK_SIZE):
        assert import_sid2pid(path, tokenizer, layout.vocab_size, codebook_size=size).num_items == 1
    for size in (0, MAX_CODEBOOK_SIZE + 1):
        with pytest.raises(CatalogError, match=f"codebook_size: got {size}"):
            import_sid2pid(path, tokenizer, layout.vocab_size, codebook_size=size)
    path.write_text(json.dumps({str(16 ** 3): [1]}))
    with pytest.raises(CatalogError, match="key 4096: code c1 = 16 is outside the codebook"):
        import_sid2pid(path, tokenizer, layout.vocab_size, codebook_size=16)


def test_sid2pid_tokens_must_be_inside_the_vocabulary(tmp_path, sid_tokenizer):
    from xrec.catalog.importers import import_sid2pid

    tokenizer, layout = sid_tokenizer
    path = tmp_path / "s.json"
    path.write_text(json.dumps({str(16 ** 3 - 1): [1]}))
    top = max(max(row) for row in import_sid2pid(path, tokenizer, layout.vocab_size, 16)
              .triples.tolist())
    assert import_sid2pid(path, tokenizer, top + 1, 16).num_items == 1
    with pytest.raises(CatalogError, match=f"has id {top}, outside the model's vocabulary"):
        import_sid2pid(path, tokenizer, top, 16)


def test_sid2pid_names_the_key_that_is_not_a_number_after_valid_ones(tmp_path, sid_tokenizer):
    from xrec.catalog.importers import import_sid2pid

    tokenizer, layout = sid_tokenizer
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"291": [1], "4095": [2], "x": [3]}))
    with pytest.raises(CatalogError, match="key 'x' is not a decimal semantic ID"):
        import_sid2pid(path, tokenizer, layout.vocab_size, codebook_size=16)
