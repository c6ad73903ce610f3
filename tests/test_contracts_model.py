"""Contracts of model/layers.py that the oracle models cannot show (issue 15).

Every oracle model uses the default eps 1e-6, where a norm that ignored the
configured value looks right. Here: RMSNorm by hand, and a Qwen3 model (q/k norms
too) with rms_norm_eps 0.5 against Hugging Face. The OneRec family's case is
NAIVE_CONFIGS["large_eps"] in test_model.py.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import xrec.model.layers as layers
from xrec.model.layers import GatedSilu, Linear, RMSNorm, linear, relative_position_bucket
from xrec.model.inputs import ModelInputs
from xrec.model.loader import load_model


def test_rms_norm_uses_its_eps_and_weight():
    norm = RMSNorm(2, eps=1.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, 2.0]))
    x = torch.tensor([[3.0, 4.0]])                     # mean of squares 12.5
    expected = torch.tensor([[3.0, 8.0]]) / math.sqrt(12.5 + 1.0)
    torch.testing.assert_close(norm(x), expected)


def test_rms_norm_keeps_the_input_dtype_and_computes_in_float32():
    norm = RMSNorm(3, eps=1e-6)
    x = torch.tensor([[1e3, -1e3, 2e3]], dtype=torch.bfloat16)
    out = norm(x)
    assert out.dtype == torch.bfloat16
    expected = x.float() / x.float().pow(2).mean(-1, keepdim=True).sqrt()
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=0)


FEW_ROWS = layers.WEIGHT_FIRST_MAX_ROWS


@pytest.mark.parametrize("rows", [1, 2, 5, FEW_ROWS, FEW_ROWS + 1])
@pytest.mark.parametrize("has_bias", [False, True])
def test_linear_is_f_linear_on_either_path(rows, has_bias):
    """Weight-first (few rows) or not, `linear` is x @ W.T + b in x's leading shape: against
    float64 products, values and gradients (training goes through the same layers)."""
    g = torch.Generator().manual_seed(rows)
    layer = Linear(48, 40, bias=has_bias)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(rows, 1, 48, generator=g, requires_grad=True)   # odd leading dims
    out = layer(x)
    expected = x.detach().double() @ layer.weight.detach().double().T
    if has_bias:
        expected = expected + layer.bias.detach().double()
    assert out.shape == (rows, 1, 40) and out.is_contiguous()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    out.sum().backward()
    expected_grad = layer.weight.detach().double().sum(0).expand(rows, 1, 48)
    torch.testing.assert_close(x.grad.double(), expected_grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x.detach(), layer.weight), F.linear(x.detach(), layer.weight),
                               rtol=1e-5, atol=1e-5)


def test_gated_silu_is_down_of_silu_gate_times_up():
    gate, up, down = (torch.nn.Linear(2, 2, bias=False) for _ in range(3))
    with torch.no_grad():
        gate.weight.copy_(torch.eye(2))
        up.weight.copy_(torch.tensor([[2.0, 0.0], [0.0, 3.0]]))
        down.weight.copy_(torch.tensor([[1.0, 1.0], [0.0, 1.0]]))
    x = torch.tensor([[1.0, -1.0]])
    silu = x * torch.sigmoid(x)
    hidden = silu * torch.tensor([[2.0, -3.0]])
    expected = torch.stack([hidden[:, 0] + hidden[:, 1], hidden[:, 1]], -1)
    torch.testing.assert_close(GatedSilu().gated(x, gate, up, down), expected)


def _hf_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Hugging Face T5Attention._relative_position_bucket, element by element."""
    out = []
    for n in relative_position.tolist():
        bucket, buckets = 0, num_buckets
        if bidirectional:
            buckets //= 2
            bucket += buckets if n > 0 else 0
            n = abs(n)
        else:
            n = -min(n, 0)
        max_exact = buckets // 2
        if n < max_exact:
            out.append(bucket + n)
            continue
        large = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact)
                                * (buckets - max_exact))
        out.append(bucket + min(large, buckets - 1))
    return out


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (16, 20), (8, 8)])
def test_relative_position_buckets_match_t5(bidirectional, num_buckets, max_distance):
    positions = torch.arange(-300, 301)
    got = relative_position_bucket(positions, bidirectional=bidirectional,
                                   num_buckets=num_buckets, max_distance=max_distance)
    assert got.tolist() == _hf_bucket(positions, bidirectional, num_buckets, max_distance)


def test_configured_rms_norm_eps_reaches_every_qwen_norm(tmp_path):
    pytest.importorskip("transformers")
    from oracles.hf_causal import hf_causal_logits, make_hf_causal

    hf, directory = make_hf_causal(tmp_path, kind="qwen3", seed=9, vocab_size=48, rms_norm_eps=0.5)
    model = load_model(directory, "cpu", torch.float32)
    prompt = [5, 9, 13, 2, 40]
    with torch.inference_mode():
        last, _ = model.prefill(ModelInputs(torch.tensor([prompt]), [len(prompt)], [], None, [],
                                            None, [0]))
        logits = model.logits(last)[0]                                        # [V]
    torch.testing.assert_close(logits, hf_causal_logits(hf, prompt)[-1], rtol=0, atol=2e-5)


def test_checkpoint_errors_list_eight_names_then_count_the_rest():
    from xrec.model.loader import _listing

    shapes = {f"w{i}": torch.Size([i, 2]) for i in range(10)}
    names = list(shapes)
    assert _listing(names[:2], shapes) == "'w0' [0, 2], 'w1' [1, 2]"
    assert _listing(names[:8], shapes).endswith("'w7' [7, 2]")
    assert _listing(names[:9], shapes).endswith("'w7' [7, 2] and 1 more")
    assert _listing(names, shapes, limit=3) == "'w0' [0, 2], 'w1' [1, 2], 'w2' [2, 2] and 7 more"


def test_random_weights_follow_the_seed_and_their_documented_scales():
    from xrec.config import ModelConfig
    from xrec.model.random_init import random_state_dict

    config = ModelConfig(d_model=32, d_ff=48, num_encoder_layers=1, num_decoder_layers=1,
                         num_heads=4, head_dim=8, vocab_size=64, torch_dtype="float32")
    first, again, other = (random_state_dict(config, seed) for seed in (1, 1, 2))
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["shared.weight"], other["shared.weight"])
    norm = first["encoder.final_layer_norm.weight"]
    assert (norm - 1.0).abs().max() < 0.6 and (norm - 1.0).std() > 0.03
    assert 0.7 < first["shared.weight"].std() < 1.3
    projection = next(t for name, t in first.items() if name.endswith("SelfAttention.q.weight"))
    assert 0.7 < projection.std() * projection.shape[-1] ** 0.5 < 1.3


def test_random_qwen_weights_have_small_biases_and_unit_norms():
    from xrec.model.random_init import random_state_dict
    from xrec.config.qwen import QwenConfig

    config = QwenConfig(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, torch_dtype="float32")
    weights = random_state_dict(config, seed=3)
    biases = torch.cat([t for name, t in weights.items() if name.endswith(".bias")])
    assert biases.numel() > 0 and 0.05 < biases.std() < 0.2
    norms = torch.cat([t for name, t in weights.items() if name.endswith("norm.weight")])
    assert 0.9 < norms.mean() < 1.1 and 0.05 < norms.std() < 0.2
    assert 0.1 < weights["model.embed_tokens.weight"].std() * 32 ** 0.5 < 1.5
