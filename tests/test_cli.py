"""The `xrec` command line with XREC_HOME in a tmp dir: its `main` in this process, stdout and
stderr captured (a subprocess per command paid ~3 s of imports each); the process boundary
itself through the console script, `--help`, the permission and umask tests, and the
server tests' `xrec serve` processes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from xrec import Engine, RecRequest
from xrec.catalog import ItemCatalog

TIMEOUT_S = 120.0
ROW = re.compile(r"^\s*(\d+)\s+\((\d+), (\d+), (\d+)\)\s+(-?\d+\.\d+)\s+((?:-?\d+\.\d+\s+){3})(.*)$")


def xrec_cli(*args: str, home: Path) -> subprocess.CompletedProcess:
    """`xrec ARGS` through `xrec.cli.main` in this process, XREC_HOME=home: its exit code
    (argparse's SystemExit included), stdout and stderr."""
    from xrec.cli import main

    out, err = io.StringIO(), io.StringIO()
    saved = os.environ.get("XREC_HOME")
    os.environ["XREC_HOME"] = str(home)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
    finally:
        if saved is None:
            os.environ.pop("XREC_HOME")
        else:
            os.environ["XREC_HOME"] = saved
    return subprocess.CompletedProcess(["xrec", *args], code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("xrec-home")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, home):
    out = tmp_path_factory.mktemp("models") / "tiny"
    proc = xrec_cli("make-model", "--size", "tiny", "--out", str(out), "--items", "500", home=home)
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout
    return out


def test_make_model_writes_a_loadable_directory(tiny_model):
    names = {p.name for p in tiny_model.iterdir()}
    assert {"config.json", "tokenizer_config.json"} <= names
    assert any(name.endswith(".safetensors") for name in names)
    catalog = ItemCatalog.from_model_dir(tiny_model, 64)
    assert catalog is not None and catalog.num_items == 500
    with Engine.from_pretrained(tiny_model, isolation="thread", device="cpu", dtype="float32") as engine:
        assert engine.model.config.vocab_size == 64 and engine.model.config.d_model == 32
        assert engine.catalog is not None and engine.catalog.num_items == 500
        box: dict = {}
        thread = threading.Thread(target=lambda: box.setdefault(
            "r", engine.recommend([RecRequest(token_ids=[1, 2, 3], beam_width=16)])), daemon=True)
        thread.start()
        thread.join(TIMEOUT_S)
        assert "r" in box, "Engine.recommend did not answer"
    response, = box["r"]
    triples = {tuple(t) for t in catalog.triples.tolist()}
    assert len(response.results) == 16
    for candidate in response.results:
        assert candidate.tokens in triples
        assert candidate.items and all(i.item_id in set(catalog.item_ids.tolist()) for i in candidate.items)


def test_recommend_prints_a_table(tiny_model, home):
    proc = xrec_cli("recommend", "--model", str(tiny_model), "--token-ids", "1,2,3", "--top-n", "5",
                    "--device", "cpu", home=home)
    assert proc.returncode == 0, proc.stderr
    rows = [ROW.match(line) for line in proc.stdout.splitlines()]
    rows = [m for m in rows if m]
    assert len(rows) == 5, proc.stdout
    assert [int(m.group(1)) for m in rows] == [1, 2, 3, 4, 5]
    catalog = ItemCatalog.from_model_dir(tiny_model, 64)
    items_of: dict = {}
    for item_id, triple in zip(catalog.item_ids.tolist(), catalog.triples.tolist()):
        items_of.setdefault(tuple(triple), []).append(item_id)
    scores = []
    for m in rows:
        triple = (int(m.group(2)), int(m.group(3)), int(m.group(4)))
        assert triple in items_of, f"{triple} is not a catalog triple"
        printed = [int(x) for x in re.findall(r"\d+", m.group(7))]
        assert printed and printed == items_of[triple][:3]
        lps = [float(x) for x in m.group(6).split()]
        scores.append(float(m.group(5)))
        assert sum(lps) == pytest.approx(scores[-1], abs=2e-3)
    assert scores == sorted(scores, reverse=True)
    # the same request through the Python API (the CLI's default beam width 128) ranks the same
    with Engine.from_pretrained(tiny_model, isolation="thread", device="cpu", dtype="float32") as engine:
        future = engine.submit(RecRequest(token_ids=[1, 2, 3], beam_width=128))
        response = future.result(timeout=TIMEOUT_S)
    assert [c.tokens for c in response.results[:5]] == [
        (int(m.group(2)), int(m.group(3)), int(m.group(4))) for m in rows]
    assert [c.score for c in response.results[:5]] == pytest.approx(scores, abs=1e-3)


@pytest.mark.parametrize("token_ids,words", [
    ("1,x,3", ["--token-ids", "1,x,3"]),
    ("1,2,999", ["INVALID_ARGUMENT", "token_ids", "999"]),
])
def test_recommend_bad_token_ids(tiny_model, home, token_ids, words):
    proc = xrec_cli("recommend", "--model", str(tiny_model), "--token-ids", token_ids, "--device", "cpu",
                    home=home)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert not any(ROW.match(line) for line in proc.stdout.splitlines())


def test_recommend_excludes_items(tiny_model, home):
    """`--exclude-items`: the best semantic ID's items and an id the catalog does not hold
    are left out in the search (issue 25), and the unknown one is counted."""
    base = ("recommend", "--model", str(tiny_model), "--token-ids", "1,2,3", "--beam-width", "16",
            "--device", "cpu")
    proc = xrec_cli(*base, "--json", home=home)
    assert proc.returncode == 0, proc.stderr
    best = json.loads(proc.stdout)[0]
    excluded = best["items"] + [1]
    assert 1 not in set(ItemCatalog.from_model_dir(tiny_model, 64).item_ids.tolist())
    proc = xrec_cli(*base, "--exclude-items", ",".join(map(str, excluded)), home=home)
    assert proc.returncode == 0, proc.stderr
    assert "1 excluded ids not in the catalog" in proc.stdout.splitlines()[0], proc.stdout
    rows = [m for m in map(ROW.match, proc.stdout.splitlines()) if m]
    assert len(rows) == 10
    assert tuple(best["tokens"]) not in [(int(m[2]), int(m[3]), int(m[4])) for m in rows]
    assert not {int(x) for m in rows for x in re.findall(r"\d+", m[7])} & set(excluded)


@pytest.mark.parametrize("flags,words", [
    (("--exclude-items", "1,x"), ["--exclude-items: expected comma-separated integers", "1,x"]),
    (("--exclude-items", "1,9223372036854775808"),
     ["INVALID_ARGUMENT", "exclude_items[1]: got 9223372036854775808"]),
    (("--item-types", "video,live"), ["INVALID_ARGUMENT", "item_types"]),   # an untyped catalog
    (("--exclude-history",), ["INVALID_ARGUMENT", "exclude_history", "decoder-only"]),
])
def test_recommend_bad_filters(tiny_model, home, flags, words):
    proc = xrec_cli("recommend", "--model", str(tiny_model), "--token-ids", "1,2,3", "--device",
                    "cpu", *flags, home=home)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr, proc.stderr
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert not any(ROW.match(line) for line in proc.stdout.splitlines())


def test_recommend_serves_an_extended_catalog_file(tiny_model, home, tmp_path):
    """`--catalog FILE` could not name an extended catalog: it was read as 20-byte records and
    refused. `--catalog-extended true|false` says how to read it; unset, the model
    directory's `extended_item_info` does (never for a text file), as a load with
    `"extended": null` keeps the current catalog's form."""
    base = ItemCatalog.from_model_dir(tiny_model, 64)
    ids = base.item_ids.tolist()
    typed = ItemCatalog.from_arrays(ids, base.triples, 64, [f"d{i}" for i in ids],
                                    ["video" if i % 2 == 0 else "live" for i in ids])
    typed.write(tmp_path / "typed.bin")
    base.write(tmp_path / "plain.txt")
    declared = tmp_path / "declared"   # the model, its own catalog extended
    declared.mkdir()
    for path in tiny_model.iterdir():
        if path.name != "tokenizer_config.json":
            (declared / path.name).symlink_to(path)
    typed.write(declared / "own.bin")
    (declared / "tokenizer_config.json").write_text(json.dumps(
        {"item_catalog": "own.bin", "extended_item_info": True}))

    def items_of_type(model, *flags) -> list[int]:
        proc = xrec_cli("recommend", "--model", str(model), "--token-ids", "1,2,3", "--device",
                        "cpu", "--json", "--item-types", "video", *flags, home=home)
        assert proc.returncode == 0, proc.stderr
        return [item for row in json.loads(proc.stdout) for item in row["items"]]

    for model, flags in [(tiny_model, ("--catalog-extended", "true")),
                         (declared, ()), (declared, ("--catalog-extended", "yes"))]:
        items = items_of_type(model, "--catalog", str(tmp_path / "typed.bin"), *flags)
        assert items and all(item % 2 == 0 for item in items), (model, flags)
    for model, flags, words in [
            (tiny_model, (), "typed.bin: trailing partial record"),   # read as 20-byte records
            (declared, ("--catalog-extended", "false"), "typed.bin: trailing partial record"),
            (declared, ("--catalog", str(tmp_path / "plain.txt")), "item_types"),   # no types
            (tiny_model, ("--catalog-extended", "true", "--catalog", str(tmp_path / "plain.txt")),
             "an extended catalog must be binary")]:
        if "--catalog" not in flags:
            flags = (*flags, "--catalog", str(tmp_path / "typed.bin"))
        proc = xrec_cli("recommend", "--model", str(model), "--token-ids", "1,2,3", "--device",
                        "cpu", "--item-types", "video", *flags, home=home)
        assert proc.returncode == 1 and words in proc.stderr, (flags, proc.stderr)
        assert "Traceback" not in proc.stderr
    proc = xrec_cli("recommend", "--model", str(declared), "--catalog-extended", "true", home=home)
    assert proc.returncode == 1 and proc.stderr.startswith(
        "xrec recommend: error: --catalog-extended: says how to read --catalog FILE"), proc.stderr


@pytest.mark.parametrize("flags, words", [
    (["--top-n", "-2"], "--top-n: got -2"),
    (["--token-ids", ""], "token_ids: empty input"),
    (["--embedding", ""], "--embedding : No such file"),
    (["--model", ""], "--model: got ''"),
])
def test_recommend_never_answers_a_request_it_was_not_given(tiny_model, home, flags, words):
    """`--top-n -2` printed every row but the last two; an empty `--token-ids` or
    `--embedding` was taken as none given and answered for the default ids 1,2,3, an empty
    `--model` by the demo model."""
    proc = xrec_cli("recommend", "--model", str(tiny_model), "--device", "cpu", "--json", *flags,
                    home=home)
    assert proc.returncode == 1 and proc.stdout == "", proc.stdout
    assert len(proc.stderr.strip().splitlines()) == 1 and words in proc.stderr, proc.stderr


def test_recommend_embedding_that_is_not_an_npy_file(tiny_model, home, tmp_path):
    """np.load read an .npz archive as a mapping (refused as "elements of type <U1"), a
    text file as a pickle ("If you trust the file ..."), and an empty file with an EOFError
    traceback."""
    import numpy as np

    np.savez(tmp_path / "e.npz", a=np.zeros((2, 32), np.float32))
    (tmp_path / "text.npy").write_text("0.5, 0.25\n")
    (tmp_path / "empty.npy").write_bytes(b"")
    for name in ("e.npz", "text.npy", "empty.npy"):
        path = tmp_path / name
        proc = xrec_cli("recommend", "--model", str(tiny_model), "--device", "cpu", "--embedding",
                        str(path), home=home)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.startswith(f"xrec recommend: error: --embedding {path}: not a .npy "
                                      "file (") and len(proc.stderr.splitlines()) == 1, proc.stderr


@pytest.fixture(scope="module")
def sid_model(tmp_path_factory, home):
    out = tmp_path_factory.mktemp("models") / "qwen3"
    proc = xrec_cli("make-model", "--size", "qwen3-sid-test", "--out", str(out), "--items", "300",
                    home=home)
    assert proc.returncode == 0, proc.stderr
    return out


def test_decoder_only_model_answers_a_chat_with_items(sid_model, home):
    from xrec.tokenizer import PromptTokenizer

    assert {"tokenizer.json", "tokenizer_config.json", "config.json", "items.bin"} <= \
        {p.name for p in sid_model.iterdir()}
    proc = xrec_cli("recommend", "--model", str(sid_model), "--chat", "I liked <s_a_3><s_b_7><s_c_9>",
                    "--generation-prefix", "<|sid_begin|>", "--beam-width", "16", "--top-n", "4",
                    "--json", home=home)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    tokenizer = PromptTokenizer.from_model_dir(sid_model)
    catalog = ItemCatalog.from_model_dir(sid_model, tokenizer.vocab_size)
    triples = {tuple(t) for t in catalog.triples.tolist()}
    assert len(rows) == 4
    for row in rows:
        assert tuple(row["tokens"]) in triples and row["items"]
        assert row["text"] == "".join(tokenizer.id_to_token(t) for t in row["tokens"])
        assert re.fullmatch(r"<s_a_\d+><s_b_\d+><s_c_\d+>", row["text"])


def test_catalog_import_through_the_xrec_command(sid_model, home, tmp_path):
    path = tmp_path / "items.csv"
    path.write_text("item_id,a,b,c\n7,<s_a_1>,<s_b_2>,<s_c_3>\n8,<s_a_1>,<s_b_2>,<s_c_4>\n")
    out = tmp_path / "two.bin"
    proc = xrec_cli("catalog", "import", "--model", str(sid_model), "--format", "csv", str(path),
                    "--out", str(out), home=home)
    assert proc.returncode == 0, proc.stderr
    assert "2 items" in proc.stdout and "--catalog" in proc.stdout
    proc = xrec_cli("recommend", "--model", str(sid_model), "--catalog", str(out), "--token-ids", "5,6",
                    "--beam-width", "4", "--json", home=home)
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["items"] for r in json.loads(proc.stdout)) == [[7], [8]]
    bad = xrec_cli("catalog", "import", "--model", str(sid_model), "--format", "csv", str(path).replace(
        "items.csv", "missing.csv"), home=home)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr


def test_help(home):
    proc = subprocess.run([sys.executable, "-m", "xrec.cli", "--help"], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=dict(os.environ, XREC_HOME=str(home)))
    assert proc.returncode == 0, proc.stderr
    for command in ("serve", "recommend", "make-model", "catalog", "bench"):
        assert command in proc.stdout
    for command in ("recommend", "make-model", "serve", "bench"):
        sub = xrec_cli(command, "--help", home=home)
        assert sub.returncode == 0 and "usage: xrec " + command in sub.stdout, sub.stderr
    assert "--token-ids" in xrec_cli("recommend", "--help", home=home).stdout
    # --help must not pay for torch (SPEC: the CLI's --help starts in well under a second)
    probe = subprocess.run([sys.executable, "-c", "import sys, xrec, xrec.cli; xrec.cli.build_parser(); "
                            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"],
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert probe.returncode == 0 and probe.stdout.strip() == "[]", probe.stdout + probe.stderr


def test_console_script(home, tmp_path):
    """The installed `xrec` entry point (next to the venv's python) runs too."""
    script = Path(sys.executable).with_name("xrec")
    if not script.exists():
        pytest.skip("no xrec console script next to this interpreter")
    proc = subprocess.run([str(script), "make-model", "--size", "nosuch", "--out", str(tmp_path / "m")],
                          capture_output=True, text=True, timeout=TIMEOUT_S,
                          env=dict(os.environ, XREC_HOME=str(home)))
    assert proc.returncode != 0 and "nosuch" in proc.stderr
    assert not (tmp_path / "m").exists()


def test_make_model_bad_arguments(home, tmp_path):
    proc = xrec_cli("make-model", "--size", "tiny", "--out", str(tmp_path / "m"), "--items", "-5", home=home)
    assert proc.returncode != 0
    assert "items" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("seed, items", [("-1", "10"), ("-1", "0"), (str(1 << 64), "10")])
def test_make_model_refuses_a_seed_torch_and_numpy_do_not_both_take(home, tmp_path, seed, items):
    """`--seed -1` failed with NumPy's bare "expected non-negative integer" (and with
    `--items 0`, no catalog drawn, wrote torch's wrapped seed 2**64 - 1); `--seed 2**64`
    with torch's "Overflow when unpacking long long"."""
    proc = xrec_cli("make-model", "--size", "tiny", "--out", str(tmp_path / "m"), "--seed", seed,
                    "--items", items, home=home)
    assert proc.returncode == 1 and not (tmp_path / "m").exists()
    assert proc.stderr.strip().splitlines() == [
        f"xrec make-model: error: seed: got {seed}, expected an integer in [0, 2**64 - 1]"]


def test_make_model_into_the_current_directory(home, tmp_path, monkeypatch):
    """`--out .` swapped the directory out (save_model replaces it whole) and then wrote the
    catalog relative to the deleted one: "[Errno 2] No such file or directory", a model
    without its catalog. `--out ''` (an unset `$OUT`) wrote into the current directory."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "notes.txt").write_text("kept\n")
    monkeypatch.chdir(project)
    proc = xrec_cli("make-model", "--size", "tiny", "--out", ".", "--items", "10", home=home)
    assert proc.returncode == 0, proc.stderr
    assert str(project) in proc.stdout
    assert (project / "notes.txt").read_text() == "kept\n"
    assert ItemCatalog.from_model_dir(project, 64).num_items == 10
    monkeypatch.chdir(tmp_path)
    proc = xrec_cli("make-model", "--size", "tiny", "--out", "", "--items", "10", home=home)
    assert proc.returncode == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["project"]
    assert proc.stderr == "xrec make-model: error: out_dir: got '', expected a directory path\n"


@pytest.mark.parametrize("port", ["70000", "-1", "65536"])
def test_serve_refuses_a_port_outside_the_range(home, tmp_path, port):
    """`--port 70000` listened on 4464 (70000 mod 65536); `--port -1` blamed the host."""
    proc = xrec_cli("serve", "--model", str(tmp_path / "none"), "--port", port, home=home)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"xrec serve: error: --port: got {port}, port must be 0–65535"]


@pytest.mark.parametrize("flags, names", [
    (["--replicas", "4"], "--replicas"),
    (["--max-replicas", "2", "--address", "127.0.0.1:1", "--replica-cpus", "2",
      "--replica-gpus", "0"], "--max-replicas, --address, --replica-cpus, --replica-gpus")])
def test_serve_refuses_ray_flags_without_ray(home, tmp_path, flags, names):
    """`xrec serve --replicas 4` (or --address, --replica-cpus ...) without --ray served one
    engine in one process: the flag was ignored without a word."""
    proc = xrec_cli("serve", "--model", str(tmp_path / "none"), "--port", "0", *flags, home=home)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"xrec serve: error: {names}: only with --ray (without it, `xrec serve` is one process "
        "with one engine); give --ray, or leave them out"]


def test_serve_refuses_engine_options_before_it_listens(home, tmp_path):
    """`xrec serve --max-concurrency 0` listened, answered /health 503 and only then stopped
    on the load's refusal; on a busy port it blamed the port, not the option."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proc = xrec_cli("serve", "--model", str(tmp_path / "none"), "--port",
                        str(busy.getsockname()[1]), "--max-concurrency", "0", home=home)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "xrec serve: error: option max_concurrency: got 0, allowed: an integer in [1, 64]"]


def _broken_copy(tiny_model: Path, out: Path, damage: str) -> Path:
    """A copy of the tiny model with its model.safetensors truncated or one weight NaN."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, out)
    path = out / "model.safetensors"
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[:1000])
    else:
        tensors = load_file(path)
        tensors["encoder.block.0.layer.0.SelfAttention.q.weight"][2, 3] = float("nan")
        save_file(tensors, str(path), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("damage, words", [
    ("truncated", ["model.safetensors: not a valid safetensors file (1000 bytes",
                   "truncated or corrupt"]),
    ("nan", ["tensor 'encoder.block.0.layer.0.SelfAttention.q.weight' in ",
             "model.safetensors holds 1 non-finite values"])])
@pytest.mark.parametrize("command", ["recommend", "serve"])
def test_a_broken_model_file_is_one_error_line(tiny_model, home, tmp_path, damage, words, command):
    """A truncated file was a 23-line traceback; a NaN weight answered "0 results" (exit 0)
    and the server 200 with no results: one line naming the file or the tensor, exit 1,
    before the server listens."""
    broken = _broken_copy(tiny_model, tmp_path / "broken", damage)
    extra = ["--port", "0"] if command == "serve" else []
    proc = xrec_cli(command, "--model", str(broken), "--device", "cpu", *extra, home=home)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert line.startswith(f"xrec {command}: error: ") and str(broken) in line, line
    assert all(w in line for w in words), line


def test_an_unreadable_model_file_is_permission_denied(tiny_model, home, tmp_path):
    """chmod 000 model.safetensors was reported as "No such file or directory". Root reads
    every file, so as root the file goes to an unmapped owner and xrec runs in a user
    namespace (`unshare -r`), where root's override does not reach it."""
    import shutil

    model = tmp_path / "locked"
    shutil.copytree(tiny_model, model)
    path = model / "model.safetensors"
    prefix = []
    if os.geteuid() == 0:
        probe = subprocess.run(["unshare", "-r", "true"], capture_output=True)
        if probe.returncode != 0:
            pytest.skip("root, and no user namespace to be anyone else in (unshare -r)")
        os.chown(path, 12345, 12345)
        prefix = ["unshare", "-r"]
    path.chmod(0)
    env = dict(os.environ, XREC_HOME=str(home))
    proc = subprocess.run([*prefix, sys.executable, "-m", "xrec.cli", "recommend", "--model",
                           str(model), "--device", "cpu"], capture_output=True, text=True,
                          timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"xrec recommend: error: {path}: Permission denied"]


def test_make_model_files_are_readable_by_others(home, tmp_path):
    """model.safetensors was 0600 while the other files were 0644: another user could not
    serve the directory. Every file gets the umask's mode."""
    out = tmp_path / "m"
    env = dict(os.environ, XREC_HOME=str(home))
    proc = subprocess.run([sys.executable, "-c", "import os, sys; os.umask(0o022); "
                           "from xrec.cli import main; sys.exit(main(sys.argv[1:]))",
                           "make-model", "--size", "tiny", "--out", str(out), "--items", "10"],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert proc.returncode == 0, proc.stderr
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "model.safetensors" in modes
    assert modes == {name: "0o644" for name in modes}
