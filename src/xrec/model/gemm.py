"""Which library computes a float32 product on a CPU: MKL (ATen's default) or oneDNN.

PyTorch sends float32 products on a CPU to MKL's sgemm. MKL takes its AVX-512 kernels
only on Intel CPUs; on an AMD CPU with AVX-512 (Zen 4, Zen 5) it runs its AVX2 ones, at
about half the machine's rate, while oneDNN (also in every PyTorch build) takes AVX-512
there (2.2–2.5x on a Zen 5). On the machine of 2026-12-01 oneDNN was 0.75–1.0x MKL
(docs/decisions.md, "float32 products through oneDNN"). So the library is chosen by
measurement, once per process: the same
products through both, interleaved; oneDNN only where it is at least `MIN_SPEEDUP` times
faster. The environment variable `XREC_CPU_GEMM` (`auto`, `mkl` or `onednn`) overrides
the measurement.

The two libraries sum in different orders: results agree to float32 rounding, not to
the bit. `onednn_linear` is differentiable (oneDNN's op has no gradient of its own): the
input's gradient is oneDNN's product too, the weight's stays ATen's (`dy^T x` reduces
over every row; oneDNN's linear would first copy both operands transposed, which cost
more than it saves at the trainer's shapes), so training gains as serving does.
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import torch

from xrec.utils.fresh_thread import in_fresh_thread

__all__ = ["CPU_GEMM_ENV", "CPU_GEMM_CHOICES", "cpu_fp32_gemm", "onednn_linear"]

CPU_GEMM_ENV = "XREC_CPU_GEMM"
CPU_GEMM_CHOICES = ("auto", "mkl", "onednn")
# oneDNN must beat MKL by this much to be chosen: a tie keeps PyTorch's default
MIN_SPEEDUP = 1.2  # pragma: no mutate
# the products timed: a batch of positions through a projection, and a few rows
_PROBES = ((256, 512, 1536), (16, 512, 1536))  # pragma: no mutate
_PAIRS = 7  # pragma: no mutate

_lock = threading.Lock()
_chosen: str | None = None


def cpu_fp32_gemm() -> str:
    """"mkl" or "onednn": the library of this process's float32 CPU products (decided on
    the first call, under a lock, from `XREC_CPU_GEMM` or by measurement)."""
    global _chosen
    if _chosen is None:
        with _lock:
            if _chosen is None:
                _chosen = _decide(os.environ.get(CPU_GEMM_ENV, "auto").strip().lower() or "auto")
    return _chosen


def onednn_linear(x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` computed by oneDNN (CPU tensors), with a gradient."""
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    return _OnednnLinear.apply(x, weight, bias) if needs_grad else _product(x, weight, bias)


def _product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class _OnednnLinear(torch.autograd.Function):
    """y = x W^T + b; dx = dy W, dW = dy^T x, db = the sum of dy over rows."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _product(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])                         # [R, N]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = _product(grad, weight.t(), None)                        # [..., K]
        if ctx.needs_input_grad[1]:
            grad_weight = grad_rows.t() @ x.reshape(-1, x.shape[-1])               # [N, K]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(0)
        return grad_x, grad_weight, grad_bias


def _decide(option: str) -> str:
    if option not in CPU_GEMM_CHOICES:
        raise ValueError(f"{CPU_GEMM_ENV}: got {option!r}, allowed: {', '.join(CPU_GEMM_CHOICES)}")
    if option != "auto":
        if option == "onednn" and not torch.backends.mkldnn.is_available():
            raise ValueError(f"{CPU_GEMM_ENV}=onednn: this PyTorch build has no oneDNN")
        return option
    if not torch.backends.mkldnn.is_available():
        return "mkl"
    # in a thread that ends: the products' OpenMP team must not stay on the caller's thread
    # (xrec.utils.fresh_thread)
    return "onednn" if in_fresh_thread(measured_speedup) >= MIN_SPEEDUP else "mkl"


def measured_speedup() -> float:
    """MKL's time over oneDNN's for the probe products, interleaved pairs, median ratio."""
    ratios = []
    with torch.inference_mode():
        for rows, inner, outer in _PROBES:
            x, weight = torch.randn(rows, inner), torch.randn(outer, inner)
            for _ in range(2):  # warm-up: oneDNN builds its kernel on the first call
                torch.nn.functional.linear(x, weight), onednn_linear(x, weight)
            for _ in range(_PAIRS):
                ratios.append(_seconds(torch.nn.functional.linear, x, weight)
                              / _seconds(onednn_linear, x, weight))
    return statistics.median(ratios)


def _seconds(fn, x: torch.Tensor, weight: torch.Tensor) -> float:
    start = time.perf_counter()
    fn(x, weight)
    return time.perf_counter() - start
