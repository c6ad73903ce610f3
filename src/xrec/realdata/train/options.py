"""The options of `xrec train` (no torch import: the command line reads them)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["FAMILIES", "TrainOptions"]

FAMILIES = ("qwen3", "onerec")


@dataclass(frozen=True)
class TrainOptions:
    """Defaults sized to train ML-1M on a small CPU machine (docs/decisions.md, Real data)."""

    family: str = "qwen3"          # "qwen3" (decoder-only) | "onerec" (encoder-decoder)
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    max_items: int = 50            # history items in a prompt (3 tokens each)
    epochs: int = 8
    batch_size: int = 32
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup_steps: int = 200
    samples_per_user: int = 8      # onerec: training pairs per user and epoch
    valid_users: int = 1000        # validation HR@10 on this many users (0: all)
    valid_beam_width: int = 20
    patience: int = 3              # epochs without a better validation HR@10
    max_minutes: float = 0.0       # stop after the epoch that passes this (0: no limit)
    seed: int = 0

    def check(self) -> None:
        for name in ("hidden", "layers", "heads", "max_items", "epochs", "batch_size",
                     "samples_per_user", "valid_beam_width", "patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: got {getattr(self, name)}, expected >= 1")
        if not self.lr > 0:
            raise ValueError(f"lr: got {self.lr}, expected > 0")
        if self.family not in FAMILIES:
            raise ValueError(f"family: got {self.family!r}, allowed: {', '.join(FAMILIES)}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
