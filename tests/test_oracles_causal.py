"""Validate the decoder-only oracles against each other before the engine is checked against them.

* the naive float64 causal LM (tests/oracles/naive_causal.py) reproduces Hugging Face Qwen2 (q/k/v biases),
  Qwen3 (q/k norm; attention_bias off and on, o_proj bias included; tied and untied head; head_dim !=
  hidden/heads) and Qwen3-MoE (norm_topk_prob off and on; decoder_sparse_step=2; mlp_only_layers) logits,
  read back from the saved directory;
* the naive beam search (normalize="full") reproduces `generate` beam search on a LEFT-padded ragged batch
  (tokens and order, scores), W in {4, 16}, N < W and N = W, with and without a catalog trie;
* the naive beam search equals exhaustive scoring of every catalog triple when the beam is wide enough, in
  both normalisations and with temperature; N > W widens only the last round; ties follow docs/beam-search.md;
* the facts about transformers 5.24 documented in oracles/hf_causal.py (saved names and config keys).
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

from oracles.naive import assert_beams_close, build_trie, round_log_probs
from oracles.naive_causal import NaiveCausalLM, causal_moe_ffn, naive_causal_beam_search, rope

pytest.importorskip("transformers")

PAD = 0

# name -> make_hf_causal keyword arguments; one model per feature the engine must get right
MODELS = {
    "qwen2": dict(kind="qwen2", seed=1),
    "qwen3": dict(kind="qwen3", seed=2, vocab_size=40),
    "qwen3_bias_untied": dict(kind="qwen3", seed=3, attention_bias=True, tie_word_embeddings=False, head_dim=12,
                              rope_theta=1e6),
    "moe_sparse_step": dict(kind="qwen3_moe", seed=4, decoder_sparse_step=2, tie_word_embeddings=False),
    "moe_norm_mlp_only": dict(kind="qwen3_moe", seed=5, num_layers=3, norm_topk_prob=True, mlp_only_layers=(1,)),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny float64 ops gain nothing from intra-op threads, and on a shared 2-core machine OpenMP's
    spinning makes them 10-50x slower: run this module on one thread, then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (hf model, directory, NaiveCausalLM read back from the directory)."""
    from oracles.hf_causal import make_hf_causal

    out = {}
    for name, kw in MODELS.items():
        model, directory = make_hf_causal(tmp_path_factory.mktemp(name), **kw)
        out[name] = (model, directory, NaiveCausalLM.from_dir(directory))
    return out


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |a - e| / max |e| (a float32 result against a float64 reference)."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    actual, expected = actual.to(torch.float64), expected.to(torch.float64)
    return float((actual - expected).abs().max() / expected.abs().max())


def _catalog(seed: int, size: int, vocab: int, *, num_first: int = 12, num_second: int = 10) -> list[tuple]:
    """`size` distinct triples avoiding PAD; first and second tokens from small pools so that prefixes are
    shared and beams compete (12 first tokens < W=16: HF keeps -1e9 placeholder beams after round 0)."""
    rng = random.Random(seed)
    firsts = rng.sample(range(1, vocab), num_first)
    seconds = rng.sample(range(1, vocab), num_second)
    triples: set[tuple[int, int, int]] = set()
    while len(triples) < size:
        triples.add((rng.choice(firsts), rng.choice(seconds), rng.randrange(1, vocab)))
    return sorted(triples)


def _prompts(seed: int, vocab: int, lengths=(3, 7, 12)) -> list[list[int]]:
    """Ragged prompts; the second one holds the PAD id (masked only where it pads, not inside a prompt)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]
    if len(prompts) > 1:
        prompts[1][len(prompts[1]) // 2] = PAD
    return prompts


# ---------------------------------------------------------------------------
# saved directory: the transformers 5.24 facts hf_causal.py documents
# ---------------------------------------------------------------------------

def test_saved_directory(models):
    from safetensors.torch import load_file

    for name, (model, directory, naive) in models.items():
        raw = json.loads((directory / "config.json").read_text())
        kw = MODELS[name]
        assert raw["model_type"] == kw["kind"]
        assert raw["eos_token_id"] is None and raw["bos_token_id"] is None and raw["pad_token_id"] == PAD
        assert model.generation_config.eos_token_id is None
        assert "eos_token_id" not in json.loads((directory / "generation_config.json").read_text())
        assert "rope_theta" not in raw and "rope_scaling" not in raw
        assert raw["use_sliding_window"] is False and raw["sliding_window"] is None
        assert raw.get("layer_types", ["full_attention"]) == ["full_attention"] * len(raw.get("layer_types", [0]))
        assert raw["rope_parameters"] == {"rope_theta": kw.get("rope_theta", 10000.0), "rope_type": "default"}
        assert raw["head_dim"] == kw.get("head_dim", 8)
        assert raw["tie_word_embeddings"] == kw.get("tie_word_embeddings", True)
        saved = load_file(str(directory / "model.safetensors"))
        assert ("lm_head.weight" in saved) == (not raw["tie_word_embeddings"])
        attn = "model.layers.0.self_attn"
        has_bias = kw["kind"] == "qwen2" or kw.get("attention_bias", False)
        for proj in "qkv":
            assert (f"{attn}.{proj}_proj.bias" in saved) == has_bias
            if has_bias:
                assert float(saved[f"{attn}.{proj}_proj.bias"].abs().max()) > 0.5
        assert (f"{attn}.o_proj.bias" in saved) == (kw["kind"] != "qwen2" and has_bias)
        assert (f"{attn}.q_norm.weight" in saved) == (kw["kind"] != "qwen2")
        if kw["kind"] == "qwen3_moe":
            assert "num_experts" not in raw and raw["num_local_experts"] == 4
            assert raw["mlp_only_layers"] == list(kw.get("mlp_only_layers", ()))
            moe_layers = [i for i in range(raw["num_hidden_layers"]) if naive.is_moe_layer(i)]
            assert moe_layers == {"moe_sparse_step": [1], "moe_norm_mlp_only": [0, 2]}[name]
            for i in range(raw["num_hidden_layers"]):
                p = f"model.layers.{i}.mlp"
                assert (f"{p}.gate.weight" in saved) == (i in moe_layers)
                assert (f"{p}.gate_proj.weight" in saved) == (i not in moe_layers)
                if i in moe_layers:
                    # per expert on disk; fused (gate rows first) in memory
                    assert f"{p}.experts.3.up_proj.weight" in saved and f"{p}.experts.gate_up_proj" not in saved
                    fused = model.state_dict()[f"{p}.experts.gate_up_proj"]
                    assert tuple(fused.shape) == (4, 32, 32)
                    assert torch.equal(saved[f"{p}.experts.2.gate_proj.weight"], fused[2, :16])
                    assert torch.equal(saved[f"{p}.experts.2.up_proj.weight"], fused[2, 16:])
                    assert torch.equal(saved[f"{p}.experts.2.down_proj.weight"],
                                       model.state_dict()[f"{p}.experts.down_proj"][2])


def test_naive_reads_memory_and_disk_alike(models):
    """The in-memory state dict (fused experts, tied alias) and config give the same network as the directory."""
    ids = [5, 9, 2, 17, 3]
    for name, (model, _, naive) in models.items():
        again = NaiveCausalLM(model.config.to_dict(), model.state_dict())
        assert torch.equal(again.logits(ids), naive.logits(ids)), name


# ---------------------------------------------------------------------------
# naive network vs Hugging Face
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(MODELS))
def test_logits_match_hf(models, name):
    from oracles.hf_causal import hf_causal_logits

    model, _, naive = models[name]
    g = torch.Generator().manual_seed(7)
    for length in (1, 6, 30):
        ids = torch.randint(0, naive.vocab_size, (length,), generator=g).tolist()
        want = naive.logits(ids)
        got = hf_causal_logits(model, ids)
        assert got.dtype == torch.float32 and want.dtype == torch.float64
        assert _rel_err(got, want) <= 2e-5
        # well-spread logits: the best token's log-prob is far from 0 (beams stay in play)
        assert float(torch.log_softmax(want, -1).max(-1).values.mean()) < -0.7


def test_features_matter(models):
    """Guards against a no-op feature in the test models: each changes the naive logits clearly."""
    ids = list(range(3, 20))

    def changed(naive, **config_changes):
        again = NaiveCausalLM({**naive.raw_config, **config_changes}, naive.sd)
        return float((again.logits(ids) - naive.logits(ids)).abs().max())

    _, _, qwen2 = models["qwen2"]
    no_bias = NaiveCausalLM(qwen2.raw_config, {k: (v * 0 if k.endswith(".bias") else v) for k, v in qwen2.sd.items()})
    assert float((no_bias.logits(ids) - qwen2.logits(ids)).abs().max()) > 0.1
    assert changed(qwen2, rope_parameters={"rope_type": "default", "rope_theta": 50.0}) > 0.1
    _, _, qwen3 = models["qwen3_bias_untied"]
    qk_norms = ("q_norm.weight", "k_norm.weight")
    unit_norms = NaiveCausalLM(qwen3.raw_config, {k: (torch.ones_like(v) if k.endswith(qk_norms) else v)
                                                  for k, v in qwen3.sd.items()})
    assert float((unit_norms.logits(ids) - qwen3.logits(ids)).abs().max()) > 0.1
    for name in ("moe_sparse_step", "moe_norm_mlp_only"):
        _, _, moe = models[name]
        assert changed(moe, norm_topk_prob=not moe.norm_topk_prob) > 0.1
        assert changed(moe, num_experts_per_tok=1) > 0.1
    # routing varies across tokens (not one fixed pair of experts)
    _, _, moe = models["moe_norm_mlp_only"]
    router = moe.w("model.layers.0.mlp.gate.weight")
    x = moe.w("model.embed_tokens.weight")[ids]
    chosen = {tuple(sorted(torch.topk(torch.softmax(router @ row, -1), 2).indices.tolist())) for row in x}
    assert len(chosen) >= 3


def test_naive_refuses_what_it_does_not_implement(models):
    _, _, naive = models["qwen3"]
    for changes, key in [({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling"),
                         ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, "rope_type"),
                         ({"use_sliding_window": True}, "use_sliding_window"),
                         ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
                         ({"model_type": "llama"}, "model_type")]:
        with pytest.raises(ValueError, match=key):
            NaiveCausalLM({**naive.raw_config, **changes}, naive.sd)
    # the older dialect: a top-level rope_theta
    legacy = {k: v for k, v in naive.raw_config.items() if k != "rope_parameters"}
    assert NaiveCausalLM({**legacy, "rope_theta": 10000.0}, naive.sd).rope_theta == 10000.0
    bad = dict(naive.sd)
    bad["model.layers.1.self_attn.k_norm.weight"] = torch.ones(3, dtype=torch.float64)
    with pytest.raises(ValueError, match="layers.1.self_attn.k_norm"):
        NaiveCausalLM(naive.raw_config, bad)


def test_rope_and_moe_by_hand():
    """RoPE of one pair of dims is a plane rotation by pos * theta^(-2i/d); the MoE picks and weights by hand."""
    x = torch.randn(5, 1, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = rope(x, torch.arange(5), 100.0)
    for t in range(5):
        for i in range(3):
            angle = t * 100.0 ** (-2 * i / 6)
            a, b = float(x[t, 0, i]), float(x[t, 0, i + 3])
            assert float(out[t, 0, i]) == pytest.approx(a * math.cos(angle) - b * math.sin(angle), abs=1e-12)
            assert float(out[t, 0, i + 3]) == pytest.approx(b * math.cos(angle) + a * math.sin(angle), abs=1e-12)
    # MoE: router picks experts 2 and 0 (probs .5 / .3 / .2 by construction), each expert returns a constant
    row = torch.tensor([1.0, 0.0], dtype=torch.float64)
    router = torch.tensor([[math.log(0.3), 0.0], [math.log(0.2), 0.0], [math.log(0.5), 0.0]], dtype=torch.float64)

    def constant_expert(c):   # down(silu(gate x) * up x) with gate = up = [1, 0] per unit, down scaled so that out = c
        unit = torch.tensor([[1.0, 0.0]], dtype=torch.float64)
        silu1 = 1.0 / (1.0 + math.exp(-1.0))
        return unit, unit, torch.tensor([[c / silu1], [0.0]], dtype=torch.float64)

    experts = [constant_expert(10.0), constant_expert(100.0), constant_expert(1000.0)]
    plain = causal_moe_ffn(row[None], router, experts, top_k=2, norm_topk_prob=False)
    normed = causal_moe_ffn(row[None], router, experts, top_k=2, norm_topk_prob=True)
    assert float(plain[0, 0]) == pytest.approx(0.5 * 1000 + 0.3 * 10, rel=1e-12)
    assert float(normed[0, 0]) == pytest.approx((0.5 * 1000 + 0.3 * 10) / 0.8, rel=1e-12)


# ---------------------------------------------------------------------------
# naive beam search vs Hugging Face generate
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,width,num_return,use_catalog", [
    ("qwen2", 4, None, True),
    ("qwen2", 16, 5, True),
    ("qwen3", 16, None, False),
    ("qwen3", 4, 1, True),
    ("qwen3_bias_untied", 4, 2, False),
    ("moe_sparse_step", 16, 16, True),
    ("moe_norm_mlp_only", 4, 3, True),
])
def test_beam_search_matches_hf(models, name, width, num_return, use_catalog):
    from oracles.hf_causal import hf_causal_beam_search

    model, _, naive = models[name]
    vocab = naive.vocab_size
    catalog = _catalog(seed=width + vocab, size=40, vocab=vocab) if use_catalog else None
    prompts = _prompts(seed=width, vocab=vocab)
    got = hf_causal_beam_search(model, prompts, beam_width=width, num_return_sequences=num_return,
                                catalog_triples=catalog)
    assert len(got) == len(prompts)
    n = width if num_return is None else num_return
    for i, (prompt, hf_results) in enumerate(zip(prompts, got)):
        want = naive_causal_beam_search(naive, token_ids=prompt, beam_width=width, num_return_sequences=num_return,
                                        normalize="full", catalog_triples=catalog)
        assert len(want) == n
        if catalog is not None:
            assert {tokens for tokens, _, _ in want} <= set(catalog)
        assert_beams_close(hf_results, want, atol=1e-4, what=f"{name} prompt {i}")
        for tokens, score, lps in want:
            assert len(tokens) == 3 and sum(lps) == pytest.approx(score, abs=1e-12)


# ---------------------------------------------------------------------------
# naive beam search vs exhaustive scoring; N; ties
# ---------------------------------------------------------------------------

def _exhaustive(model: NaiveCausalLM, prompt, triples, *, normalize, temperature=1.0):
    """Score every triple with one teacher-forced pass over prompt + its first two tokens; best first."""
    trie = build_trie(triples, 3)
    out = []
    for triple in triples:
        logits = model.logits(list(prompt) + list(triple[:2]))[-3:] / (temperature or 1.0)
        lps = [round_log_probs(logits[r], trie[tuple(triple[:r])], normalize)[triple[r]] for r in range(3)]
        out.append((tuple(triple), sum(lps), lps))
    out.sort(key=lambda item: (-item[1], item[0]))
    return out


@pytest.mark.parametrize("name,normalize,temperature", [
    ("qwen3", "allowed", 1.0),
    ("qwen3", "full", 1.0),
    ("moe_norm_mlp_only", "allowed", 2.5),
])
def test_beam_search_equals_exhaustive(models, name, normalize, temperature):
    _, _, naive = models[name]
    catalog = _catalog(seed=31, size=24, vocab=naive.vocab_size, num_first=5, num_second=4)
    prompt = _prompts(seed=5, vocab=naive.vocab_size, lengths=(9,))[0]
    want = _exhaustive(naive, prompt, catalog, normalize=normalize, temperature=temperature)
    # W >= the number of distinct prefixes at every level: the beam search is exact
    got = naive_causal_beam_search(naive, token_ids=prompt, beam_width=len(catalog), normalize=normalize,
                                   catalog_triples=catalog, temperature=temperature)
    assert_beams_close(got, want, atol=1e-9, tie_tol=0.0)
    for (_, _, lps_a), (_, _, lps_b) in zip(got, want):
        assert lps_a == pytest.approx(lps_b, abs=1e-9)
    if normalize == "allowed":   # the allowed tokens of each prefix sum to probability 1
        root = round_log_probs(naive.logits(prompt)[-1] / temperature, build_trie(catalog, 3)[()], "allowed")
        assert sum(math.exp(v) for v in root.values()) == pytest.approx(1.0, abs=1e-12)


def test_num_return_sequences_around_width(models):
    """N > W widens only the last round (the first W of the N results are the W-result); N < W returns the
    first N of the W-result; fewer valid triples than N: only the valid ones."""
    _, _, naive = models["qwen3"]
    catalog = [(a, b, c) for a in (3, 4, 5) for b in (6, 7, 8) for c in range(9, 14) if (a + b + c) % 5]  # dense
    prompt = [1, 2, 3, 4]
    for normalize in ("allowed", "full"):
        w4 = naive_causal_beam_search(naive, token_ids=prompt, beam_width=4, normalize=normalize,
                                      catalog_triples=catalog)
        n10 = naive_causal_beam_search(naive, token_ids=prompt, beam_width=4, num_return_sequences=10,
                                       normalize=normalize, catalog_triples=catalog)
        n2 = naive_causal_beam_search(naive, token_ids=prompt, beam_width=4, num_return_sequences=2,
                                      normalize=normalize, catalog_triples=catalog)
        assert len(w4) == 4 and len(n10) == 10 and len(n2) == 2
        assert n10[:4] == w4 and n2 == w4[:2]
        assert len({t for t, _, _ in n10}) == 10
        assert [s for _, s, _ in n10] == sorted((s for _, s, _ in n10), reverse=True)
    few = [(3, 6, 9), (3, 6, 10), (5, 7, 11)]
    got = naive_causal_beam_search(naive, token_ids=prompt, beam_width=8, catalog_triples=few)
    assert sorted(t for t, _, _ in got) == sorted(few)
    with pytest.raises(ValueError):
        naive_causal_beam_search(naive, token_ids=prompt, beam_width=4, num_return_sequences=0)


def test_beam_search_tie_rule():
    """Equal scores: lower parent beam first, then lower token id."""

    class Flat:
        """A stand-in model whose logits are all equal: every candidate ties."""

        def logits(self, token_ids):
            return torch.zeros(len(token_ids), 10, dtype=torch.float64)

    got = naive_causal_beam_search(Flat(), token_ids=[1], beam_width=3, num_return_sequences=4)
    assert [t for t, _, _ in got] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)]
    got = naive_causal_beam_search(Flat(), token_ids=[1], beam_width=3, num_return_sequences=2, rounds=2)
    assert [t for t, _, _ in got] == [(0, 0), (0, 1)]
