"""Random model directories (`xrec make-model`) and the built-in demo model.

A model directory holds `config.json`, `model.safetensors`, the catalog
`items.bin` and `tokenizer_config.json` naming it, so `Engine.from_pretrained`
finds everything. The demo model is created on first use under `XREC_HOME`
(default `~/.cache/xrec`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from xrec.config import MODEL_SIZES

DEMO_SIZE, DEMO_SEED, DEMO_ITEMS = "onerec-0.015b", 0, 100_000
CATALOG_FILE = "items.bin"


def write_random_model(out_dir: str | os.PathLike, size: str, seed: int = 0, num_items: int = 100_000,
                       progress: bool = False) -> Path:
    """Write a random model of a named size and a random catalog of `num_items` items."""
    from xrec.catalog import random_catalog
    from xrec.model.loader import save_model
    from xrec.model.random_init import random_state_dict

    if size not in MODEL_SIZES:
        raise ValueError(f"size: got {size!r}, allowed: {', '.join(MODEL_SIZES)}")
    if num_items < 0:
        raise ValueError(f"items: got {num_items}, expected >= 0")
    config = MODEL_SIZES[size]
    out = Path(out_dir)
    save_model(out, config, random_state_dict(config, seed, progress=progress))
    if num_items:
        random_catalog(num_items, config.vocab_size, seed).write(out / CATALOG_FILE)
        (out / "tokenizer_config.json").write_text(json.dumps({"vocab_file": CATALOG_FILE}) + "\n")
    return out


def xrec_home() -> Path:
    return Path(os.environ.get("XREC_HOME") or Path.home() / ".cache" / "xrec")


def demo_model_dir(progress: bool = True) -> Path:
    """The demo model's directory, written on first use (atomically: temp dir + rename)."""
    target = xrec_home() / "models" / f"demo-{DEMO_SIZE}-seed{DEMO_SEED}-{DEMO_ITEMS}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        write_random_model(tmp, DEMO_SIZE, DEMO_SEED, DEMO_ITEMS, progress=progress)
        try:
            tmp.rename(target)
        except OSError:  # another process won the race; its copy is identical
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
