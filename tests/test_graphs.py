"""Captured decode rounds (search/graphs.py) on a CPU: the graph code path with the
`EagerReplay` backend, which runs the rounds again on the captured (static) inputs. What a
CUDA graph adds to it, replaying kernels instead of running Python, is covered by
tests/test_gpu.py where a GPU is present.

* Batches of one bucket: the first runs eagerly, the second is captured, the rest replay,
  and every answer equals the step's without graphs (a value that bypassed the static
  inputs would give the captured batch's answer instead).
* Buckets follow the shapes and host settings: another beam width or a filter is
  another bucket; at most `max_graphs`, least recently used dropped.
* Inputs padded to `padded_len` give the answers of the unpadded batch.
* Through an engine: a catalog reload drops the graphs and captures again, and the
  counters reach `stats()`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_capturable import step_batch
from xrec import Engine, RecRequest
from xrec.config import EngineOptions, MODEL_SIZES
from xrec.catalog.sid_vocab import random_catalog_of_size
from xrec.model.random_init import random_model
from xrec.search.graphs import DecodeGraphs, EagerReplay, flatten
from xrec.search.step import RecStep
from xrec.search.workspace import padded_len
from xrec.search.workspace_buffers import Workspace

CPU = torch.device("cpu")


def requests_of(seed: int, num: int = 2, beam_width: int = 6, length: int = 6, **extra):
    rng = np.random.default_rng(seed)
    return [RecRequest(token_ids=rng.integers(0, 64, length + i % 2).tolist(), beam_width=beam_width,
                       **extra) for i in range(num)]


@pytest.fixture(scope="module", params=["tiny", "qwen3-sid-test"])
def setup(request):
    size = request.param
    config = MODEL_SIZES[size]
    catalog = random_catalog_of_size(size, config.vocab_size, 400, seed=3)
    return config, catalog, RecStep(random_model(config, seed=2), catalog.constraint_tables())


def assert_same(got, want):
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.scores, want.scores)
    np.testing.assert_array_equal(got.token_logprobs, want.token_logprobs)


def test_batches_of_one_bucket_replay_with_their_own_answers(setup):
    config, catalog, step = setup
    graphs, workspace = DecodeGraphs(EagerReplay()), Workspace(CPU)
    answers = []
    for seed in range(4):
        batch = step_batch(requests_of(seed), config, catalog)
        got = step.run(batch, workspace, graphs=graphs)
        assert_same(got, step.run(batch, Workspace(CPU)))
        answers.append(got.tokens)
        assert (graphs.num_captures, graphs.num_replays) == [(0, 0), (1, 0), (1, 1), (1, 2)][seed]
    assert not np.array_equal(answers[2], answers[3])   # two replays, two different answers
    assert not np.array_equal(answers[1], answers[2])   # the replay is not the captured batch


def test_a_replay_stops_before_its_rounds_like_an_eager_batch(setup):
    config, catalog, step = setup
    graphs, workspace = DecodeGraphs(EagerReplay()), Workspace(CPU)
    batch = step_batch(requests_of(0), config, catalog)
    for _ in range(2):
        step.run(batch, workspace, graphs=graphs)
    seen = []

    def before_round(round_index):
        seen.append(round_index)
        if round_index == 2:
            raise TimeoutError("stop")

    with pytest.raises(TimeoutError):
        step.run(batch, workspace, before_round, graphs)
    assert seen == [0, 1, 2] and graphs.num_replays == 0


def test_buckets_follow_shapes_and_settings_and_stay_bounded(setup):
    config, catalog, step = setup
    graphs, workspace = DecodeGraphs(EagerReplay(), max_graphs=2), Workspace(CPU)
    kinds = [dict(beam_width=6), dict(beam_width=4), dict(beam_width=6, temperature=0.5),
             dict(beam_width=6, exclude_items=catalog.item_ids[:5].tolist())]
    keys = []
    for kind in kinds:
        for seed in range(2):
            batch = step_batch(requests_of(seed, **kind), config, catalog)
            assert_same(step.run(batch, workspace, graphs=graphs), step.run(batch, Workspace(CPU)))
        keys.append(flatten(step.first_round(batch, Workspace(CPU)))[1])
    assert len(set(keys)) == len(kinds)
    assert graphs.num_captures == len(kinds) and graphs.num_graphs == 2
    batch = step_batch(requests_of(5, **kinds[0]), config, catalog)   # dropped: eager again
    assert_same(step.run(batch, workspace, graphs=graphs), step.run(batch, Workspace(CPU)))
    assert graphs.num_replays == 0


@pytest.mark.parametrize("lengths", [(5, 5, 5), (3, 9, 6)])
def test_padded_inputs_give_the_unpadded_answers(setup, lengths):
    config, catalog, step = setup
    rng = np.random.default_rng(7)
    requests = [RecRequest(token_ids=rng.integers(0, 64, n).tolist(), beam_width=8,
                           num_return_sequences=5) for n in lengths]
    plain = step_batch(requests, config, catalog)
    padded = step_batch(requests, config, catalog, pad_lengths=True)
    assert padded.inputs.token_ids.shape[1] == padded_len(max(lengths)) > max(lengths)
    got, want = step.run(padded), step.run(plain)
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.scores, want.scores, rtol=1e-5, atol=1e-5)


def test_padded_len():
    assert [padded_len(n) for n in (1, 8, 9, 100, 151, 256, 257, 1000, 4097)] == \
        [8, 8, 16, 104, 160, 256, 288, 1024, 4608]
    assert padded_len(151, pad=False) == 151
    assert all(n <= padded_len(n) <= n + max(7, n // 8) for n in range(1, 5000))


def test_engine_recaptures_after_a_catalog_reload():
    """Through an engine's pipeline (the executor's `make_graphs` seam with the CPU backend):
    answers equal an engine without graphs on the same catalog, before and after a reload;
    the reload drops the graphs and the next batches capture again."""
    config = MODEL_SIZES["tiny"]
    first = random_catalog_of_size("tiny", config.vocab_size, 300, seed=1)
    second = random_catalog_of_size("tiny", config.vocab_size, 300, seed=9)
    options = dict(device="cpu", max_concurrency=1, dtype="float32")
    model = random_model(config, seed=4)
    with Engine(model, first, EngineOptions(**options)) as graphed, \
            Engine(model, first, EngineOptions(**options)) as plain:
        graphed.executor.make_graphs = lambda: DecodeGraphs(EagerReplay())
        for round_index in range(2):
            for seed in range(3):
                requests = requests_of(seed, num=2)
                got, want = graphed.recommend(requests), plain.recommend(requests)
                assert [[c.tokens for c in r.results] for r in got] == \
                    [[c.tokens for c in r.results] for r in want]
                # scores to float32 rounding: the graphs run padded shapes, and a product's
                # library may block (and so round) by its row count (MKL on an Intel CPU does)
                np.testing.assert_allclose([[c.score for c in r.results] for r in got],
                                           [[c.score for c in r.results] for r in want],
                                           rtol=1e-5, atol=1e-6)
            stats = graphed.stats()
            assert (stats.graph_captures, stats.graph_replays) == [(1, 1), (2, 2)][round_index]
            if round_index == 0:
                graphed.load_catalog(second)
                plain.load_catalog(second)
        assert plain.stats().graph_captures == 0


def test_cuda_graphs_option():
    with pytest.raises(ValueError, match="option cuda_graphs: got 'yes'"):
        EngineOptions(cuda_graphs="yes")
    with pytest.raises(ValueError, match="cuda_graphs=true needs a CUDA device, got cpu"):
        Engine.from_random("tiny", num_items=50, device="cpu", cuda_graphs=True)
    with Engine.from_random("tiny", num_items=50, device="cpu") as engine:
        assert not engine.uses_graphs and engine.executor.make_graphs is None
        assert engine.model.is_capturable
    moe = random_model(MODEL_SIZES["tiny"].replace(use_moe=True, moe_num_experts=4, moe_topk=2,
                                                   moe_inter_dim=16))
    assert not moe.is_capturable   # tests/test_capturable.py: its step reads host values
