"""Benchmark models: random model directories (cached), the HF T5 export, the request workload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xrec.config import MODEL_SIZES, ModelConfig
from xrec.utils.files import atomic_directory

# --quick: the "tiny" size with as many kv heads as heads (HF T5 has no GQA).
QUICK_SIZE = "tiny-mha"
BENCH_SIZES: dict[str, ModelConfig] = {
    **MODEL_SIZES,
    QUICK_SIZE: MODEL_SIZES["tiny"].replace(num_kv_heads=4, decoder_num_kv_heads=4),
}


def model_dir(size: str, seed: int, num_items: int) -> Path:
    """A random model of a named size with a random catalog, written once under
    `$XREC_HOME/models/bench-...` (atomically: a temp dir renamed into place)."""
    from xrec.demo import write_random_model
    from xrec.utils.files import xrec_home

    if size not in BENCH_SIZES:
        raise ValueError(f"size: got {size!r}, allowed: {', '.join(BENCH_SIZES)}")
    if num_items < 1:
        raise ValueError(f"items: got {num_items}, expected >= 1 (the search is constrained)")
    target = xrec_home() / "models" / f"bench-{size}-seed{seed}-{num_items}"
    if (target / "config.json").exists():
        return target
    with atomic_directory(target) as tmp:
        write_random_model(tmp, size, seed, num_items, progress=True, sizes=BENCH_SIZES)
    return target


# ---- workload -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """One batch of equal-length token-id requests: `token_ids [B, L]` int64, beam width W
    (N = W results each)."""

    token_ids: np.ndarray
    beam_width: int

    @property
    def num_requests(self) -> int:
        return self.token_ids.shape[0]

    @property
    def input_len(self) -> int:
        return self.token_ids.shape[1]

    @property
    def key(self) -> dict:
        return {"beam_width": self.beam_width, "input_len": self.input_len,
                "num_requests": self.num_requests}


def exclusions_of(catalog, workload: Workload, seed: int, num_random: int = 1000,
                  num_subtrees: int = 2) -> list[np.ndarray]:
    """Per request of `workload`, the item ids a filtered request excludes: `num_random`
    random items of `catalog` plus every item of `num_subtrees` random level-1 subtrees."""
    rng = np.random.default_rng([seed, workload.num_requests, workload.input_len, 7])
    first = catalog.triples[:, 0]
    firsts = np.unique(first)
    out = []
    for _ in range(workload.num_requests):   # once per workload, outside the timed part
        random = rng.choice(catalog.num_items, size=min(num_random, catalog.num_items),
                            replace=False)
        subtrees = rng.choice(firsts, size=min(num_subtrees, len(firsts)), replace=False)
        rows = np.union1d(random, np.flatnonzero(np.isin(first, subtrees)))
        out.append(catalog.item_ids[rows])
    return out


def make_workload(vocab_size: int, num_requests: int, input_len: int, beam_width: int,
                  seed: int) -> Workload:
    rng = np.random.default_rng([seed, num_requests, input_len, beam_width])
    return Workload(rng.integers(0, vocab_size, size=(num_requests, input_len)), beam_width)
