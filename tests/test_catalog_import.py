"""Catalog importers (sid2pid.json, token map, CSV), `xrec catalog import`, from_model_dir."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

from xrec.catalog import CatalogError, ItemCatalog
from xrec.catalog.cli import add_catalog_parser, main
from xrec.catalog.importers import import_sid2pid, import_token_csv, import_token_map
from xrec.config import MODEL_SIZES
from xrec.catalog.sid_vocab import SidLayout, write_sid_tokenizer
from xrec.tokenizer import PromptTokenizer

# <s_a_0> = 538, <s_b_0> = 554, <s_c_0> = 570, <|sid_begin|> = 586, <|sid_end|> = 587
SMALL = SidLayout(num_base_tokens=512, codebook_size=16)
V = SMALL.vocab_size  # 768


def sid(c1: int, c2: int, c3: int, codebook_size: int = 16) -> str:
    return str((c1 * codebook_size + c2) * codebook_size + c3)


def ids(c1: int, c2: int, c3: int, layout: SidLayout = SMALL) -> list[int]:
    return [layout.itemic_id(0, c1), layout.itemic_id(1, c2), layout.itemic_id(2, c3)]


def write_json(path, data):
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("sid-model")
    write_sid_tokenizer(out, SMALL)
    (out / "config.json").write_text(json.dumps(MODEL_SIZES["qwen3-sid-test"].to_dict()))
    return out


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return PromptTokenizer.from_model_dir(model_dir)


# --- sid2pid.json --------------------------------------------------------------------------

def test_sid2pid_integers_keep_file_order(tmp_path, tokenizer):
    path = write_json(tmp_path / "sid2pid.json", {sid(1, 2, 3): [5, 6, 4], "0": [7],
                                                  sid(15, 15, 15): [9], sid(1, 2, 4): []})
    catalog = import_sid2pid(path, tokenizer, V, codebook_size=16)
    assert catalog.item_ids.tolist() == [5, 6, 4, 7, 9]
    assert catalog.triples.tolist() == [ids(1, 2, 3)] * 3 + [ids(0, 0, 0), ids(15, 15, 15)]
    assert catalog.num_triples == 3 and catalog.vocab_size == V
    rows = catalog.convert(np.array([ids(1, 2, 3)]))[0]
    assert catalog.item_ids[rows].tolist() == [5, 6, 4]  # most popular first, as in the file


def test_sid2pid_objects_and_default_codebook(tmp_path):
    layout = SidLayout(num_base_tokens=512, codebook_size=8192)
    write_sid_tokenizer(tmp_path / "big", layout)
    tokenizer = PromptTokenizer.from_model_dir(tmp_path / "big")
    key = sid(340, 6566, 5603, 8192)
    path = write_json(tmp_path / "sid2pid.json", {key: [
        {"pid": 123, "count": 9, "count_after_downsample": 3}, {"iid": 77}, 5],
        sid(0, 1, 8191, 8192): [{"pid": 1 << 62}]})
    catalog = import_sid2pid(path, tokenizer, layout.vocab_size)
    assert catalog.item_ids.tolist() == [123, 77, 5, 1 << 62]
    assert catalog.triples.tolist() == ([ids(340, 6566, 5603, layout)] * 3
                                        + [ids(0, 1, 8191, layout)])
    assert tokenizer.tokens_text(catalog.triples[0]) == "<s_a_340><s_b_6566><s_c_5603>"


def test_sid2pid_many_items_vectorised(tmp_path, tokenizer):
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(3000, 3))
    keys = [sid(*row) for row in codes.tolist()]
    data: dict = {}
    for item_id, key in enumerate(keys):
        data.setdefault(key, []).append(item_id)
    catalog = import_sid2pid(write_json(tmp_path / "s.json", data), tokenizer, V, codebook_size=16)
    expected = {item_id: ids(*row) for item_id, row in enumerate(codes.tolist())}
    assert sorted(catalog.item_ids.tolist()) == list(range(3000))
    assert all(expected[item_id] == triple
               for item_id, triple in zip(catalog.item_ids.tolist(), catalog.triples.tolist()))


@pytest.mark.parametrize("data, match", [
    ({"abc": [1]}, "key 'abc' is not a decimal semantic ID"),
    ({"-1": [1]}, "key '-1' is not a decimal"),
    ({"-0": [1]}, "key '-0' is not a decimal"),
    ({"1" * 25: [1]}, f"key {'1' * 25}: code c1 = .* is outside the codebook"),
    ({"1.5": [1]}, "key '1.5' is not a decimal"),
    ({str(16 ** 3): [1]}, r"key 4096: code c1 = 16 is outside the codebook \[0, 16\)"),
    ({"3": 7}, "key 3: got 7, expected a list of items"),
    ({"3": [1], "4": ["12"]}, "key 4: item '12' is not an integer item id"),
    ({"3": [1.5]}, "key 3: item 1.5 is not an integer"),
    ({"3": [True]}, "key 3: item True is not an integer"),
    ({"3": [{"count": 3}]}, "key 3: item {'count': 3} is not an integer"),
    ({"3": [1 << 63]}, f"key 3: item {1 << 63} is not an integer item id in int64"),
    ([1, 2], "expected a JSON object, got list"),
])
def test_sid2pid_errors(tmp_path, tokenizer, data, match):
    path = write_json(tmp_path / "sid2pid.json", data)
    with pytest.raises(CatalogError, match=match) as info:
        import_sid2pid(path, tokenizer, V, codebook_size=16)
    assert str(path) in str(info.value)


def test_sid2pid_token_errors(tmp_path, tokenizer):
    # a codebook of 32 keys codes 16..31, which this tokenizer has no tokens for
    path = write_json(tmp_path / "sid2pid.json", {sid(1, 2, 3, 32): [1], sid(1, 20, 3, 32): [2]})
    with pytest.raises(CatalogError, match=rf"{path}: key {sid(1, 20, 3, 32)}: token '<s_b_20>' "
                                           r"is not in the model's tokenizer"):
        import_sid2pid(path, tokenizer, V, codebook_size=32)
    path = write_json(tmp_path / "sid2pid.json", {sid(1, 2, 3): [1]})
    with pytest.raises(CatalogError, match=r"key 291: token '<s_b_2>' has id 556, outside the "
                                           r"model's vocabulary \[0, 555\)"):
        import_sid2pid(path, tokenizer, 555, codebook_size=16)
    for bad in (0, 1 << 21, 16.0):
        with pytest.raises(CatalogError, match="codebook_size"):
            import_sid2pid(path, tokenizer, V, codebook_size=bad)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(CatalogError, match="broken.json: not valid JSON"):
        import_sid2pid(tmp_path / "broken.json", tokenizer, V)
    with pytest.raises(CatalogError, match="cannot read .*missing.json"):
        import_sid2pid(tmp_path / "missing.json", tokenizer, V)


# --- token map (MiniOneRec's index) --------------------------------------------------------

def test_token_map(tmp_path, tokenizer):
    path = write_json(tmp_path / "index.json", {
        "0": ["<s_a_12>", "<s_b_7>", "<s_c_15>"], "-3": ["<s_a_1>", "<s_b_1>", "<s_c_1>"],
        "9223372036854775807": ["!", "<|sid_begin|>", "<s_c_1>"]})
    catalog = import_token_map(path, tokenizer, V)
    assert catalog.item_ids.tolist() == [0, -3, (1 << 63) - 1]
    assert catalog.triples.tolist() == [ids(12, 7, 15), ids(1, 1, 1), [0, 586, ids(0, 0, 1)[2]]]


@pytest.mark.parametrize("data, match", [
    ({"x1": ["<s_a_1>", "<s_b_1>", "<s_c_1>"]}, "item id 'x1' is not an integer"),
    ({"1.0": ["<s_a_1>", "<s_b_1>", "<s_c_1>"]}, "item id '1.0' is not an integer"),
    ({str(1 << 63): ["<s_a_1>", "<s_b_1>", "<s_c_1>"]}, "is not an integer in int64"),
    ({"1": ["<s_a_1>", "<s_b_1>"]}, "item 1: got .*expected a list of 3 token strings"),
    ({"1": ["<s_a_1>", "<s_b_1>", "<s_c_1>", "<s_c_2>"]}, "item 1: got .*expected a list of 3"),
    ({"1": ["<s_a_1>", 5, "<s_c_1>"]}, "item 1: got .*expected a list of 3 token strings"),
    ({"1": "<s_a_1><s_b_1><s_c_1>"}, "item 1: got .*expected a list of 3 token strings"),
    ({"1": ["<s_a_1>", "<s_b_1>", "<s_c_1>"], "2": ["<a_12>", "<b_7>", "<c_200>"]},
     "item 2: token '<a_12>' is not in the model's tokenizer"),
])
def test_token_map_errors(tmp_path, tokenizer, data, match):
    path = write_json(tmp_path / "index.json", data)
    with pytest.raises(CatalogError, match=match) as info:
        import_token_map(path, tokenizer, V)
    assert str(path) in str(info.value)


def test_token_map_id_outside_vocab(tmp_path, tokenizer):
    path = write_json(tmp_path / "index.json", {"4": ["<s_a_1>", "<s_b_1>", "<|sid_end|>"]})
    with pytest.raises(CatalogError, match=r"item 4: token '<\|sid_end\|>' has id 587, outside"):
        import_token_map(path, tokenizer, 587)


# --- CSV -----------------------------------------------------------------------------------

def test_token_csv(tmp_path, tokenizer):
    path = tmp_path / "items.csv"
    path.write_text("item_id,t0,t1,t2\n10,<s_a_1>,<s_b_2>,<s_c_3>\n\n# a comment\n"
                    ' 11 , <s_a_4> ,"<s_b_5>",<s_c_6>\n-2,<s_a_0>,<s_b_0>,<s_c_0>\n')
    catalog = import_token_csv(path, tokenizer, V)
    assert catalog.item_ids.tolist() == [10, 11, -2]
    assert catalog.triples.tolist() == [ids(1, 2, 3), ids(4, 5, 6), ids(0, 0, 0)]
    path.write_text("7,<s_a_1>,<s_b_2>,<s_c_3>\n")  # no header
    assert import_token_csv(path, tokenizer, V).item_ids.tolist() == [7]
    path.write_text("item_id,t0,t1,t2\n")
    assert import_token_csv(path, tokenizer, V).num_items == 0


@pytest.mark.parametrize("text, match", [
    ("1,<s_a_1>,<s_b_2>\n", "line 1: item 1: got .*expected a list of 3 token strings"),
    ("1,<s_a_1>,<s_b_2>,<s_c_3>,\n", "line 1: item 1: got .*expected a list of 3"),
    ("id,a,b,c\n1,<s_a_1>,<s_b_2>,<s_c_3>\nx,<s_a_1>,<s_b_2>,<s_c_3>\n",
     "line 3: item id 'x' is not an integer"),
    ("1,<s_a_1>,<s_b_2>,<s_c_3>\n2.5,<s_a_1>,<s_b_2>,<s_c_3>\n", "line 2: item id '2.5'"),
    ("1,<s_a_1>,<s_b_2>,<s_c_3>\n2,<s_a_1>,<s_b_99>,<s_c_3>\n",
     "line 2: item 2: token '<s_b_99>' is not in the model's tokenizer"),
])
def test_token_csv_errors(tmp_path, tokenizer, text, match):
    path = tmp_path / "items.csv"
    path.write_text(text)
    with pytest.raises(CatalogError, match=match) as info:
        import_token_csv(path, tokenizer, V)
    assert str(path) in str(info.value)


# --- xrec catalog import -------------------------------------------------------------------

def test_cli_writes_the_model_catalog(tmp_path, model_dir, capsys):
    directory = tmp_path / "model"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (directory / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.update(vocab_file="vocab.json", extended_item_info=True)
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    path = write_json(tmp_path / "s.json", {sid(1, 2, 3): [5, 6], sid(4, 5, 6): [{"pid": 8}]})
    assert main(["import", "--model", str(directory), "--format", "sid2pid", str(path),
                 "--codebook-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "imported 3 items, 2 distinct semantic IDs" in out
    assert str(directory / "catalog.bin") in out
    written = json.loads((directory / "tokenizer_config.json").read_text())
    assert written == {**config, "item_catalog": "catalog.bin", "extended_item_info": False}
    catalog = ItemCatalog.from_model_dir(directory, V)
    assert catalog.item_ids.tolist() == [5, 6, 8]
    assert catalog.triples.tolist() == [ids(1, 2, 3)] * 2 + [ids(4, 5, 6)]


def test_cli_out_leaves_the_directory_alone(tmp_path, model_dir, capsys):
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    csv_path = tmp_path / "items.csv"
    csv_path.write_text("1,<s_a_1>,<s_b_2>,<s_c_3>\n2,<s_a_1>,<s_b_2>,<s_c_3>\n")
    out = tmp_path / "c.bin"
    assert main(["import", "--model", str(model_dir), "--format", "csv", str(csv_path),
                 "--out", str(out)]) == 0
    assert f"--catalog {out}" in capsys.readouterr().out
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before
    assert ItemCatalog.read(out, V).item_ids.tolist() == [1, 2]


def test_cli_errors(tmp_path, model_dir, capsys):
    path = write_json(tmp_path / "index.json", {"1": ["<a_1>", "<b_1>", "<c_1>"]})
    assert main(["import", "--model", str(model_dir), "--format", "json", str(path),
                 "--out", str(tmp_path / "c.bin")]) == 1
    assert "token '<a_1>' is not in the model's tokenizer" in capsys.readouterr().err
    assert not (tmp_path / "c.bin").exists()
    (tmp_path / "config.json").write_text(json.dumps(MODEL_SIZES["qwen3-sid-test"].to_dict()))
    assert main(["import", "--model", str(tmp_path), "--format", "json", str(path)]) == 1
    assert "no tokenizer.json" in capsys.readouterr().err
    assert main(["import", "--model", str(tmp_path / "none"), "--format", "json", str(path)]) == 1
    assert "no config.json" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: an unknown format
        main(["import", "--model", str(model_dir), "--format", "parquet", str(path)])


def test_cli_subprocess_and_parser(tmp_path, model_dir):
    import argparse

    parser = argparse.ArgumentParser(prog="xrec")
    add_catalog_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["catalog", "import", "--model", "m", "--format", "sid2pid", "in"])
    assert (args.command, args.codebook_size, args.out, args.input) == ("catalog", 8192, None, "in")
    path = write_json(tmp_path / "index.json", {"3": ["<s_a_1>", "<s_b_1>", "<s_c_1>"]})
    proc = subprocess.run([sys.executable, "-m", "xrec.catalog.cli", "import", "--model",
                           str(model_dir), "--format", "json", str(path), "--out",
                           str(tmp_path / "c.bin")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "imported 1 items, 1 distinct semantic IDs" in proc.stdout
    assert ItemCatalog.read(tmp_path / "c.bin", V).triples.tolist() == [ids(1, 1, 1)]


# --- ItemCatalog.from_model_dir: which key names the catalog -------------------------------

def test_from_model_dir_naming_rules(tmp_path):
    catalog = ItemCatalog.from_arrays([10, 11], [(1, 2, 3), (4, 5, 6)], 16)
    catalog.write(tmp_path / "a.bin")
    catalog.write_text(tmp_path / "items.txt")
    extended = ItemCatalog.from_arrays([12], [(1, 2, 3)], 16, dids=["d"], types=["t"])
    extended.write(tmp_path / "e.bin")
    (tmp_path / "vocab.txt").write_text("[PAD]\n[UNK]\nhello\n")

    def load(**config):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
        found = ItemCatalog.from_model_dir(tmp_path, 16)
        return None if found is None else found.item_ids.tolist()

    assert load(item_catalog="a.bin", vocab_file="e.bin") == [10, 11]  # xrec's key wins
    assert load(item_catalog="e.bin", extended_item_info=True) == [12]
    assert load(vocab_file="a.bin") == [10, 11]  # xllm's key
    assert load(vocab_file="items.txt") == [10, 11]  # a text catalog (after its # header)
    (tmp_path / "headed.txt").write_text("item_id,t0,t1,t2\n10,1,2,3\n11,4,5,6\n")
    assert load(vocab_file="headed.txt") == [10, 11]  # its CSV header is not a vocabulary's
    for vocabulary in ("vocab.json", "tokenizer.model", "qwen.tiktoken", "vocab.txt", "/x/v.json"):
        assert load(vocab_file=vocabulary) is None, vocabulary
    assert load(vocab_file="vocab.json", item_catalog="a.bin") == [10, 11]
    (tmp_path / "tokenizer.json").write_text("{}")  # a tokenizer beside does not hide a catalog
    assert load(vocab_file="a.bin") == [10, 11]
    for bad, match in (({"item_catalog": 3}, "item_catalog = 3, expected a path"),
                       ({"item_catalog": "missing.bin"}, "cannot read catalog file"),
                       ({"item_catalog": "vocab.json"}, "cannot read catalog file"),
                       ({"vocab_file": "missing.txt"}, "cannot read catalog file"),
                       ({"item_catalog": "a.bin", "extended_item_info": 1}, "extended_item_info")):
        with pytest.raises(CatalogError, match=match):
            load(**bad)
    # a .txt catalog in the wrong shape is read as a catalog and refused, not taken for a
    # tokenizer's vocabulary (which left the engine unconstrained, said at INFO level only)
    for name, text, match in (("five.txt", "1,2,3,4,5\n", "5 comma-separated field"),
                              ("semicolons.txt", "1;2;3;4\n", "1 comma-separated field")):
        (tmp_path / name).write_text(text)
        with pytest.raises(CatalogError, match=match):
            load(vocab_file=name)
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbf10,1,2,3\n11,4,5,6\n")
    assert load(vocab_file="bom.txt") == [10, 11]   # a BOM: still a catalog, read whole
    (tmp_path / "tokenizer_config.json").write_text("[]")
    with pytest.raises(CatalogError, match="expected a JSON object, got list"):
        ItemCatalog.from_model_dir(tmp_path, 16)


def test_a_bom_is_not_part_of_the_first_item_id(tmp_path, tokenizer):
    """Excel writes CSV with a BOM: its first row's id read as "\ufeff1", which made the row
    a header and dropped the first item without a word."""
    path = tmp_path / "items.csv"
    path.write_bytes("\ufeff1,<s_a_1>,<s_b_2>,<s_c_3>\n2,<s_a_4>,<s_b_5>,<s_c_6>\n".encode())
    assert import_token_csv(path, tokenizer, V).item_ids.tolist() == [1, 2]
    text = tmp_path / "items.txt"
    text.write_bytes("\ufeff1,1,2,3\n".encode())
    assert ItemCatalog.read(text, V).item_ids.tolist() == [1]


def test_cli_refuses_an_import_without_items(tmp_path, model_dir, capsys):
    """It wrote an empty catalog and named it in the model directory, which then could not
    serve ("the catalog has no items")."""
    before = {p.name: p.read_bytes() for p in model_dir.iterdir()}
    path = tmp_path / "items.csv"
    path.write_text("item_id,t0,t1,t2\n")
    assert main(["import", "--model", str(model_dir), "--format", "csv", str(path)]) == 1
    assert f"{path}: no items to import; nothing written" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in model_dir.iterdir()} == before


# --- the text reader and the CSV importer agree; files that are no regular file (issue 28) ---

def test_a_header_line_is_read_alike_by_the_importer_and_the_text_reader(tmp_path, tokenizer):
    """`catalog import` took `item_id,t0,t1,t2` as a header; the text reader refused it with
    "'item_id,t0,t1,t2' is not 'item_id,t0,t1,t2' (four integers)"."""
    header = "item_id,t0,t1,t2\n"
    text = tmp_path / "items.csv"
    text.write_text(header + "10,1,2,3\n11,4,5,6\n")
    assert ItemCatalog.read(text, V).item_ids.tolist() == [10, 11]
    tokens = tmp_path / "tokens.csv"
    tokens.write_text(header + "10,<s_a_1>,<s_b_2>,<s_c_3>\n")
    assert import_token_csv(tokens, tokenizer, V).item_ids.tolist() == [10]
    # only a first line is a header; later, the message names the line and the field,
    # says what a line must be once, and quotes nothing of the file
    text.write_text("10,1,2,3\n" + header)
    with pytest.raises(CatalogError) as info:
        ItemCatalog.read(text, V)
    message = str(info.value)
    assert message.endswith("line 2: the line is not 'item_id,t0,t1,t2' (four integers): field "
                            "item_id is not an integer")
    assert message.count("item_id,t0,t1,t2") == 1
    # a first line with an integer in it, or not of four fields, is data: an error, not skipped
    for first, problem in (("l0,1,2,3", "field item_id is not an integer"),
                           ("SECRET=hunter2", "1 comma-separated field(s)")):
        text.write_text(f"{first}\n11,4,5,6\n")
        with pytest.raises(CatalogError, match=rf"line 1: .*: {re.escape(problem)}$") as info:
            ItemCatalog.read(text, V)
        assert first not in str(info.value)
        tokens.write_text(f"{first}\n11,<s_a_1>,<s_b_2>,<s_c_3>\n")
        with pytest.raises(CatalogError, match="line 1"):
            import_token_csv(tokens, tokenizer, V)


def _in_thread(function, *args):
    """`function(*args)` on a daemon thread: its exception or result, None if it blocks."""
    outcome: list = []

    def run():
        try:
            outcome.append(function(*args))
        except Exception as exc:  # noqa: BLE001 - the test looks at it
            outcome.append(exc)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    return outcome[0] if outcome else None


def test_readers_refuse_fifos_and_devices_without_reading(tmp_path, tokenizer):
    """A FIFO blocked the reader for ever and /dev/zero was read until memory ran out."""
    fifo = tmp_path / "items.bin"
    os.mkfifo(fifo)
    csv_fifo = tmp_path / "items.csv"
    os.mkfifo(csv_fifo)
    cases = [(ItemCatalog.read, fifo, V), (ItemCatalog.read, csv_fifo, V),
             (ItemCatalog.read, "/dev/zero", V), (import_token_csv, csv_fifo, tokenizer, V),
             (import_token_map, "/dev/zero", tokenizer, V), (ItemCatalog.read, tmp_path, V)]
    for function, path, *rest in cases:
        error = _in_thread(function, path, *rest)
        assert isinstance(error, CatalogError), (function, path, error)
        assert str(path) in str(error) and "not a regular file (a" in str(error), str(error)


def _catalog_csv(path, num_items):
    path.write_text("".join(f"{i},<s_a_{i % 16}>,<s_b_{i // 16 % 16}>,<s_c_{i // 256 % 16}>\n"
                            for i in range(num_items)))
    return path


def test_an_import_that_cannot_finish_leaves_the_old_catalog_whole(tmp_path, model_dir):
    """The catalog was rewritten in place: a write cut short (a full disk; here a file-size
    limit) left a shorter catalog that loaded without an error, the old one gone."""
    directory = tmp_path / "model"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (directory / name).write_bytes((model_dir / name).read_bytes())
    items = _catalog_csv(tmp_path / "items.csv", 1000)
    command = [sys.executable, "-m", "xrec.catalog.cli", "import", "--model", str(directory),
               "--format", "csv", str(items)]
    assert subprocess.run(command, capture_output=True, timeout=120).returncode == 0
    before = (directory / "catalog.bin").read_bytes()
    limited = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (5120, 5120)); "
               "sys.argv = sys.argv[1:]; runpy.run_module('xrec.catalog.cli', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", limited, *command[2:]], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 1 and "File too large" in proc.stderr, proc.stderr
    assert (directory / "catalog.bin").read_bytes() == before
    assert len(ItemCatalog.from_model_dir(directory, V)) == 1000
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["catalog.bin", "config.json", "tokenizer.json", "tokenizer_config.json"])


@pytest.mark.parametrize("suffix", [".csv", ".txt", ".bin"])
def test_cli_out_is_written_in_the_form_its_suffix_is_read_in(tmp_path, model_dir, suffix):
    """--out c.csv wrote the binary form, which the reader (text for .csv/.txt) refused."""
    out = tmp_path / f"c{suffix}"
    assert main(["import", "--model", str(model_dir), "--format", "csv",
                 str(_catalog_csv(tmp_path / "items.csv", 40)), "--out", str(out)]) == 0
    catalog = ItemCatalog.read(out, V)
    assert catalog.item_ids.tolist() == list(range(40))
    assert catalog.triples[17].tolist() == ids(1, 1, 0)
    assert out.read_bytes().startswith(b"# item_id") == (suffix != ".bin")


def test_integers_of_thousands_of_digits_are_catalog_errors(tmp_path, tokenizer):
    """int() of over 4,300 digits raised a bare ValueError: the admin load answered 500."""
    digits = "9" * 5000
    text = tmp_path / "items.txt"
    text.write_text(f"1,600,601,602\n{digits},600,601,602\n")
    with pytest.raises(CatalogError, match=r"line 2: item_id has more than 20 characters"):
        ItemCatalog.read(text, V)
    text.write_text("1,600,601,6\u0662\n")   # an Arabic-Indic digit is not a decimal digit here
    with pytest.raises(CatalogError, match="line 1: .*field t2 is not an integer"):
        ItemCatalog.read(text, V)
    with pytest.raises(CatalogError, match="is not an integer in int64"):
        import_token_map(write_json(tmp_path / "m.json", {digits: ["<s_a_1>", "<s_b_1>",
                                                                   "<s_c_1>"]}), tokenizer, V)
    with pytest.raises(CatalogError, match=r"\(5000 digits\): code c1 is outside the codebook"):
        import_sid2pid(write_json(tmp_path / "s.json", {digits: [1]}), tokenizer, V,
                       codebook_size=16)


def test_json_nested_past_the_recursion_limit_is_a_catalog_error(tmp_path, tokenizer):
    """json.loads raised RecursionError (a traceback, 500 on an admin route) for a
    tokenizer_config.json or an importer's input nested deeper than Python's limit."""
    deep = "[" * 100_000 + "]" * 100_000
    nested = tmp_path / "nested.json"
    nested.write_text('{"1": ' + deep + "}")
    for importer in (import_token_map, import_sid2pid):
        with pytest.raises(CatalogError, match=r"nested.json: JSON nested too deeply"):
            importer(nested, tokenizer, V)
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "tokenizer_config.json").write_text(deep)
    with pytest.raises(CatalogError, match=r"tokenizer_config.json: JSON nested too deeply"):
        ItemCatalog.from_model_dir(directory, V)


def test_a_key_written_twice_keeps_every_record(tmp_path, tokenizer):
    """json.loads keeps one value per key: a sid2pid.json listing one semantic ID twice (two
    shards joined by hand) lost the first list's items without a word, and a token map
    listing an item twice kept its last triple at its first position. Every record is kept
    now and the catalog's rule applies: the items of both lists, in file order; an item id
    listed twice keeps its last triple at that record's position."""
    path = tmp_path / "sid2pid.json"
    path.write_text(f'{{"{sid(1, 2, 3)}": [5, 6], "{sid(0, 0, 1)}": [{{"pid": 8}}], '
                    f'"{sid(1, 2, 3)}": [7]}}')
    catalog = import_sid2pid(path, tokenizer, V, codebook_size=16)
    assert catalog.item_ids.tolist() == [5, 6, 8, 7]
    assert catalog.triples.tolist() == [ids(1, 2, 3)] * 2 + [ids(0, 0, 1), ids(1, 2, 3)]
    path = tmp_path / "map.json"
    path.write_text('{"5": ["<s_a_1>", "<s_b_1>", "<s_c_1>"], "6": ["<s_a_2>", "<s_b_2>", '
                    '"<s_c_2>"], "5": ["<s_a_3>", "<s_b_3>", "<s_c_3>"]}')
    catalog = import_token_map(path, tokenizer, V)
    assert catalog.item_ids.tolist() == [6, 5]
    assert catalog.triples.tolist() == [ids(2, 2, 2), ids(3, 3, 3)]


def test_a_vocab_file_name_the_file_system_refuses_is_a_catalog_error(tmp_path):
    """A .txt vocab_file whose name is too long for the file system raised OSError (ENAMETOOLONG)
    from the check for a tokenizer vocabulary, before the reader could name it."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"vocab_file": "v" * 300 + ".txt"}))
    with pytest.raises(CatalogError, match=r"cannot read catalog file .*vvv\.txt: .*too long"):
        ItemCatalog.from_model_dir(tmp_path, 16)


def test_naming_the_catalog_that_cannot_finish_leaves_no_temporary_file(tmp_path, model_dir):
    """tokenizer_config.json was rewritten through a fixed `.tmp` name, neither synced nor
    removed when the write failed (a full disk; here a file-size limit)."""
    directory = tmp_path / "model"
    directory.mkdir()
    for name in ("tokenizer.json", "config.json"):
        (directory / name).write_bytes((model_dir / name).read_bytes())
    config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["notes"] = "n" * 20_000   # over the limit below; the 10-item catalog is not
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    before = (directory / "tokenizer_config.json").read_bytes()
    limited = ("import resource, runpy, sys; resource.setrlimit(resource.RLIMIT_FSIZE, (5120, 5120)); "
               "sys.argv = sys.argv[1:]; runpy.run_module('xrec.catalog.cli', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", limited, "xrec", "import", "--model", str(directory),
                           "--format", "csv", str(_catalog_csv(tmp_path / "items.csv", 10))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "File too large" in proc.stderr, proc.stderr
    assert (directory / "tokenizer_config.json").read_bytes() == before
    assert sorted(p.name for p in directory.iterdir()) == sorted(
        ["catalog.bin", "config.json", "tokenizer.json", "tokenizer_config.json"])
