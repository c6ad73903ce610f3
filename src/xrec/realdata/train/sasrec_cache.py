"""SASRec trained once per data and configuration: `xrec sid build` (its item table makes the
semantic IDs) and `xrec eval` (the baseline, early-stopped on the same split) train the same
model, about 16 minutes on ML-1M with 2 cores. The command line keeps each trained model under
the dataset's run directory (`$XREC_HOME/runs/<dataset>/sasrec/<key>.pt`) and the second
command loads it; the library functions cache only when given a directory.

The key is a SHA-256 of everything training reads: the split (every user's training items,
the validation and test items, the catalog size), the configuration but its thread count and
device, and `FORMAT`, which changes whenever the training code does. A run capped by wall
time (`max_seconds`) is never cached: its epoch count is not reproducible. A file that does not
load (torn, or from another version) is trained again and replaced; files are written to a
temporary name and renamed, so a killed run leaves no torn entry.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from xrec.realdata.data.interactions import Split
from xrec.realdata.train import sasrec

__all__ = ["FORMAT", "sasrec_key", "trained_sasrec"]

FORMAT = "sasrec-1"   # change with anything that changes what `train_sasrec` returns
_NOT_IN_KEY = ("num_threads", "device")   # where it runs, not what it learns
log = logging.getLogger(__name__)


def sasrec_key(split: Split, config: sasrec.SASRecConfig) -> str:
    """Hex SHA-256 of what training reads (module docstring)."""
    digest = hashlib.sha256(FORMAT.encode())
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in _NOT_IN_KEY}
    digest.update(json.dumps(fields, sort_keys=True).encode())
    split.update_digest(digest)
    return digest.hexdigest()


def trained_sasrec(split: Split, config: sasrec.SASRecConfig, progress: bool = True,
                   cache: str | os.PathLike | None = None) -> sasrec.SASRecModel:
    """`train_sasrec(split, config)`'s model, loaded from `cache` when an earlier call trained
    it there (`model.reused` says which). `cache` None: always trained, nothing written."""
    if cache is None or config.max_seconds is not None:
        model = sasrec.train_sasrec(split, config, progress=progress)
        model.reused = False
        return model
    path = Path(cache) / f"{sasrec_key(split, config)}.pt"
    if path.is_file():
        try:
            return _load(path, split.data.num_items, config)
        except Exception as exc:   # torn or foreign: train again, below
            log.warning("SASRec cache %s does not load (%s): training again", path, exc)
    model = sasrec.train_sasrec(split, config, progress=progress)
    model.reused = False
    _save(model, path)
    return model


def _save(model: sasrec.SASRecModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    entry = {"format": FORMAT, "state": model.state_dict(),
             "epoch_logs": [dataclasses.asdict(e) for e in model.epoch_logs]}
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".sasrec-", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(entry, file)
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _load(path: Path, num_items: int, config: sasrec.SASRecConfig) -> sasrec.SASRecModel:
    entry = torch.load(path, map_location=config.device, weights_only=True)
    if entry.get("format") != FORMAT:
        raise ValueError(f"format {entry.get('format')!r}, expected {FORMAT!r}")
    model = sasrec.SASRecModel(num_items, config).to(config.device)
    model.load_state_dict(entry["state"])
    model.epoch_logs = [sasrec.EpochLog(**e) for e in entry["epoch_logs"]]
    model.reused = True
    return model.eval()
