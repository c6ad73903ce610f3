"""From interaction logs to a served, measured model (docs/real-data.md). Never imported by
the serving path; `pip install -e .[train]`.

    data/         interactions (MovieLens from PyPI wheels, users' files), leave-one-out split,
                  HR/NDCG, most-popular and item-kNN baselines
    sid/          `xrec sid build`: embeddings, residual k-means, the collision rule
    sequences.py  the prompt format: semantic-ID vocabulary, prompts, training samples
    ranking.py    ranking users' next items through an Engine (validation and evaluation)
    train/        `xrec train`: trainable models, trainer; SASRec, the sequential baseline
    evaluate/     `xrec eval`: rankings, report (JSON, Markdown, PNG)
    movielens.py  `xrec demo movielens`: the stages above, cached
"""
