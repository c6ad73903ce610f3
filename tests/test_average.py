"""`WeightAverage` (`xrec train --ema`) against its definition, written out step by step."""

from __future__ import annotations

import torch

from xrec.realdata.train.average import WeightAverage


def test_average_follows_its_definition_and_swaps_in_and_back():
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(3, 4, generator=gen), torch.randn(5, generator=gen)]
    average = WeightAverage(params, decay=0.95)
    want = [p.clone() for p in params]
    for step in range(40):
        for p in params:
            p.add_(torch.randn(p.shape, generator=gen))
        average.update(step)
        d = min(0.95, (1 + step) / (10 + step))
        want = [d * w + (1 - d) * p for w, p in zip(want, params)]
    trained = [p.clone() for p in params]
    for got, expected in zip(average.values, want):
        torch.testing.assert_close(got, expected)
    with average.in_place():
        for p, expected in zip(params, want):
            torch.testing.assert_close(p, expected)
    for p, before in zip(params, trained):
        assert torch.equal(p, before)
