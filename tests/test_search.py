"""The constrained beam search end to end: `Engine` and `RecStep` against the oracles.

* Hugging Face `generate` (constrained by a catalog trie, normalize="full") on random T5
  checkpoints: same triples in the same order, scores within float32 tolerance, for W in
  {4, 16, 64}, with and without a catalog, relative bias on and off, a batch of requests of
  different lengths, through `Engine.recommend` and through one `RecStep` batch.
* The naive float64 reference (tests/oracles/naive.py) for what HF cannot check:
  normalize="allowed", MoE decoders, decoder context rows, N > W, temperature, sparse
  embeddings, and mixed widths / N / normalisations in one `StepBatch`.
* Fewer valid items than requested, item conversion (file order, caps, extended catalogs,
  return_items=False), the tie rule and determinism.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from oracles.naive import NaiveOneRec, assert_beams_close, naive_beam_search
from oracles.weights import random_state_dict, save_checkpoint
from bounded import recommend_within
from xrec import Engine, RecItem, RecRequest
from xrec.api_types import validate
from xrec.catalog import ItemCatalog
from xrec.config import ModelConfig
from xrec.search.batch import prepare_batch
from xrec.search.step import RecStep

TIMEOUT_S = 60.0          # no answer within this is a hang, not a slow machine
SCORE_ATOL = 1e-4         # float32 engine vs float32 HF / float64 naive, cumulative over 3 rounds
VOCAB, D_MODEL = 64, 32

CFG = ModelConfig(d_model=D_MODEL, d_ff=64, num_encoder_layers=2, num_decoder_layers=2, num_heads=4,
                  head_dim=8, num_kv_heads=2, decoder_num_heads=2, decoder_head_dim=12,
                  decoder_num_kv_heads=1, vocab_size=VOCAB, relative_attention_num_buckets=16,
                  relative_attention_max_distance=20, torch_dtype="float32")
MOE = CFG.replace(use_moe=True, moe_num_experts=4, moe_topk=2, moe_inter_dim=16, moe_route_scale=1.5)
MOE_SHARED = MOE.replace(moe_use_shared_experts=True, moe_num_shared_experts=2)


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------

def recommend(engine: Engine, requests, timeout: float = TIMEOUT_S):
    return recommend_within(engine, requests, timeout)


def run_step(engine: Engine, requests: list[RecRequest], tables="engine"):
    """All `requests` as ONE StepBatch through a fresh RecStep on the engine's model.
    Returns per request its finite results [(tokens, score, token_logprobs)], best first."""
    valid = [validate(r, engine.limits) for r in requests]
    batch = prepare_batch(valid, engine.model.config.d_model)
    assert batch.num_requests == len(requests)
    if tables == "engine":
        tables = engine.step.tables
    output = RecStep(engine.model, tables, 3).run(batch)
    return step_results(output)


def step_results(output):
    out = []
    for b, num in enumerate(output.num_results):
        rows = []
        for i in range(num):
            score = float(output.scores[b, i])
            if math.isfinite(score):
                rows.append((tuple(int(t) for t in output.tokens[b, i]), score,
                             [float(x) for x in output.token_logprobs[b, i]]))
        out.append(rows)
    return out


def response_results(response):
    return [(c.tokens, c.score, list(c.token_logprobs)) for c in response.results]


def check_logprobs(got, want, atol=SCORE_ATOL, what=""):
    """Per-round log-probs of each result agree (after the orders were checked equal) and sum
    to the score."""
    by_tokens = {tuple(t): lps for t, _, lps in want}
    for tokens, score, lps in got:
        assert len(lps) == 3, what
        assert sum(lps) == pytest.approx(score, abs=1e-5), f"{what}: {tokens} lps do not sum to score"
        if tokens in by_tokens:
            assert lps == pytest.approx(by_tokens[tokens], abs=atol), f"{what}: {tokens}"


def random_triples(seed: int, num: int, vocab: int = VOCAB) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab, size=(num, 3), dtype=np.int64)


def make_catalog(triples, vocab: int = VOCAB, seed: int = 0, **kw) -> ItemCatalog:
    rng = np.random.default_rng(seed + 1000)
    ids = rng.choice(1 << 40, size=len(triples), replace=False) + 1
    return ItemCatalog.from_arrays(ids, np.asarray(triples), vocab, **kw)


def unique_triples(catalog: ItemCatalog) -> list[tuple[int, int, int]]:
    return sorted({tuple(int(x) for x in t) for t in catalog.triples})


def clustered_triples(seed: int, num_prefixes: int = 70) -> np.ndarray:
    """Random (t0, t1) prefixes with 3..6 last tokens each: N > W finds enough items."""
    rng = np.random.default_rng(seed)
    rows = set()
    for t0, t1 in rng.integers(0, VOCAB, size=(num_prefixes, 2)).tolist():
        for t2 in rng.choice(VOCAB, int(rng.integers(3, 7)), replace=False).tolist():
            rows.add((t0, t1, t2))
    return np.array(sorted(rows))


def wide_triples(seed: int) -> np.ndarray:
    """A catalog whose first-level nodes have 20 children (>= vocab/4: the full LM-head path)."""
    rng = np.random.default_rng(seed)
    rows = []
    for a in (3, 17, 40):
        for b in rng.choice(VOCAB, 20, replace=False):
            for c in rng.choice(VOCAB, 3, replace=False):
                rows.append((a, int(b), int(c)))
    return np.array(rows)


def run_triples(seed: int) -> np.ndarray:
    """A catalog whose first tokens are one run of consecutive ids, 20..24 (narrow: the
    round-0 head rows are a slice of the head, as for OpenOneRec's `<s_a_*>`)."""
    rng = np.random.default_rng(seed)
    rows = {(a, int(b), int(c)) for a in range(20, 25) for b in rng.choice(VOCAB, 6, replace=False)
            for c in rng.choice(VOCAB, 3, replace=False)}
    return np.array(sorted(rows))


def ids(rng: np.random.Generator, length: int) -> list[int]:
    return rng.integers(0, VOCAB, size=length).tolist()


def embedding(rng: np.random.Generator, rows: int) -> np.ndarray:
    return (2.0 * rng.standard_normal((rows, D_MODEL))).astype(np.float32)


# ---------------------------------------------------------------------------
# Hugging Face generate as the oracle (normalize="full")
# ---------------------------------------------------------------------------

HF_MODELS = {"rel-1": dict(seed=1), "rel-2": dict(seed=2), "abs-3": dict(seed=3, relative_bias=False)}


@pytest.fixture(scope="module")
def hf_setup(tmp_path_factory):
    """name -> (hf model, {"catalog": engine, "none": engine}, catalog)."""
    pytest.importorskip("transformers")
    from oracles.hf import make_hf_t5

    out = {}
    engines = []
    for name, kw in HF_MODELS.items():
        model, directory = make_hf_t5(tmp_path_factory.mktemp(name), **kw)
        catalog = make_catalog(random_triples(kw["seed"], 300), seed=kw["seed"])
        with_catalog = Engine.from_pretrained(directory, isolation="thread",
                                              catalog=catalog, device="cpu", dtype="float32")
        without = Engine.from_pretrained(directory, isolation="thread",
                                         catalog=None, device="cpu", dtype="float32")
        assert with_catalog.step.tables is not None and without.step.tables is None
        engines += [with_catalog, without]
        out[name] = (model, {"catalog": with_catalog, "none": without}, catalog)
    yield out
    for engine in engines:
        engine.close()


@pytest.mark.parametrize("use_catalog", [True, False], ids=["catalog", "free"])
@pytest.mark.parametrize("width", [4, 16, 64])
@pytest.mark.parametrize("name", list(HF_MODELS))
def test_matches_hf_generate(hf_setup, name, width, use_catalog):
    from oracles.hf import hf_beam_search

    model, engines, catalog = hf_setup[name]
    engine = engines["catalog" if use_catalog else "none"]
    rng = np.random.default_rng(width * 7 + len(name))
    inputs = [ids(rng, n) for n in (7, 40, 19)]      # 40 > max_distance: log buckets, clipping
    triples = unique_triples(catalog) if use_catalog else None
    want = hf_beam_search(model, inputs, beam_width=width, catalog_triples=triples)
    requests = [RecRequest(token_ids=x, beam_width=width, normalize="full", return_items=False)
                for x in inputs]
    via_engine = [response_results(r) for r in recommend(engine, requests)]
    via_step = run_step(engine, requests)
    for i in range(len(inputs)):
        for how, got in (("engine", via_engine[i]), ("step", via_step[i])):
            assert len(got) == width, f"{how} request {i}"
            assert_beams_close(got, want[i], atol=SCORE_ATOL, what=f"{name} W={width} {how} request {i}")
            assert len({t for t, _, _ in got}) == width, "duplicate triples"
            if use_catalog:
                assert {t for t, _, _ in got} <= set(triples)
            for _tokens, score, lps in got:
                assert sum(lps) == pytest.approx(score, abs=1e-5)


def test_matches_hf_generate_embeddings(hf_setup):
    """sparse_embedding requests (HF: inputs_embeds), a batch of three lengths."""
    from oracles.hf import hf_beam_search

    model, engines, catalog = hf_setup["rel-2"]
    rng = np.random.default_rng(5)
    inputs = [embedding(rng, n) for n in (3, 25, 12)]
    triples = unique_triples(catalog)
    want = hf_beam_search(model, [torch.from_numpy(x) for x in inputs], beam_width=16,
                          catalog_triples=triples)
    requests = [RecRequest(sparse_embedding=x, beam_width=16, normalize="full") for x in inputs]
    for how, got in (("engine", [response_results(r) for r in recommend(engines["catalog"], requests)]),
                     ("step", run_step(engines["catalog"], requests))):
        for i in range(len(inputs)):
            assert_beams_close(got[i], want[i], atol=SCORE_ATOL, what=f"{how} request {i}")


# ---------------------------------------------------------------------------
# the naive reference as the oracle
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def naive_setup(tmp_path_factory):
    """variant -> (NaiveOneRec, model directory) for a dense GQA model and two MoE decoders."""
    out = {}
    for name, cfg, seed in (("dense", CFG, 21), ("moe", MOE, 22), ("moe-shared", MOE_SHARED, 23)):
        state = random_state_dict(cfg, seed=seed)
        directory = save_checkpoint(tmp_path_factory.mktemp(name), cfg, state)
        out[name] = (NaiveOneRec(cfg, state), directory)
    return out


@pytest.fixture(scope="module")
def naive_engines(naive_setup):
    """(variant, catalog kind) -> (NaiveOneRec, engine, catalog triples or None); built lazily."""
    cache: dict = {}

    def get(variant: str, kind: str):
        key = (variant, kind)
        if key not in cache:
            naive, directory = naive_setup[variant]
            catalog = {"random": lambda: make_catalog(clustered_triples(31)),
                       "wide": lambda: make_catalog(wide_triples(32)),
                       "run": lambda: make_catalog(run_triples(33)),
                       "none": lambda: None}[kind]()
            engine = Engine.from_pretrained(directory, isolation="thread",
                                            catalog=catalog, device="cpu", dtype="float32")
            assert (engine.step.tables is None) == (catalog is None)
            cache[key] = (naive, engine, None if catalog is None else unique_triples(catalog))
        return cache[key]

    yield get
    for _, engine, _ in cache.values():
        engine.close()


def naive_for(naive: NaiveOneRec, request: RecRequest, triples):
    kw = {}
    if request.token_ids is not None:
        kw["token_ids"] = list(request.token_ids)
    else:
        kw["sparse_embedding"] = torch.from_numpy(np.asarray(request.sparse_embedding))
    if request.decoder_context_embedding is not None:
        kw["decoder_context_embedding"] = torch.from_numpy(np.asarray(request.decoder_context_embedding))
    return naive_beam_search(naive, **kw, beam_width=request.beam_width,
                             num_return_sequences=request.num_return_sequences,
                             normalize=request.normalize or "allowed", catalog_triples=triples,
                             temperature=request.temperature)


def check_against_naive(naive, engine, triples, requests, via_engine=True):
    """All `requests` in one StepBatch (and through Engine.recommend) vs the naive search."""
    want = [naive_for(naive, r, triples) for r in requests]
    results = {"step": run_step(engine, requests)}
    if via_engine:
        results["engine"] = [response_results(r) for r in recommend(engine, requests)]
    for how, got in results.items():
        for i, r in enumerate(requests):
            what = f"{how} request {i} (W={r.beam_width}, N={r.num_return_sequences}, {r.normalize})"
            expected_len = r.num_return_sequences or r.beam_width
            assert len(want[i]) == expected_len, "the test needs a catalog with enough items"
            assert_beams_close(got[i], want[i], atol=SCORE_ATOL, what=what)
            check_logprobs(got[i], want[i], what=what)
            if triples is not None:
                assert {t for t, _, _ in got[i]} <= set(triples), what
            assert len({t for t, _, _ in got[i]}) == len(got[i]), f"{what}: duplicate triples"
    return results


def _feature_requests(feature: str, seed: int) -> list[RecRequest]:
    rng = np.random.default_rng(seed)
    if feature == "allowed":
        return [RecRequest(token_ids=ids(rng, n), beam_width=8, normalize="allowed") for n in (4, 13)]
    if feature == "full":
        return [RecRequest(token_ids=ids(rng, n), beam_width=8, normalize="full") for n in (9, 2)]
    if feature == "context":
        return [RecRequest(token_ids=ids(rng, 6), beam_width=6, normalize="allowed",
                           decoder_context_embedding=embedding(rng, 3)),
                RecRequest(token_ids=ids(rng, 11), beam_width=6, normalize="full",
                           decoder_context_embedding=embedding(rng, 1)),
                RecRequest(token_ids=ids(rng, 8), beam_width=6, normalize="allowed")]   # BOS, ragged
    if feature == "n_gt_w":
        return [RecRequest(token_ids=ids(rng, 7), beam_width=4, num_return_sequences=11, normalize=mode)
                for mode in ("allowed", "full")]
    if feature == "temperature":
        return [RecRequest(token_ids=ids(rng, 7), beam_width=6, temperature=t, normalize=mode)
                for t, mode in ((2.5, "allowed"), (0.4, "full"), (0.0, "allowed"))]
    if feature == "sparse":
        return [RecRequest(sparse_embedding=embedding(rng, n), beam_width=8, normalize=mode)
                for n, mode in ((5, "allowed"), (14, "full"))]
    raise AssertionError(feature)


FEATURES = ["allowed", "full", "context", "n_gt_w", "temperature", "sparse"]


@pytest.mark.parametrize("feature", FEATURES)
def test_matches_naive_dense(naive_engines, feature):
    naive, engine, triples = naive_engines("dense", "random")
    check_against_naive(naive, engine, triples, _feature_requests(feature, FEATURES.index(feature)))


@pytest.mark.parametrize("variant,kind,feature", [
    ("moe", "random", "allowed"),
    ("moe", "random", "context"),
    ("moe", "none", "n_gt_w"),
    ("moe-shared", "random", "allowed"),
    ("moe-shared", "wide", "full"),
    ("moe-shared", "random", "sparse"),
    ("dense", "wide", "allowed"),
    ("dense", "wide", "temperature"),
    ("dense", "none", "allowed"),
    ("dense", "none", "temperature"),
    ("dense", "run", "allowed"),
    ("dense", "run", "full"),
])
def test_matches_naive_variants(naive_engines, variant, kind, feature):
    naive, engine, triples = naive_engines(variant, kind)
    if kind == "wide":
        assert 4 * engine.step.tables.max_children[1] >= VOCAB   # really the full-head path
    elif kind == "random":
        assert 4 * engine.step.tables.max_children[1] < VOCAB    # really the narrow path
    elif kind == "run":
        assert engine.step.root_children == slice(20, 25)       # really the head slice
    check_against_naive(naive, engine, triples, _feature_requests(feature, 50 + len(variant)))


def _mixed_requests(seed: int) -> list[RecRequest]:
    rng = np.random.default_rng(seed)
    return [
        RecRequest(token_ids=ids(rng, 5), beam_width=4, normalize="allowed"),
        RecRequest(token_ids=ids(rng, 17), beam_width=8, num_return_sequences=12, normalize="full"),
        RecRequest(sparse_embedding=embedding(rng, 9), beam_width=2, num_return_sequences=6,
                   normalize="allowed", temperature=2.0),
        RecRequest(token_ids=ids(rng, 3), decoder_context_embedding=embedding(rng, 3), beam_width=6,
                   normalize="full", temperature=0.5),
        RecRequest(sparse_embedding=embedding(rng, 12), decoder_context_embedding=embedding(rng, 1),
                   beam_width=8, top_k=10, normalize="allowed"),
        RecRequest(token_ids=ids(rng, 1), beam_width=1, num_return_sequences=3, normalize="full"),
    ]


@pytest.mark.parametrize("variant,kind", [("dense", "random"), ("moe", "wide"), ("moe-shared", "random"),
                                          ("dense", "none")])
def test_mixed_batch_matches_naive(naive_engines, variant, kind):
    """Mixed W / N / normalize / temperature / context / embeddings in ONE StepBatch."""
    naive, engine, triples = naive_engines(variant, kind)
    requests = _mixed_requests(7)
    valid = [validate(r, engine.limits) for r in requests]
    batch = prepare_batch(valid, D_MODEL)
    assert batch.beam_widths == [4, 8, 2, 6, 8, 1] and batch.num_results == [4, 12, 6, 6, 8, 3]
    assert batch.full_rows == [1, 3, 5] and batch.inputs.embedding_rows == [2, 4]
    assert batch.inputs.context_rows == [3, 4]
    check_against_naive(naive, engine, triples, requests)


def test_batch_equals_single_requests(naive_engines):
    """A request's results do not depend on the batch it runs in."""
    _, engine, _ = naive_engines("dense", "random")
    requests = _mixed_requests(8)
    together = run_step(engine, requests)
    for i, r in enumerate(requests):
        alone = run_step(engine, [r])[0]
        assert_beams_close(alone, together[i], atol=SCORE_ATOL, what=f"request {i}")


# ---------------------------------------------------------------------------
# fewer valid items, item conversion, ties, determinism
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def dense_dir(naive_setup):
    return naive_setup["dense"][1]


@pytest.mark.parametrize("normalize", ["allowed", "full"])
def test_fewer_valid_items_than_requested(naive_setup, dense_dir, normalize):
    naive = naive_setup["dense"][0]
    triples = [(1, 2, 3), (1, 2, 4), (5, 6, 7)]
    catalog = make_catalog(triples + [(1, 2, 3)])          # a collision: 4 items, 3 triples
    with Engine.from_pretrained(dense_dir, isolation="thread",
                                catalog=catalog, device="cpu", dtype="float32") as engine:
        requests = [RecRequest(token_ids=[9, 9], beam_width=8, normalize=normalize),
                    RecRequest(token_ids=[3, 1, 4, 1, 5], beam_width=2, num_return_sequences=5,
                               normalize=normalize),
                    RecRequest(token_ids=[7], beam_width=1, normalize=normalize)]
        for how, results in (("engine", [response_results(r) for r in recommend(engine, requests)]),
                             ("step", run_step(engine, requests))):
            for i, got in enumerate(results):
                tokens = [t for t, _, _ in got]
                assert len(tokens) == len(set(tokens)), f"{how} {i}: duplicates {tokens}"
                assert set(tokens) <= set(triples), f"{how} {i}: invalid triple in {tokens}"
                assert all(math.isfinite(s) for _, s, _ in got)
                want = naive_for(naive, requests[i], triples)
                assert_beams_close(got, want, what=f"{how} request {i}")
            assert sorted(t for t, _, _ in results[0]) == sorted(triples)
            assert sorted(t for t, _, _ in results[1]) == sorted(triples)
            assert len(results[2]) == 1
        # every response's items belong to its triple
        for response in recommend(engine, requests):
            for c in response.results:
                rows = [i for i, t in enumerate(catalog.triples.tolist()) if tuple(t) == c.tokens]
                assert [i.item_id for i in c.items] == [int(catalog.item_ids[r]) for r in rows]


def _collision_catalog(extended: bool = False) -> tuple[ItemCatalog, dict]:
    """Every triple has several items, interleaved in the file; item 500 is listed twice (the last
    record wins, at its position). Returns (catalog, triple -> item ids in file order)."""
    base = sorted({tuple(int(x) for x in t) for t in random_triples(40, 12)})
    rows = []
    next_id = 100
    for repeat in range(6):
        for k, triple in enumerate(base):
            if repeat < 2 + k % 5:
                rows.append((next_id, triple))
                next_id += 1
    rows.insert(3, (500, base[0]))
    rows.append((500, base[1]))           # 500 moves to base[1], at the end of the file
    item_ids = [item for item, _ in rows]
    triples = [triple for _, triple in rows]
    expected: dict = {}
    seen_last = {item: i for i, item in enumerate(item_ids)}
    for i, (item, triple) in enumerate(zip(item_ids, triples)):
        if seen_last[item] == i:
            expected.setdefault(triple, []).append(item)
    kw = {}
    if extended:
        kw = dict(dids=[f"did-{i}" for i in item_ids], types=[f"type-{i % 3}" for i in item_ids])
    return ItemCatalog.from_arrays(item_ids, triples, VOCAB, **kw), expected


@pytest.mark.parametrize("each,total", [(50, 1000), (3, 1000), (2, 7), (0, 1000), (50, 0)])
def test_item_conversion_and_caps(dense_dir, each, total):
    catalog, by_triple = _collision_catalog()
    assert 500 not in by_triple[min(by_triple)] and by_triple[sorted(by_triple)[1]][-1] == 500
    with Engine.from_pretrained(dense_dir, isolation="thread",
                                catalog=catalog, device="cpu", dtype="float32",
                                each_conversion_threshold=each,
                                total_conversion_threshold=total) as engine:
        requests = [RecRequest(token_ids=[1, 2, 3], beam_width=8),
                    RecRequest(token_ids=[4, 5, 6, 7], beam_width=4, num_return_sequences=12,
                               normalize="full"),
                    RecRequest(token_ids=[1, 2, 3], beam_width=8, return_items=False)]
        responses = recommend(engine, requests)
    for response in responses[:2]:
        assert response.results
        left = total
        for c in response.results:
            want = by_triple[c.tokens][:min(each, left)]
            left -= len(want)
            assert [i.item_id for i in c.items] == want, c.tokens
            assert all(isinstance(i, RecItem) and i.did is None and i.type is None for i in c.items)
    assert sum(len(c.items) for c in responses[1].results) == min(
        total, sum(min(each, len(by_triple[c.tokens])) for c in responses[1].results))
    assert responses[2].results and all(c.items == [] for c in responses[2].results)
    assert [c.tokens for c in responses[2].results] == [c.tokens for c in responses[0].results]


def test_extended_catalog_items(dense_dir):
    catalog, by_triple = _collision_catalog(extended=True)
    did_of = dict(zip(catalog.item_ids.tolist(), catalog.dids))
    type_of = dict(zip(catalog.item_ids.tolist(), catalog.types))
    with Engine.from_pretrained(dense_dir, isolation="thread",
                                catalog=catalog, device="cpu", dtype="float32",
                                each_conversion_threshold=4) as engine:
        response, = recommend(engine, [RecRequest(token_ids=[8, 9], beam_width=6)])
        hidden, = recommend(engine, [RecRequest(token_ids=[8, 9], beam_width=6, return_items=False)])
    assert len(response.results) == 6
    for c in response.results:
        assert [i.item_id for i in c.items] == by_triple[c.tokens][:4]
        for item in c.items:
            assert item.did == did_of[item.item_id] == f"did-{item.item_id}"
            assert item.type == type_of[item.item_id]
    assert all(c.items == [] for c in hidden.results)


def test_unconstrained_engine_returns_no_items(dense_dir):
    catalog, _ = _collision_catalog()
    with Engine.from_pretrained(dense_dir, isolation="thread",
                                catalog=catalog, device="cpu", dtype="float32",
                                constrained=False) as engine:
        assert engine.step.tables is None
        response, = recommend(engine, [RecRequest(token_ids=[1, 2], beam_width=64)])
    assert len(response.results) == 64        # free decoding: more triples than the catalog has
    known = {tuple(int(x) for x in t) for t in catalog.triples}
    for c in response.results:
        assert (len(c.items) > 0) == (c.tokens in known)


def test_rounds_option(naive_setup, dense_dir):
    """Free decoding runs any number of rounds; constrained decoding exactly the ID length."""
    naive = naive_setup["dense"][0]
    catalog = make_catalog(clustered_triples(31))
    for rounds in (2, 4):
        with pytest.raises(ValueError, match="rounds"):
            Engine.from_pretrained(dense_dir, isolation="thread",
                                   catalog=catalog, device="cpu", dtype="float32", rounds=rounds)
    with pytest.raises(ValueError, match="no items"):
        Engine.from_pretrained(dense_dir, isolation="thread",
                               catalog=make_catalog(np.zeros((0, 3), np.int64)), device="cpu",
                               dtype="float32")
    for rounds in (1, 2, 4):
        with Engine.from_pretrained(dense_dir, isolation="thread",
                                    catalog=catalog, device="cpu", dtype="float32",
                                    constrained=False, rounds=rounds) as engine:
            response, = recommend(engine, [RecRequest(token_ids=[1, 2, 3], beam_width=4,
                                                      num_return_sequences=6)])
        want = naive_beam_search(naive, token_ids=[1, 2, 3], beam_width=4, num_return_sequences=6,
                                 rounds=rounds)
        got = [(c.tokens, c.score) for c in response.results]
        assert_beams_close(got, want, what=f"rounds={rounds}")
        assert all(len(c.tokens) == rounds and c.items == [] for c in response.results)


@pytest.fixture(scope="module")
def flat_dir(tmp_path_factory):
    """A model whose logits are all exactly 0 (zero embedding, tied head): every candidate ties."""
    state = random_state_dict(CFG, seed=5)
    state["shared.weight"] = torch.zeros_like(state["shared.weight"])
    return save_checkpoint(tmp_path_factory.mktemp("flat"), CFG, state)


def test_tie_rule_unconstrained(flat_dir):
    """Equal scores: lower parent beam first, then the lower token (docs/beam-search.md)."""
    with Engine.from_pretrained(flat_dir, isolation="thread",
                                catalog=None, device="cpu", dtype="float32") as engine:
        requests = [RecRequest(token_ids=[1, 2, 3], beam_width=3, num_return_sequences=4),
                    RecRequest(token_ids=[4], beam_width=5)]
        for got in ([response_results(r) for r in recommend(engine, requests)], run_step(engine, requests)):
            assert [t for t, _, _ in got[0]] == [(0, 0, 0), (0, 0, 1), (0, 0, 2), (0, 0, 3)]
            assert [t for t, _, _ in got[1]] == [(0, 0, k) for k in range(5)]
            assert all(s == pytest.approx(-3 * math.log(VOCAB), abs=1e-4) for _, s, _ in got[0])


def test_tie_rule_constrained(flat_dir):
    triples = [(9, 1, 2), (9, 1, 1), (4, 7, 7), (4, 7, 3), (4, 2, 5), (9, 3, 3), (30, 0, 0), (4, 2, 8)]
    catalog = make_catalog(triples)
    with Engine.from_pretrained(flat_dir, isolation="thread",
                                catalog=catalog, device="cpu", dtype="float32") as engine:
        requests = [RecRequest(token_ids=[1], beam_width=2, num_return_sequences=3, normalize="full"),
                    RecRequest(token_ids=[1], beam_width=8, normalize="full")]
        for got in ([response_results(r) for r in recommend(engine, requests)], run_step(engine, requests)):
            # all scores are -3 log V: beams (4,), (9,) -> (4,2), (4,7) -> (4,2,5), (4,2,8), (4,7,3)
            assert [t for t, _, _ in got[0]] == [(4, 2, 5), (4, 2, 8), (4, 7, 3)]
            assert [t for t, _, _ in got[1]] == sorted(triples)
    # 64 tied first tokens and 64 tied last tokens: the kept ones are the lowest, not the kernel's
    triples = [(a, (7 * a) % VOCAB, (13 * a) % VOCAB) for a in range(VOCAB)] + [(0, 0, c) for c in range(VOCAB)]
    with Engine.from_pretrained(flat_dir, isolation="thread",
                                catalog=make_catalog(triples), device="cpu", dtype="float32") as engine:
        requests = [RecRequest(token_ids=[1], beam_width=3, normalize="full"),
                    RecRequest(token_ids=[2, 3], beam_width=2, num_return_sequences=5, normalize="full")]
        for got in ([response_results(r) for r in recommend(engine, requests)], run_step(engine, requests)):
            assert [t for t, _, _ in got[0]] == [(0, 0, 0), (0, 0, 1), (0, 0, 2)]
            assert [t for t, _, _ in got[1]] == [(0, 0, c) for c in range(5)]


def test_nan_log_probabilities_are_never_results(dense_dir):
    """A last-level token whose logit is NaN (its LM-head row written NaN after the load
    check, as an overflow leaves it): the beams that have it as a child lose every child
    (their "allowed" normaliser is NaN) and drop out as if -inf, whatever the NaN's sign;
    the other candidates are those of the clean search. Before, the NaN-scored results
    came first and as many real ones were lost."""
    rng = np.random.default_rng(4)
    triples = rng.integers(0, 20, size=(150, 3)) + np.array([0, 20, 40])   # levels apart
    request = RecRequest(token_ids=[3, 1, 4], beam_width=6)
    with Engine.from_pretrained(dense_dir, isolation="thread", catalog=make_catalog(triples),
                                device="cpu", dtype="float32") as engine:
        clean = [(t, s) for t, s, _ in response_results(recommend(engine, [request])[0])]
        poisoned = clean[1][0][2]                     # the second result's last token
        dead = {tuple(t[:2]) for t in triples.tolist() if t[2] == poisoned}
        kept = [(t, s) for t, s in clean if t[:2] not in dead]
        assert len(clean) == 6 and 0 < len(kept) < 6
        weight, _ = engine.model.head_weight()
        saved = weight[poisoned].clone()
        for value in (torch.tensor(math.nan).abs(), -torch.tensor(math.nan).abs()):
            with torch.no_grad():
                weight[poisoned] = value
            try:
                got = [(t, s) for t, s, _ in response_results(recommend(engine, [request])[0])]
            finally:
                with torch.no_grad():
                    weight[poisoned] = saved
            assert all(math.isfinite(s) for _, s in got), got
            assert got[:len(kept)] == kept
            assert not {t[:2] for t, _ in got} & dead


def test_select_top_tie_rule():
    """The best k per row, best first; equal scores by lower flat index, also at the cut."""
    from xrec.search.beam import select_top

    inf = float("inf")
    scores = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0],
                           [3.0, 3.0, 3.0, 3.0, -1.0, 5.0, -inf, 2.0],
                           [-inf, -inf, -2.0, -inf, -0.0, 0.0, -inf, -inf]])
    values, indices = select_top(scores, 4)
    assert indices.tolist() == [[1, 3, 5, 0], [5, 0, 1, 2], [4, 5, 2, 0]]
    assert values.tolist() == [[1, 1, 1, 0], [5, 3, 3, 3], [0, 0, -2, -inf]]
    values, indices = select_top(torch.zeros(2, 300), 5)           # 300 ties: the first five
    assert indices.tolist() == [list(range(5))] * 2
    values, indices = select_top(torch.tensor([[0.5, -1.0]]), 4)    # fewer candidates than k
    assert indices.tolist() == [[0, 1, 0, 0]] and values.tolist() == [[0.5, -1.0, -inf, -inf]]
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(-3, 3, (4, 200), generator=g).float().masked_fill(
        torch.rand(4, 200, generator=g) < 0.2, -inf)
    values, indices = select_top(rows, 37)
    for r in range(4):
        want = sorted(range(200), key=lambda j: (-float(rows[r, j]), j))[:37]
        assert indices[r].tolist() == want
        assert torch.equal(values[r], rows[r, want])


def test_deterministic(naive_engines):
    _, engine, _ = naive_engines("moe", "random")
    requests = _mixed_requests(9)
    valid = [validate(r, engine.limits) for r in requests]
    step = RecStep(engine.model, engine.step.tables, 3)
    first, second = step.run(prepare_batch(valid, D_MODEL)), step.run(prepare_batch(valid, D_MODEL))
    for name in ("tokens", "scores", "token_logprobs"):
        assert np.array_equal(getattr(first, name), getattr(second, name)), name
    # through the engine the scheduler may split the requests differently on each call, and a
    # different batch shape may move float32 sums by an ulp: same triples, same order, close scores
    a = recommend(engine, requests)
    b = recommend(engine, requests)
    for i, (x, y) in enumerate(zip(a, b)):
        assert [c.tokens for c in x.results] == [c.tokens for c in y.results], f"request {i}"
        assert [c.items for c in x.results] == [c.items for c in y.results], f"request {i}"
        assert [c.score for c in x.results] == pytest.approx([c.score for c in y.results], abs=SCORE_ATOL)
