"""`xrec bench`: smoke runs with --quick on the tiny model (outputs written, results
correct: xrec's "full" mode returns HF generate's triples), and the pieces with
hand-checked inputs. Timings are never asserted."""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from xrec.bench.cli import main  # noqa: E402
from xrec.bench.lib.common import (markdown_table, output_paths, percentile,  # noqa: E402
                                   summarize, write_outputs)
from xrec.bench.lib.contenders import build_trie, overlap, prefix_allowed_tokens  # noqa: E402
from xrec.bench.serve import Sent, arrivals, summarize_load  # noqa: E402


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """XREC_HOME for the module: the quick model is written there once."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("xrec-home")
        mp.setenv("XREC_HOME", str(path))
        yield path


def _run(name: str, out: Path, *extra: str) -> dict:
    assert main([name, "--quick", "--out", str(out), "--no-progress", *extra]) == 0
    files = {p.suffix: p for p in out.iterdir()}
    assert set(files) == {".json", ".md", ".png"}, files
    assert files[".png"].stat().st_size > 1000
    record = json.loads(files[".json"].read_text())
    env = record["environment"]
    for key in ("cpu", "cores", "torch", "torch_threads", "python", "git_sha", "date", "command"):
        assert env[key] not in (None, ""), key
    assert files[".md"].read_text().startswith(f"## xrec bench {name}")
    return record


def test_offline_quick_full_mode_equals_hf(home, tmp_path):
    record = _run("offline", tmp_path)
    assert len(record["points"]) == 2
    for point in record["points"]:
        rows = point["contenders"]
        assert set(rows) == {"xrec", "xrec-full", "hf", "naive"}
        assert rows["xrec-full"]["overlap_vs_hf"]["mean"] == 1.0
        assert rows["xrec-full"]["overlap_vs_hf"]["min"] == 1.0
        assert 0.0 < rows["xrec"]["overlap_vs_hf"]["mean"] <= 1.0
        assert rows["hf"]["speedup_vs_hf"] == 1.0
        for row in rows.values():
            assert row["runs"] >= 1 and row["requests_per_s"] > 0
            assert row["p50_ms"] <= row["p95_ms"] <= row["p99_ms"]
            assert row["peak_mib"] is not None and row["peak_mib"] >= 0


def test_offline_quick_decoder_only_full_mode_equals_hf(home, tmp_path):
    record = _run("offline", tmp_path, "--family", "qwen3")
    assert record["settings"]["size"] == "qwen3-sid-test"
    assert record["model"]["config"]["model_type"] == "qwen3"
    for point in record["points"]:
        rows = point["contenders"]
        assert set(rows) == {"xrec", "xrec-full", "hf"}   # the naive contender is encoder-decoder only
        assert rows["xrec-full"]["overlap_vs_hf"]["mean"] == 1.0
        assert rows["xrec-full"]["overlap_vs_hf"]["min"] == 1.0


def test_offline_quick_filter_row_is_paired_with_the_unfiltered_batch(home, tmp_path):
    """xrec-filter: the same batch, each request excluding 1,000 items (half the quick
    catalog) and 2 subtrees; its row reads its batch time against xrec's, run by run."""
    record = _run("offline", tmp_path, "--contenders", "xrec,xrec-filter")
    for point in record["points"]:
        rows = point["contenders"]
        assert set(rows) == {"xrec", "xrec-filter"}
        filtered = rows["xrec-filter"]
        ratios = [f / x for f, x in zip(filtered["wall_ms"], rows["xrec"]["wall_ms"])]
        assert filtered["vs_unfiltered"] == pytest.approx(statistics.median(ratios))
    assert "× unfiltered" in next(tmp_path.glob("*.md")).read_text()


def test_offline_quick_float32_row_reads_what_the_dtype_buys(home, tmp_path):
    """xrec-fp32: a second engine in float32 beside xrec's (here asked for bfloat16); xrec's
    row reads the median of the paired ratios of their batch times."""
    record = _run("offline", tmp_path, "--contenders", "xrec,xrec-fp32", "--dtype", "bfloat16")
    assert record["model"]["engine_dtypes"] == {"xrec": "bfloat16", "xrec-fp32": "float32"}
    for point in record["points"]:
        rows = point["contenders"]
        ratios = [f / x for f, x in zip(rows["xrec-fp32"]["wall_ms"], rows["xrec"]["wall_ms"])]
        assert rows["xrec"]["speedup_vs_float32"] == pytest.approx(statistics.median(ratios))
    assert "× xrec-fp32 (paired)" in next(tmp_path.glob("*.md")).read_text()


def test_breakdown_quick_decoder_only(home, tmp_path):
    # --dtype reaches the engine (the suite's CPU "auto" is float32)
    record = _run("breakdown", tmp_path, "--family", "qwen3", "--dtype", "bfloat16")
    assert record["settings"]["dtype"] == "bfloat16"
    assert "bfloat16)" in next(tmp_path.glob("*.md")).read_text().splitlines()[0]
    for mode in ("allowed", "full"):
        parts = record["modes"][mode]["parts_ms"]
        for part in ("prompt (round 0)", "decoder, round 1", "decoder, round 2",
                     "LM head + normalise, round 0", "top-k select"):
            assert parts.get(part, 0) > 0, (mode, part, parts)
        assert "encoder" not in parts


def test_family_and_size_must_agree(home, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["offline", "--family", "qwen3", "--size", "onerec-0.015b", "--out", str(tmp_path)])
    assert "not of --family qwen3" in capsys.readouterr().err


TINY = ["--size", "tiny-mha", "--items", "2000", "--no-progress"]


@pytest.mark.parametrize("flags", [
    ["offline", "--contenders", "xrec", "--repeats", "0"],
    ["offline", "--contenders", "xrec,hf", "--repeats", "1", "--hf-repeats", "0"],
    ["offline", "--contenders", "xrec", "--repeats", "1", "--num-requests", "0"],
    ["offline", "--contenders", "xrec", "--repeats", "1", "--threads", "-1"],
    ["offline", "--contenders", "xrec", "--repeats", "1", "--warmup", "-1"],
    ["breakdown", "--beam-width", "4", "--length", "16", "--num-requests", "2", "--repeats", "0"],
    ["embedded", "--beam-width", "4", "--length", "16", "--num-requests", "2", "--repeats", "1",
     "--conditions", "alone", "--isolations", "thread", "--rounds", "0"],
    ["contention", "--workloads", "serve", "--beam-width", "4", "--length", "16",
     "--num-requests", "2", "--seconds", "0.1", "--rounds", "0"],
], ids=lambda flags: f"{flags[0]} {' '.join(flags[-2:])}")
def test_counts_below_one_are_refused_before_running(home, tmp_path, capsys, flags):
    """Zero or negative runs, requests, rounds or threads: an argument error before anything
    runs (they crashed with a traceback, printed rows of no runs or a row without HF, or
    ran the default rounds)."""
    command, *rest = flags
    with pytest.raises(SystemExit):
        main([command, *TINY, "--beam-widths", "4", "--lengths", "16", "--num-requests", "2",
              "--out", str(tmp_path), *rest] if command == "offline" else
             [command, *TINY, "--out", str(tmp_path), *rest])
    assert f"{flags[-2]}: expected an integer >= " in capsys.readouterr().err
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_out_that_is_a_file_is_refused_before_running(tmp_path, capsys, monkeypatch):
    """--out naming a file: an argument error before any model is built or run (the whole
    benchmark ran, then its results could not be written)."""
    monkeypatch.setenv("XREC_HOME", str(tmp_path / "home"))
    (tmp_path / "taken").write_text("not a directory")
    with pytest.raises(SystemExit):
        main(["offline", "--quick", "--no-progress", "--contenders", "xrec",
              "--out", str(tmp_path / "taken")])
    assert "--out" in capsys.readouterr().err
    assert not (tmp_path / "home").exists()
    assert (tmp_path / "taken").read_text() == "not a directory"


@pytest.mark.parametrize("case", ["filter", "target1"])
def test_offline_quick_with_a_case_is_refused(home, tmp_path, capsys, case):
    """--quick replaced --case with the tiny grid: `--quick --case filter` ran xrec, xrec-full,
    hf and naive, no filtered row, and wrote an `offline-` record as if the case had run."""
    with pytest.raises(SystemExit):
        main(["offline", "--quick", "--no-progress", "--case", case, "--out", str(tmp_path)])
    assert f"--case {case}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_offline_rejects_unknown_contender(home, tmp_path, capsys):
    assert main(["offline", "--quick", "--out", str(tmp_path), "--contenders", "xrec,vllm"]) == 1
    assert "vllm" in capsys.readouterr().err


def test_scaling_quick(home, tmp_path):
    record = _run("scaling", tmp_path, "--contenders", "xrec,hf")
    axes = {p["axis"] for p in record["points"]}
    assert axes == {"beam_width", "input_len", "num_requests"}
    for point in record["points"]:
        assert set(point["contenders"]) == {"xrec", "hf"}
        assert point["contenders"]["xrec"]["peak_mib"] is not None


def test_breakdown_quick(home, tmp_path):
    record = _run("breakdown", tmp_path)
    for mode in ("allowed", "full"):
        result = record["modes"][mode]
        parts = result["parts_ms"]
        for part in ("encoder", "cross K/V", "decoder prefix (round 0)", "decoder, round 1",
                     "decoder, round 2", "LM head + normalise, round 0", "top-k select",
                     "beam update"):
            assert parts.get(part, 0) > 0, (mode, part, parts)
        assert 0.0 <= result["host_fraction"] < 1.0
        assert sum(parts.values()) == pytest.approx(result["op_ms"], rel=0.05)


def test_roofline_quick_both_families_and_dtypes(home, tmp_path):
    """Each workload in each dtype, read against that dtype's fresh-process GEMM peak, the
    higher of before and after (bfloat16 runs emulated where the CPU lacks it)."""
    record = _run("roofline", tmp_path, "--dtypes", "float32,bfloat16")
    for when in ("before", "after"):
        for dtype in ("float32", "bfloat16"):
            peak = record["peaks"][when][dtype]
            assert peak["flops_per_s"] == max(peak["by_shape"].values()) > 0
    assert [(w["size"], w["dtype"]) for w in record["workloads"]] == [
        ("tiny-mha", "float32"), ("tiny-mha", "bfloat16"),
        ("qwen3-sid-test", "float32"), ("qwen3-sid-test", "bfloat16")]
    for workload in record["workloads"]:
        peaks = [record["peaks"][when][workload["dtype"]]["flops_per_s"] / 1e9
                 for when in ("before", "after")]
        assert workload["peak_gflop_per_s"] == pytest.approx(max(peaks))
        assert workload["fraction_of_peak"] == pytest.approx(
            workload["gflop_per_s"] / workload["peak_gflop_per_s"])
        assert (workload["speedup_vs_float32"] is None) == (workload["dtype"] == "float32")
        components = workload["components"]
        assert sum(c["flop_share"] for c in components.values()) == pytest.approx(1.0)
        has_cross = workload["size"] == "tiny-mha"
        for name in ("encoder / prompt", "decoder", "attention", "LM head") + (
                ("cross K/V",) if has_cross else ()):
            assert components[name]["gflop"] > 0 and components[name]["ms"] > 0, name
        if not has_cross:   # decoder-only: no encoder output to project
            assert components["cross K/V"]["gflop"] == 0.0
        assert len(workload["runs"]["step_ms"]) == len(workload["runs"]["reference_gflop_per_s"]) == 2
        assert 0 < workload["fraction_of_reference"] < 1 and 0 < workload["fraction_of_peak"] < 1
    table = (tmp_path / next(p.name for p in tmp_path.iterdir() if p.suffix == ".md")).read_text()
    assert "| tiny-mha W=8 L=16 B=2 | bfloat16 |" in table


def test_roofline_dtypes_flag_is_checked(home, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["roofline", "--quick", "--out", str(tmp_path), "--dtypes", "float64"])
    assert "expected comma-separated dtypes among float32, bfloat16, float16" in \
        capsys.readouterr().err


class _FakeServer(BaseHTTPRequestHandler):
    """Answers like `xrec serve` would, at once (the load generator is under test)."""

    def do_GET(self):
        self._reply(200, {"status": "ok"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "token_ids" not in body:
            self._reply(400, {"error": {"code": "INVALID_ARGUMENT", "message": "no input"}})
            return
        self._reply(200, {"id": "x", "results": [{"tokens": [1, 2, 3], "score": -1.0}]})

    def _reply(self, status, payload):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_serve_client_against_a_fake_server(home, tmp_path):
    pytest.importorskip("httpx")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        record = _run("serve", tmp_path, "--url", url)
    finally:
        httpd.shutdown()
    (load,) = record["load"]
    assert load["sent"] > 0 and load["ok"] == load["sent"] and load["errors"] == {}
    (versus,) = record["server_vs_offline"]
    assert versus["num_requests"] == 4 and versus["server_vs_offline"] > 0


def test_serve_quick_against_xrec_serve(home, tmp_path):
    record = _run("serve", tmp_path)
    assert [v["max_concurrency"] for v in record["server_vs_offline"]] == [1, 2]
    for load in record["load"]:
        assert load["errors"] == {} and load["ok"] == load["sent"]


def _assert_environment_from_the_start(record: dict, written: Path) -> None:
    """The environment (its date, the load average "at start") was taken before the
    measurement, not with the end's: these runs start several fresh processes, so their
    start lies well over a second before the record is written."""
    import datetime as dt

    started = dt.datetime.fromisoformat(record["environment"]["date"]).timestamp()
    assert written.stat().st_mtime - started > 1.5


def test_embedded_quick_writes_its_table(home, tmp_path):
    """Each row in a fresh process, both isolation modes, and the transport and the
    process-isolated engine's start measured in one process holding both engines."""
    assert main(["embedded", "--quick", "--out", str(tmp_path), "--no-progress",
                 "--conditions", "alone"]) == 0
    files = {p.suffix: p for p in tmp_path.iterdir()}
    assert set(files) == {".json", ".md"}, files
    record = json.loads(files[".json"].read_text())
    assert [(r["condition"], r["isolation"]) for r in record["rows"]] == \
        [("alone", "thread"), ("alone", "process")]
    for row in record["rows"]:
        assert len(row["batch_ms_rounds"]) == 1 and row["batch_ms"] > 0
    assert record["rows"][0]["throughput_vs_alone"] == 1.0
    transport, start = record["transport"], record["start"]
    assert transport["thread_p50_ms"] > 0 and transport["process_p50_ms"] > 0
    assert start["starts"] == record["settings"]["repeats"] and min(start["first_s"], start["forked_s"], start["fresh_s"]) > 0
    assert start["fresh_vs_forked"] == pytest.approx(statistics.median(
        fresh / forked for forked, fresh in zip(start["forked_all_s"], start["fresh_all_s"])))
    assert files[".md"].read_text().startswith("## xrec bench embedded")
    assert "as a fresh interpreter" in files[".md"].read_text()
    _assert_environment_from_the_start(record, files[".json"])


def test_embedded_without_the_alone_thread_row_has_no_ratio(home, tmp_path):
    """Throughput vs xrec alone is read against the alone, in-thread row; without it the
    first row was its own yardstick and read 1.00 (main-op: the target 'met')."""
    assert main(["embedded", "--quick", "--out", str(tmp_path), "--no-progress",
                 "--conditions", "main-op", "--isolations", "thread"]) == 0
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    (row,) = record["rows"]
    assert row["condition"] == "main-op" and row["batch_ms"] > 0
    assert row["throughput_vs_alone"] is None
    assert "| main-op | thread |" in next(tmp_path.glob("*.md")).read_text()
    assert "not measured" in next(tmp_path.glob("*.md")).read_text()


@pytest.mark.parametrize("flags", [["--conditions", "alone,busy"], ["--isolations", "fork"]])
def test_embedded_refuses_unknown_conditions_and_isolations(home, tmp_path, capsys, flags):
    """An unknown host condition was measured as `alone` under its own name; an unknown
    isolation failed in the measuring process (a RuntimeError traceback)."""
    assert main(["embedded", "--quick", "--out", str(tmp_path), "--no-progress", *flags]) == 1
    assert f"{flags[0]}: unknown ['{flags[1].split(',')[-1]}']" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the neighbour takes one of 2+ CPUs")
def test_contention_quick_measures_both_policies_beside_a_neighbour(home, tmp_path):
    """Each measurement in a fresh process, idle and beside a spinning neighbour, for both
    thread policies; ratios read against the fixed policy's idle throughput."""
    assert main(["contention", "--quick", "--out", str(tmp_path), "--no-progress",
                 "--workloads", "serve"]) == 0
    files = {p.suffix: p for p in tmp_path.iterdir()}
    assert set(files) == {".json", ".md"}, files
    record = json.loads(files[".json"].read_text())
    assert [(r["workload"], r["policy"]) for r in record["rows"]] == \
        [("serve", "fixed"), ("serve", "adaptive")]
    fixed = record["rows"][0]
    for row in record["rows"]:
        assert row["idle"] > 0 and row["busy"] > 0
        assert row["busy_vs_fixed_idle"] == pytest.approx(row["busy"] / fixed["idle"])
    assert files[".md"].read_text().startswith("## xrec bench contention")
    _assert_environment_from_the_start(record, files[".json"])
    assert main(["contention", "--quick", "--out", str(tmp_path), "--workloads", "nap"]) == 1


def test_batch_error_rows_are_not_answers(home, tmp_path):
    """Rows the engine refuses (longer than the model takes) are written as error records
    at once: rows/s counts the rows answered, and the table shows the errors (it read
    hundreds of rows/s of nothing)."""
    assert main(["batch", "--quick", "--out", str(tmp_path), "--no-progress",
                 "--contenders", "batch", "--lengths", "9000,9000"]) == 0
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    result = record["results"]["batch"]
    assert result["rows"] == result["errors"] == 200
    assert result["rows_per_s"] == 0.0
    table = next(tmp_path.glob("*.md")).read_text()
    assert "| contender | rows | errors |" in table and "| batch | 200 | 200 |" in table


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the neighbour takes one of 2+ CPUs")
def test_contention_batch_error_rows_are_not_answers(home, tmp_path, capsys):
    """The batch workload took `xrec batch`'s own rows/s, which counts the error records
    written at once for rows the engine refuses: rows longer than the model takes were
    measured as thousands of rows/s. Rows/s counts the rows answered (`answered_per_s`, as
    `xrec bench batch` does), and none answered is an argument error naming the refusal
    (a rate of 0 left busy / idle undefined), not a traceback."""
    assert main(["contention", *TINY, "--out", str(tmp_path), "--workloads", "batch",
                 "--length", "9000", "--beam-width", "4", "--rows", "40", "--rounds", "1"]) == 1
    said = capsys.readouterr().err
    assert "xrec bench contention: error: batch workload: xrec batch answered none of its " \
           "40 rows (the first error record: INVALID_ARGUMENT: " in said, said
    assert not list(tmp_path.glob("*.json"))


def _spinning_children(pid: int) -> list[int]:
    """Processes whose parent is `pid` and that run contention's spinning neighbour."""
    return _children(pid, b"while True")


def _is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGKILL"])
def test_contention_neighbour_ends_with_the_bench(signal_name):
    """Ctrl-C (SIGINT to the bench alone) while the busy neighbour settles, before the
    measuring process starts, or the bench killed outright (a timeout's SIGKILL): the
    neighbour ends with it (it spun on a core after the bench had exited)."""
    import signal
    import subprocess
    import sys
    import time

    script = ("from xrec.bench.contention import _measure_in_fresh_process\n"
              "_measure_in_fresh_process({}, busy=True)\n")
    bench = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.DEVNULL)
    spinners: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while not spinners and bench.poll() is None and time.monotonic() < deadline:
            spinners = _spinning_children(bench.pid)
            time.sleep(0.005)
        assert spinners, "the neighbour never started"
        bench.send_signal(getattr(signal, signal_name))   # the neighbour settles for 0.5 s
        assert bench.wait(timeout=60) != 0
        assert _all_end(spinners[:1], 10.0), "the busy neighbour outlived the bench"
    finally:
        _kill_all(bench, spinners)


def test_a_killed_bench_leaves_no_server(tmp_path):
    """`xrec bench serve` runs `xrec serve` as a child (`server`): a bench killed outright
    (a timeout's SIGKILL) left that server running, holding its port and cores. It is
    started through `module_command` now and ends with the bench."""
    import signal
    import subprocess
    import sys

    from xrec.demo import write_random_model

    model_dir = write_random_model(tmp_path / "model", "tiny", num_items=100)
    script = ("import sys, time\n"
              "from xrec.bench.serve import server\n"
              "with server(sys.argv[1], 1, 1, 'cpu', 120.0) as url:\n"
              "    print(url, flush=True)\n"
              "    time.sleep(600)\n")
    bench = subprocess.Popen([sys.executable, "-c", script, str(model_dir)],
                             stdout=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        assert bench.stdout.readline().startswith("http://127.0.0.1:"), "no server answered"
        children = _children(bench.pid)
        assert children
        bench.send_signal(signal.SIGKILL)
        bench.wait(timeout=60)
        # SIGTERM: the server drains (nothing) and exits
        assert _all_end(children, 30.0), "the server outlived the killed bench"
    finally:
        _kill_all(bench, children)


def _all_end(pids: list[int], timeout_s: float) -> bool:
    """Whether every process of `pids` has ended within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while any(map(_is_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(_is_running, pids))


def _kill_all(bench, pids: list[int]) -> None:
    """A test's cleanup: SIGKILL what still runs of `pids` and of the `bench` process."""
    import signal

    for pid in pids:
        if _is_running(pid):
            os.kill(pid, signal.SIGKILL)
    if bench.poll() is None:
        bench.kill()
        bench.wait()


def _children(pid: int, marker: bytes = b"") -> list[int]:
    """Processes whose parent is `pid` (and whose command line holds `marker`)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            if parent == pid and marker in (stat.parent / "cmdline").read_bytes():
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found

GR_SMALL = ["offline", "--family", "qwen3", "--case", "gr-inference", "--size", "qwen3-sid-test",
            "--contexts", "16,32", "--batches", "1,2", "--beam-width", "8", "--items", "300",
            "--repeats", "2", "--hf-repeats", "1", "--online-requests", "8", "--no-progress"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_offline_gr_inference_case_scaled_down(home, tmp_path, dtype):
    """NVIDIA's gr-inference protocol at a tiny size on the CPU: a row per (context, batch)
    and contender, HF at the first context with batch 1 only, the graphs slot saying why it
    has no number, the online row. Oracles: in float32, xrec's triples are HF generate's
    and its top-1 the float32 engine's; in bfloat16 the agreement is counted from the
    top-1 triples the record holds."""
    assert main([*GR_SMALL, "--dtype", dtype, "--out", str(tmp_path)]) == 0
    files = {p.suffix: p for p in tmp_path.iterdir()}
    assert set(files) == {".json", ".md", ".png"}, files
    record = json.loads(files[".json"].read_text())
    markdown = files[".md"].read_text()
    assert markdown.startswith("## xrec bench offline --case gr-inference (qwen3-sid-test")
    assert record["case"] == "gr-inference" and record["settings"]["dtype"] == dtype
    assert record["settings"]["hf_point"] == [16, 1] and not record["settings"]["has_targets"]
    assert record["model"]["engine_options"]["max_beam_width"] >= 8
    assert [(p["context"], p["batch"]) for p in record["points"]] == \
        [(16, 1), (16, 2), (32, 1), (32, 2)]
    for point in record["points"]:
        rows, batch = point["contenders"], point["batch"]
        is_hf_point = (point["context"], batch) == (16, 1)
        assert list(rows) == ["xrec-graphs", "xrec-eager"] + (["hf"] if is_hf_point else [])
        graphs = rows["xrec-graphs"]
        assert graphs["available"] is False and graphs["reason"].startswith("not available")
        eager = rows["xrec-eager"]
        assert eager["runs"] == 2 and eager["batches"] == 1 and eager["median_ms"] > 0
        assert eager["ms_per_request"] == pytest.approx(eager["median_ms"] / batch)
        assert len(eager["top1"]) == len(point["fp32_top1"]) == batch
        assert eager["top1_vs_fp32"]["equal"] == \
            sum(a == b for a, b in zip(eager["top1"], point["fp32_top1"]))
        assert "target_ms" not in eager   # the targets are the 1.7B protocol's
        if point["context"] == 16:
            hf = record["points"][0]["contenders"]["hf"]
            assert eager["vs_hf_per_request"] == \
                pytest.approx(hf["ms_per_request"] / eager["ms_per_request"])
        if dtype == "float32":
            assert eager["top1_vs_fp32"]["fraction"] == 1.0
        if is_hf_point:
            assert rows["hf"]["runs"] == 1 and len(rows["hf"]["top1"]) == 1
            if dtype == "float32":   # "full" normalisation: HF generate's triples, all of them
                assert eager["overlap_vs_hf"] == {"mean": 1.0, "min": 1.0}
                assert rows["hf"]["top1"] == point["fp32_top1"]
    agreement = record["top1_vs_fp32"]
    assert agreement["requests"] == 6 and agreement["target"] is None
    assert agreement["fraction"] == (1.0 if dtype == "float32" else agreement["equal"] / 6)
    # bfloat16 flips only near-ties of the float32 ranking; a broken path would agree with
    # float32 by chance only (1 in ~300 items)
    assert agreement["fraction"] >= 0.5
    online = record["online"]
    assert online["concurrency"] == 4 and online["sent"] == online["ok"] == 8
    assert online["errors"] == {} and online["throughput_per_s"] > 0
    assert online["p50_ms"] <= online["p99_ms"]


def test_gr_inference_protocol_is_the_default_on_cuda():
    """Without --size, CUDA runs NVIDIA's workload (its targets apply); a CPU the family's
    default size; flags scale the workload down (no targets)."""
    from xrec.bench.cli import build_parser
    from xrec.bench.gr_inference import protocol_of

    def protocol(*flags):
        args = build_parser().parse_args(["offline", "--family", "qwen3", "--case",
                                          "gr-inference", *flags])
        args.is_size_given, args.size = args.size is not None, args.size or "qwen3-sid-tiny"
        return protocol_of(args)

    full = protocol("--device", "cuda")
    assert (full.size, full.dtype, full.beam_width) == ("qwen3-sid-1.7b", "bfloat16", 256)
    assert (full.contexts, full.batches, full.hf_point) == ((1000, 5000), (1, 8), (1000, 1))
    assert full.has_targets and full.contenders == ("xrec-eager", "hf")
    assert full.online_concurrency == 4
    assert protocol("--device", "cuda", "--size", "qwen3-sid-test").size == "qwen3-sid-test"
    assert protocol().size == "qwen3-sid-tiny" and not protocol().has_targets
    small = protocol("--device", "cuda", "--beam-width", "8", "--contexts", "16", "--batches", "2,4")
    assert small.hf_point == (16, 2) and not small.has_targets
    with pytest.raises(ValueError, match="xrec-eager"):
        protocol("--contenders", "hf")


def test_offline_gr_inference_case_refuses_the_encoder_decoder_family(home, tmp_path, capsys):
    assert main(["offline", "--case", "gr-inference", "--out", str(tmp_path)]) == 1
    assert "--family qwen3" in capsys.readouterr().err


# ---- pieces ----------------------------------------------------------------------------------

def test_trie_and_allowed_tokens():
    import torch

    trie = build_trie(np.array([[3, 1, 2], [3, 1, 0], [0, 5, 5], [3, 1, 2]]))
    assert trie == {(): [0, 3], (0,): [5], (3,): [1], (0, 5): [5], (3, 1): [0, 2]}
    allowed = prefix_allowed_tokens(trie, vocab_size=6, start=1)
    assert allowed(0, torch.tensor([0, 3, 1])) == [0, 2]       # decoder start, then the prefix
    assert allowed(0, torch.tensor([0])) == [0, 3]
    assert allowed(0, torch.tensor([0, 4])) == list(range(6))   # outside the catalog
    after_prompt = prefix_allowed_tokens(trie, vocab_size=6, start=3)   # a decoder-only prompt of 3
    assert after_prompt(0, torch.tensor([5, 5, 4, 3, 1])) == [0, 2]
    assert after_prompt(0, torch.tensor([5, 5, 4])) == [0, 3]


def test_overlap():
    a = [[(1, 1, 1), (2, 2, 2)], [(1, 2, 3), (3, 2, 1)]]
    b = [[(2, 2, 2), (1, 1, 1)], [(1, 2, 3), (9, 9, 9)]]
    assert overlap(a, b) == {"mean": 0.75, "min": 0.5}


def test_statistics():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0], 100) == 2.0
    row = summarize([0.2, 0.1, 0.3], [0.1] * 3 + [0.2] * 3, num_requests=4)
    assert row["median_ms"] == pytest.approx(200.0) and row["requests_per_s"] == pytest.approx(20.0)
    assert markdown_table(["a", "b"], [[1, 0.12345]]).splitlines()[2] == "| 1 | 0.123 |"


def test_runs_in_the_same_second_keep_their_own_outputs(tmp_path):
    """Output names carry the second the run ended: a second run ending in the same second
    wrote over the first one's JSON and Markdown."""
    written = []
    for run in (1, 2):
        paths = output_paths(tmp_path, "offline")
        write_outputs(paths, {"run": run}, lambda record: f"## run {record['run']}")
        written.append(paths)
    assert written[0]["json"] != written[1]["json"]
    for run, paths in enumerate(written, 1):
        assert json.loads(paths["json"].read_text()) == {"run": run}
        assert paths["md"].read_text() == f"## run {run}\n"


def test_a_plot_that_fails_loses_no_results(tmp_path):
    """The JSON file is claimed when the paths are chosen; the plot ran before the results
    were written, so a plot that raised left that file empty and lost the measurement."""
    paths = output_paths(tmp_path, "offline")

    def failing_plot(path):
        raise RuntimeError("the plot failed")

    with pytest.raises(RuntimeError, match="the plot failed"):
        write_outputs(paths, {"run": 1}, lambda record: "## run 1", draw=failing_plot)
    assert json.loads(paths["json"].read_text()) == {"run": 1}
    assert paths["md"].read_text() == "## run 1\n"


def test_poisson_arrivals_and_load_summary():
    times = arrivals(rate=50.0, duration_s=20.0, seed=1)
    assert np.all(np.diff(times) > 0) and times[-1] < 20.0
    assert 800 < len(times) < 1200                      # 1000 expected
    sent = [Sent("small", 0.0, 0.1, 200), Sent("large", 0.5, 1.5, 200), Sent("small", 1.0, 2.0, 503)]
    row = summarize_load(sent, offered=2.0)
    assert row["ok"] == 2 and row["errors"] == {"503": 1}
    assert row["throughput_per_s"] == pytest.approx(1.0)
    assert row["small_p50_ms"] == pytest.approx(100.0) and row["large_p99_ms"] == pytest.approx(1000.0)


def test_hf_export_refuses_grouped_kv_heads():
    from xrec.realdata.train.hf_models import hf_t5_config
    from xrec.config import MODEL_SIZES

    with pytest.raises(ValueError, match="grouped kv heads"):
        hf_t5_config(MODEL_SIZES["tiny"])
