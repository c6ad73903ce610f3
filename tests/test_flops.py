"""The roofline's FLOP count (xrec.bench.lib.flops) against counts it did not make.

torch's FlopCounterMode counts the GEMMs a call really runs (linear layers, matmuls;
not CPU scaled_dot_product_attention; oneDNN's linear, which xrec's CPU float32 products
take where it is faster (xrec.model.gemm), once told its formula below): over xrec's encoder, cross K/V, decoder prefix,
decode round and prompt, that is exactly the projection and FFN terms of the formula
(dense, GQA, MoE, both families). Hugging Face T5's eager encoder also counts its
attention matmuls: the encoder's attention term.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from xrec.bench.lib.flops import SearchShape, search_flops, search_terms
from xrec.config import MODEL_SIZES
from xrec.model.gemm import cpu_fp32_gemm
from xrec.model.inputs import ModelInputs
from xrec.model.registry import model_class

LENGTH, WIDTH, BATCH = 12, 5, 2


@register_flop_formula(torch.ops.mkldnn._linear_pointwise)
def onednn_linear_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """`x [..., K] @ w [N, K].T`: 2 x rows x K x N, as torch counts `aten.mm`."""
    rows = 1
    for size in x_shape[:-1]:
        rows *= size
    return 2 * rows * x_shape[-1] * w_shape[0]
ONEREC = MODEL_SIZES["tiny"].replace(use_absolute_position_embedding=True)  # no per-head bias:
QWEN = dataclasses.replace(MODEL_SIZES["qwen3-sid-test"], torch_dtype="float32")  # flash paths


@pytest.fixture(autouse=True)
def gemm_library_chosen():
    """The first float32 product of a process measures both libraries (xrec.model.gemm):
    done here, not inside a count."""
    cpu_fp32_gemm()


def counted(fn) -> int:
    with FlopCounterMode(display=False) as mode:
        fn()
    return mode.get_total_flops()


def terms(config, rounds: int = 2) -> dict[str, float]:
    return search_terms(config, SearchShape(BATCH, LENGTH, WIDTH, (3.0,) * rounds))


def build(config):
    torch.manual_seed(0)
    return model_class(config)(config).eval()


def inputs(config) -> ModelInputs:
    ids = torch.randint(0, config.vocab_size, (BATCH, LENGTH))
    prefix = [getattr(config, "decoder_start_len", 1)] * BATCH
    return ModelInputs(ids, [LENGTH] * BATCH, [], None, [], None, prefix)


def decode_round(model, context) -> None:
    beams = model.new_beam_kv(BATCH, WIDTH, 2)
    model.decode_step(torch.randint(0, model.config.vocab_size, (BATCH, WIDTH)), 1, context, beams)


@pytest.mark.parametrize("config", [
    ONEREC, ONEREC.replace(num_kv_heads=1, decoder_num_kv_heads=1, d_ff=48),
    ONEREC.replace(use_moe=True, moe_num_experts=4, moe_topk=2, moe_inter_dim=24,
                   moe_use_shared_experts=True, moe_num_shared_experts=1)],
    ids=["dense", "gqa", "moe"])
@torch.inference_mode()
def test_encoder_decoder_gemms_are_the_formula(config):
    model, expected = build(config), terms(config)
    batch = inputs(config)
    hidden = model.embed(batch.token_ids)
    assert counted(lambda: model.encode(hidden, None)) == expected["encoder"]
    encoded = model.encode(hidden, None)
    assert counted(lambda: model.prepare_cross(encoded, None)) == expected["cross K/V"]
    cross = model.prepare_cross(encoded, None)
    prefix, lengths, is_ragged = model._prefix(batch)
    assert counted(lambda: model.decode_prefix(prefix, lengths, is_ragged, cross)) == \
        expected["decoder prefix"]
    _, context = model.prefill(batch)
    assert counted(lambda: decode_round(model, context)) == expected["decoder rounds"]


@pytest.mark.parametrize("config", [
    QWEN, dataclasses.replace(QWEN, model_type="qwen2"),
    dataclasses.replace(QWEN, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=24, mlp_only_layers=(0,))],
    ids=["qwen3", "qwen2", "qwen3_moe"])
@torch.inference_mode()
def test_decoder_only_gemms_are_the_formula(config):
    model, expected = build(config), terms(config)
    batch = inputs(config)
    assert counted(lambda: model.prefill(batch)) == expected["prompt"]
    _, context = model.prefill(batch)
    assert counted(lambda: decode_round(model, context)) == expected["decoder rounds"]


@torch.inference_mode()
def test_encoder_attention_term_is_what_hf_t5_computes():
    transformers = pytest.importorskip("transformers")
    from xrec.realdata.train.hf_models import hf_t5_config

    config = MODEL_SIZES["tiny"].replace(num_kv_heads=4, decoder_num_kv_heads=4)
    hf_config = hf_t5_config(config)
    hf_config._attn_implementation = "eager"          # matmuls the counter sees, not SDPA
    hf = transformers.T5ForConditionalGeneration(hf_config).eval()
    ids = torch.randint(0, config.vocab_size, (BATCH, LENGTH))
    expected = terms(config)
    assert counted(lambda: hf.encoder(input_ids=ids)) == \
        expected["encoder"] + expected["encoder attention"]


def test_components_sum_the_terms_and_the_issue_figure():
    config = MODEL_SIZES["onerec-0.1b"]
    shape = SearchShape(4, 256, 128, (8192.0, 12.0, 1.5))
    by_component, by_stage = search_flops(config, shape), search_terms(config, shape)
    assert sum(by_component.values()) == pytest.approx(sum(by_stage.values()))
    assert by_component["top-k"] == 0.0
    # issue 13: "about 215 GFLOP" for onerec-0.1b, W=128, L=256, 4 requests
    assert 210e9 < sum(by_component.values()) < 220e9
