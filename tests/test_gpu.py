"""CUDA: the same engine on the GPU (float32) returns the CPU's results, with concurrent
pipelines on their own streams, for both model families. Skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xrec import Engine, RecRequest
from xrec.demo import write_random_model

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module", params=["tiny", "qwen3-sid-test"])
def model_dir(request, tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("gpu"), request.param, seed=2, num_items=500)


def _requests():
    rng = np.random.default_rng(0)
    return [RecRequest(token_ids=rng.integers(0, 64, 5 + i).tolist(), beam_width=16,
                       normalize="full" if i % 2 else "allowed") for i in range(8)]


def test_cuda_results_equal_cpu_results(model_dir):
    with Engine.from_pretrained(model_dir, isolation="thread", device="cpu") as engine:
        expected = engine.recommend(_requests())
    with Engine.from_pretrained(model_dir, isolation="thread",
                                device="cuda", dtype="float32", max_concurrency=2,
                                max_seqs_per_batch=2) as engine:
        actual = engine.recommend(_requests())
    for a, e in zip(actual, expected):
        assert [c.tokens for c in a.results] == [c.tokens for c in e.results]
        np.testing.assert_allclose([c.score for c in a.results], [c.score for c in e.results],
                                   atol=1e-4)


def test_cuda_bfloat16_serves(model_dir):
    with Engine.from_pretrained(model_dir, isolation="thread",
                                device="cuda") as engine:   # auto dtype: bfloat16
        responses = engine.recommend(_requests())
    assert all(r.results for r in responses)


def test_cuda_graphs_replay_the_eager_answers(model_dir):
    """Option cuda_graphs (search/graphs.py): batches of one bucket on 2 pipelines, captured
    and replayed, answer as the eager engine does; the counters say graphs ran."""
    rng = np.random.default_rng(3)
    batches = [[RecRequest(token_ids=rng.integers(0, 64, 6).tolist(), beam_width=16)
                for _ in range(2)] for _ in range(8)]
    answers = {}
    for graphs in (False, True):
        with Engine.from_pretrained(model_dir, isolation="thread", device="cuda", dtype="float32",
                                    max_concurrency=2, max_seqs_per_batch=2,
                                    cuda_graphs=graphs) as engine:
            answers[graphs] = [engine.recommend(batch) for batch in batches]
            stats = engine.stats()
        if graphs:
            assert stats.graph_captures >= 1 and stats.graph_replays >= 1, stats
        else:
            assert (stats.graph_captures, stats.graph_replays) == (0, 0)
    for got, want in zip(answers[True], answers[False]):
        for a, e in zip(got, want):
            assert [c.tokens for c in a.results] == [c.tokens for c in e.results]
            np.testing.assert_allclose([c.score for c in a.results], [c.score for c in e.results],
                                       atol=1e-5)
