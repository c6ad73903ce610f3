"""The decoder-only family against its oracles (docs/model.md, docs/quality.md).

* Hugging Face Qwen2 / Qwen3 / Qwen3-MoE: the logits of a ragged batch's prompts (round 0)
  and of every decode round (per-beam K/V, reordered between rounds) through xrec's
  `prefill` / `decode_step`; the whole constrained search with `normalize="full"` equal to
  `generate(prefix_allowed_tokens_fn=trie)` on ragged batches, W in {4, 16, 64}, N < W and
  N = W, with and without a catalog.
* The float64 naive reference for what `generate` cannot do: "allowed" normalisation,
  N > W, temperature, mixed requests in one batch.
* Checkpoint and request errors of this family.
"""

from __future__ import annotations

import json
import random
import re
import shutil

import numpy as np
import pytest
import torch

from oracles.hf_causal import PAD, hf_causal_beam_search, hf_causal_logits, make_hf_causal
from oracles.naive import assert_beams_close
from oracles.naive_causal import NaiveCausalLM, naive_causal_beam_search
from xrec import Engine, RecRequest
from xrec.catalog import ItemCatalog
from xrec.errors import InvalidArgument
from xrec.model.inputs import ModelInputs
from xrec.model.loader import CheckpointError, load_model

pytest.importorskip("transformers")

VOCAB = 96
PROMPTS = [[5, 9, 13], [7, 3, 22, 40, 41, 50, 2], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]]
SCORE_ATOL = 1e-4
# kind -> make_hf_causal options
VARIANTS = {
    "qwen2": dict(kind="qwen2"),
    "qwen3": dict(kind="qwen3"),
    "qwen3-untied-bias": dict(kind="qwen3", tie_word_embeddings=False, attention_bias=True),
    "qwen3_moe": dict(kind="qwen3_moe", norm_topk_prob=True, mlp_only_layers=(1,)),
}


def random_triples(seed: int, size: int) -> list[tuple[int, int, int]]:
    """`size` distinct triples over [1, VOCAB) (never the pad id)."""
    rng = random.Random(seed)
    triples: set[tuple[int, int, int]] = set()
    while len(triples) < size:
        triples.add(tuple(rng.randrange(PAD + 1, VOCAB) for _ in range(3)))
    return sorted(triples)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """variant -> (HF model, directory, naive model), built once."""
    cache = {}

    def get(variant: str):
        if variant not in cache:
            hf, directory = make_hf_causal(tmp_path_factory.mktemp(variant), seed=len(cache) + 3,
                                           vocab_size=VOCAB, **VARIANTS[variant])
            cache[variant] = (hf, directory, NaiveCausalLM.from_dir(directory))
        return cache[variant]
    return get


@pytest.fixture(scope="module")
def engines(models):
    """(variant, catalog size or None) -> Engine on that model (closed at the end)."""
    cache = {}

    def get(variant: str, num_items: int | None):
        key = (variant, num_items)
        if key not in cache:
            _, directory, _ = models(variant)
            catalog = None if num_items is None else ItemCatalog.from_arrays(
                np.arange(num_items), np.array(random_triples(num_items, num_items)), VOCAB)
            cache[key] = Engine.from_pretrained(directory, isolation="thread",
                                                catalog=catalog, max_input_len=64)
        return cache[key]
    yield get
    for engine in cache.values():
        engine.close()


def results_of(response) -> list[tuple[tuple[int, ...], float, list[float]]]:
    return [(c.tokens, c.score, list(c.token_logprobs)) for c in response.results]


# ---------------------------------------------------------------------------
# logits: prompt and decode rounds
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prompt_and_round_logits_match_hf(models, variant):
    hf, directory, _ = models(variant)
    model = load_model(directory, "cpu", torch.float32)
    lengths = [len(p) for p in PROMPTS]
    ids = torch.zeros(len(PROMPTS), max(lengths), dtype=torch.long)
    for b, prompt in enumerate(PROMPTS):
        ids[b, :len(prompt)] = torch.tensor(prompt)
    with torch.inference_mode():
        last, context = model.prefill(ModelInputs(ids, lengths, [], None, [], None, [0] * len(PROMPTS)))
        logits = model.logits(last)                                          # [B, V]
        for b, prompt in enumerate(PROMPTS):
            torch.testing.assert_close(logits[b], hf_causal_logits(hf, prompt)[-1], rtol=0, atol=2e-5)
        # three rounds of 4 beams: each round feeds a token per beam, then reorders the beams
        num_beams, rounds = 4, 3
        gen = torch.Generator().manual_seed(1)
        beams = model.new_beam_kv(len(PROMPTS), num_beams, rounds + 1)
        seqs = [[[] for _ in range(num_beams)] for _ in PROMPTS]
        for r in range(1, rounds + 1):
            feed = torch.randint(1, VOCAB, (len(PROMPTS), num_beams), generator=gen)
            for b in range(len(PROMPTS)):
                for w in range(num_beams):
                    seqs[b][w].append(int(feed[b, w]))
            step = model.logits(model.decode_step(feed, r, context, beams))   # [B, W, V]
            for b, prompt in enumerate(PROMPTS):
                for w in range(num_beams):
                    want = hf_causal_logits(hf, prompt + seqs[b][w])[-1]
                    torch.testing.assert_close(step[b, w], want, rtol=0, atol=3e-5)
            parents = torch.randint(0, num_beams, (len(PROMPTS), num_beams), generator=gen)
            beams.reorder((parents + torch.arange(len(PROMPTS)).unsqueeze(1) * num_beams).flatten(),
                          num_written=r)
            seqs = [[list(seqs[b][int(p)]) for p in parents[b]] for b in range(len(PROMPTS))]


# ---------------------------------------------------------------------------
# the whole search against generate ("full")
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("variant,width,num_results,num_items", [
    ("qwen3", 4, 4, 60), ("qwen3", 16, 5, 300), ("qwen3", 64, 64, 300), ("qwen3", 16, 16, None),
    ("qwen2", 16, 16, 300), ("qwen2", 4, 2, None),
    ("qwen3-untied-bias", 16, 7, 300), ("qwen3_moe", 16, 16, 300), ("qwen3_moe", 4, 3, None),
])
def test_full_search_equals_generate(models, engines, variant, width, num_results, num_items):
    hf, _, _ = models(variant)
    engine = engines(variant, num_items)
    triples = None if num_items is None else random_triples(num_items, num_items)
    want = hf_causal_beam_search(hf, PROMPTS, beam_width=width, num_return_sequences=num_results,
                                 catalog_triples=triples)
    got = engine.recommend([RecRequest(token_ids=p, beam_width=width, num_return_sequences=num_results,
                                       normalize="full") for p in PROMPTS])
    for b, response in enumerate(got):
        assert_beams_close(results_of(response), want[b], atol=SCORE_ATOL, what=f"request {b}")
        if triples is not None:
            assert all(c.tokens in set(triples) and c.items for c in response.results)


# ---------------------------------------------------------------------------
# against the naive reference: allowed, N > W, temperature, a mixed batch
# ---------------------------------------------------------------------------

MIXED = [
    dict(token_ids=PROMPTS[0], beam_width=4),
    dict(token_ids=PROMPTS[1], beam_width=8, num_return_sequences=20, normalize="full"),
    dict(token_ids=PROMPTS[2], beam_width=6, num_return_sequences=2, temperature=0.7),
    dict(token_ids=[30, 31], beam_width=1, num_return_sequences=3),
    dict(token_ids=PROMPTS[1][:5], beam_width=8, temperature=1.5, normalize="full"),
]


@pytest.mark.parametrize("variant,num_items", [("qwen3", 300), ("qwen3_moe", 300), ("qwen2", None)])
def test_mixed_batch_matches_naive(models, engines, variant, num_items):
    _, _, naive = models(variant)
    engine = engines(variant, num_items)
    triples = None if num_items is None else random_triples(num_items, num_items)
    got = engine.recommend([RecRequest(**kw) for kw in MIXED])
    for index, (kw, response) in enumerate(zip(MIXED, got)):
        want = naive_causal_beam_search(naive, token_ids=kw["token_ids"], beam_width=kw["beam_width"],
                                        num_return_sequences=kw.get("num_return_sequences"),
                                        normalize=kw.get("normalize", "allowed"), catalog_triples=triples,
                                        temperature=kw.get("temperature", 1.0))
        assert_beams_close(results_of(response), want, atol=SCORE_ATOL, what=f"request {index}")
        for candidate, expected in zip(response.results, want):
            assert np.allclose(candidate.token_logprobs, expected[2], atol=SCORE_ATOL)


def test_results_do_not_depend_on_the_batch(engines):
    engine = engines("qwen3", 300)
    requests = [RecRequest(**kw) for kw in MIXED]
    together = engine.recommend(requests)
    for index, request in enumerate(requests):
        alone, = engine.recommend([request])
        assert_beams_close(results_of(alone), results_of(together[index]), atol=1e-5,
                           what=f"request {index}")


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,words", [
    (dict(sparse_embedding=np.zeros((3, 32), np.float32)), ["sparse_embedding", "decoder-only"]),
    (dict(token_ids=[1, 2], decoder_context_embedding=np.zeros((1, 32), np.float32)),
     ["decoder_context_embedding", "decoder-only"]),
    (dict(prompt="hello"), ["prompt", "tokenizer.json"]),
    (dict(messages=[{"role": "user", "content": "hi"}]), ["messages", "tokenizer.json"]),
    (dict(token_ids=[1] * 65), ["token_ids", "max_input_len=64"]),
    (dict(token_ids=[1, VOCAB]), ["token_ids", str(VOCAB)]),
    (dict(token_ids=[1], prompt="x"), ["both", "token_ids", "prompt"]),
])
def test_bad_requests_name_the_field(engines, kwargs, words):
    engine = engines("qwen3", 60)
    with pytest.raises(InvalidArgument) as info:
        engine.recommend([RecRequest(**kwargs)])
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert len(engine.recommend([RecRequest(token_ids=[1, 2], beam_width=4)])[0].results) == 4


def test_prompt_beyond_max_position_embeddings(models):
    _, directory, _ = models("qwen3")   # max_position_embeddings 512, 3 rounds: 510 prompt positions
    with Engine.from_pretrained(directory, isolation="thread", max_input_len=1024) as engine:
        assert engine.recommend([RecRequest(token_ids=[1] * 510, beam_width=2)])[0].results
        with pytest.raises(InvalidArgument, match="token_ids.*511.*max_position_embeddings"):
            engine.recommend([RecRequest(token_ids=[1] * 511, beam_width=2)])


def test_a_model_that_holds_no_prompt_is_refused_at_start(models, tmp_path):
    """max_position_embeddings at or below the generated tokens (plus the generation prefix)
    leaves no position for a prompt: the engine started, then refused every request with a
    limit of -1 positions."""
    _, directory, _ = models("qwen3")
    small = tmp_path / "small"
    shutil.copytree(directory, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 3}))
    with Engine.from_pretrained(small, isolation="thread") as engine:   # 3 rounds: 1 position
        assert engine.recommend([RecRequest(token_ids=[1], beam_width=2)])[0].results
    with pytest.raises(ValueError, match="max_position_embeddings.*got 3.*holds no prompt.*at least 5"):
        Engine.from_pretrained(small, isolation="thread", generation_prefix=[17, 18])
    (small / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 2}))
    with pytest.raises(ValueError, match="max_position_embeddings.*got 2.*holds no prompt.*at least 3"):
        Engine.from_pretrained(small, isolation="thread")


def test_generation_prefix_ids_are_appended(models, engines):
    _, directory, naive = models("qwen3")
    with Engine.from_pretrained(directory, isolation="thread", generation_prefix=[17, 18]) as engine:
        got, = engine.recommend([RecRequest(token_ids=PROMPTS[0], beam_width=4)])
    assert got.usage["input_tokens"] == len(PROMPTS[0]) + 2
    want = naive_causal_beam_search(naive, token_ids=PROMPTS[0] + [17, 18], beam_width=4)
    assert_beams_close(results_of(got), want, atol=SCORE_ATOL)
    with pytest.raises(ValueError, match="generation_prefix.*text.*tokenizer"):
        Engine.from_pretrained(directory, isolation="thread", generation_prefix="<|sid_begin|>")
    with pytest.raises(ValueError, match="generation_prefix.*vocabulary"):
        Engine.from_pretrained(directory, isolation="thread", generation_prefix=[VOCAB])


def test_checkpoint_missing_q_norm_is_named(models, tmp_path):
    from safetensors.torch import load_file, save_file
    _, directory, _ = models("qwen3")
    for name in ("config.json", "generation_config.json"):
        if (directory / name).exists():
            (tmp_path / name).write_text((directory / name).read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.1.self_attn.q_norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.self_attn\.q_norm\.weight"):
        load_model(tmp_path)


def test_tied_checkpoint_with_a_different_lm_head_is_refused(models, tmp_path):
    """tie_word_embeddings true and an lm_head.weight that differs from the embedding: xrec
    served the embedding without a word, transformers 5 serves the lm_head (it unties them,
    with a warning), 4.x the embedding. Refused, naming both tensors. An equal copy is dropped,
    and an lm_head alone is the embedding (transformers ties them that way round too)."""
    from safetensors.torch import load_file, save_file
    hf, directory, _ = models("qwen3")
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    tensors = load_file(str(directory / "model.safetensors"))
    embedding = tensors["model.embed_tokens.weight"]
    save_file({**tensors, "lm_head.weight": embedding + 0.5}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"'lm_head.weight' \[96, 32\] differs from "
                                              r"'model.embed_tokens.weight'.*tie_word_embeddings=true"):
        load_model(tmp_path)
    save_file({**tensors, "lm_head.weight": embedding.clone()}, str(tmp_path / "model.safetensors"))
    assert torch.equal(load_model(tmp_path, dtype=torch.float32).head_weight()[0], embedding)
    alone = {n: t for n, t in tensors.items() if n != "model.embed_tokens.weight"}
    save_file({**alone, "lm_head.weight": embedding}, str(tmp_path / "model.safetensors"))
    model = load_model(tmp_path, dtype=torch.float32)
    assert torch.equal(model.embed(torch.tensor([3])), embedding[3:4])


def test_unknown_model_type_is_refused(models, tmp_path):
    _, directory, _ = models("qwen3")
    raw = json.loads((directory / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type.*llama.*qwen3"):
        load_model(tmp_path)


# config.json RoPE settings -> (keys to drop, keys to set, None if xrec reads it as Hugging Face
# does, else the words of its refusal). The saved file says rope_parameters {default, 10000}.
ROPE_SETTINGS = {
    # transformers 5 reads rope_theta inside rope_scaling before the top-level key: theta 500
    "theta_in_rope_scaling": (("rope_parameters",), {"rope_scaling": {"rope_type": "default", "rope_theta": 500.0}},
                              None),
    # a rope_scaling dict replaces rope_parameters in transformers 5 (4.x never reads the latter): 10000
    "rope_scaling_hides_rope_parameters": ((), {"rope_scaling": {"rope_type": "default"},
                                                "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}},
                                           None),
    # an edited top-level rope_theta: transformers 5 keeps rope_parameters' 10000, 4.x reads 500
    "top_level_theta_differs": ((), {"rope_theta": 500.0}, "rope_theta=500.0, rope_parameters.rope_theta=10000.0"),
    # transformers 5 reads the older key "type" where "rope_type" is absent: linear scaling
    "linear_as_type": ((), {"rope_parameters": {"type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
                       "config key 'rope_parameters.type': got 'linear'"),
}


def _hf_from_dir(directory):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.mark.parametrize("setting", list(ROPE_SETTINGS))
def test_rope_settings_are_read_as_hugging_face_reads_them_or_refused(models, tmp_path, setting):
    """xrec serves Hugging Face's logits for each setting or refuses it, naming the keys; it
    served plain RoPE at another theta than transformers 5 without a word."""
    _, directory, _ = models("qwen3")
    drop, change, refusal = ROPE_SETTINGS[setting]
    raw = json.loads((directory / "config.json").read_text())
    raw = {**{k: v for k, v in raw.items() if k not in drop}, **change}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    prompt = list(range(1, 40))
    with torch.inference_mode():
        want = hf_causal_logits(_hf_from_dir(tmp_path), prompt)[-1]
    if refusal is not None:
        with pytest.raises(ValueError, match=re.escape(refusal)):
            load_model(tmp_path, "cpu", torch.float32)
        return
    model = load_model(tmp_path, "cpu", torch.float32)
    with torch.inference_mode():
        last, _ = model.prefill(ModelInputs(torch.tensor([prompt]), [len(prompt)], [], None, [], None, [0]))
        torch.testing.assert_close(model.logits(last)[0], want, rtol=0, atol=2e-5)


# a config.json without num_key_value_heads / head_dim (make_hf_causal options, keys dropped): transformers
# then takes 32 K/V heads (qwen3_moe: 4) and, for qwen3, a head_dim of 128
MISSING_HEAD_KEYS = {
    "qwen3_moe-kv": (dict(kind="qwen3_moe", num_heads=8, num_kv_heads=4, head_dim=4), ("num_key_value_heads",)),
    "qwen3-head_dim": (dict(kind="qwen3", num_heads=2, num_kv_heads=2, head_dim=128), ("head_dim",)),
    "qwen2-both": (dict(kind="qwen2", num_heads=64, num_kv_heads=32, head_dim=2, hidden_size=128),
                   ("num_key_value_heads", "head_dim")),
}


@pytest.mark.parametrize("case", list(MISSING_HEAD_KEYS))
def test_missing_head_keys_take_hugging_face_defaults(tmp_path, case):
    """Without the key xrec took num_attention_heads K/V heads and hidden / heads per head:
    checkpoints transformers loads were refused as not matching config.json. A default that does
    not divide the heads is refused, naming the key."""
    options, dropped = MISSING_HEAD_KEYS[case]
    _, directory = make_hf_causal(tmp_path, seed=5, vocab_size=VOCAB, **options)
    raw = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k not in dropped}))
    prompt = list(range(1, 20))
    with torch.inference_mode():
        want = hf_causal_logits(_hf_from_dir(directory), prompt)[-1]
        model = load_model(directory, "cpu", torch.float32)
        last, _ = model.prefill(ModelInputs(torch.tensor([prompt]), [len(prompt)], [], None, [], None, [0]))
        torch.testing.assert_close(model.logits(last)[0], want, rtol=0, atol=2e-5)
    raw = {k: v for k, v in raw.items() if k != "num_key_value_heads"}
    (directory / "config.json").write_text(json.dumps({**raw, "num_attention_heads": 6, "head_dim": 4}))
    with pytest.raises(ValueError, match="'num_key_value_heads' is missing: transformers then takes "
                                         f"{4 if options['kind'] == 'qwen3_moe' else 32}"):
        load_model(directory, "cpu", torch.float32)


def test_expert_counts_that_disagree_are_refused(models, tmp_path):
    """transformers 5 writes num_local_experts and reads it over num_experts; 4.x reads
    num_experts only. With both, xrec read num_experts (and refused the checkpoint transformers 5
    serves as not matching config.json); two values are refused naming both keys, one is read."""
    _, directory, _ = models("qwen3_moe")
    raw = json.loads((directory / "config.json").read_text())
    assert raw["num_local_experts"] == 4 and "num_experts" not in raw
    (tmp_path / "model.safetensors").write_bytes((directory / "model.safetensors").read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_experts": 7}))
    with pytest.raises(ValueError, match="num_experts=7, num_local_experts=4 disagree"):
        load_model(tmp_path, "cpu", torch.float32)
    (tmp_path / "config.json").write_text(json.dumps({**raw, "num_experts": 4}))
    prompt = PROMPTS[1]
    model = load_model(tmp_path, "cpu", torch.float32)
    with torch.inference_mode():
        last, _ = model.prefill(ModelInputs(torch.tensor([prompt]), [len(prompt)], [], None, [], None, [0]))
        torch.testing.assert_close(model.logits(last)[0], hf_causal_logits(_hf_from_dir(tmp_path), prompt)[-1],
                                   rtol=0, atol=2e-5)


def test_catalog_tokens_the_tokenizer_does_not_know_are_refused(tmp_path):
    from xrec.demo import write_random_model
    from xrec.catalog.sid_vocab import SidLayout

    directory = write_random_model(tmp_path / "sid", "qwen3-sid-test", seed=1, num_items=50)
    layout = SidLayout(num_base_tokens=512, codebook_size=16)
    unknown = layout.num_tokens          # padding past the last token: no string for it
    known = [layout.itemic_id(level, 1) for level in range(3)]
    catalog = ItemCatalog.from_arrays([11, 12], [known, [known[0], unknown, known[2]]],
                                      layout.vocab_size)
    with pytest.raises(ValueError, match=rf"item 12 has token {unknown} at level 1.*tokenizer"):
        Engine.from_pretrained(directory, isolation="thread", catalog=catalog)
    with Engine.from_pretrained(directory, isolation="thread",
                                catalog=ItemCatalog.from_arrays([11], [known],
                                                                           layout.vocab_size)) as engine:
        result, = engine.recommend([RecRequest(prompt="hello", beam_width=2)])[0].results
    assert result.items[0].item_id == 11 and result.text == "<s_a_1><s_b_1><s_c_1>"
