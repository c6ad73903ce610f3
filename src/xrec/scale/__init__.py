"""Beyond one process: `xrec batch` (offline candidate generation) and the Ray paths.

    rows.py        input rows (Parquet / JSONL) -> requests; answers -> output records and files
    batch.py       `xrec batch` in process: one Engine, chunks, a progress bar, resumable
    batch_ray.py   `xrec batch --ray`: Ray Data map_batches over an actor pool of Engines
    serve_app.py   `xrec serve --ray`: a Ray Serve deployment whose replicas each hold an Engine
    cli.py         the `xrec batch` parser and `xrec serve`'s Ray flags

Ray is optional (`pip install xrec[ray]`): nothing outside batch_ray.py and serve_app.py
imports it, and those import it only when a Ray path runs.
"""
