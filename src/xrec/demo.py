"""Random model directories (`xrec make-model`) and the built-in demo model.

A model directory holds `config.json`, `model.safetensors`, the catalog
`items.bin` and `tokenizer_config.json` naming it, so `Engine.from_pretrained`
finds everything. A decoder-only size (`qwen3-sid-*`) also gets OpenOneRec's
vocabulary layout: a `tokenizer.json` that knows the Qwen3 special tokens, the
itemic tokens `<s_a_i>`, `<s_b_i>`, `<s_c_i>` and `<|sid_begin|>` / `<|sid_end|>`,
a chat template, and a catalog over the itemic tokens. The demo model is created
on first use under `XREC_HOME` (default `~/.cache/xrec`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from xrec.config.sizes import size_config
from xrec.utils.files import atomic_directory, xrec_home

DEMO_SIZE, DEMO_SEED, DEMO_ITEMS = "onerec-0.015b", 0, 100_000
CATALOG_FILE = "items.bin"


def write_random_model(out_dir: str | os.PathLike, size: str, seed: int = 0, num_items: int = 100_000,
                       progress: bool = False, sizes: dict | None = None) -> Path:
    """Write a random model of a named size (from `sizes`, default `MODEL_SIZES`) and a random
    catalog of `num_items` items. The weights are drawn in float32 and written in the
    size's `torch_dtype` (`Engine.from_random` builds the same model in memory instead).
    The directory is replaced whole (`save_model`), so it is named by its absolute path: a
    relative one (".") would point into the directory just swapped out."""
    import torch

    from xrec.catalog.sid_vocab import random_catalog_of_size, sid_layout_of, write_sid_tokenizer
    from xrec.model.loader import save_model
    from xrec.model.random_init import random_state_dict

    config = size_config(size, num_items, sizes, seed)
    if not os.fspath(out_dir):   # Path("") is the current directory
        raise ValueError("out_dir: got '', expected a directory path")
    layout = sid_layout_of(size, config.vocab_size)
    out = Path(out_dir).resolve()
    save_model(out, config, random_state_dict(config, seed, progress=progress,
                                              dtype=getattr(torch, config.torch_dtype)))
    if num_items:
        random_catalog_of_size(size, config.vocab_size, num_items, seed).write(out / CATALOG_FILE)
        key = "vocab_file" if layout is None else "item_catalog"
        (out / "tokenizer_config.json").write_text(json.dumps({key: CATALOG_FILE}) + "\n")
    if layout is not None:
        write_sid_tokenizer(out, layout)   # keeps the item_catalog key
    return out


def demo_model_dir(progress: bool = True) -> Path:
    """The demo model's directory, written on first use (atomically: temp dir + rename)."""
    target = xrec_home() / "models" / f"demo-{DEMO_SIZE}-seed{DEMO_SEED}-{DEMO_ITEMS}"
    if (target / "config.json").exists():
        return target
    with atomic_directory(target) as tmp:
        write_random_model(tmp, DEMO_SIZE, DEMO_SEED, DEMO_ITEMS, progress=progress)
    return target


def model_dir_or_demo(model_dir: str | None) -> str:
    """`--model`: `model_dir`, or the demo model's directory (written on first use) when it
    is None. An empty one (an unset `$MODEL`) is refused: it served the demo model."""
    if model_dir == "":
        raise ValueError("--model: got '', expected a model directory (leave --model out "
                         "for the demo model)")
    return str(demo_model_dir()) if model_dir is None else model_dir
