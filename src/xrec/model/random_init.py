"""Deterministic random weights for a config (test and demo models)."""

from __future__ import annotations

import torch
from tqdm import tqdm

from xrec.config import ModelConfig
from xrec.model.onerec import OneRecModel


def random_state_dict(config: ModelConfig, seed: int, progress: bool = False) -> dict[str, torch.Tensor]:
    """Weights drawn from a seeded generator: norms near 1, projections ~ N(0, 1/fan_in),
    embeddings ~ N(0, 1), bias tables ~ N(0, 1) so that positions matter."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in OneRecModel(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    total = sum(s.numel() for s in shapes.values())
    bar = tqdm(total=total, unit="param", unit_scale=True, desc="weights",
               disable=not progress or total < 50_000_000)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith("layer_norm.weight"):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif name == "shared.weight" or "relative_attention_bias" in name:
            tensor = torch.randn(shape, generator=generator)
        else:
            tensor = torch.randn(shape, generator=generator) * shape[-1] ** -0.5
        tensors[name] = tensor
        bar.update(shape.numel())
    bar.close()
    return tensors
