"""The library of float32 CPU products (xrec.model.gemm): oneDNN's linear against ATen's,
values and gradients, and the choice between them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xrec.model import gemm
from xrec.model.gemm import CPU_GEMM_ENV, onednn_linear
from xrec.model.layers import linear

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this PyTorch build has no oneDNN")


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))


@pytest.mark.parametrize("shape", [(1, 24), (7, 24), (3, 5, 24), (300, 24)])
@pytest.mark.parametrize("has_bias", [False, True])
def test_onednn_linear_is_f_linear(shape, has_bias):
    torch.manual_seed(0)
    x, weight = torch.randn(shape), torch.randn(40, 24)
    bias = torch.randn(40) if has_bias else None
    assert close(onednn_linear(x, weight, bias), F.linear(x, weight, bias))
    strided = torch.randn(shape[-1], *shape[:-1]).movedim(0, -1)   # not contiguous
    assert close(onednn_linear(strided, weight, bias), F.linear(strided, weight, bias))


@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize("outputs", [12, 40])   # fewer and more outputs than inputs
def test_onednn_linear_gradients_are_f_linears(has_bias, outputs):
    torch.manual_seed(1)
    x = torch.randn(4, 9, 16, requires_grad=True)
    weight = torch.randn(outputs, 16, requires_grad=True)
    bias = torch.randn(outputs, requires_grad=True) if has_bias else None
    grad = torch.randn(4, 9, outputs)
    inputs = (x, weight) + ((bias,) if has_bias else ())
    ours = torch.autograd.grad(onednn_linear(x, weight, bias), inputs, grad)
    theirs = torch.autograd.grad(F.linear(x, weight, bias), inputs, grad)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and close(a, b)
    # only what is asked for: a frozen weight gets no gradient, the input still does
    (only_x,) = torch.autograd.grad(onednn_linear(x, weight.detach()), (x,), grad)
    assert close(only_x, theirs[0])


@pytest.mark.parametrize("library", ["mkl", "onednn"])
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_xrec_linear_gives_f_linear_through_either_library(monkeypatch, library, rows):
    monkeypatch.setattr(gemm, "_chosen", library)
    torch.manual_seed(2)
    x, weight, bias = torch.randn(rows, 32), torch.randn(48, 32), torch.randn(48)
    assert close(linear(x, weight, bias), F.linear(x, weight, bias))
    assert close(linear(x, weight), F.linear(x, weight))


def test_the_choice_follows_the_environment(monkeypatch):
    monkeypatch.setattr(gemm, "_chosen", None)
    monkeypatch.setenv(CPU_GEMM_ENV, "MKL")
    assert gemm.cpu_fp32_gemm() == "mkl"
    monkeypatch.setattr(gemm, "_chosen", None)
    monkeypatch.setenv(CPU_GEMM_ENV, "onednn")
    assert gemm.cpu_fp32_gemm() == "onednn"
    monkeypatch.setattr(gemm, "_chosen", None)
    monkeypatch.setenv(CPU_GEMM_ENV, "auto")
    assert gemm.cpu_fp32_gemm() in ("mkl", "onednn")


def test_an_unknown_library_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(gemm, "_chosen", None)
    monkeypatch.setenv(CPU_GEMM_ENV, "openblas")
    with pytest.raises(ValueError, match="XREC_CPU_GEMM: got 'openblas', allowed: auto, mkl, onednn"):
        gemm.cpu_fp32_gemm()


def test_auto_takes_onednn_only_when_measured_faster(monkeypatch):
    monkeypatch.setattr(gemm, "measured_speedup", lambda: gemm.MIN_SPEEDUP - 0.01)
    assert gemm._decide("auto") == "mkl"
    monkeypatch.setattr(gemm, "measured_speedup", lambda: gemm.MIN_SPEEDUP)
    assert gemm._decide("auto") == "onednn"


def test_the_measurement_is_a_ratio_of_real_products():
    assert gemm.measured_speedup() > 0
