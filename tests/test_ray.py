"""The Ray paths (xrec.scale.batch_ray, xrec.scale.serve_app) on one local Ray cluster.

One cluster serves every test of this module (num_cpus=2, no dashboard, a small object
store); skipped cleanly where Ray is not installed. Batch: `--ray` writes the records of
the in-process run, row for row: the same ids, items, tokens and errors, and scores equal
to fp32 rounding (an sgemm's last bits may depend on its buffers' alignment, which
differs between processes; MKL calls this conditional numerical reproducibility). Serve: the plain server's
malformed-request table gives the same statuses through Ray Serve's proxy; killing one
replica's process during load fails only requests in flight on it (the proxy's own 500),
and Serve replaces it. `xrec serve --ray`'s start-up and shutdown: replicas the cluster cannot
place are refused and a signal stops a start that waits for them, start-up errors are one
ValueError, a full replica answers 429, SIGTERM drains with 503 before the app goes.
No wall-time assertions: every wait is bounded.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
httpx = pytest.importorskip("httpx")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from test_server import MALFORMED, VALID, assert_error  # noqa: E402  (the plain server's table)

from xrec.demo import write_random_model  # noqa: E402
from xrec.scale.batch import BatchJob, run_batch  # noqa: E402
from xrec.scale.batch_ray import RayOptions, init_ray, pool_size, run_batch_ray  # noqa: E402
from xrec.scale.rows import RowSettings, read_output  # noqa: E402
from xrec.scale.serve_app import (APP_NAME, DEPLOYMENT_NAME, PROXY_CALLBACK,  # noqa: E402
                                  PROXY_CALLBACK_VARIABLE, ServeOptions, drain, replica_infos,
                                  serve_forever, start, start_serve)

VOCAB = 64
WAIT_S = 120.0
OPTIONS = {"num_threads": 1}
SETTINGS = RowSettings(beam_width=4)
RAY_OPTIONS = RayOptions(actor_cpus=0.5)   # Serve's replicas hold 2 x 0.25 of the 2 CPUs
# where the reader is the point, not the pool: one actor process to start, not two
ONE_ACTOR = RayOptions(num_actors=1, actor_cpus=0.5)


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ[PROXY_CALLBACK_VARIABLE] = PROXY_CALLBACK   # read by the proxy process
    init_ray(num_cpus=2, include_dashboard=False, object_store_memory=150 << 20,
             log_to_driver=False)
    yield
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    # named "tiny" and seeded as tests/test_server.py's model: its table applies as it is
    return write_random_model(tmp_path_factory.mktemp("model") / "tiny", "tiny", seed=0,
                              num_items=500)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def serve_port(cluster) -> int:
    """Serve on the cluster, its proxy on this port for the whole module (Serve keeps its
    HTTP options until it is shut down)."""
    port = free_port()
    start_serve("127.0.0.1", port)
    return port


@pytest.fixture(scope="module")
def app_url(serve_port, model_dir):
    start(ServeOptions(str(model_dir), num_replicas=2, replica_cpus=0.25, grace_s=2.0),
          "127.0.0.1", serve_port)
    yield f"http://127.0.0.1:{serve_port}"
    serve.delete(APP_NAME)


@pytest.fixture
def own_app(serve_port):
    """For a test that deploys `xrec serve --ray`'s own application (APP_NAME at /): it runs
    before `app_url` deploys the shared one (the file's order), and leaves none behind."""
    assert APP_NAME not in serve.status().applications, "run before the app_url fixture"
    yield
    serve.delete(APP_NAME)


@contextlib.contextmanager
def within(seconds: float):
    """A TimeoutError in the main thread after `seconds`: a hang fails instead."""
    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture(scope="module")
def client(app_url):
    with httpx.Client(base_url=app_url, timeout=WAIT_S) as client:
        yield client


# ---- batch ------------------------------------------------------------------------------------

def batch_job(tmp_path: Path, model_dir, source: Path, out: str, **kwargs) -> BatchJob:
    return BatchJob(str(source), str(tmp_path / out), str(model_dir), settings=SETTINGS,
                    chunk_rows=16, engine_options=OPTIONS, progress=False, **kwargs)


def assert_same_records(actual: list[dict], expected: list[dict]) -> None:
    """Equal row for row; scores to fp32 rounding (see the module's docstring)."""
    def without_scores(records: list[dict]) -> list[dict]:
        return [{k: v for k, v in r.items() if k != "scores"} for r in records]

    assert without_scores(actual) == without_scores(expected)
    for got, want in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(got["scores"] or [], np.float64),
                                   np.asarray(want["scores"] or [], np.float64),
                                   rtol=1e-5, atol=1e-6, err_msg=f"row {got['id']}")


def test_ray_batch_writes_the_in_process_records_parquet(tmp_path, cluster, model_dir):
    rng = np.random.default_rng(3)
    rows = [{"id": i, "token_ids": rng.integers(0, VOCAB, rng.integers(1, 20)).tolist()}
            for i in range(150)]
    rows[7]["token_ids"] = [VOCAB + 1]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet", row_group_size=40)
    run_batch(batch_job(tmp_path, model_dir, tmp_path / "in.parquet", "local"))
    summary = run_batch_ray(batch_job(tmp_path, model_dir, tmp_path / "in.parquet", "ray"),
                            RAY_OPTIONS)
    assert (summary.num_rows, summary.num_errors) == (150, 1)
    local, distributed = read_output(tmp_path / "local"), read_output(tmp_path / "ray")
    assert [r["id"] for r in distributed] == list(range(150))
    assert_same_records(distributed, local)


def test_ray_batch_writes_the_in_process_bytes_jsonl(tmp_path, cluster, model_dir):
    rng = np.random.default_rng(4)
    lines = [json.dumps({"id": f"u{i}", "token_ids": rng.integers(0, VOCAB, 5).tolist()})
             for i in range(40)]
    lines[3], lines[20] = "{oops", json.dumps({"id": "u20"})
    (tmp_path / "in.jsonl").write_text("\n".join(lines[:10]) + "\n\n" + "\n".join(lines[10:]) + "\n")
    run_batch(batch_job(tmp_path, model_dir, tmp_path / "in.jsonl", "local"))
    run_batch_ray(batch_job(tmp_path, model_dir, tmp_path / "in.jsonl", "ray"), ONE_ACTOR)

    local, distributed = read_output(tmp_path / "local"), read_output(tmp_path / "ray")
    assert len(local) == 40 and [r["id"] for r in distributed] == [r["id"] for r in local]
    assert_same_records(distributed, local)
    assert distributed[3]["error"].startswith("INVALID_ARGUMENT: row is not JSON")


def test_ray_batch_reads_the_exclude_items_column(tmp_path, cluster, model_dir):
    """The optional list<int64> column reaches each actor's rows (Parquet reads name their
    columns): the records are the in-process ones, a bad list an error record."""
    from xrec.catalog import ItemCatalog

    rng = np.random.default_rng(5)
    catalog_ids = ItemCatalog.from_model_dir(model_dir, VOCAB).item_ids
    rows = [{"id": i, "token_ids": rng.integers(0, VOCAB, 6).tolist(),   # a fifth of the items
             "exclude_items": rng.choice(catalog_ids, 100).tolist() if i % 3 else None}
            for i in range(40)]
    rows[11]["exclude_items"] = [3, None]   # a null in the list (negative ids are valid)
    schema = pa.schema([("id", pa.int64()), ("token_ids", pa.list_(pa.int64())),
                        ("exclude_items", pa.list_(pa.int64()))])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), tmp_path / "in.parquet",
                   row_group_size=16)
    run_batch(batch_job(tmp_path, model_dir, tmp_path / "in.parquet", "local"))
    summary = run_batch_ray(batch_job(tmp_path, model_dir, tmp_path / "in.parquet", "ray"),
                            RAY_OPTIONS)
    assert (summary.num_rows, summary.num_errors) == (40, 1)
    local, distributed = read_output(tmp_path / "local"), read_output(tmp_path / "ray")
    assert distributed[11]["error"].startswith("INVALID_ARGUMENT: exclude_items: not a list of "
                                               "integers")
    assert_same_records(distributed, local)
    for row, record in zip(rows, distributed):   # filtered in the search (issue 25)
        recommended = {i for items in record["items"] for i in items}
        assert not recommended & set(row["exclude_items"] or []), row["id"]


@pytest.mark.parametrize("name, fmt", [("in.pq", None), ("rows.data", "parquet")])
def test_ray_batch_reads_parquet_of_any_name(tmp_path, cluster, model_dir, name, fmt):
    """`.pq` is Parquet by its suffix and `--format parquet` takes any name, as without
    --ray; Ray Data's read_parquet read `*.parquet` files only ("No input files found to
    read with the following file extensions: ['parquet']")."""
    rows = [{"id": i, "token_ids": [i % VOCAB, 1, 2]} for i in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / name)
    run_batch(batch_job(tmp_path, model_dir, tmp_path / name, "local", input_format=fmt))
    run_batch_ray(batch_job(tmp_path, model_dir, tmp_path / name, "ray", input_format=fmt),
                  ONE_ACTOR)
    assert_same_records(read_output(tmp_path / "ray"), read_output(tmp_path / "local"))


def test_ray_batch_refuses_parquet_without_a_suffix(tmp_path, cluster, model_dir):
    """Ray Data's reader filters by suffix and cannot take a name without one: refused before
    the output is made, not as Ray's "no files found" once the run has started."""
    pq.write_table(pa.Table.from_pylist([{"id": 1, "token_ids": [1]}]), tmp_path / "rows")
    with pytest.raises(ValueError, match=r"^--input .*/rows: --ray reads a Parquet file by its "
                                         r"suffix \(Ray Data's reader skips a name without one\)"):
        run_batch_ray(batch_job(tmp_path, model_dir, tmp_path / "rows", "ray",
                                input_format="parquet"), RAY_OPTIONS)
    assert not (tmp_path / "ray").exists()


def test_ray_batch_refuses_resume(tmp_path, cluster, model_dir):
    """`xrec batch --ray --resume` was refused by the CLI alone: `run_batch_ray` took a job
    with resume=True, kept the parts of the in-process run it resumed and wrote every row
    again beside them under Ray's part names (each row twice). Refused, the output as it was."""
    rows = [{"id": i, "token_ids": [i % VOCAB, 1]} for i in range(20)]
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_batch(batch_job(tmp_path, model_dir, source, "out"))
    before = sorted(p.name for p in (tmp_path / "out").iterdir())
    with pytest.raises(ValueError, match="^--resume: a --ray run is not resumable"):
        run_batch_ray(batch_job(tmp_path, model_dir, source, "out", resume=True), RAY_OPTIONS)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == before
    assert [r["id"] for r in read_output(tmp_path / "out")] == list(range(20))


def test_ray_pool_that_takes_every_cpu_is_refused():
    assert pool_size(2.0, 1, RayOptions()) == (1, 1.0)
    assert pool_size(9.0, 2, RayOptions()) == (4, 2.0)
    assert pool_size(1.5, 4, RayOptions()) == (1, 0.5)
    with pytest.raises(ValueError, match="2 x --actor-cpus 1 = 2 CPUs, but the cluster has 2 "
                                         "free .* hangs without an error"):
        pool_size(2.0, 1, RayOptions(num_actors=2, actor_cpus=1.0))
    with pytest.raises(ValueError, match="has 1 CPU\\(s\\) free; an actor pool needs more"):
        pool_size(1.0, 1, RayOptions())


def test_unreachable_cluster_is_one_clear_line(tmp_path, model_dir):
    (tmp_path / "in.jsonl").write_text('{"id": 1, "token_ids": [1]}\n')
    with socket.socket() as s:   # a port that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "xrec", "batch", "--input",
                           str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o"), "--model",
                           str(model_dir), "--ray", "--address", f"127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"xrec batch: error: --address 127.0.0.1:{port}: cannot reach the Ray cluster "
        "(Connection refused); is `ray start --head` running there?")


def test_a_line_that_is_not_utf8_is_refused_before_ray_starts(tmp_path, model_dir):
    """Ray Data's read_text decodes strictly, so `--ray` refuses such a file up front (the
    in-process run fails that row alone: test_batch.py) instead of failing midway."""
    (tmp_path / "in.jsonl").write_bytes(b'{"id": 1, "token_ids": [1]}\n{"id": "\xe9"}\n')
    done = subprocess.run([sys.executable, "-m", "xrec", "batch", "--input",
                           str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o"), "--model",
                           str(model_dir), "--ray", "--address", "127.0.0.1:1"],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        f"xrec batch: error: --input {tmp_path / 'in.jsonl'}: line 2 is not UTF-8 text; --ray "
        "reads only UTF-8 (without --ray that row alone fails)")


# ---- serve: start-up and shutdown (own_app: before the shared app) ------------------------------

KEY = "test-key"
HEAVY = {"token_ids": [int(t) for t in np.random.default_rng(5).integers(0, VOCAB, 3000)],
         "beam_width": 512}


def signal_when(is_time, sig: int) -> threading.Thread:
    """A thread that sends `sig` to this process once `is_time()` (never after WAIT_S)."""
    def wait_then_signal() -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if is_time():
                os.kill(os.getpid(), sig)
                return
            time.sleep(0.2)

    thread = threading.Thread(target=wait_then_signal, daemon=True)
    thread.start()
    return thread


def test_replicas_the_cluster_cannot_place_are_refused_and_a_signal_stops_a_start(
        own_app, serve_port, model_dir, monkeypatch):
    """Serve waits for a replica it cannot place without a limit, and SIGTERM / SIGINT only
    set a flag read after the start: more replicas than the free CPUs are one error line
    before anything deploys; one the check cannot see (a resource no node has here; CPUs
    split between nodes, a lost node) is stopped by a signal."""
    done = subprocess.run([sys.executable, "-m", "xrec", "serve", "--ray", "--address",
                           ray.get_runtime_context().gcs_address, "--model", str(model_dir),
                           "--port", str(serve_port), "--replicas", "3", "--replica-cpus", "1"],
                          capture_output=True, text=True, timeout=WAIT_S)
    assert done.returncode == 1, done.stderr
    assert re.fullmatch(r"xrec serve: error: --replicas 3 x --replica-cpus 1 = 3 CPU\(s\), but "
                        r"the Ray cluster has [0-9.]+ free; Serve would wait for the replicas "
                        r"without end: ask for less, or add nodes",
                        done.stderr.strip().splitlines()[-1]), done.stderr
    assert APP_NAME not in serve.status().applications

    placeable = ServeOptions.deployment_options

    def unplaceable(self) -> dict:
        options = placeable(self)
        options["ray_actor_options"]["resources"] = {"xrec_test_no_node_has_it": 1}
        return options

    monkeypatch.setattr(ServeOptions, "deployment_options", unplaceable)
    signal_when(lambda: APP_NAME in serve.status().applications, signal.SIGINT)
    with within(WAIT_S):
        assert serve_forever(ServeOptions(str(model_dir), replica_cpus=0.25, grace_s=0.0), None,
                             "127.0.0.1", serve_port) == 0
    # deleted without waiting there: Serve waits grace_s + 5 s for the replica it never placed
    deadline = time.monotonic() + WAIT_S
    while APP_NAME in serve.status().applications and time.monotonic() < deadline:
        time.sleep(0.2)
    assert APP_NAME not in serve.status().applications


def test_sigterm_leaves_the_serve_of_a_joined_cluster_running(own_app, serve_port, model_dir,
                                                              tmp_path):
    """`xrec serve --ray --address` joins a cluster that runs on without it: SIGTERM deletes
    its application and leaves Serve there (it shut Serve down: every other application of
    the cluster and its proxies went too)."""
    url = f"http://127.0.0.1:{serve_port}"
    log = tmp_path / "serve.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "xrec", "serve", "--ray", "--address",
                                 ray.get_runtime_context().gcs_address, "--model", str(model_dir),
                                 "--port", str(serve_port), "--replica-cpus", "0.25",
                                 "--num-threads", "1", "--grace-s", "1"],
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + WAIT_S
        while "SIGTERM stops" not in log.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert httpx.get(f"{url}/health", timeout=WAIT_S).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert httpx.get(f"{url}/-/healthz", timeout=WAIT_S).status_code == 200   # Serve's proxy
    assert APP_NAME not in serve.status().applications


def test_start_errors_are_one_value_error(own_app, serve_port, model_dir, tmp_path, monkeypatch):
    """Serve running on another port kept it and the app was not where --port said; replicas
    that fail to start were Serve's RuntimeError (a traceback from `xrec serve`) without
    their reason."""
    options = ServeOptions(str(model_dir), replica_cpus=0.25)
    other = free_port()
    with pytest.raises(ValueError, match=f"^--host 127.0.0.1 --port {other}: Ray Serve already "
                                         f"runs on this cluster on 127.0.0.1:{serve_port} "):
        start(options, "127.0.0.1", other)
    assert APP_NAME not in serve.status().applications

    once = ServeOptions.deployment_options   # one try of the constructor, not three: faster
    monkeypatch.setattr(ServeOptions, "deployment_options",
                        lambda self: {**once(self), "max_constructor_retry_count": 1})
    (tmp_path / "no-weights").mkdir()
    shutil.copy(model_dir / "config.json", tmp_path / "no-weights")   # ServeOptions reads it
    with pytest.raises(ValueError, match=r"^the replicas failed to start: .*CheckpointError: "
                                         r"no \*\.safetensors file in "):
        start(ServeOptions(str(tmp_path / "no-weights"), replica_cpus=0.25), "127.0.0.1",
              serve_port)


def outcome(response: httpx.Response) -> tuple[int, str]:
    """(status, xrec's error code; "OK"; or the text of an answer not in xrec's shape)."""
    if response.status_code == 200:
        return 200, "OK"
    if response.headers.get("content-type", "").startswith("application/json"):
        return response.status_code, response.json()["error"]["code"]
    return response.status_code, response.text


def post(url: str, body: dict) -> tuple[int, str]:
    with httpx.Client(base_url=url, timeout=WAIT_S,
                      headers={"Authorization": f"Bearer {KEY}"}) as client:
        try:
            return outcome(client.post("/v1/rec/completions", json=body))
        except httpx.HTTPError as e:
            return 0, type(e).__name__


def until_refused(url: str, stops: list) -> None:
    """Heavy requests one after another until one is answered neither 200 nor 429: that
    answer, with its time."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        status, code = post(url, HEAVY)
        if status not in (200, 429):
            stops.append((time.monotonic(), status, code))
            return


def burst_then_sigterm(url: str, seen: dict) -> None:
    """Once the app answers: its replicas' metrics URLs, a burst of 12 heavy requests, then
    3 clients in a loop and SIGTERM to this process (serve_forever's)."""
    deadline = time.monotonic() + WAIT_S
    while post(url, {**HEAVY, "token_ids": [1]})[0] != 200:
        if time.monotonic() > deadline:
            return   # never up: `within` ends serve_forever
        time.sleep(0.2)
    try:
        seen["metrics_urls"] = [info["metrics_url"] for info in replica_infos(1)]
        with ThreadPoolExecutor(12) as pool:
            seen["burst"] = list(pool.map(lambda _: post(url, HEAVY), range(12)))
        seen["stops"] = stops = []
        clients = [threading.Thread(target=until_refused, args=(url, stops), daemon=True)
                   for _ in range(3)]
        for client in clients:
            client.start()
        time.sleep(1.0)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)
    for client in clients:
        client.join(WAIT_S)


def serve_beside(client, options: ServeOptions, serve_port: int) -> dict:
    """`serve_forever(options)` here while `client(url, seen)` runs on a thread (and ends it
    with SIGTERM); what the client saw."""
    seen: dict = {}
    thread = threading.Thread(target=client, args=(f"http://127.0.0.1:{serve_port}", seen),
                              daemon=True)
    thread.start()
    with within(3 * WAIT_S):
        assert serve_forever(options, None, "127.0.0.1", serve_port) == 0
    thread.join(WAIT_S)
    return seen


def test_a_full_replica_answers_429_and_sigterm_drains_with_503(own_app, serve_port, model_dir):
    """Through Serve as from `xrec serve`: requests past the engine's capacity get the
    engine's 429 (Serve's proxy queued them without a bound: all 200, seconds late); SIGTERM
    drains the replica, new requests 503 UNAVAILABLE in xrec's JSON, before the application
    goes (it went at once: Serve's plain-text 404). With an API key a replica opens no
    metrics port of its own (it answered without the key)."""
    options = ServeOptions(str(model_dir), api_key=KEY, replica_cpus=0.25, grace_s=30.0,
                           engine_options={"num_threads": 1, "request_queue_size": 2,
                                           "max_seqs_per_batch": 1})
    seen = serve_beside(burst_then_sigterm, options, serve_port)
    assert seen["metrics_urls"] == [None]
    # the engine holds 3: the rest refused at once (they waited for their turn, all 200)
    statuses = [status for status, _ in seen["burst"]]
    assert set(statuses) == {200, 429} and statuses.count(200) <= 6, seen["burst"]
    assert (429, "RESOURCE_EXHAUSTED") in seen["burst"]   # the engine's own, in xrec's JSON
    assert len(seen["stops"]) == 3
    assert min(seen["stops"])[1:] == (503, "UNAVAILABLE"), seen["stops"]


def queue_then_sigterm(url: str, seen: dict) -> None:
    """Once the app answers: 32 heavy requests at once, SIGTERM to this process (serve_forever's)
    while the replica's engine holds at least 8 of them waiting; their outcomes."""
    deadline = time.monotonic() + WAIT_S
    while post(url, {**HEAVY, "token_ids": [1]})[0] != 200:
        if time.monotonic() > deadline:
            return   # never up: `within` ends serve_forever
        time.sleep(0.2)
    metrics_url = next(info["metrics_url"] for info in replica_infos(1))
    with ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(post, url, HEAVY) for _ in range(32)]
        try:
            while time.monotonic() < deadline and metric(metrics_url, "xrec_requests_waiting") < 8:
                time.sleep(0.05)
        finally:
            os.kill(os.getpid(), signal.SIGTERM)
        seen["outcomes"] = [future.result() for future in futures]


def check_what_grace_leaves_is_answered_503(serve_port, model_dir) -> None:
    """`xrec serve --ray` with no grace, one request a batch and a queue of them, then SIGTERM:
    every request is answered once, 200 or (what the grace leaves) 503 UNAVAILABLE."""
    options = ServeOptions(str(model_dir), replica_cpus=0.25, grace_s=0.0,
                           engine_options={"num_threads": 1, "request_queue_size": 64,
                                           "max_seqs_per_batch": 1})
    seen = serve_beside(queue_then_sigterm, options, serve_port)
    assert set(seen["outcomes"]) <= {(200, "OK"), (503, "UNAVAILABLE")}, seen["outcomes"]
    assert (503, "UNAVAILABLE") in seen["outcomes"]


def test_what_the_grace_period_leaves_is_answered_503(own_app, serve_port, model_dir):
    """Requests still waiting when SIGTERM's grace period ends are answered 503 UNAVAILABLE in
    xrec's JSON, at its end, as `xrec serve` answers them: they ran on for grace_s + 5 s more,
    then Serve killed the replica and the proxy answered the rest 500 in plain text."""
    check_what_grace_leaves_is_answered_503(serve_port, model_dir)


def test_a_drain_before_the_deployment_exists_returns_at_once(serve_port):
    """A signal just after the application appeared, before Serve had registered its
    deployment, drained nothing and failed the stop with a KeyError: Serve refuses a handle to
    a deployment it does not know (a fresh-clone CI run of 2026-12-07, in the unplaceable
    replica's test). No replica runs, so there is no one to ask."""
    assert "xrec-never-deployed" not in serve.status().applications
    drain(0.0, app_name="xrec-never-deployed")
    assert replica_infos(0, app_name="xrec-never-deployed") == []


def test_a_signal_while_some_replicas_start_drains_those_that_answer(own_app, serve_port,
                                                                     model_dir, monkeypatch):
    """A signal during the start (Serve still waits for a replica) stopped it without a drain,
    though a replica that had started was answering: its requests ran on for grace_s + 5 s,
    then Serve killed it and the proxy answered them 500 in plain text. The replicas that
    answer are drained first, as after the start."""
    placeable = ServeOptions.deployment_options

    def one_of_two_placeable(self) -> dict:   # 2 x 1.5 of the cluster's 2 CPUs
        options = {**placeable(self), "num_replicas": 2}
        options["ray_actor_options"]["num_cpus"] = 1.5
        return options

    monkeypatch.setattr(ServeOptions, "deployment_options", one_of_two_placeable)
    check_what_grace_leaves_is_answered_503(serve_port, model_dir)


def test_the_drain_reaches_every_busy_replica(own_app, serve_port, model_dir):
    """SIGTERM's drain asked the replicas one at a time, each taking up to grace_s while
    busy, all within grace_s + 5 s: the third busy replica was asked after two grace
    periods and not waited for (its requests ran on, new ones were taken meanwhile, and
    Serve's deletion killed it grace_s + 5 s later: the proxy's plain-text 500). Three
    replicas holding more work than the grace period drain at once: when drain() returns
    every engine is closed, and every request was answered 200 or 503."""
    options = ServeOptions(str(model_dir), num_replicas=3, replica_cpus=0.25, grace_s=3.0,
                           engine_options={"num_threads": 1, "request_queue_size": 64,
                                           "max_seqs_per_batch": 1})
    start(options, "127.0.0.1", serve_port)
    metrics_urls = [info["metrics_url"] for info in replica_infos(3)]
    assert len(metrics_urls) == 3
    url = f"http://127.0.0.1:{serve_port}"
    with ThreadPoolExecutor(120) as pool:
        futures = [pool.submit(post, url, HEAVY) for _ in range(120)]
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not all(
                metric(u, "xrec_requests_waiting") >= 2 for u in metrics_urls):
            time.sleep(0.05)
        drain(options.grace_s)
        is_ready = [metric(u, "xrec_ready") for u in metrics_urls]
        outcomes = [future.result() for future in futures]
    assert is_ready == [0.0, 0.0, 0.0]
    assert set(outcomes) <= {(200, "OK"), (503, "UNAVAILABLE")}, outcomes


# ---- serve ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path, body, status, code",
                         [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_request_through_serve(client, path, body, status, code):
    if isinstance(body, bytes):
        response = client.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = client.post(path, json=body)
    error = assert_error(response, status, code)
    assert response.headers.get_list("x-request-id") == [error["request_id"]]
    assert client.post(path, json=VALID).status_code == 200


def test_routes_health_and_metrics_are_xrec_serves(client, cluster):
    assert client.get("/health").json() == {"status": "ok", "model": "tiny"}
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == ["tiny"]
    assert_error(client.get("/no/such/path"), 404, "NOT_FOUND")
    response = client.post("/v1/rec/completions", json={**VALID, "request_id": "mine"})
    assert response.status_code == 200 and response.json()["id"] == "mine"
    assert response.headers.get_list("x-request-id") == ["mine"]
    assert len(response.json()["results"]) == 4 and response.headers["x-catalog-version"]
    assert "xrec_requests_total" in client.get("/metrics").text
    infos = replica_infos(2)
    assert len({i["pid"] for i in infos}) == 2
    for info in infos:   # each replica's own registry, on the loopback interface only
        assert info["metrics_url"].startswith("http://127.0.0.1:")
        assert metric(info["metrics_url"], "xrec_pipelines") == 1.0


def test_the_workers_of_a_cluster_xrec_starts_run_at_normal_priority(client, cluster):
    """Ray starts its workers at nice 15: beside the other worker of the test suite a
    replica's engine load took 2 min 8 s instead of 5 s, past the wait of a test. A
    cluster xrec starts (`init_ray`, as `connect` starts one) runs them at nice 0:
    Serve's replicas and a plain task."""
    assert [os.getpriority(os.PRIO_PROCESS, info["pid"]) for info in replica_infos(2)] == [0, 0]
    assert ray.get(ray.remote(num_cpus=0)(lambda: os.nice(0)).remote(), timeout=WAIT_S) == 0


def metric(url: str, name: str) -> float:
    text = httpx.get(url, timeout=WAIT_S).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    return 0.0


def test_a_killed_replica_fails_only_its_requests_and_is_replaced(client, app_url, cluster):
    infos = replica_infos(2)
    victim, survivor = infos[0], infos[1]
    heavy = {"token_ids": list(np.random.default_rng(5).integers(0, VOCAB, 3000)),
             "beam_width": 512}
    heavy["token_ids"] = [int(t) for t in heavy["token_ids"]]
    results: list = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(base_url=app_url, timeout=WAIT_S) as own:
            while not stop.is_set():
                try:
                    response = own.post("/v1/rec/completions", json=heavy)
                except httpx.HTTPError as e:   # a hang would be a ReadTimeout: counted as such
                    results.append(type(e).__name__)
                    continue
                # the proxy answers a request whose replica died itself: plain text
                results.append(response.status_code if response.status_code == 200 else
                               (response.status_code, response.text))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(6)]
    for thread in threads:
        thread.start()
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and metric(victim["metrics_url"], "xrec_batches_running") < 1:
            time.sleep(0.01)
        assert metric(victim["metrics_url"], "xrec_batches_running") >= 1
        os.kill(victim["pid"], signal.SIGKILL)
        num_before = len(results)
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and len(results) < num_before + 6:
            time.sleep(0.05)   # the survivor keeps answering meanwhile
    finally:
        stop.set()
        for thread in threads:
            thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    failed = [r for r in results if r != 200]
    assert 200 in results[num_before:]   # the survivor answered meanwhile
    assert failed and all(r == (500, "Internal Server Error") for r in failed), results
    # Serve replaces the dead replica: two running again, the survivor untouched
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        states = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].replica_states
        if states.get("RUNNING") == 2 and sum(states.values()) == 2:
            break
        time.sleep(0.2)
    pids = {i["pid"] for i in replica_infos(2)}
    assert len(pids) == 2 and survivor["pid"] in pids and victim["pid"] not in pids
    assert all(client.post("/v1/rec/completions", json=VALID).status_code == 200
               for _ in range(4))


def test_build_app_takes_serve_runs_text_arguments(model_dir):
    """`serve run xrec.scale.serve_app:build_app model=DIR replicas=2 ...` passes text."""
    from xrec.scale.serve_app import build_app

    app = build_app({"model": str(model_dir), "replicas": "3", "replica_cpus": "0.5",
                     "max_seqs_per_batch": "32", "constrained": "false"})
    assert type(app).__name__ == "Application"
    options = ServeOptions(str(model_dir), engine_options={"max_seqs_per_batch": 32},
                           num_replicas=3, replica_cpus=0.5).deployment_options()
    assert options["num_replicas"] == 3 and options["ray_actor_options"]["num_cpus"] == 0.5
    assert options["max_ongoing_requests"] == 2 * (1024 + 32)   # the engine's capacity, twice
    scaled = ServeOptions(str(model_dir), num_replicas=1, max_replicas=4).deployment_options()
    assert scaled["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4,
                                            "target_ongoing_requests": 64}
    with pytest.raises(ValueError, match="unknown argument 'bogus'"):
        build_app({"model": str(model_dir), "bogus": "1"})
    with pytest.raises(ValueError, match="option max_seqs_per_batch"):
        build_app({"model": str(model_dir), "max_seqs_per_batch": "0"})
