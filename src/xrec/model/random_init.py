"""Deterministic random weights for a config of either family (test and demo models)."""

from __future__ import annotations

import torch
from tqdm import tqdm

from xrec.config import FamilyConfig
from xrec.model.registry import model_class

_NORMS = ("layer_norm.weight", "layernorm.weight", "norm.weight")


def random_state_dict(config: FamilyConfig, seed: int, progress: bool = False) -> dict[str, torch.Tensor]:
    """Weights drawn from a seeded generator: norms near 1, projections ~ N(0, 1/fan_in),
    biases ~ N(0, 0.1). OneRec's shared embedding and bias tables ~ N(0, 1) (its tied head
    scales by d_model**-0.5, and position biases must matter); a Qwen embedding, which is
    also its tied head, ~ N(0, 1/hidden) like a projection (logits of unit scale)."""
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in model_class(config)(config).state_dict().items()}
    generator = torch.Generator().manual_seed(seed)
    total = sum(s.numel() for s in shapes.values())
    bar = tqdm(total=total, unit="param", unit_scale=True, desc="weights",
               disable=not progress or total < 50_000_000)
    tensors = {}
    for name, shape in shapes.items():
        if name.endswith(_NORMS):
            tensor = 1.0 + 0.1 * torch.randn(shape, generator=generator)
        elif name.endswith(".bias"):
            tensor = 0.1 * torch.randn(shape, generator=generator)
        elif name == "shared.weight" or "relative_attention_bias" in name:
            tensor = torch.randn(shape, generator=generator)
        else:
            tensor = torch.randn(shape, generator=generator) * shape[-1] ** -0.5
        tensors[name] = tensor
        bar.update(shape.numel())
    bar.close()
    return tensors
