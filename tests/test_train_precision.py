"""Mixed-precision training (`xrec train --dtype`): what "auto" picks, bad values, attention
kept in float32, a bfloat16 step against the float32 one from the same weights (both
families), and a whole bfloat16 run that learns and writes a float32 model."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from test_train import SMALL, walk_interactions
from xrec.realdata.data import leave_one_out
from xrec.realdata.sequences import SidVocabulary, causal_windows, seq2seq_windows
from xrec.realdata.sid.build import build_sid_dir
from xrec.realdata.train.models import TrainableModel, model_config
from xrec.realdata.train.options import TrainOptions
from xrec.realdata.train.precision import (FLOAT32_SDPA, _float32_sdpa, compile_settings,
                                           resolve_train_dtype, use_float32_attention)
from xrec.realdata.train.trainer import train

AVX512_BF16 = "processor : 0\nflags : fpu sse2 avx512f avx512_bf16\n"
AVX2 = "processor : 0\nflags : fpu sse2 avx2\n"


def test_auto_is_bfloat16_where_the_cpu_has_it_and_the_family_validated(monkeypatch):
    monkeypatch.delenv("XREC_CPU_AUTO_DTYPE", raising=False)
    assert resolve_train_dtype("auto", "qwen3", AVX512_BF16) == torch.bfloat16
    assert resolve_train_dtype("auto", "qwen3", AVX2) == torch.float32
    assert resolve_train_dtype("auto", "onerec", AVX512_BF16) == torch.float32
    assert resolve_train_dtype("bfloat16", "onerec", AVX2) == torch.bfloat16
    assert resolve_train_dtype("float32", "qwen3", AVX512_BF16) == torch.float32
    monkeypatch.setenv("XREC_CPU_AUTO_DTYPE", "float32")
    assert resolve_train_dtype("auto", "qwen3") == torch.float32


def test_a_dtype_training_does_not_know_is_a_clear_error():
    with pytest.raises(ValueError, match="dtype: got 'float16', allowed: auto, float32, bfloat16"):
        resolve_train_dtype("float16", "qwen3")
    with pytest.raises(ValueError, match="dtype: got 'half', allowed: auto, float32, bfloat16"):
        TrainOptions(dtype="half").check()


def test_float32_attention_under_bfloat16_autocast_is_the_float32_attention():
    """The attention of a bfloat16 training pass: bfloat16 inputs (as autocast's products
    give them), computed and returned in float32, equal to Hugging Face's SDPA on the same
    values in float32."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = TrainableModel.create(model_config("qwen3", 12, 32, 1, 2, 32, 0), seed=0)
    use_float32_attention(model.hf)
    assert model.hf.config._attn_implementation == FLOAT32_SDPA
    module = model.hf.model.layers[0].self_attn
    q, k, v = (torch.randn(2, 2, 7, 8).bfloat16() for _ in range(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = _float32_sdpa(module, q, k, v, None, is_causal=True)
    expected, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), None,
                                         is_causal=True)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected)


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """The walk of tests/test_train.py and its semantic IDs. The models below have the
    trainer's config for it, so the compiled passes of the step test serve the run test."""
    split = leave_one_out(walk_interactions())
    sid_dir = tmp_path_factory.mktemp("walk") / "sid"
    build_sid_dir(split, sid_dir, embeddings="svd", codebook_size=8, dim=8)
    return split, sid_dir, SidVocabulary.read(sid_dir, split.data.item_ids)


@pytest.mark.parametrize("family", ["qwen3", "onerec"])
def test_a_bfloat16_step_is_the_float32_step_within_bfloat16_rounding(walk, family):
    """The same initial weights and batch of training windows: the bfloat16 loss is within
    1% of the float32 one (and not equal to it: the products did run in bfloat16), every
    gradient points the way the float32 one does, and weights and gradients stay float32."""
    split, _, vocab = walk
    options = TrainOptions(family=family, **SMALL)
    windows = seq2seq_windows if family == "onerec" else causal_windows
    batch = windows(vocab, split.train, options.max_items)[:options.batch_size]
    config = model_config(family, vocab.vocab_size, options.hidden, options.layers,
                          options.heads, 3 * options.max_items + 8, vocab.bos_id)
    losses, grads, models = [], [], []
    for dtype in (torch.float32, torch.bfloat16):
        model = TrainableModel.create(config, seed=0, lookahead=options.lookahead, dtype=dtype)
        with compile_settings():     # as the trainer runs its steps
            loss, _ = model.loss(batch)
            loss.backward()
        losses.append(float(loss.detach()))
        grads.append([p.grad for p in model.parameters()])
        models.append(model)
    assert losses[1] == pytest.approx(losses[0], rel=1e-2) and losses[1] != losses[0]
    for p, g32, g16 in zip(models[1].parameters(), *grads):
        assert p.dtype == g16.dtype == torch.float32
        if g32.norm() > 1e-6:
            assert torch.cosine_similarity(g16.flatten(), g32.flatten(), dim=0) > 0.98


def test_a_bfloat16_run_learns_and_writes_a_float32_model(walk, tmp_path):
    """`xrec train --dtype bfloat16` on the walk: it learns the walk as the float32 run of
    tests/test_train.py does (validation HR@10 >= 0.8), reports its dtype, and writes
    float32 weights."""
    split, sid_dir, _ = walk
    report = train(split, sid_dir, tmp_path / "model",
                   TrainOptions(epochs=12, patience=20, dtype="bfloat16", **SMALL),
                   progress=False, log=lambda *_: None)   # the step test's threads: its compiles
    assert report["dtype"] == "bfloat16"
    assert report["best"]["hr@10"] >= 0.8, report["history"]
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
