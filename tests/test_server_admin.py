"""Catalog loads that read the server's disk (issue 28): off without a catalog directory,
only regular files under it, bounded in size, errors that never quote a file.

A real uvicorn server on 127.0.0.1 (test_server's `ServerThread`) with real files, FIFOs and
symlinks in a temporary catalog directory; `xrec serve` subprocesses for start-up refusals
and the drain. Every wait is bounded (client timeouts, `wait_until`); none asserts wall time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")

from test_server import WAIT_S, ServerThread, start_serve  # noqa: E402

from xrec import Engine, InvalidArgument  # noqa: E402
from xrec.catalog import ItemCatalog, random_catalog  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.server.app import create_app  # noqa: E402

VOCAB = 64
LOAD = "/v1/admin/catalog"
SECRET = "DB_PASSWORD=hunter2"


def catalog_of(seed: int, num_items: int = 300) -> ItemCatalog:
    triples = random_catalog(num_items, VOCAB, seed=seed).triples
    return ItemCatalog.from_arrays(seed * 10**6 + np.arange(1, num_items + 1), triples, VOCAB)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0,
                              num_items=500)


@pytest.fixture(scope="module")
def engine(model_dir):
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu")
    yield engine
    engine.close(5)


@pytest.fixture
def catalogs(tmp_path):
    """A catalog directory with a good catalog, a secret beside a FIFO, /dev/zero behind a
    symlink, a sub-directory, and a secret outside it (reachable by .., a symlink, a path)."""
    directory = tmp_path / "catalogs"
    (directory / "daily").mkdir(parents=True)
    catalog_of(1).write(directory / "daily" / "good.bin")
    (directory / "env.txt").write_text(f"{SECRET}\nAPI_TOKEN=abc\n")
    (directory / "env.bin").write_text(f"{SECRET}\n")
    os.mkfifo(directory / "fifo.bin")
    (directory / "zero.bin").symlink_to("/dev/zero")
    (tmp_path / "outside.txt").write_text(f"{SECRET}\n")
    (directory / "escape.txt").symlink_to(tmp_path / "outside.txt")
    return directory


def _server(engine, **options) -> ServerThread:
    return ServerThread(create_app(engine, **options))


def _error(response: httpx.Response, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code, error
    return error["message"]


def test_loads_are_off_without_a_catalog_directory(engine, catalogs):
    server = _server(engine)
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            for path in ("daily/good.bin", str(catalogs / "fifo.bin"), "/dev/zero"):
                message = _error(client.post(LOAD, json={"path": path}), 404, "NOT_FOUND")
                assert "--catalog-dir" in message
            assert client.get(LOAD).json()["current"]["num_items"] == 500   # reading stays on
    finally:
        server.stop()


def test_special_files_are_refused_without_blocking_or_reading(engine, catalogs):
    """A FIFO blocked the load for ever (and every later load behind it); /dev/zero was read
    until memory ran out; a directory is no file either. Each is 400 at once, and a good
    load goes through after them."""
    for directory, files in ((catalogs, [("fifo.bin", "a FIFO"), ("daily", "a directory"),
                                         (".", "a directory")]),
                             ("/dev", [("zero", "a character device"),
                                       ("null", "a character device")])):
        server = _server(engine, catalog_dir=directory)
        try:
            with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
                for path, kind in files:
                    message = _error(client.post(LOAD, json={"path": path}), 400,
                                     "INVALID_ARGUMENT")
                    assert message == f"catalog {path}: not a regular file ({kind})", message
                if directory == catalogs:
                    loaded = client.post(LOAD, json={"path": "daily/good.bin"})
                    assert loaded.status_code == 200, loaded.text
                    assert loaded.json()["current"]["content_hash"] == catalog_of(1).content_hash()
        finally:
            server.stop()


def test_paths_outside_the_catalog_directory_are_refused(engine, catalogs, tmp_path):
    server = _server(engine, catalog_dir=catalogs)
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            for path in ("../outside.txt", str(tmp_path / "outside.txt"), "escape.txt",
                         "daily/../../outside.txt", "/etc/passwd", "/dev/zero"):
                message = _error(client.post(LOAD, json={"path": path}), 400, "INVALID_ARGUMENT")
                assert "outside the catalog directory" in message and SECRET not in message, path
            message = _error(client.post(LOAD, json={"path": "a\x00b"}), 400, "INVALID_ARGUMENT")
            assert "NUL" in message
            # inside it, relative or absolute, through .. or not: loaded
            for path in ("daily/good.bin", str(catalogs / "daily" / "good.bin"),
                         "daily/../daily/good.bin"):
                assert client.post(LOAD, json={"path": path}).status_code == 200, path
            source = client.get(LOAD).json()["current"]["source"]
            assert source == str((catalogs / "daily" / "good.bin").resolve())
    finally:
        server.stop()


def test_a_path_no_file_name_can_hold_is_refused(engine, catalogs):
    """A lone UTF-16 surrogate (`\\ud800`, valid JSON) cannot be encoded as a file name:
    the route answered 500 INTERNAL with a logged traceback (UnicodeEncodeError) and
    `Engine.load_catalog` raised the UnicodeEncodeError itself; both are INVALID_ARGUMENT."""
    server = _server(engine, catalog_dir=catalogs)
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            for body in (b'{"path": "\\ud800.bin"}', b'{"path": "daily/\\udfff"}'):
                message = _error(client.post(LOAD, content=body), 400, "INVALID_ARGUMENT")
                assert "surrogate" in message, message
            assert client.post(LOAD, json={"path": "daily/good.bin"}).status_code == 200
    finally:
        server.stop()
    with pytest.raises(InvalidArgument, match="surrogate"):
        engine.load_catalog(catalogs / "\ud800.bin")


def test_each_load_answers_the_catalog_it_loaded_when_loads_race(engine, catalogs):
    """Eight loads at once, five times: each answer's `current` is the catalog that load
    swapped in (as `Engine.load_catalog` returns it). The versions were read after the
    load, off its thread, so the next queued load could swap in between and a load was
    answered with another file's catalog."""
    hashes = {}
    for seed in range(20, 28):
        catalog_of(seed, num_items=20).write(catalogs / f"c{seed}.bin")
        hashes[f"c{seed}.bin"] = catalog_of(seed, num_items=20).content_hash()
    server = _server(engine, catalog_dir=catalogs)
    answers: dict[str, dict] = {}

    def load(client: httpx.Client, name: str) -> None:
        answers[name] = client.post(LOAD, json={"path": name}).json()
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            for _ in range(5):
                threads = [threading.Thread(target=load, args=(client, name)) for name in hashes]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join(WAIT_S)
                assert {name: answer["current"]["content_hash"]
                        for name, answer in answers.items()} == hashes
    finally:
        server.stop()


def test_errors_name_the_file_in_the_catalog_directory_and_never_quote_it(engine, catalogs):
    """A text file that is no catalog was answered with its first line
    ('DB_PASSWORD=...' is not 'item_id,t0,t1,t2')."""
    server = _server(engine, catalog_dir=catalogs)
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            for path, words in (("env.txt", ["catalog env.txt: line 1: ", "field", "integer"]),
                                ("env.bin", ["catalog env.bin: record at offset 0: "]),
                                ("missing.bin", ["catalog missing.bin: ", "No such file"])):
                message = _error(client.post(LOAD, json={"path": path}), 400, "INVALID_ARGUMENT")
                for word in words:
                    assert word in message, (path, message)
                for secret in ("DB_PASSWORD", "hunter2", "API_TOKEN", str(catalogs)):
                    assert secret not in message, (path, message)
    finally:
        server.stop()


def test_a_file_over_the_size_limit_is_refused_before_reading(engine, catalogs):
    server = _server(engine, catalog_dir=catalogs, max_catalog_bytes=1000)
    try:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            client.post(LOAD, json={"path": "daily/good.bin"})   # 6,000 bytes
            message = _error(client.post(LOAD, json={"path": "daily/good.bin"}), 400,
                             "INVALID_ARGUMENT")
            assert message == ("catalog daily/good.bin: 6000 bytes, over the limit of 1000 "
                               "bytes")
            small = catalog_of(2, num_items=50)   # 1,000 bytes
            small.write(catalogs / "small.bin")
            assert client.post(LOAD, json={"path": "small.bin"}).status_code == 200
            # refused before reading: the previous catalog was kept, so restore works
            assert client.post(LOAD + "/restore").status_code == 200
    finally:
        server.stop()
    with pytest.raises(ValueError, match="catalog_dir"):
        create_app(engine, catalog_dir=catalogs / "env.txt")
    with pytest.raises(ValueError, match="max_catalog_bytes"):
        create_app(engine, catalog_dir=catalogs, max_catalog_bytes=0)


# ---- the process --------------------------------------------------------------------------

def _env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XREC_API_KEY"}
    return {**env, "XREC_HOME": str(tmp_path / "home")}


def _xrec(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xrec", *args], capture_output=True, text=True,
                          env=env, timeout=WAIT_S * 4)


def test_a_bad_start_up_catalog_is_one_line_and_exit_1(model_dir, catalogs, tmp_path):
    """`--catalog /dev/zero` printed a 29-line traceback; a FIFO blocked the start."""
    big = tmp_path / "big.bin"
    catalog_of(3).write(big)
    cases = [(["--catalog", "/dev/zero"], "--catalog /dev/zero: not a regular file "
              "(a character device)"),
             (["--catalog", str(catalogs / "fifo.bin")], f"--catalog {catalogs / 'fifo.bin'}: "
              "not a regular file (a FIFO)"),
             (["--catalog", str(big), "--max-catalog-bytes", "100"],
              f"--catalog {big}: 6000 bytes, over the limit of 100 bytes"),
             (["--catalog-dir", str(tmp_path / "nope")], "--catalog-dir: got "),
             (["--max-catalog-bytes", "0"], "--max-catalog-bytes: got 0")]
    for args, expected in cases:
        done = _xrec(["serve", "--model", str(model_dir), "--device", "cpu", "--port", "0",
                      *args], _env(tmp_path))
        assert done.returncode == 1, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"xrec serve: error: {expected}"), lines


def test_xrec_serve_serves_an_extended_catalog_file(model_dir, tmp_path):
    """`xrec serve --catalog FILE` had no way to say the file is extended (read as 20-byte
    records, it was refused); `--catalog-extended true` serves its dids and types."""
    plain = catalog_of(7)
    ids = plain.item_ids.tolist()
    typed = ItemCatalog.from_arrays(ids, plain.triples, VOCAB, [f"d{i}" for i in ids],
                                    ["video" if i % 2 == 0 else "live" for i in ids])
    typed.write(tmp_path / "typed.bin")
    with _xrec_serve(model_dir, tmp_path, "--catalog", str(tmp_path / "typed.bin"),
                     "--catalog-extended", "true") as client:
        current = client.get(LOAD).json()["current"]
        assert current["is_extended"] and current["content_hash"] == typed.content_hash()
        answer = client.post("/v1/rec/completions", json={
            "token_ids": [1, 2, 3], "beam_width": 8, "item_types": ["video"]})
        assert answer.status_code == 200, answer.text
        items = [item for result in answer.json()["results"] for item in result["items"]]
    assert items and all(item == {"item_id": item["item_id"], "did": f"d{item['item_id']}",
                                  "type": "video"} for item in items), items


@contextmanager
def _xrec_serve(model_dir, tmp_path, *args: str) -> Iterator[httpx.Client]:
    """`xrec serve` of `model_dir` with `args` (log: tmp_path/serve.log), a client of it;
    then SIGTERM, which must end it with status 0."""
    log_path = tmp_path / "serve.log"
    proc, url, _ = start_serve(["--model", str(model_dir), "--device", "cpu", "--grace-s", "1",
                                *args], _env(tmp_path), log_path)
    try:
        with httpx.Client(base_url=url, timeout=WAIT_S) as client:
            yield client
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S * 2) == 0, log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_loads_through_xrec_serve_and_a_clean_drain(model_dir, catalogs, tmp_path):
    """The FIFO load held two requests open past SIGTERM ("2 HTTP request(s) still open
    after the drain") and the process kept running; now it is refused and the drain ends."""
    with _xrec_serve(model_dir, tmp_path, "--catalog-dir", str(catalogs)) as client:
        for _ in range(2):
            message = _error(client.post(LOAD, json={"path": "fifo.bin"}), 400, "INVALID_ARGUMENT")
            assert "FIFO" in message
        assert client.post(LOAD, json={"path": "daily/good.bin"}).status_code == 200
    log = (tmp_path / "serve.log").read_text()
    assert "still open" not in log and "Traceback" not in log, log
    assert "without an API key" in log   # loads on, no key: the operator is warned
