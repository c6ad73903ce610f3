"""The whole suite: dtype "auto" pinned to float32 on CPUs, and fixed thread counts (below).

Under `make mutate` only: each mutant runs the tests of its own module, fastest first.

mutmut gives each mutant every selected test that called the mutated function, as an
unordered set, and stops at the first failure (-x). A model function is called by every
search and engine test too, which made a full run take hours; its own module's tests
(the HF oracles, the naive reference, the contracts) are the ones meant to catch it.
So the tests of a mutant outside its module's files (TESTS_OF) are deselected (unless
that leaves none), and the rest run with modules contiguous (their module-scoped
fixtures are built once), ordered by their fastest test, then by duration in mutmut's
stats run. A normal run (no MUTANT_UNDER_TEST in the environment) is left alone.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

# dtype "auto" means float32 on every CPU in the tests (child processes inherit it), so that
# results do not depend on whether the machine has native bfloat16 (xrec.model.dtype); the
# tests of bfloat16 name it. Kept if the caller set it.
os.environ.setdefault("XREC_CPU_AUTO_DTYPE", "float32")
# Thread counts stay as configured whatever the machine's load (xrec.engine.threads), so that
# results do not depend on what else the machine runs; the tests of adaptive threads turn it on.
os.environ.setdefault("XREC_ADAPTIVE_THREADS", "0")
# `make test` runs the suite on 2 pytest-xdist workers (whole files each): a worker computes
# on one intra-op thread (children inherit it) unless OMP_NUM_THREADS was set. Two workers of
# 2 threads on 2 cores spun their OpenMP teams against each other: 538 s against 442 s for
# the cold suite (docs/decisions.md, "The suite on two workers"). Tests about threads name
# their counts.
if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    torch.set_num_threads(1)
# Element-wise chains run eagerly unless a test asks for fused ones (option fused_kernels):
# compiling them costs seconds per engine (xrec.model.fusion).
os.environ.setdefault("XREC_FUSED_KERNELS", "0")
# One float32 library for every process of the run (xrec.model.gemm decides by measuring,
# once per process): where MKL and oneDNN tie (an Intel CPU with AMX), two processes may
# choose differently, and results that must agree across processes (a killed training
# run resumed by another) then differ by float32 rounding. Kept if the caller set it; the
# tests of the choice set their own.
if "XREC_CPU_GEMM" not in os.environ:
    from xrec.model.gemm import cpu_fp32_gemm
    os.environ["XREC_CPU_GEMM"] = cpu_fp32_gemm()

STATS = Path("mutmut-stats.json")   # mutmut runs the tests inside mutants/
# mutant name prefix -> the test files that speak for that module
TESTS_OF = (
    ("xrec.catalog.filters.", ("test_filters.py",)),
    ("xrec.search.filters.", ("test_filters.py",)),
    ("xrec.model.", ("test_contracts_model.py", "test_model.py", "test_xattention.py",
                     "test_qwen.py")),
    ("xrec.search.", ("test_contracts_search.py", "test_search.py", "test_workspace.py",
                      "test_xattention.py")),
    ("xrec.catalog", ("test_contracts_catalog.py", "test_catalog.py", "test_catalog_import.py")),
    # the engine's front (validation, responses) is what the Python API tests speak for
    ("xrec.engine.engine.", ("test_engine.py", "test_api.py")),
    ("xrec.engine.frontend.", ("test_engine.py", "test_api.py")),
    ("xrec.engine.responses.", ("test_engine.py", "test_api.py")),
    ("xrec.engine.", ("test_scheduler.py", "test_engine.py", "test_deadlines.py")),
    ("xrec.server.schemas", ("test_contracts_schemas.py",)),
)


def _module(item) -> str:
    return item.nodeid.split("::", 1)[0]


# The longest files, longest first (seconds of each file's tests on 2 workers of an AVX2-only
# AMD EPYC, family 23, 2026-12-07, with engine children from the fork server). `make test` hands whole files to its 2 workers in
# collection order (`--no-loadscope-reorder`; pytest-xdist's default orders them by their
# number of tests, which put the files of one or a few long tests, ML-100k's 91 s, last,
# where one worker could run them while the other had nothing left). Longest first, the
# short files fill both workers' last minutes: a replay of the measured times through
# xdist's scheduler gave the busier worker 690 s against 740; the suite itself read within
# its noise (docs/decisions.md, "On an AVX2-only Zen 1 the suite is over the line").
LONGEST_FIRST = ("test_fusion.py", "test_ray.py", "test_train_precision.py",
                 "test_realdata_ml100k.py", "test_bench.py", "test_train.py",
                 "test_server_hostile.py", "test_isolation.py", "test_engine_exit.py",
                 "test_batch.py", "test_realdata_inputs.py", "test_sasrec.py")


def _longest_first(items) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(_module(item).rsplit("/", 1)[-1], len(rank)))


def pytest_collection_modifyitems(config, items) -> None:
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if not mutant or not STATS.is_file():
        _longest_first(items)   # a stable sort: each file's tests keep their order
        return
    files = next((files for prefix, files in TESTS_OF if mutant.startswith(prefix)), None)
    if files is not None:
        own = [item for item in items if _module(item).rsplit("/", 1)[-1] in files]
        if own and len(own) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in own])
            items[:] = own
    duration = json.loads(STATS.read_text()).get("duration_by_test", {})
    seconds = {item.nodeid: duration.get(item.nodeid, 0.0) for item in items}
    fastest: dict[str, float] = {}
    for item in items:
        fastest[_module(item)] = min(fastest.get(_module(item), float("inf")), seconds[item.nodeid])
    items.sort(key=lambda item: (fastest[_module(item)], _module(item), seconds[item.nodeid]))
