"""Per-request item filters (docs/beam-search.md, "Filters") against their oracle: the same
request, unfiltered, over a catalog from which the filtered-out items were removed,
written to a file and loaded by the same engine. Both families, both normalisations.

Plus the contracts of the pieces, against brute force over small random catalogs: which
trie nodes a filter kills (`catalog/filters.py`), which children the search may still
choose (`search/filters.py`), and which items conversion still returns.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xrec import Engine, InvalidArgument, RecRequest
from xrec.catalog import ItemCatalog
from xrec.catalog.filters import FilterIndex
from xrec.catalog.sid_vocab import SidLayout
from xrec.demo import write_random_model
from xrec.search.filters import SearchFilter

WAIT_S = 60.0
ATOL = 1e-5                      # float32 scores of the same search on two catalogs
FAMILIES = {"onerec": "tiny", "qwen3": "qwen3-sid-test"}
SID_LAYOUT = SidLayout(num_base_tokens=512, codebook_size=16)   # qwen3-sid-test's vocabulary
TYPES = ("movie", "show", "short")


def _catalog(family: str, seed: int = 0, num_items: int = 240) -> ItemCatalog:
    """A dense extended catalog: few tokens per level, so prefixes are shared, whole
    subtrees exist, and many semantic IDs hold several items (collisions)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, 5, size=(num_items, 3))                          # [n, 3]
    codes[: num_items // 4] = codes[num_items // 4: num_items // 2]           # collisions
    if family == "qwen3":
        starts = np.array([SID_LAYOUT.level_start(level) for level in range(3)])
        triples, vocab = codes + starts, SID_LAYOUT.vocab_size
    else:
        triples, vocab = codes + np.array([3, 20, 40]), 64
    item_ids = rng.choice(20_000, size=num_items, replace=False) - 10_000   # signed, as hashed ids
    types = [TYPES[i] for i in rng.integers(0, len(TYPES), size=num_items)]
    return ItemCatalog(item_ids, triples.astype(np.int32), vocab,
                       dids=[f"d{i}" for i in item_ids], types=types)


@pytest.fixture(scope="module", params=list(FAMILIES))
def served(request, tmp_path_factory):
    """(family, engine over the full catalog, that catalog, a directory for reduced ones)."""
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    write_random_model(directory / "model", FAMILIES[family], seed=2, num_items=0)
    catalog = _catalog(family)
    with Engine.from_pretrained(directory / "model", catalog=catalog, isolation="thread",
                                device="cpu") as engine:
        yield family, engine, catalog, directory


def _request(family: str, seed: int, **fields) -> RecRequest:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, 400 if family == "qwen3" else 60, size=6).tolist()
    return RecRequest(**{"token_ids": ids, "beam_width": 12, "num_return_sequences": 12, **fields})


def _reduced(catalog: ItemCatalog, keep: np.ndarray) -> ItemCatalog:
    rows = np.flatnonzero(keep)
    if catalog.types is None:
        return ItemCatalog(catalog.item_ids[rows], catalog.triples[rows], catalog.vocab_size)
    return ItemCatalog(catalog.item_ids[rows], catalog.triples[rows], catalog.vocab_size,
                       dids=[catalog.dids[r] for r in rows], types=[catalog.types[r] for r in rows])


def _answer(response) -> list[tuple[tuple[int, ...], float, list[int]]]:
    return [(r.tokens, r.score, [i.item_id for i in r.items]) for r in response.results]


def _assert_same(got, want, what):
    assert [g[0] for g in got] == [w[0] for w in want], what           # same IDs, same order
    for (_, g_score, g_items), (_, w_score, w_items) in zip(got, want):
        assert g_score == pytest.approx(w_score, abs=ATOL), what
        assert g_items == w_items, what                                  # same items per ID


def _check_against_reduced(served, keep: np.ndarray, what: str, seed: int = 0, **filters):
    """The filtered request on the full catalog answers as the unfiltered one on the
    catalog of the `keep` rows, in both normalisations."""
    family, engine, catalog, directory = served
    for normalize in ("allowed", "full"):
        request = _request(family, seed, normalize=normalize, **filters)
        got = engine.recommend(request)[0]
        plain = _request(family, seed, normalize=normalize)
        if keep.any():
            path = directory / f"reduced-{abs(hash(what)) % 10**8}.bin"
            _reduced(catalog, keep).write(path)
            engine.load_catalog(path)
            try:
                want = engine.recommend(plain)[0]
            finally:
                engine.restore_catalog()
            _assert_same(_answer(got), _answer(want), f"{what}, {normalize}")
        else:
            assert got.results == [], f"{what}, {normalize}: nothing is left"
        allowed = set(catalog.item_ids[keep].tolist())
        assert all(item in allowed for _, _, items in _answer(got) for item in items)


def test_excluding_whole_subtrees_a_collision_member_and_unknown_ids(served):
    family, engine, catalog, _ = served
    triples = catalog.triples
    first, second = triples[0, 0], tuple(triples[5, :2])
    whole = (triples[:, 0] == first) | ((triples[:, 0] == second[0]) & (triples[:, 1] == second[1]))
    shared = np.flatnonzero((triples == triples[0]).all(axis=1))       # a collision
    assert len(shared) >= 2
    drop = whole.copy()
    drop[np.flatnonzero((triples == triples[70]).all(axis=1))[:1]] = True   # one of a triple's items
    excluded = catalog.item_ids[drop].tolist() + [10_001, 10_002]           # + unknown ids
    _check_against_reduced(served, ~drop, "subtrees", exclude_items=excluded)
    response = engine.recommend(_request(family, 0, exclude_items=excluded))[0]
    assert response.usage["excluded_items_unknown"] == 2


@pytest.mark.parametrize("seed", range(3))
def test_random_exclusions(served, seed):
    _, _, catalog, _ = served
    rng = np.random.default_rng(seed)
    drop = rng.random(catalog.num_items) < [0.2, 0.5, 0.9][seed]
    _check_against_reduced(served, ~drop, f"random {seed}", seed=seed,
                           exclude_items=catalog.item_ids[drop].tolist())


def test_all_items_but_a_few_fewer_than_asked(served):
    """Fewer allowed items than num_return_sequences: the ones that exist."""
    _, _, catalog, _ = served
    keep = np.zeros(catalog.num_items, dtype=bool)
    keep[[3, 50, 51]] = True
    _check_against_reduced(served, keep, "a few", exclude_items=catalog.item_ids[~keep].tolist())


def test_excluding_everything_leaves_no_result(served):
    _, _, catalog, _ = served
    _check_against_reduced(served, np.zeros(catalog.num_items, dtype=bool), "all",
                           exclude_items=catalog.item_ids.tolist())


@pytest.mark.parametrize("types", [("movie",), ("show", "short"), ("unused",)])
def test_type_allow_lists_with_exclusions(served, types):
    _, _, catalog, _ = served
    rng = np.random.default_rng(len(types))
    is_type = np.isin(np.asarray(catalog.types), types)
    drop = rng.random(catalog.num_items) < 0.3
    _check_against_reduced(served, is_type & ~drop, f"types {types}", seed=len(types),
                           item_types=list(types), exclude_items=catalog.item_ids[drop].tolist())


def test_item_types_on_a_catalog_without_types_fails_that_request_only(served, tmp_path):
    family, engine, catalog, _ = served
    plain = ItemCatalog(catalog.item_ids, catalog.triples, catalog.vocab_size)
    path = tmp_path / "plain.bin"
    plain.write(path)
    engine.load_catalog(path, extended=False)
    try:
        typed, other = engine.submit_many([_request(family, 0, item_types=["movie"]),
                                           _request(family, 1)])
        with pytest.raises(InvalidArgument, match="item_types"):
            typed.result(WAIT_S)
        assert other.result(WAIT_S).results
    finally:
        engine.restore_catalog()


def test_filtered_and_plain_requests_share_a_batch(served):
    """One batch, mixed: each request answers as it would alone."""
    family, engine, catalog, _ = served
    excluded = catalog.item_ids[:100].tolist()
    requests = [_request(family, 0), _request(family, 1, exclude_items=excluded),
                _request(family, 2, item_types=["show"]), _request(family, 3)]
    together = [_answer(r) for r in engine.recommend(requests)]
    alone = [_answer(engine.recommend(r)[0]) for r in requests]
    for index, (got, want) in enumerate(zip(together, alone)):
        _assert_same(got, want, f"request {index}")


def test_a_seeded_mix_of_settings_and_filters_answers_as_alone(served):
    """One batch of a seeded random mix: widths from 1 to past the catalog's semantic IDs,
    N below, at and above W, both normalisations, temperatures, and filters (none, an empty
    list, duplicated and unknown ids, every item, type lists, types with exclusions): each
    request answers as it does alone."""
    family, engine, catalog, _ = served
    rng = np.random.default_rng(25)
    ids = catalog.item_ids.tolist()
    filters = [{}, {"exclude_items": []}, {"exclude_items": ids + [10_001]},
               {"exclude_items": ids[:80] * 2 + [10_001, -2 ** 63]}, {"item_types": ["show"]},
               {"item_types": ["movie", "unused"], "exclude_items": ids[::3]}]
    requests = []
    for index in rng.permutation(len(filters) + 2):
        width = int(rng.choice([1, 5, catalog.num_triples + 3]))
        num = int(rng.choice([max(1, width // 2), width, 2 * width + 1]))
        requests.append(_request(family, int(index), beam_width=width, num_return_sequences=num,
                                 normalize=str(rng.choice(["allowed", "full"])),
                                 temperature=float(rng.choice([0.0, 2.0])),
                                 **filters[index % len(filters)]))
    batch_sizes = []
    engine.executor.fault = lambda batch: batch_sizes.append(batch.num_requests)
    try:
        together = [_answer(r) for r in engine.recommend(requests)]
        assert batch_sizes == [len(requests)]
        alone = [_answer(engine.recommend(r)[0]) for r in requests]
    finally:
        engine.executor.fault = None
    for index, (request, got, want) in enumerate(zip(requests, together, alone)):
        _assert_same(got, want, f"request {index}")
        if request.exclude_items is not None and len(request.exclude_items) > catalog.num_items:
            assert got == [], "every item excluded"
        assert len(got) <= request.num_return_sequences


def test_exclude_history_drops_the_items_a_chat_names(tmp_path):
    """Decoder-only with a tokenizer: the semantic IDs a chat prompt names are excluded, as
    if the catalog did not hold their items (the oracle: that catalog, loaded)."""
    directory = write_random_model(tmp_path / "sid", "qwen3-sid-test", seed=1, num_items=300)
    with Engine.from_pretrained(directory, isolation="thread", device="cpu") as engine:
        catalog = engine.catalog
        first = engine.recommend(RecRequest(token_ids=[5, 6, 7], beam_width=8))[0]
        named = first.results[:3]
        chat = [{"role": "user", "content": "I watched " + " and ".join(r.text for r in named)}]
        filtered = engine.recommend(RecRequest(messages=chat, beam_width=8,
                                               num_return_sequences=8, exclude_history=True))[0]
        assert not {r.tokens for r in filtered.results} & {r.tokens for r in named}
        is_named = np.isin(catalog.find_triples(catalog.triples),
                           catalog.find_triples(np.array([r.tokens for r in named])))
        assert is_named.sum() >= 3
        _reduced(catalog, ~is_named).write(tmp_path / "reduced.bin")
        engine.load_catalog(tmp_path / "reduced.bin")
        want = engine.recommend(RecRequest(messages=chat, beam_width=8, num_return_sequences=8))[0]
        _assert_same(_answer(filtered), _answer(want), "history")


def test_filters_need_a_catalog_and_history_a_tokenizer(tmp_path):
    directory = write_random_model(tmp_path / "tiny", "tiny", seed=1, num_items=50)
    with Engine.from_pretrained(directory, isolation="thread", device="cpu") as engine:
        with pytest.raises(InvalidArgument, match="exclude_history.*decoder-only"):
            engine.submit(RecRequest(token_ids=[1, 2], exclude_history=True))
        for bad, match in ((["a"], "exclude_items"), ([-2 ** 63 - 1], r"exclude_items\[0\]"),
                           ([1.5], "exclude_items"), ("12", "exclude_items")):
            with pytest.raises(InvalidArgument, match=match):
                engine.submit(RecRequest(token_ids=[1, 2], exclude_items=bad))
        with pytest.raises(InvalidArgument, match="item_types"):
            engine.submit(RecRequest(token_ids=[1, 2], item_types="movie"))
        with pytest.raises(InvalidArgument, match="item_types: an empty allow-list"):
            engine.submit(RecRequest(token_ids=[1, 2], item_types=[]))
    with Engine.from_pretrained(directory, isolation="thread", device="cpu", constrained=False,
                                max_exclude_items=3) as engine:
        with pytest.raises(InvalidArgument, match="exclude_items.*without a catalog"):
            engine.submit(RecRequest(token_ids=[1, 2], exclude_items=[1]))
    with Engine.from_pretrained(directory, isolation="thread", device="cpu",
                                max_exclude_items=3) as engine:
        with pytest.raises(InvalidArgument, match="4 ids, more than max_exclude_items=3"):
            engine.submit(RecRequest(token_ids=[1, 2], exclude_items=[1, 2, 3, 4]))


def test_item_types_are_the_strings_themselves_at_the_memory_they_take():
    """Types are coded as the catalog's strings: "movie" and "movie\\x00" stay two types,
    and one long type costs its own length, not items x its length (a fixed-width numpy
    string array did both wrong: 5,000 items and one 20,000-character type took 400 MB)."""
    import tracemalloc

    catalog = ItemCatalog([1, 2], np.array([[1, 2, 3], [1, 2, 4]], dtype=np.int32), 8,
                          dids=["a", "b"], types=["movie", "movie\x00"])
    index = FilterIndex(catalog)
    assert index.type_names == ("movie", "movie\x00")
    assert index.resolve(None, ("movie",), None).allowed_rows(np.array([0, 1])).tolist() == \
        [True, False]
    num_items = 5_000
    types = ["x" * 20_000] + ["short"] * (num_items - 1)
    catalog = ItemCatalog(np.arange(num_items), np.arange(3 * num_items).reshape(-1, 3) % 8, 8,
                          dids=[""] * num_items, types=types)
    tracemalloc.start()
    try:
        index = FilterIndex(catalog)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert index.type_names == ("short", "x" * 20_000)
    assert peak < 32 << 20, f"coding the types took {peak / 2**20:.0f} MiB at its peak"


# ---- contracts against brute force -------------------------------------------------------

def _brute_dead(catalog: ItemCatalog, keep: np.ndarray) -> list[set]:
    """Per depth, the trie nodes none of whose items is kept (node = index among the sorted
    unique prefixes of that depth)."""
    dead = []
    for depth in (1, 2, 3):
        prefixes = sorted({tuple(t[:depth]) for t in catalog.triples.tolist()})
        live = {tuple(t[:depth]) for t in catalog.triples[keep].tolist()}
        dead.append({i for i, p in enumerate(prefixes) if p not in live})
    return dead


@st.composite
def catalogs_and_filters(draw):
    num_items = draw(st.integers(1, 40))
    vocab = draw(st.integers(2, 6))
    seed = draw(st.integers(0, 2**16))
    rng = np.random.default_rng(seed)
    triples = rng.integers(0, vocab, size=(num_items, 3)).astype(np.int32)
    types = [["a", "b", "c"][i] for i in rng.integers(0, 3, size=num_items)]
    catalog = ItemCatalog(np.arange(num_items) + 1, triples, vocab,
                          dids=[str(i) for i in range(num_items)], types=types)
    excluded = rng.random(catalog.num_items) < draw(st.floats(0, 1))
    type_set = draw(st.none() | st.sets(st.sampled_from(["a", "b", "c", "z"])).map(
        lambda s: tuple(sorted(s))))
    named = rng.integers(0, vocab, size=draw(st.integers(0, 9)))
    return catalog, excluded, type_set, named


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(catalogs_and_filters())
def test_resolved_filter_kills_exactly_the_nodes_with_no_item_left(case):
    catalog, excluded, type_set, named = case
    index = FilterIndex(catalog)
    ids = np.sort(catalog.item_ids[excluded])
    item_filter = index.resolve(np.append(ids, [10**6]), type_set, named.astype(np.int64))
    keep = ~excluded
    if type_set is not None:
        keep &= np.isin(np.asarray(catalog.types), type_set)
    windows = {tuple(named[i:i + 3].tolist()) for i in range(len(named) - 2)}
    keep &= np.array([tuple(t) not in windows for t in catalog.triples.tolist()])
    want = _brute_dead(catalog, keep)
    sizes = index.sizes
    for depth in range(3):   # a node is dead in the search iff listed dead or masked by type
        got = set(item_filter.dead[depth].tolist())
        if item_filter.type_set is not None:
            got |= set(np.flatnonzero(~item_filter.type_set.alive[depth]).tolist())
        assert got == want[depth], depth
        assert set(range(sizes[depth])) >= got
    assert item_filter.num_unknown == 1
    rows = np.arange(catalog.num_items)
    np.testing.assert_array_equal(item_filter.allowed_rows(rows), keep)
    # the device side: SearchFilter.allowed answers the same for every node of every depth
    search = SearchFilter.of([item_filter, None], sizes)
    for depth in range(3):
        nodes = torch.arange(sizes[depth]).view(1, 1, -1).expand(2, 1, -1)
        allowed = search.allowed(depth, nodes)
        if allowed is None:
            assert not want[depth]
            continue
        assert set(torch.nonzero(~allowed[0, 0]).flatten().tolist()) == want[depth]
        assert bool(allowed[1].all())   # the unfiltered request keeps everything


@settings(max_examples=100, deadline=None)
@given(catalogs_and_filters(), st.integers(0, 3), st.integers(0, 6))
def test_conversion_returns_only_kept_items_first_in_file_order(case, each, total):
    """convert_flat with a filter equals conversion over the reduced catalog."""
    catalog, excluded, _, _ = case
    item_filter = FilterIndex(catalog).resolve(np.sort(catalog.item_ids[excluded]), None, None)
    rows, offsets = catalog.convert_flat(catalog.triples, each, total,
                                         keep_rows=item_filter.allowed_rows)
    reduced = _reduced(catalog, ~excluded)
    want_rows, want_offsets = reduced.convert_flat(catalog.triples, each, total)
    np.testing.assert_array_equal(offsets, want_offsets)
    np.testing.assert_array_equal(catalog.item_ids[rows], reduced.item_ids[want_rows])


def test_a_filter_resolves_on_the_catalog_its_batch_runs_on(served, tmp_path):
    """Submitted under catalog A, launched after a reload to B: the filter is B's (which
    excluded ids B holds, how many it does not), and so is the answer's catalog version."""
    import threading

    family, engine, catalog, _ = served
    extra_ids = np.array([20_001, 20_002])
    extra_rows = np.flatnonzero((catalog.triples == catalog.triples[7]).all(axis=1))[:1]
    bigger = ItemCatalog(np.append(catalog.item_ids, extra_ids),
                         np.concatenate([catalog.triples, catalog.triples[[7, 9]]]),
                         catalog.vocab_size, dids=list(catalog.dids) + ["x", "y"],
                         types=list(catalog.types) + ["movie", "movie"])
    path = tmp_path / "bigger.bin"
    bigger.write(path)
    gate, inside = threading.Event(), threading.Event()

    def hold(batch):
        if any(r.request_id == "blocker" for r in batch.requests):
            inside.set()
            gate.wait(WAIT_S)
    engine.executor.fault = hold
    try:
        blocker = engine.submit(RecRequest(token_ids=[1, 2], beam_width=4, request_id="blocker"))
        assert inside.wait(WAIT_S)
        excluded = extra_ids.tolist() + catalog.item_ids[extra_rows].tolist() + [30_000]
        waiting = engine.submit(_request(family, 4, exclude_items=excluded))
        version = engine.load_catalog(path)
        gate.set()
        blocker.result(WAIT_S)
        response = waiting.result(WAIT_S)
    finally:
        engine.executor.fault = None
        gate.set()
        engine.restore_catalog()
    assert response.catalog_version == version.content_hash
    assert response.usage["excluded_items_unknown"] == 1          # 30_000 only: B holds the rest
    items = {i.item_id for r in response.results for i in r.items}
    assert not items & set(excluded)
