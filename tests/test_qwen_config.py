"""Decoder-only config.json (qwen2 / qwen3 / qwen3_moe): Hugging Face's own files are read as
the same shape, unsupported settings are refused naming the key, `to_dict` round-trips
through xrec and through Hugging Face."""

from __future__ import annotations

import json

import pytest

from xrec.config import MODEL_SIZES, model_config_from_dict, read_model_config
from xrec.config.qwen import QwenConfig

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def hf_config_dict(kind: str, **overrides) -> dict:
    """config.json as transformers 5 writes it for `kind`."""
    classes = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "qwen3_moe": transformers.Qwen3MoeConfig}
    keys = dict(SMALL, **(MOE if kind == "qwen3_moe" else {}))
    if kind == "qwen2":
        keys.pop("head_dim")
    return classes[kind](**{**keys, **overrides}).to_dict()


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_moe"])
def test_hugging_face_configs_are_read(kind):
    cfg = model_config_from_dict(hf_config_dict(kind, rope_theta=5000.0, tie_word_embeddings=True))
    assert isinstance(cfg, QwenConfig) and cfg.model_type == kind
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim) == (32, 3, 4, 2, 8)
    assert cfg.rope_theta == 5000.0 and cfg.tie_word_embeddings
    assert cfg.has_qkv_bias == (kind == "qwen2") and cfg.has_qk_norm == (kind != "qwen2")
    assert cfg.is_encoder_decoder is False and cfg.accepts_embeddings is False
    assert cfg.beam_kv_shape == (3, 2, 8)
    if kind == "qwen3_moe":   # transformers 5 writes num_local_experts
        assert cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
        assert all(cfg.is_moe_layer(i) for i in range(3))


def test_swish_reads_as_silu():
    """transformers' ACT2FN maps "swish" to SiLU: the same network, refused until now."""
    assert model_config_from_dict(hf_config_dict("qwen3", hidden_act="swish")) == \
        model_config_from_dict(hf_config_dict("qwen3"))
    import torch
    x = torch.linspace(-20, 20, 1001)
    act = transformers.activations.ACT2FN
    torch.testing.assert_close(act["swish"](x), act["silu"](x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "qwen3_moe"])
@pytest.mark.parametrize("first_windowed, window", [(1, 64), (3, 64), (28, 64), (0, None)])
@pytest.mark.parametrize("with_layer_types", [True, False])
def test_use_sliding_window_is_refused_only_where_a_layer_is_windowed(kind, first_windowed, window,
                                                                       with_layer_types):
    """use_sliding_window true was refused outright, though transformers windows only the
    layers from max_window_layers on (qwen2, qwen3; every layer for qwen3_moe) and none
    without a sliding_window: xrec serves a config exactly when transformers' layers are all
    full attention (its own reading is the oracle; 4.x configs carry no layer_types)."""
    keys = dict(SMALL, **(MOE if kind == "qwen3_moe" else {}))
    if kind == "qwen2":
        keys.pop("head_dim")
    classes = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "qwen3_moe": transformers.Qwen3MoeConfig}
    hf = classes[kind](**keys, use_sliding_window=True, max_window_layers=first_windowed,
                       sliding_window=window)
    windowed = hf.sliding_window is not None and (
        kind == "qwen3_moe" or "sliding_attention" in hf.layer_types)
    raw = {**hf.to_dict(), "use_sliding_window": True, "sliding_window": window}
    if not with_layer_types:
        raw.pop("layer_types", None)
    if windowed:
        with pytest.raises(ValueError, match="'(use_sliding_window|layer_types)'"):
            model_config_from_dict(raw)
    else:
        assert model_config_from_dict(raw) == model_config_from_dict(hf_config_dict(kind))


def test_moe_layer_rule_and_bias_flags():
    cfg = model_config_from_dict(hf_config_dict("qwen3_moe", decoder_sparse_step=2, mlp_only_layers=[3],
                                                num_hidden_layers=4, attention_bias=True))
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, True, False, False]
    assert cfg.has_qkv_bias and cfg.has_o_bias
    qwen2 = model_config_from_dict(hf_config_dict("qwen2"))
    assert qwen2.has_qkv_bias and not qwen2.has_o_bias


@pytest.mark.parametrize("change,key", [
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters"),
    (dict(rope_parameters={"type": "yarn", "rope_theta": 1e4, "factor": 2.0}), "rope_parameters.type': got 'yarn'"),
    (dict(rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     "rope_parameters': got RoPE settings per layer type \\(full_attention\\)"),
    (dict(use_sliding_window=True, sliding_window=64), "use_sliding_window"),
    (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(num_key_value_heads=3), "num_key_value_heads"),
    (dict(head_dim=7), "head_dim"),
    (dict(hidden_size="32"), "hidden_size"),
    (dict(tie_word_embeddings="yes"), "tie_word_embeddings"),
    (dict(model_type="llama"), "model_type"),
    (dict(mlp_only_layers=[9]), "mlp_only_layers"),
    (dict(layer_types=3), "layer_types': got 3, expected a list of strings"),
    (dict(layer_types="full_attention"), "layer_types': got full_attention, expected a list"),
    (dict(rms_norm_eps=float("inf")), "rms_norm_eps': got inf, expected a finite number"),
    (dict(rope_theta=10 ** 400), "rope_theta': got an integer of 401 digits"),
    # transformers 5 reads rope_parameters' 10000, transformers 4 the top-level 5000
    (dict(rope_theta=5000.0), "rope_theta=5000.0, rope_parameters.rope_theta=10000.0 disagree"),
    (dict(num_hidden_layers=2000), "num_hidden_layers': got 2000, expected an integer >= 1 and "
                                   "<= 1024"),
    (dict(num_experts=20000, num_local_experts=20000), "num_experts': got 20000"),
    # a head count of 0 divided by zero; widths of 2^62 failed inside torch as the model was built
    (dict(num_attention_heads=0), "num_attention_heads': got 0, expected an integer >= 1"),
    (dict(intermediate_size=2 ** 62), f"intermediate_size': got {2 ** 62}"),
    (dict(head_dim=2 ** 62), f"head_dim': got {2 ** 62}"),
    (dict(moe_intermediate_size=2 ** 40), f"moe_intermediate_size': got {2 ** 40}"),
    (dict(vocab_size=2 ** 31), f"vocab_size': got {2 ** 31}"),
    (dict(mlp_only_layers=[True]), "mlp_only_layers': got \\[True\\]"),   # not layer 1
])
def test_unsupported_settings_are_refused_naming_the_key(change, key):
    raw = {**hf_config_dict("qwen3_moe"), **change}
    with pytest.raises(ValueError, match=key):
        model_config_from_dict(raw)


@pytest.mark.parametrize("theta", [1e-300, 1e-30, 0.5, 0.0, float("nan")])
def test_a_rope_base_below_one_is_refused(theta):
    """A base of 1e-300 (0 in float32) gave infinite frequencies: NaN scores, no results."""
    raw = {**hf_config_dict("qwen3"), "rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    with pytest.raises(ValueError, match="rope_theta': got .*expected a finite number >= 1"):
        model_config_from_dict(raw)
    raw["rope_parameters"]["rope_theta"] = 1.0
    assert model_config_from_dict(raw).rope_theta == 1.0


def test_max_position_embeddings_sizes_nothing(tmp_path):
    """RoPE's tables are built for the positions a batch holds, never for max_position_embeddings:
    a model saying 10^30 positions loads and scores as one saying 64."""
    import torch

    from xrec.model.inputs import ModelInputs
    from xrec.model.loader import load_model, save_model
    from xrec.model.random_init import random_state_dict

    config = QwenConfig(**SMALL, max_position_embeddings=64, torch_dtype="float32")
    weights = random_state_dict(config, seed=5)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    logits = []
    for positions in (64, 10 ** 30):
        save_model(tmp_path / str(positions), config.replace(max_position_embeddings=positions), weights)
        model = load_model(tmp_path / str(positions), dtype=torch.float32)
        assert model.config.max_positions == positions
        with torch.inference_mode():
            last, _ = model.prefill(ModelInputs(torch.tensor([prompt]), [len(prompt)], [], None, [], None,
                                                [0]))
            logits.append(model.logits(last))
    assert torch.equal(*logits)


def test_head_dim_default_needs_a_hidden_size_the_heads_divide():
    """Without head_dim (or with null) it is hidden_size / num_attention_heads; a hidden size
    the heads do not divide names both keys (it read "'head_dim': got 0")."""
    raw = {**hf_config_dict("qwen2"), "hidden_size": 30, "num_attention_heads": 4}
    raw.pop("head_dim", None)
    with pytest.raises(ValueError, match="'head_dim' is missing, and hidden_size=30 is not a "
                                         "multiple of num_attention_heads=4"):
        model_config_from_dict(raw)
    assert model_config_from_dict({**raw, "head_dim": 6}).head_dim == 6
    assert model_config_from_dict({**raw, "hidden_size": 32, "head_dim": None}).head_dim == 8


@pytest.mark.parametrize("missing", ["vocab_size", "hidden_size", "num_hidden_layers"])
def test_missing_required_keys(missing):
    raw = hf_config_dict("qwen3")
    del raw[missing]
    with pytest.raises(ValueError, match=missing):
        model_config_from_dict(raw)


def test_unknown_model_type_lists_both_families():
    with pytest.raises(ValueError, match="onerec.*qwen3_moe"):
        model_config_from_dict({"model_type": "mamba"})


def test_rope_parameters_theta_is_accepted():
    raw = hf_config_dict("qwen3")
    raw.pop("rope_theta", None)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 123.0}
    assert model_config_from_dict(raw).rope_theta == 123.0


@pytest.mark.parametrize("name", [n for n, c in MODEL_SIZES.items() if isinstance(c, QwenConfig)])
def test_round_trip_through_xrec_and_hugging_face(name, tmp_path):
    cfg = MODEL_SIZES[name]
    raw = cfg.to_dict()
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_model_config(tmp_path / "config.json") == cfg
    hf = transformers.AutoConfig.from_pretrained(tmp_path)
    assert (hf.model_type, hf.hidden_size, hf.num_hidden_layers, hf.head_dim, hf.vocab_size) == \
        (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim, cfg.vocab_size)
    assert hf.tie_word_embeddings == cfg.tie_word_embeddings
    assert model_config_from_dict(hf.to_dict()) == cfg


def test_moe_round_trip():
    cfg = model_config_from_dict(hf_config_dict("qwen3_moe", norm_topk_prob=True, decoder_sparse_step=3))
    assert model_config_from_dict(cfg.to_dict()) == cfg
    assert model_config_from_dict(transformers.Qwen3MoeConfig(**cfg.to_dict()).to_dict()) == cfg


def test_parameter_count_matches_the_model():
    import torch

    from xrec.model.qwen import QwenModel
    for raw in (hf_config_dict("qwen2"), hf_config_dict("qwen3_moe", attention_bias=True,
                                                        mlp_only_layers=[1])):
        cfg = model_config_from_dict(raw)
        with torch.device("meta"):
            model = QwenModel(cfg)
        assert cfg.num_parameters == sum(p.numel() for p in model.parameters())
