"""The options of `xrec train` (no torch import: the command line reads them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from xrec.config.engine import EngineOptions

__all__ = ["FAMILIES", "FAMILY_DEFAULTS", "MAX_SEED", "TrainOptions", "check_seed"]

FAMILIES = ("qwen3", "onerec")
TRAIN_DTYPES = ("auto", "float32", "bfloat16")
MAX_SEED = 2 ** 32 - 1      # training seeds torch with seed * 1000 + epoch
MIN_VALID_BEAM_WIDTH = 10   # validation is HR@10 (as xrec eval's MIN_BEAM_WIDTH)
MAX_PROMPT_ITEMS = (EngineOptions.max_input_len - 1) // 3   # BOS + 3 tokens per item
# What an option left at None becomes (docs/decisions.md, Real data): the encoder-decoder
# costs ~2.3x the decoder-only per epoch and learns more per step from smaller batches, at
# half the rate it had until 2026-12-03 (all ML-1M validation users: HR@10 0.2166 at 5e-4
# against 0.2070 at 1e-3; 2.5e-4 and 2e-3 trailed on the first 1,000); the
# decoder-only family's 12 epochs beat 8 on ML-1M validation (best HR@10 0.235 vs 0.216); its
# look-ahead heads tie on plain HR@10 and add +0.006 with seen items removed over all
# validation users (0.2583 vs 0.2588, 0.3129 vs 0.3073); the encoder-decoder's are an option.
FAMILY_DEFAULTS = {"qwen3": {"epochs": 12, "batch_size": 32, "lr": 3e-3, "lookahead": 0.5},
                   "onerec": {"epochs": 5, "batch_size": 8, "lr": 5e-4, "lookahead": 0.0}}


def check_seed(seed: int) -> None:
    """A seed numpy and torch both take, epoch offsets included (`torch.manual_seed` refuses
    2**64 and above with "Overflow when unpacking long long", naming nothing)."""
    if not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed: got {seed}, expected an integer in [0, {MAX_SEED}]")


def check_train_dtype(name: str) -> None:
    if name not in TRAIN_DTYPES:
        raise ValueError(f"dtype: got {name!r}, allowed: {', '.join(TRAIN_DTYPES)}")


@dataclass(frozen=True)
class TrainOptions:
    """Defaults sized to train ML-1M on a small CPU machine (docs/decisions.md, Real data);
    `epochs`, `batch_size`, `lr` and `lookahead` default to the family's (`FAMILY_DEFAULTS`)."""

    family: str = "qwen3"          # "qwen3" (decoder-only) | "onerec" (encoder-decoder)
    hidden: int = 128
    layers: int = 2
    heads: int = 4
    max_items: int = 50            # history items in a prompt (3 tokens each)
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    weight_decay: float = 0.01
    warmup_steps: int = 200
    dropout: float = 0.0           # on embeddings and residual branches, training only
    seen_unlikelihood: float = 0.0  # weight of the seen-item unlikelihood (train/repeats.py)
    label_smoothing: float = 0.0   # of the cross-entropy, over the whole vocabulary
    lookahead: float | None = None  # weight of the look-ahead heads' loss (train/lookahead.py)
    shifted_windows: bool = False  # each epoch, windows before a user's last shift at random
    ema: float = 0.0               # decay of the weights' moving average (0: none)
    valid_users: int = 1000        # validation HR@10 on this many users (0: all)
    valid_beam_width: int = 20
    patience: int = 3              # epochs without a better validation HR@10
    max_minutes: float = 0.0       # stop after the epoch that passes this (0: no limit)
    final: bool = False            # all `epochs` on every item but the test one, no validation
    seed: int = 0
    dtype: str = "auto"            # of the forward pass: auto | float32 | bfloat16 (precision.py)

    def __post_init__(self) -> None:
        for name, value in FAMILY_DEFAULTS.get(self.family, {}).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)

    def check(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family: got {self.family!r}, allowed: {', '.join(FAMILIES)}")
        for name in ("hidden", "layers", "heads", "max_items", "epochs", "batch_size",
                     "patience"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: got {getattr(self, name)}, expected >= 1")
        # validation runs through the serving engine: beyond its limits it failed an epoch late
        if self.max_items > MAX_PROMPT_ITEMS:
            raise ValueError(f"max_items: got {self.max_items}, expected at most "
                             f"{MAX_PROMPT_ITEMS} (a prompt of 1 + 3 x max_items tokens must fit "
                             f"the engine's max_input_len {EngineOptions.max_input_len})")
        if not MIN_VALID_BEAM_WIDTH <= self.valid_beam_width <= EngineOptions.max_beam_width:
            raise ValueError(f"valid_beam_width: got {self.valid_beam_width}, expected "
                             f"{MIN_VALID_BEAM_WIDTH} (validation HR@10 needs that many items) "
                             f"to {EngineOptions.max_beam_width} (the engine's max_beam_width)")
        for name in ("warmup_steps", "valid_users"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: got {getattr(self, name)}, expected >= 0")
        check_seed(self.seed)
        # [low, high): each a finite number (NaN passed `< 0` checks and failed after a whole
        # epoch, on NaN weights; max_minutes NaN meant no limit)
        ranges = {"dropout": (0, 1), "ema": (0, 1), "label_smoothing": (0, 1),
                  "seen_unlikelihood": (0, math.inf), "lookahead": (0, math.inf),
                  "weight_decay": (0, math.inf), "max_minutes": (0, math.inf)}
        for name, (low, high) in ranges.items():
            value = getattr(self, name)
            if not (math.isfinite(value) and low <= value < high):
                raise ValueError(f"{name}: got {value}, expected a finite number in [{low}, {high})")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr: got {self.lr}, expected a finite number > 0")
        check_train_dtype(self.dtype)
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
