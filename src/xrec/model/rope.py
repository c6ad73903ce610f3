"""Rotary position embedding (rotate-half form, as Hugging Face's Qwen2 / Qwen3)."""

from __future__ import annotations

import torch


def rope_tables(positions: torch.Tensor, head_dim: int, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[..., head_dim]` of integer `positions [...]`.

    The angles are float32 products `position * inv_freq` with `inv_freq =
    theta ** -(2i / head_dim)`, as Hugging Face computes them (same rounding), then
    cast to the model dtype.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))                  # [Dh/2]
    angles = positions.float().unsqueeze(-1) * inv_freq                 # [..., Dh/2]
    angles = torch.cat((angles, angles), dim=-1)                        # [..., Dh]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x [..., Dh]` rotated: x * cos + rotate_half(x) * sin (cos/sin broadcast to x),
    rotate_half(x) = (-x2, x1) for the halves x1, x2 of x.

    Written as x * cos, then each half's sin term added in place: three passes over x
    and one new tensor, where the rotated copy, its negation and the sum took six and
    five (docs/decisions.md, Roofline)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = x * cos
    out[..., :half].addcmul_(x2, sin[..., :half], value=-1)
    out[..., half:].addcmul_(x1, sin[..., half:])
    return out
