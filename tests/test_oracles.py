"""Validate the test oracles against each other before the engine is checked against them.

* the naive float64 network (tests/oracles/naive.py) reproduces Hugging Face T5's encoder output and
  decoder logits (relative bias on, absolute mode, token ids, inputs_embeds, decoder context rows,
  tied and untied LM head);
* the naive beam search (normalize="full") reproduces `generate` beam search (tokens and order,
  scores), with and without a catalog trie, on a padded batch of requests of different lengths;
* the naive beam search equals exhaustive scoring of every catalog triple when the beam is wide
  enough, in both normalisations, with temperature and with decoder context rows;
* the MoE FFN equals a hand-written scalar-loop computation; GQA equals MHA with repeated kv heads.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from oracles.naive import (
    NaiveOneRec,
    assert_beams_close,
    attention,
    build_trie,
    moe_ffn,
    naive_beam_search,
    relative_position_bucket,
    round_log_probs,
)
from oracles.weights import canonical_names, random_state_dict, save_checkpoint, to_xllm_names
from xrec.config import ModelConfig


def _rel_close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-4) -> None:
    """max |a - e| <= rtol * max |e| (a float32 result against a float64 reference)."""
    actual = actual.to(torch.float64)
    expected = expected.to(torch.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    err = float((actual - expected).abs().max())
    scale = float(expected.abs().max())
    assert err <= rtol * scale, f"max abs error {err:.3e} > {rtol} * {scale:.3e}"


def _random_catalog(seed: int, size: int, vocab: int, low: int = 2) -> list[tuple[int, int, int]]:
    """`size` distinct random triples; tokens avoid 0 (decoder start / pad) and 1 (T5's default EOS)."""
    rng = random.Random(seed)
    triples: set[tuple[int, int, int]] = set()
    while len(triples) < size:
        triples.add(tuple(rng.randrange(low, vocab) for _ in range(3)))
    return sorted(triples)


TINY = ModelConfig(d_model=16, d_ff=24, num_encoder_layers=2, num_decoder_layers=2, num_heads=4, head_dim=4,
                   num_kv_heads=2, decoder_num_heads=2, decoder_head_dim=6, decoder_num_kv_heads=1, vocab_size=40,
                   relative_attention_num_buckets=16, relative_attention_max_distance=20, torch_dtype="float32")


# ---------------------------------------------------------------------------
# Hugging Face fixtures (module scope: each model is built once)
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def transformers_mod():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_models(transformers_mod, tmp_path_factory):
    """name -> (hf model, directory, NaiveOneRec built from xrec's reading of the saved config.json)."""
    from oracles.hf import make_hf_t5, xrec_config

    out = {}
    for name, kw in {
        "relative": dict(seed=11),
        "absolute": dict(seed=12, relative_bias=False),
        "untied": dict(seed=13, tie_word_embeddings=False),
        "unscaled": dict(seed=14, scale_decoder_outputs=False),   # tied, head input not scaled
        "deep_decoder": dict(seed=15, num_layers=1, num_decoder_layers=3),
    }.items():
        model, directory = make_hf_t5(tmp_path_factory.mktemp(name), **kw)
        out[name] = (model, directory, NaiveOneRec(xrec_config(directory), model.state_dict()))
    return out


# ---------------------------------------------------------------------------
# building blocks
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (32, 32), (16, 20), (8, 10), (64, 256)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bucket_matches_hf(transformers_mod, num_buckets, max_distance, bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    positions = torch.arange(-400, 401)
    want = T5Attention._relative_position_bucket(positions, bidirectional=bidirectional, num_buckets=num_buckets,
                                                 max_distance=max_distance)
    got = [relative_position_bucket(int(r), bidirectional=bidirectional, num_buckets=num_buckets,
                                    max_distance=max_distance) for r in positions]
    assert got == want.tolist()


def test_moe_by_hand():
    """One token through a tiny MoE, computed with scalar loops, against `moe_ffn` and NaiveOneRec."""
    d, inter, n_exp, topk, n_shared, scale = 5, 3, 4, 2, 2, 2.5
    g = torch.Generator().manual_seed(7)
    router = torch.randn(n_exp, d, generator=g, dtype=torch.float64)
    experts = [tuple(torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((inter, d), (inter, d), (d, inter)))
               for _ in range(n_exp)]
    shared = tuple(torch.randn(shape, generator=g, dtype=torch.float64)
                   for shape in ((inter * n_shared, d), (inter * n_shared, d), (d, inter * n_shared)))
    x = [float(v) for v in torch.randn(d, generator=g, dtype=torch.float64)]

    def ffn_by_hand(w1, w3, w2, x):
        width = w1.shape[0]
        hidden = []
        for i in range(width):
            a = sum(float(w1[i, j]) * x[j] for j in range(d))
            b = sum(float(w3[i, j]) * x[j] for j in range(d))
            hidden.append(a / (1.0 + math.exp(-a)) * b)
        return [sum(float(w2[o, i]) * hidden[i] for i in range(width)) for o in range(d)]

    logits = [sum(float(router[e, j]) * x[j] for j in range(d)) for e in range(n_exp)]
    z = sum(math.exp(v) for v in logits)
    probs = [math.exp(v) / z for v in logits]
    chosen = sorted(range(n_exp), key=lambda e: -probs[e])[:topk]
    assert sum(probs[e] for e in chosen) < 1.0  # so "no renormalisation" is actually being tested
    want = [0.0] * d
    for e in chosen:
        y = ffn_by_hand(*experts[e], x)
        for o in range(d):
            want[o] += probs[e] * scale * y[o]
    y = ffn_by_hand(*shared, x)
    for o in range(d):
        want[o] += y[o]

    got = moe_ffn(torch.tensor([x], dtype=torch.float64), router, experts, topk=topk, route_scale=scale,
                  shared=shared)
    assert torch.allclose(got[0], torch.tensor(want, dtype=torch.float64), rtol=1e-12, atol=1e-12)

    # the same weights inside a NaiveOneRec decoder layer
    cfg = TINY.replace(d_model=d, use_moe=True, moe_num_experts=n_exp, moe_topk=topk, moe_inter_dim=inter,
                       moe_route_scale=scale, moe_use_shared_experts=True, moe_num_shared_experts=n_shared,
                       num_heads=1, head_dim=4, num_kv_heads=1, decoder_num_heads=1, decoder_num_kv_heads=1)
    sd = random_state_dict(cfg, seed=1)
    p = "decoder.block.1.layer.2.ffn"
    sd[f"{p}.gate.weight"] = router
    for e, (w1, w3, w2) in enumerate(experts):
        sd[f"{p}.experts.{e}.w1.weight"], sd[f"{p}.experts.{e}.w3.weight"], sd[f"{p}.experts.{e}.w2.weight"] = w1, w3, w2
    sd[f"{p}.shared_experts.w1.weight"], sd[f"{p}.shared_experts.w3.weight"], sd[f"{p}.shared_experts.w2.weight"] = shared
    model = NaiveOneRec(cfg, sd)
    got2 = model._moe("decoder.block.1.layer.2", torch.tensor([x, x], dtype=torch.float64))
    assert torch.allclose(got2, torch.tensor([want, want], dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """kv head j serves query heads j*G .. (j+1)*G-1 (repeat_interleave)."""
    g = torch.Generator().manual_seed(3)
    heads, kv, hd, d, tq, tk = 6, 2, 4, 10, 5, 7
    wq = torch.randn(heads * hd, d, generator=g, dtype=torch.float64)
    wk = torch.randn(kv * hd, d, generator=g, dtype=torch.float64)
    wv = torch.randn(kv * hd, d, generator=g, dtype=torch.float64)
    wo = torch.randn(d, heads * hd, generator=g, dtype=torch.float64)
    xq = torch.randn(tq, d, generator=g, dtype=torch.float64)
    xkv = torch.randn(tk, d, generator=g, dtype=torch.float64)
    bias = torch.randn(heads, tq, tk, generator=g, dtype=torch.float64)
    group = heads // kv
    wk_full = wk.reshape(kv, hd, d).repeat_interleave(group, dim=0).reshape(heads * hd, d)
    wv_full = wv.reshape(kv, hd, d).repeat_interleave(group, dim=0).reshape(heads * hd, d)
    for causal in (False, True):
        a = attention(xq, xkv, wq, wk, wv, wo, num_heads=heads, num_kv_heads=kv, head_dim=hd, scale=0.5,
                      bias=bias, causal=causal)
        b = attention(xq, xkv, wq, wk_full, wv_full, wo, num_heads=heads, num_kv_heads=heads, head_dim=hd,
                      scale=0.5, bias=bias, causal=causal)
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    # scale multiplies q.k only, not the position bias (Hugging Face's eager attention convention)
    a = attention(xq, xkv, wq, wk, wv, wo, num_heads=heads, num_kv_heads=kv, head_dim=hd, scale=0.5, bias=bias,
                  causal=False)
    b = attention(xq, xkv, wq * 0.5, wk, wv, wo, num_heads=heads, num_kv_heads=kv, head_dim=hd, scale=1.0,
                  bias=bias, causal=False)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


def test_round_log_probs_normalisations():
    g = torch.Generator().manual_seed(5)
    logits = 3 * torch.randn(30, generator=g, dtype=torch.float64)
    allowed = {3, 7, 8, 20}
    full = round_log_probs(logits, allowed, "full")
    allowed_lp = round_log_probs(logits, allowed, "allowed")
    plain = torch.log_softmax(logits, -1)
    assert sorted(full) == sorted(allowed_lp) == sorted(allowed)
    for t in allowed:
        assert full[t] == pytest.approx(float(plain[t]), abs=1e-12)
    assert sum(math.exp(v) for v in allowed_lp.values()) == pytest.approx(1.0, abs=1e-12)
    assert sum(math.exp(v) for v in full.values()) < 1.0
    for mode in ("full", "allowed"):
        unconstrained = round_log_probs(logits, None, mode)
        assert [unconstrained[t] for t in range(30)] == pytest.approx(plain.tolist(), abs=1e-12)
    assert round_log_probs(logits, set(), "allowed") == {}
    with pytest.raises(ValueError):
        round_log_probs(logits, allowed, "bogus")


# ---------------------------------------------------------------------------
# naive network vs Hugging Face
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["relative", "absolute", "untied", "unscaled"])
@pytest.mark.parametrize("kind", ["token_ids", "inputs_embeds"])
def test_forward_matches_hf(hf_models, name, kind):
    from oracles.hf import hf_encoder_and_logits

    model, directory, naive = hf_models[name]
    cfg = naive.config
    assert cfg.use_absolute_position_embedding == (name == "absolute")
    assert cfg.tie_word_embeddings == (name != "untied")
    assert cfg.scale_decoder_outputs == (name not in ("untied", "unscaled"))
    assert cfg.bos_token_id == 0
    g = torch.Generator().manual_seed(21)
    for length in (1, 9, 40):   # 40 > relative_attention_max_distance: log buckets and clipping
        if kind == "token_ids":
            inputs = torch.randint(0, cfg.vocab_size, (length,), generator=g).tolist()
            want_enc = naive.encode(token_ids=inputs)
        else:
            inputs = 2.0 * torch.randn(length, cfg.d_model, generator=g)
            want_enc = naive.encode(sparse_embedding=inputs)
        dec_ids = [0] + torch.randint(0, cfg.vocab_size, (3,), generator=g).tolist()
        enc, logits = hf_encoder_and_logits(model, inputs, dec_ids)
        _rel_close(enc, want_enc)
        _rel_close(logits, naive.decoder_logits(want_enc, naive.embed(dec_ids)))
        # decoder context rows in place of BOS (HF: decoder_inputs_embeds); 24 rows reach the decoder's
        # log-spaced (unidirectional) buckets, where they differ from bidirectional bucketing
        for ctx_len in (1, 4, 24):
            ctx = 2.0 * torch.randn(ctx_len, cfg.d_model, generator=g)
            _, ctx_logits = hf_encoder_and_logits(model, inputs, decoder_inputs_embeds=ctx)
            _rel_close(ctx_logits, naive.decoder_logits(want_enc, naive.decoder_prefix(ctx)))


def test_relative_bias_matters(hf_models):
    """Guard against a no-op bias: zeroing the tables changes the naive model's output."""
    _, _, naive = hf_models["relative"]
    flat = NaiveOneRec(naive.config.replace(use_absolute_position_embedding=True), naive.sd)
    ids = list(range(2, 30))
    a = naive.decoder_logits(naive.encode(token_ids=ids), naive.embed([0, 5, 6]))
    b = flat.decoder_logits(flat.encode(token_ids=ids), flat.embed([0, 5, 6]))
    assert float((a - b).abs().max()) > 0.1


def test_state_dict_names(hf_models):
    """HF's state dict holds our canonical names (plus tied aliases), and the saved file the checkpoint names."""
    from safetensors.torch import load_file

    for name, (model, directory, naive) in hf_models.items():
        sd = model.state_dict()
        expected = canonical_names(naive.config)
        for key, shape in expected.items():
            assert tuple(sd[key].shape) == shape, key
        extra = set(sd) - set(expected)
        # tied aliases of `shared` (and of lm_head when HF ties it)
        assert extra <= {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight",
                         "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
                         "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"}, extra
        saved = load_file(str(directory / "model.safetensors"))
        assert set(expected) <= set(saved)
        assert ("lm_head.weight" in saved) == (name == "untied")
        if name == "absolute":
            assert float(saved["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"].abs().max()) == 0


# ---------------------------------------------------------------------------
# naive beam search vs Hugging Face generate
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,width,use_catalog,kind", [
    ("relative", 4, False, "token_ids"),
    ("relative", 4, True, "token_ids"),
    ("relative", 16, False, "token_ids"),
    ("relative", 16, True, "token_ids"),
    ("relative", 16, True, "inputs_embeds"),
    ("absolute", 16, True, "token_ids"),
    ("untied", 4, True, "inputs_embeds"),
    ("deep_decoder", 8, True, "token_ids"),   # generate's cache breaks there: helper turns it off
])
def test_beam_search_matches_hf(hf_models, name, width, use_catalog, kind):
    from oracles.hf import hf_beam_search

    model, _, naive = hf_models[name]
    cfg = naive.config
    catalog = _random_catalog(seed=width, size=200, vocab=cfg.vocab_size) if use_catalog else None
    g = torch.Generator().manual_seed(100 + width)
    lengths = (7, 40, 19)
    if kind == "token_ids":
        requests = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    else:
        requests = [2.0 * torch.randn(n, cfg.d_model, generator=g) for n in lengths]
    got = hf_beam_search(model, requests, beam_width=width, catalog_triples=catalog)
    assert len(got) == len(requests)
    for i, (request, hf_results) in enumerate(zip(requests, got)):
        inputs = {"token_ids": request} if kind == "token_ids" else {"sparse_embedding": request}
        want = naive_beam_search(naive, **inputs, beam_width=width, normalize="full", catalog_triples=catalog)
        assert len(want) == width
        if catalog is not None:
            assert all(tokens in set(catalog) for tokens, _, _ in want)
        assert_beams_close(hf_results, want, atol=1e-4, what=f"request {i}")
        for _tokens, score, lps in want:
            assert len(lps) == 3 and sum(lps) == pytest.approx(score, abs=1e-12)


def test_hf_generation_never_stops_at_eos(hf_models):
    """Every triple starts with token 1, T5's default EOS id: beams still run the full 3 rounds."""
    from oracles.hf import hf_beam_search

    model, _, naive = hf_models["relative"]
    assert model.generation_config.eos_token_id is None and model.config.eos_token_id is None
    catalog = [(1, a, b) for a in (1, 3, 9, 0) for b in (1, 5, 0, 2)]
    requests = [[4, 5, 6], [7, 8, 9, 10, 11]]
    got = hf_beam_search(model, requests, beam_width=8, catalog_triples=catalog)
    for request, hf_results in zip(requests, got):
        want = naive_beam_search(naive, token_ids=request, beam_width=8, normalize="full", catalog_triples=catalog)
        assert_beams_close(hf_results, want, atol=1e-4)


# ---------------------------------------------------------------------------
# naive beam search vs exhaustive scoring
# ---------------------------------------------------------------------------

def _exhaustive(model: NaiveOneRec, triples, *, normalize, token_ids=None, sparse_embedding=None,
                decoder_context_embedding=None, temperature=1.0):
    """Score every triple with one teacher-forced decoder pass; best first."""
    trie = build_trie(triples, 3)
    enc = model.encode(token_ids=token_ids, sparse_embedding=sparse_embedding)
    prefix = model.decoder_prefix(decoder_context_embedding)
    temp = temperature or 1.0
    out = []
    for triple in triples:
        logits = model.decoder_logits(enc, torch.cat([prefix, model.embed(list(triple[:2]))]))[-3:] / temp
        lps = [round_log_probs(logits[r], trie[tuple(triple[:r])], normalize)[triple[r]] for r in range(3)]
        out.append((tuple(triple), sum(lps), lps))
    out.sort(key=lambda item: (-item[1], item[0]))
    return out


@pytest.fixture(scope="module")
def tiny_gqa_model():
    return NaiveOneRec(TINY, random_state_dict(TINY, seed=4))


@pytest.mark.parametrize("normalize", ["allowed", "full"])
@pytest.mark.parametrize("variant", ["plain", "context", "temperature", "sparse"])
def test_beam_search_equals_exhaustive(tiny_gqa_model, normalize, variant):
    model = tiny_gqa_model
    catalog = _random_catalog(seed=9, size=25, vocab=TINY.vocab_size, low=0)
    g = torch.Generator().manual_seed(8)
    kw = {"token_ids": torch.randint(0, TINY.vocab_size, (12,), generator=g).tolist()}
    if variant == "context":
        kw["decoder_context_embedding"] = torch.randn(3, TINY.d_model, generator=g)
    if variant == "sparse":
        kw = {"sparse_embedding": torch.randn(6, TINY.d_model, generator=g)}
    temperature = 2.5 if variant == "temperature" else 1.0
    want = _exhaustive(model, catalog, normalize=normalize, temperature=temperature, **kw)
    # W >= the number of distinct prefixes at every level: the beam search is exact
    got = naive_beam_search(model, **kw, beam_width=len(catalog), normalize=normalize, catalog_triples=catalog,
                            temperature=temperature)
    assert_beams_close(got, want, atol=1e-9, tie_tol=0.0)
    for (_, _, lps_a), (_, _, lps_b) in zip(got, want):
        assert lps_a == pytest.approx(lps_b, abs=1e-9)
    # temperature 0 means 1
    if variant == "plain":
        zero = naive_beam_search(model, **kw, beam_width=4, normalize=normalize, catalog_triples=catalog,
                                 temperature=0)
        one = naive_beam_search(model, **kw, beam_width=4, normalize=normalize, catalog_triples=catalog)
        assert zero == one


def test_beam_search_more_returns_than_beams(tiny_gqa_model):
    """N > W widens only the last round: the first W of the N results are the W-result."""
    model = tiny_gqa_model
    catalog = [(a, b, c) for a in range(5) for b in range(5) for c in range(5) if (a + b + c) % 7]  # dense
    for normalize in ("allowed", "full"):
        w4 = naive_beam_search(model, token_ids=[3, 4, 5], beam_width=4, normalize=normalize,
                               catalog_triples=catalog)
        n10 = naive_beam_search(model, token_ids=[3, 4, 5], beam_width=4, num_return_sequences=10,
                                normalize=normalize, catalog_triples=catalog)
        assert len(w4) == 4 and len(n10) == 10
        assert n10[:4] == w4
        assert len({t for t, _, _ in n10}) == 10
        assert [s for _, s, _ in n10] == sorted((s for _, s, _ in n10), reverse=True)
    unconstrained = naive_beam_search(model, token_ids=[3, 4, 5], beam_width=3, num_return_sequences=7)
    assert len(unconstrained) == 7


def test_beam_search_fewer_valid_items(tiny_gqa_model):
    """Fewer catalog items than N: only the valid ones, no -inf, no duplicates."""
    model = tiny_gqa_model
    catalog = [(1, 2, 3), (1, 2, 4), (5, 6, 7)]
    got = naive_beam_search(model, token_ids=[9, 9], beam_width=8, catalog_triples=catalog)
    assert sorted(t for t, _, _ in got) == sorted(catalog)
    assert all(math.isfinite(s) for _, s, _ in got)
    # W=2: round 0 keeps (1,) and (5,), round 1 (1, 2) and (5, 6), round 2 all three triples (N=5)
    got2 = naive_beam_search(model, token_ids=[9, 9], beam_width=2, num_return_sequences=5, catalog_triples=catalog)
    assert sorted(t for t, _, _ in got2) == sorted(catalog)
    with pytest.raises(ValueError):
        naive_beam_search(model, token_ids=[9], beam_width=4, num_return_sequences=0)


def test_beam_search_tie_rule():
    """Equal scores: lower parent beam first, then lower token id."""

    class Flat:
        """A stand-in model whose logits are all equal: every candidate ties."""
        config = TINY

        def encode(self, token_ids=None, sparse_embedding=None):
            return torch.zeros(1, TINY.d_model, dtype=torch.float64)

        def decoder_prefix(self, ctx=None):
            return torch.zeros(1, TINY.d_model, dtype=torch.float64)

        def embed(self, ids):
            return torch.zeros(len(ids), TINY.d_model, dtype=torch.float64)

        def decoder_logits(self, enc, dec):
            return torch.zeros(dec.shape[0], TINY.vocab_size, dtype=torch.float64)

    got = naive_beam_search(Flat(), token_ids=[1], beam_width=3, num_return_sequences=4)
    assert [t for t, _, _ in got] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)]
    got = naive_beam_search(Flat(), token_ids=[1], beam_width=3, rounds=2)
    assert [t for t, _, _ in got] == [(0, 0), (0, 1), (0, 2)]


# ---------------------------------------------------------------------------
# weights helpers
# ---------------------------------------------------------------------------

def test_random_state_dict_and_renames(tmp_path):
    cfg = TINY.replace(use_moe=True, moe_num_experts=3, moe_topk=2, moe_inter_dim=8, moe_use_shared_experts=True,
                       moe_num_shared_experts=2, tie_word_embeddings=False)
    sd = random_state_dict(cfg, seed=2)
    assert set(sd) == set(canonical_names(cfg))
    assert torch.equal(random_state_dict(cfg, seed=2)["shared.weight"], sd["shared.weight"])
    NaiveOneRec(cfg, sd)  # shapes check out
    bad = dict(sd)
    bad["decoder.block.1.layer.2.ffn.experts.2.w2.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match="experts.2.w2"):
        NaiveOneRec(cfg, bad)
    renamed = to_xllm_names(sd)
    p = "module.module3.t5_model."
    assert f"{p}encoder.block.0.layer.1.ffn.gate_proj.weight" in renamed
    assert f"{p}encoder.block.0.layer.1.ffn.wi.weight" in renamed
    assert f"{p}encoder.block.0.layer.1.ffn.wo.weight" in renamed
    assert f"{p}decoder.block.0.layer.2.ffn.router.weight" in renamed
    assert f"{p}decoder.block.0.layer.2.ffn.experts.1.up_proj.weight" in renamed
    assert f"{p}decoder.block.0.layer.2.ffn.shared_experts.w3.weight" in renamed
    assert f"{p}lm_head.weight" in renamed and len(renamed) == len(sd)
    directory = save_checkpoint(tmp_path / "ckpt", cfg, sd)
    assert ModelConfig.from_file(directory / "config.json") == cfg
