"""A pipeline's reusable buffers: reuse across batches never changes results."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xrec import Engine, RecRequest
from xrec.api_types import validate
from xrec.demo import write_random_model
from xrec.search.batch import prepare_batch
from xrec.search.workspace_buffers import Workspace


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = write_random_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=5, num_items=400)
    with Engine.from_pretrained(directory, isolation="thread", device="cpu") as engine:
        yield engine


def _batch(engine, widths, seed):
    rng = np.random.default_rng(seed)
    requests = [validate(RecRequest(token_ids=rng.integers(0, 64, 3 + i).tolist(), beam_width=w),
                         engine.limits) for i, w in enumerate(widths)]
    return prepare_batch(requests, engine.model.config.d_model)


def test_reused_buffers_give_the_results_of_fresh_ones(engine):
    workspace = Workspace(torch.device("cpu"))
    batches = [_batch(engine, [16, 8, 16], 0), _batch(engine, [4], 1), _batch(engine, [32, 32], 2)]
    for batch in batches + batches[::-1]:
        reused, fresh = engine.step.run(batch, workspace), engine.step.run(batch)
        np.testing.assert_array_equal(reused.tokens, fresh.tokens)
        np.testing.assert_array_equal(reused.scores, fresh.scores)
        np.testing.assert_array_equal(reused.token_logprobs, fresh.token_logprobs)


def test_buffers_grow_to_the_largest_batch_and_stay(engine):
    workspace = Workspace(torch.device("cpu"))
    engine.step.run(_batch(engine, [32, 32], 0), workspace)
    grown = workspace.num_bytes
    assert grown > 0
    engine.step.run(_batch(engine, [4], 1), workspace)
    assert workspace.num_bytes == grown  # a smaller batch takes views, allocates nothing


def test_take_gives_views_of_one_buffer():
    workspace = Workspace(torch.device("cpu"))
    big = workspace.take("x", (4, 8), torch.float32)
    small = workspace.take("x", (2, 3), torch.float32)
    assert small.data_ptr() == big.data_ptr()
    assert workspace.take("x", (5, 8), torch.float32).shape == (5, 8)
    assert workspace.num_bytes == 5 * 8 * 4
