"""`xrec eval --exclude-seen` (issue 25): each user's history excluded inside the beam
search (`RecRequest.exclude_items`) beside the post-filtered "seen removed" ranking, on
test_train's walk data with two briefly trained models (one per family).

What must hold, and is asserted: the in-search ranking never holds a seen item, and with
unique semantic IDs it holds min(W, unseen items) items, never fewer than the post-filtered
one (W results less the seen ones); with a beam as wide as the catalog both searches are
exhaustive and hold the same items. What need not hold, and is not asserted: a higher
HR@10 in search. Beam search is not monotone in the catalog: the beam slots freed by dead
prefixes can go to prefixes whose children outscore a target the full search had kept.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from test_train import _train, walk_interactions  # noqa: E402

from xrec.cli import main  # noqa: E402
from xrec.realdata.data import leave_one_out  # noqa: E402
from xrec.realdata.data.metrics import remove_seen  # noqa: E402
from xrec.realdata.evaluate.run import EvalOptions, evaluate  # noqa: E402
from xrec.realdata.ranking import GenerativeRanker  # noqa: E402
from xrec.realdata.sequences import SidVocabulary  # noqa: E402
from xrec.realdata.sid.build import build_sid_dir  # noqa: E402

IN_SEARCH, REMOVED = ", seen excluded in search", ", seen removed"


@pytest.fixture(scope="module")
def split():
    return leave_one_out(walk_interactions())


@pytest.fixture(scope="module")
def trained(split, tmp_path_factory):
    """One briefly trained model per family over unique semantic IDs (the default rule)."""
    sid_dir = tmp_path_factory.mktemp("walk") / "sid"
    build_sid_dir(split, sid_dir, embeddings="svd", codebook_size=8, dim=8)
    tokens = SidVocabulary.read(sid_dir, split.data.item_ids).item_tokens
    assert len(np.unique(tokens, axis=0)) == split.data.num_items
    return {family: _train(split, sid_dir, sid_dir.parent / family, family, epochs=4)
            for family in ("qwen3", "onerec")}


def _rank(split, model_dir, beam_width, **how):
    ranker = GenerativeRanker.open(model_dir, split.data.item_ids)
    try:
        return ranker.rank(split, "test", beam_width, beam_width, **how)
    finally:
        ranker.close()


@pytest.mark.parametrize("family", ["qwen3", "onerec"])
def test_in_search_ranking_has_no_seen_item_and_a_full_beam(split, trained, family):
    width = 16
    users = np.flatnonzero(split.test >= 0)
    histories = [split.history("test")[u] for u in users]
    plain = _rank(split, trained[family], width)
    removed = _rank(split, trained[family], width, exclude_seen=True)
    in_search = _rank(split, trained[family], width, exclude_seen_in_search=True)
    np.testing.assert_array_equal(removed, remove_seen(plain, histories, width))
    for row, history in zip(in_search, histories):
        assert not set(row[row >= 0]) & set(history.tolist())
        assert len(set(row[row >= 0])) == (row >= 0).sum()
    unseen = np.array([split.data.num_items - len(set(h.tolist())) for h in histories])
    num_in_search, num_removed = (in_search >= 0).sum(1), (removed >= 0).sum(1)
    np.testing.assert_array_equal(num_in_search, np.minimum(width, unseen))
    assert (num_in_search >= num_removed).all()
    assert (num_in_search > num_removed).any(), "no seen item in any plain ranking: vacuous"


def test_exhaustive_beam_gives_the_same_items_both_ways(split, trained):
    """W above the number of semantic IDs: both searches keep every prefix, so each user's
    lists hold exactly the unseen items (their order may differ within float rounding)."""
    width = 64
    removed = _rank(split, trained["qwen3"], width, exclude_seen=True)
    in_search = _rank(split, trained["qwen3"], width, exclude_seen_in_search=True)
    users = np.flatnonzero(split.test >= 0)
    for row_removed, row_in_search, u in zip(removed, in_search, users):
        unseen = set(range(split.data.num_items)) - set(split.history("test")[u].tolist())
        assert set(row_removed[row_removed >= 0]) == set(row_in_search[row_in_search >= 0]) == unseen


def test_eval_reports_the_in_search_row_beside_the_post_filter_one(split, trained, tmp_path):
    """W=10 < 50: the @50 metrics are over at most 10 items (so equal to the @10 ones), and
    eval.json and eval.md say so; baselines get no in-search row."""
    models = [trained["qwen3"], trained["onerec"]]
    report = evaluate(split, models, tmp_path,
                      EvalOptions(beam_width=10, exclude_seen=True, baselines=("most-popular",)),
                      progress=False, log=lambda *_: None)
    names, metrics = list(report["metrics"]), report["metrics"]
    for model in report["models"]:
        at = names.index(model)
        assert names[at:at + 3] == [model, model + REMOVED, model + IN_SEARCH]
        assert model + IN_SEARCH in report["seconds"]
        for row in names[at:at + 3]:
            assert metrics[row]["hr@50"] == metrics[row]["hr@10"]
            assert metrics[row]["users"] == (split.test >= 0).sum()
    assert "most-popular" + IN_SEARCH not in names and "most-popular" + REMOVED in names
    assert report["options"]["exclude_seen"] is True
    assert len(report["notes"]) == 1 and "@50" in report["notes"][0]
    assert json.loads((tmp_path / "eval.json").read_text())["notes"] == report["notes"]
    markdown = (tmp_path / "eval.md").read_text()
    assert report["notes"][0] in markdown
    assert all(f"| {model}{IN_SEARCH} |" in markdown for model in report["models"])
    assert (tmp_path / "eval.png").stat().st_size > 0


def test_cli_exclude_seen(split, trained, tmp_path, capsys):
    """`xrec eval --exclude-seen` on an interaction file: the walk data written as CSV (users
    and items in order of first appearance, so the indices are the trained model's)."""
    data = split.data
    lines = ["user_id,item_id,timestamp"] + [
        f"{data.user_ids[u]},{data.item_ids[i]},{t:g}"
        for u, i, t in zip(data.users, data.items, data.timestamps)]
    (tmp_path / "walk.csv").write_text("\n".join(lines) + "\n")
    out = tmp_path / "eval"
    assert main(["eval", "--data", str(tmp_path / "walk.csv"), "--model", str(trained["qwen3"]),
                 "--out", str(out), "--beam-width", "32", "--baselines", "none",
                 "--exclude-seen", "--no-progress"]) == 0
    report = json.loads((out / "eval.json").read_text())
    (model,) = report["models"]
    assert list(report["metrics"]) == [model, model + REMOVED, model + IN_SEARCH]
    assert report["options"]["beam_width"] == 32 and report["options"]["exclude_seen"] is True
    assert "@50" in report["notes"][0]
    assert main(["eval", "--data", str(tmp_path / "walk.csv"), "--model", str(trained["qwen3"]),
                 "--out", str(out), "--beam-width", "9", "--baselines", "none",
                 "--no-progress"]) == 1
    assert "beam_width: got 9, expected >= 10" in capsys.readouterr().err
