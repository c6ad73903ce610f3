"""`xrec batch`'s output directory and what `--resume` accepts (xrec.scale.batch, rows):
the records' ids in a typed column, the identity a resumed run must share, the lock that
keeps a directory to one run, the files a kill leaves. Real files, a real engine; no Ray
(both paths share these functions; tests/test_ray.py runs the Ray path itself).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
import uuid
from pathlib import Path

import numpy as np
import pytest

from test_batch import (OPTIONS, SETTINGS, VOCAB, WAIT_S, engine, job, model_dir,  # fixtures too
                        token_rows, write_jsonl)

from xrec.scale import batch, rows
from xrec.scale.batch import MANIFEST, part_name, run_batch, write_manifest
from xrec.scale.rows import InputInfo, read_output

def no_model_load(*args, **kwargs):
    raise AssertionError("the model was loaded: the job should have been refused before")


def listing(directory: Path) -> list[tuple[str, int]]:
    return sorted((p.name, p.stat().st_mtime_ns) for p in directory.iterdir())


# ---- thread count: part of the identity -------------------------------------------------------

def test_adaptive_threads_is_resolved_into_the_identity(tmp_path, model_dir, engine, monkeypatch):
    """The engine's default (adaptive threads, unless XREC_ADAPTIVE_THREADS=0) was left
    unset, so the manifest did not say whether the thread count followed the machine's load,
    and a --resume under the other setting was accepted, mixing records of both."""
    source = write_jsonl(tmp_path / "in.jsonl", token_rows(4))
    monkeypatch.setenv("XREC_ADAPTIVE_THREADS", "1")
    run_batch(job(tmp_path, model_dir, source, chunk_rows=2), engine)
    manifest = json.loads((tmp_path / "out" / MANIFEST).read_text())
    assert manifest["job"]["engine_options"]["adaptive_threads"] is True
    monkeypatch.setenv("XREC_ADAPTIVE_THREADS", "0")
    assert job(tmp_path, model_dir, source).options()["adaptive_threads"] is False
    with pytest.raises(ValueError, match=r"written by a different run \(engine_options differ\)"):
        run_batch(job(tmp_path, model_dir, source, chunk_rows=2, resume=True), engine)
    same = run_batch(job(tmp_path, model_dir, source, chunk_rows=2, resume=True,
                         engine_options={**OPTIONS, "adaptive_threads": True}), engine)
    assert (same.num_rows, same.num_skipped) == (0, 4)


# ---- what --resume accepts -------------------------------------------------------------------

def test_resume_refuses_the_output_of_a_ray_run(tmp_path, model_dir, engine):
    """A --ray run's output (parts part-NNNNNN-<write uuid>, a manifest with a "ray" key):
    --resume without --ray took its parts for uncounted ones and deleted every one."""
    source = write_jsonl(tmp_path / "in.jsonl", token_rows(6))
    run_batch(job(tmp_path, model_dir, source, chunk_rows=2), engine)
    out = tmp_path / "out"
    write_uuid = uuid.uuid4().hex
    for part in sorted(out.glob("part-*.jsonl")):   # what batch_ray's PartNames writes
        part.rename(out / f"{part.stem}-{write_uuid}.jsonl")
    manifest = json.loads((out / MANIFEST).read_text())
    write_manifest(out, manifest["job"], 3, 6, True, ray={"actors": 1, "actor_cpus": 1.0})
    before, records = listing(out), read_output(out)
    with pytest.raises(ValueError, match=r"written by a --ray run, which is not resumable .* "
                                         r"give --overwrite to write it again"):
        run_batch(job(tmp_path, model_dir, source, chunk_rows=2, resume=True), engine)
    assert listing(out) == before and read_output(out) == records


def test_resume_refuses_a_model_or_catalog_changed_in_place(tmp_path, model_dir, engine):
    """The identity named the model directory and the catalog by path only: weights or a
    catalog rewritten there were resumed with, the output mixing two models' answers."""
    model = Path(shutil.copytree(model_dir, tmp_path / "model"))
    catalog = Path(shutil.copy(model / "items.bin", tmp_path / "catalog.bin"))
    source = write_jsonl(tmp_path / "in.jsonl", token_rows(2))

    def resume(out: str, **kwargs) -> None:
        run_batch(job(tmp_path, model, source, out=out, resume=True, **kwargs), engine)

    run_batch(job(tmp_path, model, source, out="a"), engine)
    run_batch(job(tmp_path, model, source, out="b", catalog=str(catalog)), engine)
    resume("a")                                     # unchanged: nothing to do
    touch(catalog)
    with pytest.raises(ValueError, match=r"different run \(catalog_file differ\)"):
        resume("b", catalog=str(catalog))
    resume("a")
    touch(model / "model.safetensors")
    with pytest.raises(ValueError, match=r"different run \(model_files differ\)"):
        resume("a")


def touch(path: Path) -> None:
    """A file rewritten in place, as far as its stat tells: same size, a later mtime."""
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1000))


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
@pytest.mark.parametrize("damage", ["missing", "empty", "cut"])
def test_resume_writes_a_counted_part_that_is_not_whole_again(tmp_path, model_dir, engine, fmt,
                                                               damage):
    """--resume trusted the manifest's count: a counted part that was missing, empty or cut
    short (a copy cut short, a power loss before parts were fsynced) was kept, the run said it
    had finished, and the output lacked those rows or held a part no reader opens. That part
    and every one after it are written again."""
    source = write_jsonl(tmp_path / "in.jsonl", token_rows(10))
    run_batch(job(tmp_path, model_dir, source, chunk_rows=3, output_format=fmt), engine)
    out = tmp_path / "out"
    full = read_output(out)
    part = out / part_name(1, fmt)
    if damage == "missing":
        part.unlink()
    else:
        part.write_bytes(b"" if damage == "empty" else part.read_bytes()[:-7])
    resumed = run_batch(job(tmp_path, model_dir, source, chunk_rows=3, output_format=fmt,
                            resume=True), engine)
    assert (resumed.num_rows, resumed.num_skipped) == (7, 3)
    assert read_output(out) == full
    assert json.loads((out / MANIFEST).read_text())["is_complete"]


def test_resume_inside_a_parquet_row_group_reads_every_later_group(tmp_path, model_dir, engine):
    """A resumed Parquet input skipped whole row groups before the first chunk to write again,
    but also every later group smaller than the rows skipped inside the first one read (a
    short last group): from chunk 1 of 3 rows, groups of 10 + 1 rows gave rows 2..9 (row 2
    twice) and lost row 10. Every group from the first one read is read now."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.Table.from_pylist(token_rows(11)), tmp_path / "in.parquet",
                   row_group_size=10)
    source = tmp_path / "in.parquet"
    run_batch(job(tmp_path, model_dir, source, chunk_rows=3), engine)
    out = tmp_path / "out"
    full = read_output(out)
    (out / part_name(1, "parquet")).unlink()   # written again, with every part after it
    resumed = run_batch(job(tmp_path, model_dir, source, chunk_rows=3, resume=True), engine)
    assert (resumed.num_rows, resumed.num_skipped) == (8, 3)
    assert [r["id"] for r in read_output(out)] == list(range(11))
    assert read_output(out) == full


# ---- the directory is one run's ----------------------------------------------------------------

def test_a_second_run_on_a_held_output_fails_at_once(tmp_path, model_dir, engine):
    """Two runs on one directory lost rows: a --resume deleted the part the other had
    renamed but not yet counted. A real `xrec batch` is stopped (SIGSTOP) once it has written
    its first manifest; a run on its output then fails at once and touches nothing."""
    source = write_jsonl(tmp_path / "in.jsonl", token_rows(20))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "xrec", "batch", "--input", str(source), "--output",
               str(out), "--model", str(model_dir), "--beam-width", "4", "--chunk-rows", "2",
               "--num-threads", "1", "--no-progress"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and process.poll() is None \
                and not (out / MANIFEST).exists():
            time.sleep(0.005)
        process.send_signal(signal.SIGSTOP)
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        before = listing(out)
        for flags in ({"resume": True}, {"overwrite": True}):
            with pytest.raises(ValueError, match="another xrec batch run is writing it"):
                run_batch(job(tmp_path, model_dir, source, chunk_rows=2, **flags), engine)
        assert listing(out) == before
    finally:
        process.kill()
        process.wait(WAIT_S)
        process.stderr.close()
    run_batch(job(tmp_path, model_dir, source, chunk_rows=2, resume=True), engine)
    assert [r["id"] for r in read_output(out)] == list(range(20))


def test_a_manifest_torn_by_a_kill_is_xrec_batchs_own(tmp_path, model_dir, engine):
    """A kill while the manifest was written left `._xrec_batch.json.tmp`: --overwrite
    refused it as a stranger's file and a plain run called the directory not empty."""
    rows_ = token_rows(4)
    source = write_jsonl(tmp_path / "in.jsonl", rows_)
    torn = f".{MANIFEST}.tmp"
    (tmp_path / "first").mkdir()                    # killed while writing its first manifest
    (tmp_path / "first" / torn).write_text('{"job": {"inp')
    run_batch(job(tmp_path, model_dir, source, out="first", chunk_rows=2), engine)
    assert [r["id"] for r in read_output(tmp_path / "first")] == [0, 1, 2, 3]
    (tmp_path / "first" / torn).write_text('{"job": {"inp')   # killed later: replaced
    run_batch(job(tmp_path, model_dir, source, out="first", chunk_rows=2, overwrite=True), engine)
    assert not (tmp_path / "first" / torn).exists()
    (tmp_path / "first" / torn).write_text('{"job": {"inp')   # and resumed: deleted
    run_batch(job(tmp_path, model_dir, source, out="first", chunk_rows=2, resume=True), engine)
    assert not (tmp_path / "first" / torn).exists()
    assert [r["id"] for r in read_output(tmp_path / "first")] == [0, 1, 2, 3]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_part_is_on_disk_before_the_manifest_counts_it(tmp_path, model_dir, engine, monkeypatch,
                                                         fmt):
    """A Parquet part was renamed into place, and counted by the fsynced manifest, without its
    data ever being fsynced (and no rename made durable): after a power loss the manifest could
    count an empty part, which --resume keeps. Now each part's data, then its name (the
    directory), reach the disk before the manifest that counts it is renamed into place."""
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    source = write_jsonl(tmp_path / "in.jsonl", token_rows(5))
    run_batch(job(tmp_path, model_dir, source, chunk_rows=2, output_format=fmt), engine)
    for chunk in range(3):
        name = part_name(chunk, fmt)
        renamed = events.index(("replace", name))
        counted = events.index(("replace", MANIFEST), renamed)
        assert events[renamed - 1] == ("fsync", f".{name}.tmp")
        assert ("fsync", "out") in events[renamed:counted]
    assert events[-1] == ("fsync", "out")   # the last manifest's rename too


def test_more_chunks_than_part_names_sort_is_refused(tmp_path, model_dir, monkeypatch):
    """part-{chunk:06d}: part-1000000 sorts before part-200000, and readers of the directory
    (read_output, Spark, pyarrow datasets) get the rows out of order."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    num_rows = 1_000_000
    tokens = pa.ListArray.from_arrays(pa.array(np.arange(num_rows + 1, dtype=np.int32)),
                                      pa.array(np.ones(num_rows, dtype=np.int64)))
    pq.write_table(pa.table({"id": np.arange(num_rows), "token_ids": tokens}),
                   tmp_path / "in.parquet")
    monkeypatch.setattr(batch, "load_engine", no_model_load)
    with pytest.raises(ValueError, match="--chunk-rows 1: 1000000 rows make 1000000 chunks, "
                                         "more than the 999999 part files an output holds; "
                                         "give --chunk-rows 2 or more"):
        run_batch(job(tmp_path, model_dir, tmp_path / "in.parquet", chunk_rows=1))
    assert not (tmp_path / "out").exists()
    info = InputInfo(str(tmp_path / "in.parquet"), "parquet", "token_ids", 999_999, ("id",))
    assert job(tmp_path, model_dir, info.path, chunk_rows=1).num_chunks(info) == 999_999


# ---- ids in a typed column -----------------------------------------------------------------

def test_jsonl_ids_that_do_not_fit_an_int64_column_are_error_records(tmp_path, model_dir, engine):
    """JSONL in, Parquet out: the first row's integer id types the column int64. A later
    string, boolean or too large id failed the whole run (and every --resume), a float id
    was truncated. Each is now that row's error record."""
    pq = pytest.importorskip("pyarrow.parquet")
    rows_ = token_rows(9)
    bad = {2: "user-2", 3: 3.5, 4: True, 5: 2 ** 63, 6: [6], 7: "x" * 100}
    for index, row_id in bad.items():
        rows_[index]["id"] = row_id
    source = write_jsonl(tmp_path / "in.jsonl", rows_)
    summary = run_batch(job(tmp_path, model_dir, source, chunk_rows=3, output_format="parquet"),
                        engine)
    assert (summary.num_rows, summary.num_errors) == (9, 6)
    got = read_output(tmp_path / "out")
    assert [r["id"] for r in got] == [0, 1, None, None, None, None, None, None, 8]
    why = ("but the first row's id typed the output's id column as integers (int64); write "
           "JSONL output (--output-format jsonl) or give every row an integer id")
    assert [r["error"] for r in got[2:8]] == [f"INVALID_ARGUMENT: id {shown} is {what}, {why}" for
                                              shown, what in [
        ("'user-2'", "a string"), ("3.5", "a float"), ("True", "a boolean"),
        ("9223372036854775808", "an integer out of int64's range"), ("[6]", "a list"),
        ("'" + "x" * 36 + "...", "a string")]]
    assert all(r["tokens"] == [] for r in got[2:8])
    assert str(pq.read_table(tmp_path / "out" / part_name(0, "parquet")).schema.field("id").type) \
        == "int64"
    as_jsonl = run_batch(job(tmp_path, model_dir, source, out="jsonl", chunk_rows=3), engine)
    assert as_jsonl.num_errors == 0
    assert [r for r in got if r["id"] is not None] == \
        [r for r in read_output(tmp_path / "jsonl") if type(r["id"]) is int and r["id"] < 2 ** 63]


def test_ids_past_64_bits_and_non_finite_ids_are_error_records(tmp_path, model_dir, engine):
    """orjson reads a JSON integer past 64 bits as the nearest float: two such ids were both
    answered under one float id that neither row had. A Parquet NaN or infinite id was
    answered with id null in JSONL output. Each is now that row's error record."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    big = 12345678901234567890123
    (tmp_path / "in.jsonl").write_text(
        f'{{"id": {big}, "token_ids": [1]}}\n{{"id": {big + 1}, "token_ids": [2]}}\n'
        f'{{"id": {2 ** 64 - 1}, "token_ids": [3]}}\n{{"id": 1e20, "token_ids": [4]}}\n')
    run_batch(job(tmp_path, model_dir, tmp_path / "in.jsonl"), engine)
    got = read_output(tmp_path / "out")
    assert [r["id"] for r in got] == [None, None, 2 ** 64 - 1, 1e20]
    assert [r["error"] for r in got] == [
        f"INVALID_ARGUMENT: id {i} is an integer out of the range ids are read in "
        "[-2**63, 2**64 - 1]; give it as a JSON string" for i in (big, big + 1)] + [None, None]
    pq.write_table(pa.table({"id": [1.0, float("nan"), -float("inf")], "token_ids": [[1], [2], [3]]}),
                   tmp_path / "in.parquet")
    run_batch(job(tmp_path, model_dir, tmp_path / "in.parquet", out="nan", output_format="jsonl"),
              engine)
    assert [(r["id"], r["error"]) for r in read_output(tmp_path / "nan")] == [
        (1.0, None), (None, "INVALID_ARGUMENT: id nan is not a finite number"),
        (None, "INVALID_ARGUMENT: id -inf is not a finite number")]


@pytest.mark.parametrize("kind", ["binary", "decimal128(20, 0)", "timestamp[ns]"])
def test_parquet_ids_jsonl_cannot_hold_are_refused_before_the_model_loads(tmp_path, model_dir,
                                                                         monkeypatch, kind):
    """Parquet in, JSONL out: an id column orjson cannot write passed the checks, the model
    loaded, the first chunk ran, and the writer failed the run (every --resume too)."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    ids = {"binary": pa.array([b"u1", b"u2"]), "decimal128(20, 0)": pa.array(
        [1, 2], pa.decimal128(20, 0)), "timestamp[ns]": pa.array([1, 2], pa.timestamp("ns"))}
    pq.write_table(pa.table({"id": ids[kind], "token_ids": [[1, 2], [3]]}), tmp_path / "in.parquet")
    monkeypatch.setattr(batch, "load_engine", no_model_load)
    with pytest.raises(ValueError, match=re.escape(
            f"id column 'id' is {kind}; JSONL output takes integer, float, boolean or string ids; "
            "write Parquet output (--output-format parquet)")):
        run_batch(job(tmp_path, model_dir, tmp_path / "in.parquet", output_format="jsonl"))
    assert not (tmp_path / "out").exists()


def test_parquet_string_ids_still_make_jsonl(tmp_path, model_dir, engine):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    ids = pa.array(["a", "b", "c"]).dictionary_encode()
    pq.write_table(pa.table({"id": ids, "token_ids": [[1, 2], [3], [4]]}), tmp_path / "in.parquet")
    run_batch(job(tmp_path, model_dir, tmp_path / "in.parquet", output_format="jsonl"), engine)
    assert [(r["id"], r["error"]) for r in read_output(tmp_path / "out")] == \
        [("a", None), ("b", None), ("c", None)]


# ---- counting a --ray run's errors --------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_count_errors_holds_one_part_at_a_time(tmp_path, fmt):
    """batch_ray counted a run's errors with read_output: every record of the output in the
    driver's memory at once. Its peak (Python objects, tracemalloc) now stays under what the
    records of two part files take."""
    schema = None
    if fmt == "parquet":
        schema = rows.output_schema(pytest.importorskip("pyarrow").int64())
    out, one = tmp_path / "out", tmp_path / "one"
    out.mkdir()
    one.mkdir()
    num_errors = 0
    for chunk in range(8):
        records = [rows.error_record(None, "INVALID_ARGUMENT", "bad") if i % 7 == 0 else
                   {"id": chunk * 2000 + i, "tokens": [[1, 2, 3]] * 4, "scores": [-1.5] * 4,
                    "items": [[7, 8]] * 4, "error": None} for i in range(2000)]
        num_errors += sum(r["error"] is not None for r in records)
        rows.write_records(out / part_name(chunk, fmt), records, fmt, schema)
    shutil.copy(out / part_name(0, fmt), one)
    write_manifest(out, {}, 8, 16000, True, ray={"actors": 1, "actor_cpus": 1.0})

    def peak(function, *args) -> tuple[int, int]:
        function(*args)   # warm: imports, caches
        tracemalloc.start()
        try:
            return function(*args), tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    _, one_part = peak(read_output, one)
    count, counting = peak(rows.count_errors, out)
    assert count == num_errors
    assert counting < 2 * one_part, (counting, one_part)
