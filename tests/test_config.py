"""config.json in its two dialects (docs/model.md, "config.json") and EngineOptions' range checks.

The defaults below are copied from the spec's table, not from the code under test.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from xrec.config import MODEL_SIZES, EngineOptions, ModelConfig

# docs/model.md, "onerec" dialect: xllm key -> documented default
ONEREC_DEFAULTS = {
    "d_model": 128, "d_ff": 256, "num_layers": 12, "num_decoder_layers": 4, "num_heads": 4, "d_kv": 32,
    "vocab_size": 8200, "layer_norm_epsilon": 1e-6, "use_absolute_position_embedding": False,
    "tie_word_embeddings": True, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
    "bos_token_id": 0, "use_moe": False, "moe_num_experts": 8, "moe_topk": 2, "moe_inter_dim": 1024,
    "moe_route_scale": 1.0, "moe_use_shared_experts": False, "moe_num_shared_experts": 0,
    "torch_dtype": "bfloat16",
}
# xllm key -> ModelConfig field, where they differ
FIELD_OF = {"num_layers": "num_encoder_layers", "d_kv": "head_dim", "num_key_value_heads": "num_kv_heads",
            "decoder_d_kv": "decoder_head_dim", "decoder_num_key_value_heads": "decoder_num_kv_heads"}

SMALL = {"model_type": "onerec", "d_model": 32, "d_ff": 64, "num_layers": 2, "num_decoder_layers": 2,
         "num_heads": 4, "d_kv": 8, "vocab_size": 64, "relative_attention_max_distance": 32}

# what a Hugging Face T5Config(feed_forward_proj="gated-silu").to_dict() looks like (trimmed)
T5_RAW = {
    "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "feed_forward_proj": "gated-silu",
    "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 3, "num_heads": 4, "vocab_size": 64,
    "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128, "layer_norm_epsilon": 1e-6,
    "dropout_rate": 0.1, "initializer_factor": 1.0, "is_encoder_decoder": True, "use_cache": True,
    "pad_token_id": 0, "eos_token_id": 1, "decoder_start_token_id": 0, "tie_word_embeddings": True,
    "dense_act_fn": "silu", "is_gated_act": True, "dtype": "float32",
}


def _field(cfg: ModelConfig, key: str):
    return getattr(cfg, FIELD_OF.get(key, key))


# ---------------------------------------------------------------------------
# the "onerec" dialect
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [{"model_type": "onerec"}, {}], ids=["onerec", "no_model_type"])
def test_onerec_defaults(raw):
    cfg = ModelConfig.from_dict(raw)
    for key, value in ONEREC_DEFAULTS.items():
        assert _field(cfg, key) == value, key
        assert type(_field(cfg, key)) is type(value), key
    # derived defaults: decoder heads and head dim follow the encoder's, kv heads the heads
    assert cfg.decoder_num_heads == 4 and cfg.decoder_head_dim == 32
    assert cfg.num_kv_heads == 4 and cfg.decoder_num_kv_heads == 4
    assert cfg.attention_scale == 1.0 and cfg.encoder_attention_scale == 1.0   # T5: no scaling


def test_onerec_every_key_is_read():
    raw = {"model_type": "onerec", "d_model": 48, "d_ff": 80, "num_layers": 3, "num_decoder_layers": 5,
           "num_heads": 6, "d_kv": 4, "decoder_num_heads": 4, "decoder_d_kv": 12, "num_key_value_heads": 3,
           "decoder_num_key_value_heads": 1, "vocab_size": 500, "layer_norm_epsilon": 1e-5,
           "use_absolute_position_embedding": True, "tie_word_embeddings": False,
           "relative_attention_num_buckets": 16, "relative_attention_max_distance": 64, "bos_token_id": 7,
           "use_moe": True, "moe_num_experts": 6, "moe_topk": 3, "moe_inter_dim": 40, "moe_route_scale": 2.5,
           "moe_use_shared_experts": True, "moe_num_shared_experts": 2, "torch_dtype": "float16",
           "moe_score_func": "softmax", "some_unknown_key": [1, 2], "architectures": ["OneRec"]}
    cfg = ModelConfig.from_dict(raw)
    for key, value in raw.items():
        if key in ("model_type", "moe_score_func", "some_unknown_key", "architectures"):
            continue
        assert _field(cfg, key) == value, key
    # shared experts switch the softmax scale to 1/sqrt(head_dim), per stack
    assert cfg.attention_scale == pytest.approx(12 ** -0.5)
    assert cfg.encoder_attention_scale == pytest.approx(4 ** -0.5)


@pytest.mark.parametrize("given,want", [
    # (keys given) -> (num_kv_heads, decoder_num_heads, decoder_num_kv_heads)
    ({"num_heads": 8}, (8, 8, 8)),
    ({"num_heads": 8, "num_key_value_heads": 2}, (2, 8, 2)),                         # decoder kv -> kv
    ({"num_heads": 8, "decoder_num_heads": 4}, (8, 4, 4)),                          # -> decoder heads
    ({"num_heads": 8, "decoder_num_heads": 4, "num_key_value_heads": 2}, (2, 4, 2)),
    ({"num_heads": 8, "decoder_num_heads": 4, "decoder_num_key_value_heads": 1}, (8, 4, 1)),
    ({"num_heads": 8, "num_key_value_heads": 4, "decoder_num_key_value_heads": 2}, (4, 8, 2)),
])
def test_onerec_head_fallbacks(given, want):
    cfg = ModelConfig.from_dict({"model_type": "onerec", **given})
    assert (cfg.num_kv_heads, cfg.decoder_num_heads, cfg.decoder_num_kv_heads) == want


def test_onerec_head_dim_fallback_and_nulls():
    cfg = ModelConfig.from_dict({"d_kv": 16, "decoder_num_heads": None, "d_ff": None})
    assert cfg.decoder_head_dim == 16 and cfg.decoder_num_heads == 4 and cfg.d_ff == 256
    assert ModelConfig.from_dict({"d_kv": 16, "decoder_d_kv": 8}).decoder_head_dim == 8


@pytest.mark.parametrize("alias,name", [("bf16", "bfloat16"), ("fp32", "float32"), ("float", "float32"),
                                        ("fp16", "float16"), ("half", "float16"), ("float32", "float32")])
def test_dtype_aliases(alias, name):
    assert ModelConfig.from_dict({**SMALL, "torch_dtype": alias}).torch_dtype == name


# ---------------------------------------------------------------------------
# the "t5" dialect
# ---------------------------------------------------------------------------

def test_t5_dialect():
    cfg = ModelConfig.from_dict(T5_RAW)
    assert (cfg.d_model, cfg.d_ff, cfg.vocab_size, cfg.head_dim) == (32, 64, 64, 8)
    assert cfg.num_encoder_layers == 3 and cfg.num_decoder_layers == 3          # decoder layers default
    assert cfg.num_heads == cfg.num_kv_heads == cfg.decoder_num_heads == cfg.decoder_num_kv_heads == 4
    assert cfg.decoder_head_dim == 8
    assert cfg.relative_attention_num_buckets == 32 and cfg.relative_attention_max_distance == 128
    assert not cfg.use_absolute_position_embedding and cfg.tie_word_embeddings and not cfg.use_moe
    assert cfg.scale_decoder_outputs
    assert cfg.torch_dtype == "float32" and cfg.bos_token_id == 0
    raw = dict(T5_RAW, num_decoder_layers=1, decoder_start_token_id=5, bos_token_id=9, torch_dtype="bfloat16",
               scale_decoder_outputs=False)
    del raw["dtype"]
    cfg = ModelConfig.from_dict(raw)
    assert cfg.num_decoder_layers == 1
    assert cfg.bos_token_id == 5                  # decoder_start_token_id is BOS, not bos_token_id
    assert cfg.torch_dtype == "bfloat16" and not cfg.scale_decoder_outputs
    del raw["torch_dtype"]
    assert ModelConfig.from_dict(raw).torch_dtype == "float32"


def test_t5_config_written_by_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=1,
                               num_heads=4, feed_forward_proj="gated-silu", decoder_start_token_id=3)
    hf.save_pretrained(str(tmp_path))
    cfg = ModelConfig.from_file(tmp_path / "config.json")
    assert (cfg.d_model, cfg.d_ff, cfg.num_encoder_layers, cfg.num_decoder_layers, cfg.num_heads) == (32, 64, 2, 1, 4)
    assert cfg.bos_token_id == 3 and cfg.vocab_size == 64
    hf = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
    with pytest.raises(ValueError, match="feed_forward_proj.*relu"):
        ModelConfig.from_dict(hf.to_dict())


@pytest.mark.parametrize("proj", ["relu", "gated-gelu", "gelu", "silu"])
def test_t5_refuses_other_feed_forward(proj):
    with pytest.raises(ValueError, match=f"'feed_forward_proj'.*'{proj}'.*gated-silu"):
        ModelConfig.from_dict(dict(T5_RAW, feed_forward_proj=proj))


def test_t5_feed_forward_missing_means_relu():
    raw = dict(T5_RAW)
    del raw["feed_forward_proj"]
    with pytest.raises(ValueError, match="'feed_forward_proj'.*'relu'"):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("key", ["d_model", "d_kv", "num_heads", "num_layers", "vocab_size"])
def test_t5_required_keys(key):
    raw = dict(T5_RAW)
    del raw[key]
    with pytest.raises(ValueError, match=f"'{key}'.*missing"):
        ModelConfig.from_dict(raw)


# ---------------------------------------------------------------------------
# refusals: ValueError naming the key and the value
# ---------------------------------------------------------------------------

REFUSALS = [
    # (changes to SMALL, key the message names, value the message shows)
    ({"moe_score_func": "sigmoid"}, "moe_score_func", "'sigmoid'"),
    ({"num_heads": 6, "num_key_value_heads": 4}, "num_key_value_heads", "4"),
    ({"decoder_num_heads": 4, "decoder_num_key_value_heads": 3}, "decoder_num_key_value_heads", "3"),
    ({"num_heads": 8, "num_key_value_heads": 8, "decoder_num_heads": 4}, "decoder_num_key_value_heads", "8"),
    ({"d_model": 0}, "d_model", "0"),
    ({"d_ff": -1}, "d_ff", "-1"),
    ({"num_layers": 0}, "num_layers", "0"),
    ({"num_decoder_layers": 0}, "num_decoder_layers", "0"),
    ({"num_heads": 0}, "num_heads", "0"),
    ({"d_kv": 0}, "d_kv", "0"),
    ({"decoder_d_kv": -8}, "decoder_d_kv", "-8"),
    ({"num_key_value_heads": 0}, "num_key_value_heads", "0"),
    ({"vocab_size": 0}, "vocab_size", "0"),
    ({"relative_attention_num_buckets": 0}, "relative_attention_num_buckets", "0"),
    ({"relative_attention_num_buckets": 2, "relative_attention_max_distance": 8},
     "relative_attention_num_buckets", "2"),
    ({"d_model": "32"}, "d_model", "'32'"),
    ({"d_model": 32.0}, "d_model", "32.0"),
    ({"num_heads": True}, "num_heads", "True"),
    ({"vocab_size": [64]}, "vocab_size", "[64]"),
    ({"use_moe": "yes"}, "use_moe", "'yes'"),
    ({"tie_word_embeddings": 1}, "tie_word_embeddings", "1"),
    ({"use_absolute_position_embedding": "false"}, "use_absolute_position_embedding", "'false'"),
    ({"moe_route_scale": "2"}, "moe_route_scale", "'2'"),
    ({"layer_norm_epsilon": "1e-6"}, "layer_norm_epsilon", "'1e-6'"),
    ({"layer_norm_epsilon": 0}, "layer_norm_epsilon", "0"),
    ({"layer_norm_epsilon": math.inf}, "layer_norm_epsilon", "inf"),   # JSON's Infinity, 1e999
    ({"layer_norm_epsilon": 10 ** 400}, "layer_norm_epsilon", "401 digits"),
    ({"num_layers": 1025}, "num_layers", "1025"),                        # built before matched
    ({"num_decoder_layers": 10 ** 8}, "num_decoder_layers", "100000000"),
    ({"use_moe": True, "moe_num_experts": 16385, "moe_topk": 1}, "moe_num_experts", "16385"),
    # widths past 2^20 and vocabularies past 2^31 - 1 failed inside torch as the model was built
    ({"d_ff": 2 ** 62}, "d_ff", str(2 ** 62)),
    ({"d_kv": 2 ** 21}, "d_kv", str(2 ** 21)),
    ({"num_heads": 2 ** 40, "num_key_value_heads": 1}, "num_heads", str(2 ** 40)),
    ({"relative_attention_num_buckets": 2 ** 62, "relative_attention_max_distance": 2 ** 70},
     "relative_attention_num_buckets", str(2 ** 62)),
    ({"vocab_size": 2 ** 31}, "vocab_size", str(2 ** 31)),
    ({"use_moe": True, "moe_inter_dim": 2 ** 62}, "moe_inter_dim", str(2 ** 62)),
    ({"use_moe": True, "moe_use_shared_experts": True, "moe_num_shared_experts": 2 ** 40},
     "moe_num_shared_experts", str(2 ** 40)),
    ({"model_type": "bert"}, "model_type", "'bert'"),
    ({"model_type": "T5"}, "model_type", "'T5'"),
    ({"bos_token_id": 64}, "bos_token_id", "64"),
    ({"bos_token_id": -1}, "bos_token_id", "-1"),
    ({"relative_attention_num_buckets": 32, "relative_attention_max_distance": 16},
     "relative_attention_max_distance", "16"),
    ({"relative_attention_num_buckets": 8, "relative_attention_max_distance": 3},
     "relative_attention_max_distance", "3"),
    ({"torch_dtype": "int8"}, "torch_dtype", "'int8'"),
    ({"torch_dtype": "float64"}, "torch_dtype", "'float64'"),
    ({"use_moe": True, "moe_topk": 9, "moe_num_experts": 8}, "moe_topk", "9"),
    ({"use_moe": True, "moe_topk": 0}, "moe_topk", "0"),
    ({"use_moe": True, "moe_num_experts": 0}, "moe_num_experts", "0"),
    ({"use_moe": True, "moe_inter_dim": 0}, "moe_inter_dim", "0"),
    ({"use_moe": True, "moe_use_shared_experts": True}, "moe_num_shared_experts", "0"),
]


@pytest.mark.parametrize("changes,key,value", REFUSALS, ids=[f"{k}={v}" for _, k, v in REFUSALS])
def test_refusals_name_key_and_value(changes, key, value):
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dict({**SMALL, **changes})
    message = str(info.value)
    assert key in message, message
    assert value in message.replace(key, ""), message


def test_t5_refusals_name_key_and_value():
    with pytest.raises(ValueError, match=r"decoder_start_token_id.*got 64"):
        ModelConfig.from_dict(dict(T5_RAW, decoder_start_token_id=64))
    with pytest.raises(ValueError, match=r"'torch_dtype'.*'int4'"):
        ModelConfig.from_dict(dict(T5_RAW, dtype="int4"))
    with pytest.raises(ValueError, match=r"'num_heads'.*'4'"):
        ModelConfig.from_dict(dict(T5_RAW, num_heads="4"))


def test_limits_are_inclusive():
    """The smallest accepted values next to the refused ones above."""
    ModelConfig.from_dict({**SMALL, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 17})
    ModelConfig.from_dict({**SMALL, "relative_attention_num_buckets": 4, "relative_attention_max_distance": 3})
    ModelConfig.from_dict({**SMALL, "bos_token_id": 63})
    ModelConfig.from_dict({**SMALL, "use_moe": True, "moe_topk": 8, "moe_num_experts": 8})
    ModelConfig.from_dict({**SMALL, "d_ff": 2 ** 20, "vocab_size": 2 ** 31 - 1})
    # absolute mode has no buckets to check; MoE keys are not checked without MoE
    ModelConfig.from_dict({**SMALL, "use_absolute_position_embedding": True, "relative_attention_max_distance": 2})
    ModelConfig.from_dict({**SMALL, "moe_topk": 99, "moe_use_shared_experts": True})


def test_config_files_that_are_not_json_text_name_the_file(tmp_path):
    """A FIFO blocked the read, /dev/zero read until memory ran out, and bytes that are not
    UTF-8 or nest too deep raised without the file's name."""
    path = tmp_path / "config.json"
    os.mkfifo(path)
    with pytest.raises(ValueError, match=r"config.json: not a regular file \(a FIFO\)"):
        ModelConfig.from_file(path)
    path.unlink()
    path.symlink_to("/dev/zero")
    with pytest.raises(ValueError, match=r"config.json: not a regular file \(a character device\)"):
        ModelConfig.from_file(path)
    path.unlink()
    path.write_bytes(b"\xff{}")
    with pytest.raises(ValueError, match=r"config.json is not UTF-8 text"):
        ModelConfig.from_file(path)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ValueError, match=r"config.json: JSON nested too deeply"):
        ModelConfig.from_file(path)


def test_a_model_directory_that_is_not_one_is_named(tmp_path):
    """`xrec serve --model FILE` said "no config.json at FILE/config.json"; now it says the path
    is not a directory."""
    from xrec.config import read_model_config
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"model directory {file} is not a directory"):
        read_model_config(file / "config.json")
    with pytest.raises(ValueError, match=rf"^no config.json at {tmp_path / 'config.json'}$"):
        read_model_config(tmp_path / "config.json")


def test_from_file_errors(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig.from_file(tmp_path / "config.json")
    path = tmp_path / "config.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        ModelConfig.from_file(path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object.*list"):
        ModelConfig.from_file(path)
    path.write_text(json.dumps(SMALL))
    assert ModelConfig.from_file(path) == ModelConfig.from_dict(SMALL)


# ---------------------------------------------------------------------------
# round trip
# ---------------------------------------------------------------------------

ROUND_TRIP = {
    **{name: cfg for name, cfg in MODEL_SIZES.items() if isinstance(cfg, ModelConfig)},
    "t5": ModelConfig.from_dict(dict(T5_RAW, decoder_start_token_id=3)),
    "everything": ModelConfig.from_dict({**SMALL, "decoder_num_heads": 2, "decoder_d_kv": 6,
                                         "num_key_value_heads": 2, "decoder_num_key_value_heads": 1,
                                         "use_moe": True, "moe_num_experts": 3, "moe_topk": 1,
                                         "moe_inter_dim": 8, "moe_route_scale": 0.5, "moe_use_shared_experts": True,
                                         "moe_num_shared_experts": 2, "tie_word_embeddings": False,
                                         "use_absolute_position_embedding": True, "bos_token_id": 5,
                                         "layer_norm_epsilon": 1e-5, "torch_dtype": "float16"}),
}


@pytest.mark.parametrize("name", list(ROUND_TRIP))
def test_to_dict_from_dict_round_trip(name, tmp_path):
    cfg = ROUND_TRIP[name]
    raw = cfg.to_dict()
    assert raw["model_type"] == "onerec"
    # written with xllm's keys
    for key in ("num_layers", "d_kv", "decoder_d_kv", "num_key_value_heads", "decoder_num_key_value_heads"):
        assert raw[key] == _field(cfg, key)
    for field in FIELD_OF.values():
        assert field not in raw
    assert ModelConfig.from_dict(raw) == cfg
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert ModelConfig.from_file(tmp_path / "config.json") == cfg


def test_replace_validates():
    cfg = MODEL_SIZES["tiny"]
    assert cfg.replace(vocab_size=100).vocab_size == 100
    with pytest.raises(ValueError, match="vocab_size.*0"):
        cfg.replace(vocab_size=0)
    with pytest.raises(ValueError, match="bos_token_id.*64"):
        cfg.replace(bos_token_id=64)


# ---------------------------------------------------------------------------
# engine options
# ---------------------------------------------------------------------------

def test_engine_option_defaults_are_valid():
    options = EngineOptions()
    assert options.max_top_k >= options.max_beam_width >= options.default_beam_width
    assert EngineOptions.from_kwargs(rounds=2, max_beam_width=64, default_beam_width=16).rounds == 2


ENGINE_REFUSALS = [
    ({"max_beam_width": 0}, "max_beam_width", "0"),
    ({"rounds": 65}, "rounds", "65"),
    ({"rounds": 0}, "rounds", "0"),
    ({"max_seqs_per_batch": True}, "max_seqs_per_batch", "True"),
    ({"max_tokens_per_batch": 1.5}, "max_tokens_per_batch", "1.5"),
    ({"max_concurrency": 0}, "max_concurrency", "0"),
    ({"num_threads": -2}, "num_threads", "-2"),
    ({"max_top_k": 100, "max_beam_width": 128}, "max_top_k", "100"),
    ({"default_beam_width": 600}, "default_beam_width", "600"),
    ({"max_beam_width": 512, "max_beams_per_batch": 256}, "max_beam_width", "512"),
    ({"max_memory_utilization": 0}, "max_memory_utilization", "0"),
    ({"max_memory_utilization": 1.5}, "max_memory_utilization", "1.5"),
    ({"normalize": "softmax"}, "normalize", "'softmax'"),
    ({"dtype": "int8"}, "dtype", "'int8'"),
    ({"device": "tpu"}, "device", "'tpu'"),
    # accepted here, then torch's RuntimeError at load
    ({"device": "cuda:x"}, "device", "'cuda:x'"),
    ({"device": "cuda:-1"}, "device", "'cuda:-1'"),
    ({"device": "cuda:"}, "device", "'cuda:'"),
    ({"device": "cuda:01"}, "device", "'cuda:01'"),
    ({"batch_wait_ms": -1}, "batch_wait_ms", "-1"),
    ({"request_timeout_ms": 0}, "request_timeout_ms", "0"),
    ({"each_conversion_threshold": -1}, "each_conversion_threshold", "-1"),
    ({"retain_host_memory": "yes"}, "retain_host_memory", "'yes'"),
]


@pytest.mark.parametrize("changes,key,value", ENGINE_REFUSALS, ids=[f"{k}={v}" for _, k, v in ENGINE_REFUSALS])
def test_engine_option_refusals(changes, key, value):
    with pytest.raises(ValueError) as info:
        EngineOptions(**changes)
    message = str(info.value)
    assert key in message and f"got {value}" in message, message


def test_unknown_dtype_names_the_allowed_values():
    with pytest.raises(ValueError, match=r"^option dtype: got 'fp64', allowed: 'auto', float32, "
                                         r"bfloat16, float16$"):
        EngineOptions(dtype="fp64")


def test_engine_options_unknown_name():
    with pytest.raises(ValueError, match=r"unknown engine option.*'beam_with'"):
        EngineOptions.from_kwargs(beam_with=4)
