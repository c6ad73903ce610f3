"""Fused element-wise chains (xrec.model.fusion, option fused_kernels): each compiled chain
computes what its eager function computes, a fused model what the eager one computes, and
the engine fuses where the option says, reports it, and falls back where compiling fails."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from xrec import Engine, RecRequest
from xrec.config.sizes import size_config
from xrec.model import fusion
from xrec.model.attention import merge_states, unshared_stage
from xrec.model.fusion import compiled, fuse, is_fused, should_fuse, unfuse
from xrec.model.inputs import ModelInputs
from xrec.model.layers import rms_norm_low_precision, silu_mul
from xrec.model.random_init import random_model

BF16 = torch.bfloat16
REQUESTS = [RecRequest(token_ids=[5, 17, 9], beam_width=4), RecRequest(token_ids=[3], beam_width=4)]


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("rows", [1, 6])
def test_each_compiled_chain_computes_what_its_eager_function_does(rows):
    gen = torch.Generator().manual_seed(rows)
    def draw(*shape):
        return torch.randn(*shape, generator=gen)
    with torch.inference_mode():
        wide = draw(rows, 3, 24).to(BF16)
        x, weight = wide[:, 1], (draw(24) + 2).to(BF16)              # a strided view, as q of qkv
        torch.testing.assert_close(compiled(rms_norm_low_precision)(x, weight, 1e-6),
                                   rms_norm_low_precision(x, weight, 1e-6))
        gate, up = draw(rows, 40).to(BF16), draw(rows, 40).to(BF16)
        torch.testing.assert_close(compiled(silu_mul)(gate.clone(), up), silu_mul(gate.clone(), up))
        # the attention chains get what RecModel.beam_attention gives them: the rows of 2
        # requests' beams, q [2W, H, Dh] a view of the q/k/v product (4 query heads, 2 kv
        # heads of 8), each beam's first 1 or 2 of its 2 cache slots, the position bias
        # [H, S] a transposed view, as the encoder-decoder's is
        q = draw(2 * rows, 64).to(BF16)[:, :32].unflatten(-1, (4, 8))
        cache_k, cache_v = draw(2 * rows, 2, 2, 8).to(BF16), draw(2 * rows, 2, 2, 8).to(BF16)
        for num_slots in (1, 2):
            k, v, bias = cache_k[:, :num_slots], cache_v[:, :num_slots], draw(num_slots, 4).t()
            for got, want in zip(compiled(unshared_stage)(q, k, v, bias, 0.3),
                                 unshared_stage(q, k, v, bias, 0.3)):
                torch.testing.assert_close(got, want)
        o_u, lse_u = unshared_stage(q, k, v, bias, 0.3)                # float32 rows
        o_a = draw(2, 4, rows, 8).to(BF16).transpose(1, 2)              # the shared stage's view
        o_b, lse_a, lse_b = o_u.unflatten(0, (2, rows)), draw(2, rows, 4), lse_u.unflatten(0, (2, rows))
        torch.testing.assert_close(compiled(merge_states)(o_a, lse_a, o_b, lse_b),
                                   merge_states(o_a, lse_a, o_b, lse_b))


def _prefill_and_rounds(model, num_batch: int = 2, num_beams: int = 3, length: int = 5) -> list:
    """The hidden states of a prefill and two decode rounds on fixed random tokens."""
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    inputs = ModelInputs(token_ids=torch.randint(vocab, (num_batch, length), generator=gen),
                         lengths=[length, length - 2], embedding_rows=[], embeddings=None,
                         context_rows=[], contexts=None,
                         prefix_lengths=[model.config.decoder_start_len] * num_batch)
    with torch.inference_mode():
        last, context = model.prefill(inputs)
        beams = model.new_beam_kv(num_batch, num_beams, 3)
        out = [last]
        for round_index in (1, 2):
            tokens = torch.randint(vocab, (num_batch, num_beams), generator=gen)
            out.append(model.decode_step(tokens, round_index, context, beams))
    return out


@pytest.mark.parametrize("size", ["tiny", "qwen3-sid-test"])
def test_a_fused_model_computes_what_the_eager_one_does(size):
    model = random_model(size_config(size, 100), seed=3, dtype=BF16)
    eager = _prefill_and_rounds(model)
    fuse(model)
    assert is_fused(model)
    fused = _prefill_and_rounds(model)
    unfuse(model)
    assert not is_fused(model)
    again = _prefill_and_rounds(model)
    for a, b, c in zip(fused, eager, again):
        assert torch.equal(b, c)                      # unfused, the eager code runs again
        # the same steps; float32 sums in another order: bfloat16 roundings now and then
        assert _relative_error(a, b) < 1e-2
        assert not torch.equal(a, torch.zeros_like(a))


def test_should_fuse_follows_the_option_the_device_the_dtype_and_the_width(monkeypatch):
    cpu, wide, narrow = torch.device("cpu"), fusion.FUSED_MIN_WIDTH, fusion.FUSED_MIN_WIDTH // 4
    monkeypatch.setenv(fusion.FUSED_ENV, "1")
    assert should_fuse(None, cpu, BF16, wide) and should_fuse(None, cpu, torch.float16, wide)
    assert not should_fuse(None, cpu, torch.float32, wide)   # its RMSNorm is one kernel already
    assert not should_fuse(None, cpu, BF16, narrow)          # slower than eager there
    assert not should_fuse(None, torch.device("cuda"), BF16, wide)
    assert should_fuse(True, cpu, torch.float32, narrow) and not should_fuse(False, cpu, BF16, wide)
    monkeypatch.setenv(fusion.FUSED_ENV, "off")
    assert not should_fuse(None, cpu, BF16, wide) and should_fuse(True, cpu, BF16, wide)
    with pytest.raises(ValueError, match="fused_kernels=true needs a CPU model, got cuda"):
        should_fuse(True, torch.device("cuda"), BF16, wide)


@pytest.fixture(scope="module")
def fused():
    """A fused bfloat16 engine, shared: its load compiles every variant (~20 s)."""
    with Engine.from_random("tiny", num_items=200, dtype="bfloat16", fused_kernels=True) as engine:
        yield engine


def test_an_engine_fuses_when_asked_and_says_so(fused):
    with pytest.raises(ValueError, match="option fused_kernels: got 'yes', allowed: true, false"):
        Engine.from_random("tiny", num_items=200, fused_kernels="yes")
    with Engine.from_random("tiny", num_items=200, dtype="bfloat16") as eager:
        assert fused.fused_kernels and fused.describe()["fused_kernels"] and is_fused(fused.model)
        assert not eager.fused_kernels and not is_fused(eager.model)   # the suite's default: off
        compiles = _compiles()
        for a, b in zip(fused.recommend(REQUESTS), eager.recommend(REQUESTS)):
            assert len(a.results) == len(b.results) == 4
            torch.testing.assert_close([r.score for r in a.results], [r.score for r in b.results],
                                       rtol=0, atol=0.05)
        # batches of other shapes, in the engine's pipeline thread: the warm-up at load
        # compiled every variant they need
        for requests in ([RecRequest(token_ids=list(range(3, 60)), beam_width=32)] * 3,
                         [RecRequest(token_ids=list(range(3, 20)), beam_width=16)],
                         [RecRequest(token_ids=[7], beam_width=1)] * 2,
                         [RecRequest(token_ids=[4, 8], beam_width=1)]):
            assert all(r.results for r in fused.recommend(requests))
        assert _compiles() == compiles


def _compiles() -> int:
    """Functions compiled by dynamo so far in this process (every thread)."""
    return torch._dynamo.utils.counters["frames"]["total"]


def test_where_compiling_fails_the_engine_runs_eagerly_or_raises_when_fusion_was_required():
    """A real failure: no C++ compiler for Inductor (and no cached kernels to fall back on),
    in a process of its own."""
    script = textwrap.dedent("""
        import logging
        from xrec import Engine, RecRequest
        from xrec.model import fusion
        logging.basicConfig(level=logging.WARNING)
        fusion.FUSED_MIN_WIDTH = 1   # "auto" would fuse this narrow model
        with Engine.from_random("tiny", num_items=200, dtype="bfloat16") as engine:
            answer = engine.recommend([RecRequest(token_ids=[5, 17, 9], beam_width=4)])[0]
            print("auto", engine.fused_kernels, len(answer.results))
        try:
            Engine.from_random("tiny", num_items=200, dtype="bfloat16", fused_kernels=True)
        except RuntimeError as error:
            print("required", str(error).splitlines()[0][:60])
    """)
    env = {**os.environ, "XREC_FUSED_KERNELS": "1", "CXX": "/nonexistent/c++",
           "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "auto False 4" in done.stdout
    assert "required option fused_kernels=true: compiling failed" in done.stdout
    warnings = [line for line in done.stderr.splitlines() if "running them eagerly" in line]
    assert len(warnings) == 1, done.stderr[-3000:]


def test_the_breakdown_counts_a_fused_chain_as_an_op_not_as_host_time(fused):
    """`xrec bench breakdown`'s profile: a compiled chain's kernels are one event the profiler
    does not name as an op; its time goes to the part that ran it."""
    from xrec.api_types import validate
    from xrec.bench.breakdown import FUSED_LABEL, profile_step
    from xrec.search.batch import prepare_batch
    from xrec.search.workspace_buffers import Workspace

    batch = prepare_batch([validate(r, fused.limits) for r in REQUESTS], fused.model.config.d_model)
    workspace = Workspace(fused.model.device)
    for _ in range(2):  # warm-up runs, as the bench does before it profiles
        fused.step.run(batch, workspace)
    profile = profile_step(fused.step, batch, workspace=workspace)
    assert FUSED_LABEL in profile["top_ops_ms"]["encoder"]
    assert profile["part_times_from"] == "plain run"
    assert sum(profile["parts_ms"].values()) == pytest.approx(profile["op_ms"], rel=0.05)
    assert profile["op_ms"] < profile["profiled_wall_ms"]


def test_a_warm_up_compiles_the_attention_chains_once_per_slot_count_not_per_batch_layout(fused):
    """The unshared stage reads rows `[B * W, ...]` and the merge a contiguous log-sum-exp
    (`RecModel.beam_attention`), so both families' warm-ups (1 or 2 requests, beams and
    prompt positions) compile the unshared stage once per slot count (1 and 2) and q
    layout (a batch of one request and one beam has other strides), and the merge once per
    layout of the shared stage's output. Viewed whole, the batch and beam axes gave 13
    variants of the unshared stage and 5 of the merge."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model = random_model(size_config("qwen3-sid-test", 100), seed=3, dtype=BF16)
    fuse(model)
    fusion.warm_up(model, 3)       # the encoder-decoder's ran at the engine's load (`fused`)
    variants = {fn.__name__: len(_debug_get_cache_entry_list(fn.__code__))
                for fn in (unshared_stage, merge_states)}
    # 2 x 2 + 2 and 3, and one more merge where the chain test above ran first
    assert variants["unshared_stage"] <= 6 and variants["merge_states"] <= 4, variants
