"""An exponential moving average of a model's weights (`xrec train --ema DECAY`): the weights
that validation reads and the written model holds, while the optimizer steps the trained ones."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["WeightAverage"]


class WeightAverage:
    """After each step, average <- average + (1 - d) (weights - average), with d = `decay`
    or, early on, (1 + step) / (10 + step) when smaller, so the first steps' weights (random
    ones at step 0) fade out fast."""

    def __init__(self, params: list[torch.Tensor], decay: float):
        self.params, self.decay = params, decay
        self.values = [p.detach().clone() for p in params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        weight = 1 - min(self.decay, (1 + step) / (10 + step))
        for average, p in zip(self.values, self.params):
            average.lerp_(p, weight)

    @contextmanager
    def in_place(self) -> Iterator[None]:
        """The model holds the averaged weights inside, the trained ones again after."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    @torch.no_grad()
    def _exchange(self) -> None:
        for average, p in zip(self.values, self.params):
            trained = p.detach().clone()
            p.copy_(average)
            average.copy_(trained)
