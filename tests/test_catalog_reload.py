"""Catalog hot reload (issue 12): `Engine.load_catalog` / `restore_catalog` and the admin routes.

Real engines, real files, a real uvicorn server on 127.0.0.1 (test_server's `ServerThread`).
Batches are held in flight with the executor's fault hook (events, never sleeps); every
wait is bounded. Each catalog here has its own item ids, so an answer's items tell which
catalog they came from, and its `catalog_version` / `X-Catalog-Version` must name that one.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections import Counter

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_server import ServerThread, wait_until  # noqa: E402

from xrec import Engine, InvalidArgument, NotFound, RecRequest, Unavailable  # noqa: E402
from xrec.catalog import ItemCatalog, random_catalog  # noqa: E402
from xrec.demo import write_random_model  # noqa: E402
from xrec.server.app import create_app  # noqa: E402

VOCAB = 64                   # the "tiny" model's vocabulary
WAIT_S = 60.0
API_KEY = "reload-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def catalog_of(seed: int, num_items: int = 400) -> ItemCatalog:
    """A catalog whose item ids are its own: seed * 10**6 + 1 ... (no two seeds share one)."""
    triples = random_catalog(num_items, VOCAB, seed=seed).triples
    return ItemCatalog.from_arrays(seed * 10**6 + np.arange(1, num_items + 1), triples, VOCAB)


def write(catalog: ItemCatalog, path) -> str:
    catalog.write(path)
    return str(path)


class HoldBatches:
    """Executor fault hook: a batch whose request ids start with "hold" waits for `release`."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, batch) -> None:
        if any(r.request_id.startswith("hold") for r in batch.requests):
            self.entered.set()
            assert self.release.wait(WAIT_S)


def items_match(catalog: ItemCatalog, response) -> bool:
    """Every result is a triple of `catalog` and its items are that triple's items there."""
    for result in response.results:
        rows, = catalog.convert([result.tokens], each_conversion_threshold=10**6,
                                total_conversion_threshold=10**6)
        ids = set(catalog.item_ids[rows].tolist())
        if not ids or not {item.item_id for item in result.items} <= ids:
            return False
    return True


def answer(engine: Engine, **kw):
    future = engine.submit(RecRequest(token_ids=[1, 2, 3], beam_width=4, **kw))
    return future.result(timeout=WAIT_S)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0,
                              num_items=500)


@pytest.fixture
def engine(model_dir):
    engine = Engine.from_pretrained(model_dir, isolation="thread", device="cpu", max_concurrency=2)
    engine.executor.fault = gate = HoldBatches()
    yield engine
    gate.release.set()
    engine.close(5)


# ---- the Python API ----------------------------------------------------------------

def test_load_swaps_and_every_answer_names_its_catalog(engine, tmp_path):
    first = engine.catalog_version
    assert first.num_items == 500 and first.content_hash == engine.catalog.content_hash()
    assert items_match(engine.catalog, answer(engine))
    new = catalog_of(1)
    before = time.time()
    version = engine.load_catalog(write(new, tmp_path / "one.bin"))
    assert version == engine.catalog_version and engine.previous_catalog_version == first
    assert (version.content_hash, version.num_items) == (new.content_hash(), 400)
    assert version.source == str((tmp_path / "one.bin").resolve()) and version.loaded_at >= before
    response = answer(engine)
    assert response.catalog_version == version.content_hash and response.results
    assert items_match(new, response)
    # the same content in the text form is the same version
    new.write_text(tmp_path / "one.txt")
    assert engine.load_catalog(tmp_path / "one.txt").content_hash == version.content_hash


def test_restore_swaps_back_and_forth(engine, tmp_path):
    with pytest.raises(NotFound, match="no previous catalog"):
        engine.restore_catalog()
    first = engine.catalog_version
    second = engine.load_catalog(catalog_of(2))          # an ItemCatalog is loaded as it is
    assert second.source is None
    assert engine.restore_catalog() == first and engine.previous_catalog_version == second
    assert answer(engine).catalog_version == first.content_hash
    assert engine.restore_catalog() == second and engine.previous_catalog_version == first
    assert items_match(catalog_of(2), answer(engine))


def bad_catalogs(tmp_path):
    """(name, path, extended, words in the error) for files that must be refused."""
    good = catalog_of(3)
    out = tmp_path / "out-of-vocab.txt"
    out.write_text(f"5,1,2,3\n6,1,{VOCAB},3\n")
    truncated = tmp_path / "truncated.bin"
    write(good, tmp_path / "good.bin")
    truncated.write_bytes((tmp_path / "good.bin").read_bytes()[:-7])
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    garbage = tmp_path / "garbage.csv"
    garbage.write_text("item,t0,t1,t2\n")
    return [("missing", tmp_path / "nope.bin", None, ["nope.bin"]),
            ("directory", tmp_path, None, [str(tmp_path)]),
            ("out-of-vocab", out, None, [str(VOCAB)]),
            ("truncated", truncated, None, ["partial record"]),
            ("empty", empty, None, ["no items"]),
            ("garbage", garbage, None, ["garbage.csv"]),
            ("not-extended", tmp_path / "good.bin", True, ["good.bin"])]


def test_bad_catalogs_are_refused_and_the_current_keeps_serving(engine, tmp_path):
    current = engine.load_catalog(catalog_of(4))
    for name, path, extended, words in bad_catalogs(tmp_path):
        with pytest.raises(InvalidArgument) as info:
            engine.load_catalog(path, extended=extended)
        for word in words:
            assert word in info.value.message, (name, info.value.message)
        assert engine.catalog_version == current, name
        response = answer(engine)
        assert response.catalog_version == current.content_hash and items_match(catalog_of(4), response)
    # the load let go of the previous version before reading the file (two catalogs at most)
    assert engine.previous_catalog_version is None
    for value in (None, 5, ""):
        with pytest.raises(InvalidArgument, match="catalog"):
            engine.load_catalog(value)
    with pytest.raises(InvalidArgument, match="extended"):
        engine.load_catalog(tmp_path / "good.bin", extended="yes")


def test_a_file_that_cannot_be_read_keeps_the_previous_version(engine, tmp_path):
    """A missing path, a FIFO or a directory is refused before the previous version is let
    go, as the admin route refuses it: it let go first, so `restore_catalog` found nothing
    where the same load over HTTP kept the previous version restorable."""
    first = engine.catalog_version
    second = engine.load_catalog(write(catalog_of(18), tmp_path / "second.bin"))
    os.mkfifo(tmp_path / "fifo.bin")
    for path, words in ((tmp_path / "nope.bin", "No such file"),
                        (tmp_path / "fifo.bin", r"not a regular file \(a FIFO\)"),
                        (tmp_path, r"not a regular file \(a directory\)")):
        with pytest.raises(InvalidArgument, match=words):
            engine.load_catalog(path)
        assert engine.catalog_versions() == (second, first), path
    assert engine.restore_catalog() == first


def test_a_batch_in_flight_finishes_on_the_catalog_it_started_with(engine):
    gate = engine.executor.fault
    old_catalog, old_version = engine.catalog, engine.catalog_version
    held = engine.submit(RecRequest(token_ids=[4, 5], beam_width=8, request_id="hold-1"))
    assert gate.entered.wait(WAIT_S)
    new_version = engine.load_catalog(catalog_of(5))      # while the batch runs
    after = answer(engine, request_id="after")            # the other pipeline, new catalog
    gate.release.set()
    response = held.result(timeout=WAIT_S)
    assert response.catalog_version == old_version.content_hash and response.results
    assert items_match(old_catalog, response)
    assert after.catalog_version == new_version.content_hash and items_match(catalog_of(5), after)


def test_two_catalogs_at_most_a_load_waits_for_batches_on_the_previous(engine):
    """A runs a held batch; B is loaded (A previous); loading C must let A go first, so
    it waits for A's batch: A, B and C are never all in memory."""
    gate = engine.executor.fault
    a_served = weakref.ref(engine._catalogs.current)
    held = engine.submit(RecRequest(token_ids=[4, 5], beam_width=8, request_id="hold-2"))
    assert gate.entered.wait(WAIT_S)
    b = engine.load_catalog(catalog_of(6))
    loaded = []
    loader = threading.Thread(target=lambda: loaded.append(engine.load_catalog(catalog_of(7))))
    loader.start()
    assert wait_until(lambda: engine.previous_catalog_version is None, WAIT_S)   # A let go...
    loader.join(0.2)
    assert not loaded and a_served() is not None      # ...but the held batch still runs on it
    assert engine.catalog_version == b
    gate.release.set()
    loader.join(WAIT_S)
    assert loaded and a_served() is None
    assert held.result(timeout=WAIT_S).results
    assert engine.previous_catalog_version == b and engine.catalog_version == loaded[0]


def test_a_load_gives_up_when_the_previous_catalog_stays_busy(engine):
    gate = engine.executor.fault
    held = engine.submit(RecRequest(token_ids=[4, 5], beam_width=8, request_id="hold-3"))
    assert gate.entered.wait(WAIT_S)
    b = engine.load_catalog(catalog_of(8))
    engine._catalogs.release_wait_s = 0.05
    with pytest.raises(Unavailable, match="still running"):
        engine.load_catalog(catalog_of(9))
    assert engine.catalog_version == b
    gate.release.set()
    assert held.result(timeout=WAIT_S).results
    assert engine.load_catalog(catalog_of(9)).num_items == 400


def test_a_load_retried_after_giving_up_still_waits_for_the_released_catalog(engine):
    """After a load gave up on A (a batch still runs on it), the retry must wait for A too:
    it used to load C at once, so A (in flight), B and C were all in memory."""
    gate = engine.executor.fault
    a_served = weakref.ref(engine._catalogs.current)
    held = engine.submit(RecRequest(token_ids=[4, 5], beam_width=8, request_id="hold-5"))
    assert gate.entered.wait(WAIT_S)
    b = engine.load_catalog(catalog_of(16))
    engine._catalogs.release_wait_s = 0.05
    for _ in range(2):   # the retry gives up alike while A's batch runs
        with pytest.raises(Unavailable, match="still running"):
            engine.load_catalog(catalog_of(17))
        assert engine.catalog_version == b and a_served() is not None
    gate.release.set()
    assert held.result(timeout=WAIT_S).results
    engine._catalogs.release_wait_s = WAIT_S
    c = engine.load_catalog(catalog_of(17))
    assert a_served() is None and engine.catalog_version == c
    assert engine.previous_catalog_version == b


def test_unconstrained_engine_uses_a_loaded_catalog_for_items_only(model_dir):
    with Engine.from_pretrained(model_dir, isolation="thread",
                                device="cpu", constrained=False) as engine:
        assert engine.step.tables is None
        found = [r.tokens for r in answer(engine).results]          # free decoding's triples
        catalog = ItemCatalog.from_arrays(np.arange(len(found)) + 7 * 10**6, found, VOCAB)
        engine.load_catalog(catalog)
        assert engine.step.tables is None                            # still free decoding
        response = answer(engine)
        assert response.catalog_version == catalog.content_hash()
        assert [r.tokens for r in response.results] == found
        assert [[i.item_id for i in r.items] for r in response.results] == \
            [[7 * 10**6 + i] for i in range(len(found))]


def test_extended_catalog_reload(engine, tmp_path):
    base = catalog_of(11)
    extended = ItemCatalog.from_arrays(base.item_ids, base.triples, VOCAB,
                                       dids=[f"d{i}" for i in base.item_ids],
                                       types=["video"] * base.num_items)
    version = engine.load_catalog(write(extended, tmp_path / "ext.bin"), extended=True)
    assert version.is_extended and version.content_hash != base.content_hash()
    items = [item for r in answer(engine).results for item in r.items]
    assert items and all(item.did == f"d{item.item_id}" and item.type == "video" for item in items)


def test_a_text_catalog_loads_over_an_extended_one_without_naming_extended(engine, tmp_path):
    """`extended` defaults to the current catalog's form; over an extended catalog that made
    every .txt/.csv load fail ("an extended catalog must be binary") unless the caller said
    extended=false, though the text form has no strings to read."""
    base = catalog_of(18)
    extended = ItemCatalog.from_arrays(base.item_ids, base.triples, VOCAB,
                                       dids=["d"] * base.num_items, types=["t"] * base.num_items)
    assert engine.load_catalog(extended).is_extended
    text = catalog_of(19)
    text.write_text(tmp_path / "items.csv")
    version = engine.load_catalog(tmp_path / "items.csv")
    assert not version.is_extended and version.content_hash == text.content_hash()
    items = [item for r in answer(engine).results for item in r.items]
    assert items and all(item.did is None and item.type is None for item in items)
    with pytest.raises(InvalidArgument, match="the text form has no did/type strings"):
        engine.load_catalog(tmp_path / "items.csv", extended=True)   # asked for: refused
    assert engine.load_catalog(write(extended, tmp_path / "e.bin"), extended=True).is_extended
    assert not engine.load_catalog(tmp_path / "items.csv").is_extended


def test_decoder_only_catalog_tokens_are_checked_against_the_tokenizer(tmp_path):
    from xrec.catalog.sid_vocab import SidLayout

    directory = write_random_model(tmp_path / "sid", "qwen3-sid-test", seed=1, num_items=50)
    layout = SidLayout(num_base_tokens=512, codebook_size=16)
    known = [layout.itemic_id(level, 1) for level in range(3)]
    unknown = [known[0], layout.num_tokens, known[2]]     # padding: no token string for it
    with Engine.from_pretrained(directory, isolation="thread") as engine:
        current = engine.catalog_version
        with pytest.raises(InvalidArgument, match=rf"item 12 has token {layout.num_tokens} .*tokenizer"):
            engine.load_catalog(ItemCatalog.from_arrays([11, 12], [known, unknown], layout.vocab_size))
        assert engine.catalog_version == current
        engine.load_catalog(ItemCatalog.from_arrays([11], [known], layout.vocab_size))
        result, = engine.recommend([RecRequest(prompt="hello", beam_width=2)])[0].results
        assert result.items[0].item_id == 11


class CountingTokenizer:
    """A real `tokenizers.Tokenizer` that counts the ids it is asked about."""

    def __init__(self, tokenizer):
        self.tokenizer, self.asked = tokenizer, Counter()

    def id_to_token(self, token_id):
        self.asked[token_id] += 1
        return self.tokenizer.id_to_token(token_id)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_the_tokenizer_check_asks_only_about_the_catalog_tokens(tmp_path):
    """It asked about every id below the model's vocabulary, one call each, at every load
    (176,384 ids for OpenOneRec's, whatever the catalog held); now once about each distinct
    token of the catalog, with the same error for an unknown one."""
    from xrec.catalog.sid_vocab import SidLayout, write_sid_tokenizer
    from xrec.engine.catalogs import check_catalog_tokens
    from xrec.tokenizer import PromptTokenizer

    layout = SidLayout(num_base_tokens=512, codebook_size=16)
    write_sid_tokenizer(tmp_path, layout)
    tokenizer = PromptTokenizer.from_model_dir(tmp_path)
    tokenizer._tokenizer = counting = CountingTokenizer(tokenizer._tokenizer)
    triples = [[layout.itemic_id(level, code) for level, code in enumerate(codes)]
               for codes in ((1, 2, 3), (1, 2, 4), (5, 2, 3))]
    check_catalog_tokens(ItemCatalog.from_arrays([1, 2, 3], triples, layout.vocab_size), tokenizer)
    assert counting.asked == Counter(set(np.ravel(triples).tolist()))   # 6 of 768 ids
    counting.asked.clear()
    unknown = [triples[0][0], layout.num_tokens, triples[0][2]]   # padding: no token for it
    with pytest.raises(ValueError, match=rf"item 12 has token {layout.num_tokens} at level 1, "
                                         r"which .* \(1 items have unknown tokens\)"):
        check_catalog_tokens(ItemCatalog.from_arrays([11, 12], [triples[0], unknown],
                                                     layout.vocab_size), tokenizer)
    assert sorted(counting.asked) == sorted({*triples[0], layout.num_tokens})


# ---- HTTP --------------------------------------------------------------------------

def metric_samples(client) -> dict:
    text = client.get("/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_admin_routes(engine, tmp_path):
    server = ServerThread(create_app(engine, api_key=API_KEY, catalog_dir=tmp_path))
    try:
        with httpx.Client(base_url=server.url, headers=AUTH, timeout=WAIT_S) as client:
            for method, path in (("GET", "/v1/admin/catalog"), ("POST", "/v1/admin/catalog"),
                                 ("POST", "/v1/admin/catalog/restore")):
                unauthorized = httpx.request(method, server.url + path, json={"path": "x"})
                assert unauthorized.status_code == 401
            first = client.get("/v1/admin/catalog").json()
            assert first["previous"] is None and first["current"]["num_items"] == 500
            native = client.post("/v1/rec/completions", json={"token_ids": [1, 2], "beam_width": 4})
            assert native.headers["X-Catalog-Version"] == first["current"]["content_hash"]

            new = catalog_of(12)
            loaded = client.post("/v1/admin/catalog", json={"path": write(new, tmp_path / "n.bin")})
            assert loaded.status_code == 200, loaded.text
            body = loaded.json()
            assert body["current"]["content_hash"] == new.content_hash() == client.get(
                "/v1/admin/catalog").json()["current"]["content_hash"]
            assert body["previous"] == first["current"]
            xllm = client.post("/v1/completions", json={"token_ids": [1, 2], "beam_width": 4})
            assert xllm.headers["X-Catalog-Version"] == new.content_hash()
            items = {int(i) for i in xllm.json()["output_tensors"][0]["contents"]["int64_contents"]}
            assert items - {-1} <= set(new.item_ids.tolist())
            samples = metric_samples(client)
            assert samples[("xrec_catalog_info", (("content_hash", new.content_hash()),
                                                  ("source", str((tmp_path / "n.bin").resolve()))))] == 1
            assert samples[("xrec_catalog_items", ())] == 400
            assert samples[("xrec_catalog_changes_total", (("action", "load"), ("code", "OK")))] == 1

            refused = client.post("/v1/admin/catalog", json={"path": str(tmp_path / "none.bin")})
            assert refused.status_code == 400 and refused.json()["error"]["code"] == "INVALID_ARGUMENT"
            assert refused.json()["error"]["message"].startswith("catalog none.bin: ")
            for body_bytes in (b"{", b'{"path": 5}', b'{"path": "x", "bogus": 1}', b"{}"):
                bad = client.post("/v1/admin/catalog", content=body_bytes)
                assert bad.status_code in (400, 422) and bad.json()["error"]["code"] == "INVALID_ARGUMENT"
            (tmp_path / "bad.bin").write_bytes(b"\x01" * 7)
            bad = client.post("/v1/admin/catalog", json={"path": "bad.bin"})   # read, then refused
            assert bad.status_code == 400 and "partial record" in bad.json()["error"]["message"]
            restore = client.post("/v1/admin/catalog/restore")   # the refused load let the previous go
            assert restore.status_code == 404 and restore.json()["error"]["code"] == "NOT_FOUND"
            assert client.get("/v1/admin/catalog").json()["current"]["content_hash"] == new.content_hash()
            samples = metric_samples(client)
            assert samples[("xrec_catalog_changes_total",
                            (("action", "load"), ("code", "INVALID_ARGUMENT")))] == 6
            assert samples[("xrec_catalog_changes_total",
                            (("action", "restore"), ("code", "NOT_FOUND")))] == 1

            client.post("/v1/admin/catalog", json={"path": write(catalog_of(13), tmp_path / "m.bin")})
            restored = client.post("/v1/admin/catalog/restore").json()
            assert restored["current"]["content_hash"] == new.content_hash()
            assert restored["previous"]["content_hash"] == catalog_of(13).content_hash()
    finally:
        server.stop()


def test_a_load_cancelled_by_the_shutdown_is_answered_unavailable(engine, tmp_path):
    """A load still running when uvicorn's graceful shutdown timed out (here: waiting to let
    go of the previous catalog, which a held batch still runs on) had its handler cancelled
    and was answered uvicorn's plain-text 500 ("Internal Server Error", and a traceback in
    the log). It is 503 UNAVAILABLE in the error shape, as a completion's handler is."""
    app = create_app(engine, api_key=API_KEY, catalog_dir=tmp_path)
    config = uvicorn.Config(app, log_level="critical", lifespan="off", access_log=False,
                            timeout_graceful_shutdown=1)
    server = ServerThread(app, config=config)
    gate, answers = engine.executor.fault, []
    try:
        held = engine.submit(RecRequest(token_ids=[4, 5], beam_width=8, request_id="hold-s"))
        assert gate.entered.wait(WAIT_S)
        engine.load_catalog(catalog_of(20))   # the held batch's catalog is the previous now
        path = write(catalog_of(21), tmp_path / "c.bin")
        loader = threading.Thread(target=lambda: answers.append(httpx.post(
            server.url + "/v1/admin/catalog", json={"path": path}, headers=AUTH,
            timeout=WAIT_S)), daemon=True)
        loader.start()
        assert wait_until(lambda: engine.previous_catalog_version is None, WAIT_S)  # it waits
        app.state.xrec.begin_drain()
        server.server.should_exit = True   # 1 s later uvicorn cancels the load's handler
        loader.join(WAIT_S)
        assert answers, "the load was not answered"
        assert answers[0].status_code == 503, answers[0].text
        assert answers[0].json()["error"]["code"] == "UNAVAILABLE"
    finally:
        gate.release.set()
        server.thread.join(WAIT_S)
    assert held.result(timeout=WAIT_S).results
    assert not server.thread.is_alive()


def test_hot_reload_under_load(model_dir, tmp_path):
    """32 clients while the catalog changes 10 times (3 bad files among them, and a restore):
    every answer is 200, names a catalog that was loaded, and its tokens and items are that
    catalog's; no request is lost."""
    catalogs = {}
    files = []
    for step in range(10):
        if step in (2, 5, 8):
            bad = tmp_path / f"bad-{step}.bin"
            bad.write_bytes(b"\x01" * (20 * step + 3))
            files.append(str(bad))
        else:
            catalog = catalog_of(20 + step, num_items=200 + 30 * step)
            catalogs[catalog.content_hash()] = catalog
            files.append(write(catalog, tmp_path / f"good-{step}.bin"))
    engine = Engine.from_pretrained(model_dir, isolation="thread",
                                    device="cpu", max_concurrency=2, max_seqs_per_batch=8)
    catalogs[engine.catalog_version.content_hash] = engine.catalog
    server = ServerThread(create_app(engine, catalog_dir=tmp_path))
    stop = threading.Event()
    answers: list = []
    sent = Counter()

    def client_loop(index: int) -> None:
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            number = 0
            while not stop.is_set():
                rid = f"c{index}-{number}"
                body = {"token_ids": [(index + number) % VOCAB, 7, 9], "beam_width": 4 + index % 5,
                        "request_id": rid}
                sent[index] += 1
                try:
                    response = client.post("/v1/rec/completions", json=body)
                    answers.append((rid, response.status_code, response.headers.get("X-Catalog-Version"),
                                    response.json()))
                except httpx.HTTPError as exc:
                    answers.append((rid, None, None, repr(exc)))
                number += 1

    threads = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(32)]
    try:
        for thread in threads:
            thread.start()
        outcomes = []
        with httpx.Client(base_url=server.url, timeout=WAIT_S) as admin:
            for step, path in enumerate(files):
                seen = len(answers)
                assert wait_until(lambda: len(answers) >= seen + 32, WAIT_S), "clients stalled"
                outcomes.append(admin.post("/v1/admin/catalog", json={"path": path}).status_code)
                if step == 6:
                    assert admin.post("/v1/admin/catalog/restore").status_code == 200
            seen = len(answers)
            assert wait_until(lambda: len(answers) >= seen + 32, WAIT_S), "clients stalled"
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
        assert not any(thread.is_alive() for thread in threads)
    finally:
        stop.set()
        server.stop()
        engine.close(5)
    assert outcomes == [400 if step in (2, 5, 8) else 200 for step in range(10)]
    assert len(answers) == sum(sent.values())                        # nothing lost
    failed = [a for a in answers if a[1] != 200]
    assert not failed, failed[:3]
    versions = Counter(version for _, _, version, _ in answers)
    assert set(versions) <= set(catalogs) and len(versions) >= 5, versions
    for rid, _, version, body in answers:
        assert body["id"] == rid
        catalog = catalogs[version]
        for result in body["results"]:
            rows, = catalog.convert([result["tokens"]], each_conversion_threshold=10**6,
                                    total_conversion_threshold=10**6)
            ids = set(catalog.item_ids[rows].tolist())
            assert ids, (rid, version, result["tokens"])           # a triple of that catalog
            assert {item["item_id"] for item in result["items"]} <= ids, (rid, version)


def test_process_isolated_engine_reloads_in_its_child(model_dir, tmp_path):
    with Engine.from_pretrained(model_dir, device="cpu", isolation="process") as engine:
        first = engine.catalog_version
        assert first.num_items == 500 and engine.previous_catalog_version is None
        new = catalog_of(30)
        new.write(tmp_path / "p.bin")
        version = engine.load_catalog(tmp_path / "p.bin")
        assert version.content_hash == new.content_hash() == engine.catalog_version.content_hash
        response = engine.recommend(RecRequest(token_ids=[1, 2, 3], beam_width=4))[0]
        assert response.catalog_version == version.content_hash and items_match(new, response)
        with pytest.raises(InvalidArgument, match="none.bin"):
            engine.load_catalog(tmp_path / "none.bin")
        assert engine.catalog_version == version
        engine.load_catalog(new)                              # an ItemCatalog crosses too
        assert engine.restore_catalog() == version


def test_from_pretrained_reads_a_catalog_file_as_extended_in_either_isolation(model_dir, tmp_path):
    """`catalog_extended` (what `--catalog-extended` sets) reaches the child process too; it
    is refused where there is no file for it to apply to, before anything loads."""
    base = catalog_of(40)
    ids = base.item_ids.tolist()
    typed = ItemCatalog.from_arrays(ids, base.triples, VOCAB, [f"d{i}" for i in ids], ["t"] * len(ids))
    path = write(typed, tmp_path / "typed.bin")
    with Engine.from_pretrained(model_dir, catalog=path, catalog_extended=True, device="cpu",
                                isolation="process") as engine:
        assert engine.catalog_version.is_extended
        assert engine.catalog_version.content_hash == typed.content_hash()
    for catalog, extended, words in [(None, True, "give one as catalog"),
                                     (typed, False, "give one as catalog"),
                                     (path, "yes", "got 'yes', expected true, false or None")]:
        for isolation in ("thread", "process"):
            with pytest.raises(ValueError, match=words):
                Engine.from_pretrained(tmp_path / "no-model", catalog=catalog,
                                       catalog_extended=extended, isolation=isolation)
