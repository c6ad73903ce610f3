"""Deterministic random weights for a config of either family (test, demo and bench models).

`random_state_dict` draws the weights `xrec make-model` writes; `random_model` builds a
model with such weights directly in memory on a device (no files: a 1.7B model on a
GPU in seconds, or on the `meta` device with no values at all).
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from xrec.config import FamilyConfig
from xrec.model.family import RecModel
from xrec.model.layers import stack_weights
from xrec.model.registry import model_class
from xrec.utils.progress import bar_disabled

_NORMS = ("layer_norm.weight", "layernorm.weight", "norm.weight")


def random_state_dict(config: FamilyConfig, seed: int, progress: bool = False,
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Weights drawn from a seeded generator: norms near 1, projections ~ N(0, 1/fan_in),
    biases ~ N(0, 0.1). OneRec's shared embedding and bias tables ~ N(0, 1) (its tied head
    scales by d_model**-0.5, and position biases must matter); a Qwen embedding, which is
    also its tied head, ~ N(0, 1/hidden) like a projection (logits of unit scale). Drawn in
    float32, each tensor cast to `dtype` as it is drawn."""
    shapes = _shapes(config)
    generator = torch.Generator().manual_seed(seed)
    total = sum(s.numel() for s in shapes.values())
    bar = tqdm(total=total, unit="param", unit_scale=True, desc="weights",
               disable=True if total < 50_000_000 else bar_disabled(progress))
    tensors = {}
    for name, shape in shapes.items():
        tensors[name] = _draw(name, shape, generator).to(dtype)
        bar.update(shape.numel())
    bar.close()
    return tensors


def random_model(config: FamilyConfig, seed: int = 0, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> RecModel:
    """An eval-mode model of `config` with random weights, built on `device` in `dtype`
    (default: the config's `torch_dtype`), without writing or reading a file.

    On a CPU the weights are `random_state_dict(config, seed, dtype=dtype)`'s: the model
    equals the one `xrec make-model` writes with that seed, loaded in the config's dtype
    (when `dtype` is that one). On an accelerator
    each tensor is drawn there (a generator of that device, float32, then cast): the same
    distributions, values that depend on the device's generator, and no host copy. On the
    `meta` device the model has shapes and no values (for contracts at any size)."""
    device = torch.device(device)
    dtype = dtype or getattr(torch, config.torch_dtype)
    with torch.device("meta"):
        model = model_class(config)(config)
    if device.type == "meta":
        return model.to(dtype).eval().requires_grad_(False)
    if device.type == "cpu":
        tensors = random_state_dict(config, seed, dtype=dtype)
    else:
        generator = torch.Generator(device=device).manual_seed(seed)
        tensors = {name: _draw(name, shape, generator, device).to(dtype)
                   for name, shape in _shapes(config).items()}
    stack_weights(tensors, model.stacked)
    model.load_state_dict(tensors, assign=True)
    return model.eval().requires_grad_(False)


def _shapes(config: FamilyConfig) -> dict[str, torch.Size]:
    with torch.device("meta"):
        return {name: p.shape for name, p in model_class(config)(config).state_dict().items()}


def _draw(name: str, shape: torch.Size, generator: torch.Generator,
          device: torch.device | None = None) -> torch.Tensor:
    """One tensor of `random_state_dict`, float32 (the scale by the tensor's kind)."""
    tensor = torch.randn(shape, generator=generator, device=device)
    if name.endswith(_NORMS):
        return tensor.mul_(0.1).add_(1.0)
    if name.endswith(".bias"):
        return tensor.mul_(0.1)
    if name == "shared.weight" or "relative_attention_bias" in name:
        return tensor
    return tensor.mul_(shape[-1] ** -0.5)
