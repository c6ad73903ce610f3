"""This machine's GEMM peak, measured in a fresh process: `python -m xrec.bench.lib.peak`.

The roofline's denominator. A fresh process, because a process that already ran other
torch work may hold OpenMP teams or allocator state that slow (or warm) the product.
The peak is the best median FLOP/s over a few large shapes (square, and the tall-skinny
shapes of a batch of positions times a projection), with the same intra-op thread count
as the run it is compared with. `Gemm` is also the roofline's interleaved reference: the
best shape's product timed between xrec's steps, so that a ratio is taken at one moment
(a shared machine's GEMM rate drifts within minutes: docs/decisions.md, Roofline). bfloat16
is measured where the device computes it natively (CUDA; a CPU with AVX512-BF16 or AMX),
else reported as absent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

# (m, k, n): square, and a few thousand positions through D -> 4D / 4D -> D projections
SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 1024, 4096), (4096, 4096, 1024))


class Gemm:
    """One `[m, k] @ [k, n]` product on `device` in `dtype_name`, timed (synchronised)."""

    def __init__(self, shape: tuple[int, int, int], device: str, dtype_name: str):
        import torch

        m, k, n = shape
        dtype = getattr(torch, dtype_name)
        self.shape, self.device, self.flops = shape, device, 2.0 * m * k * n
        self.a = torch.randn(m, k, device=device).to(dtype)
        self.b = torch.randn(k, n, device=device).to(dtype)
        self.out = torch.empty(m, n, device=device, dtype=dtype)

    def seconds(self) -> float:
        import torch

        is_cuda = self.device.startswith("cuda")
        if is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(self.a, self.b, out=self.out)
        if is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def measure(device: str, dtype_name: str, threads: int | None, repeats: int = 9) -> dict:
    """FLOP/s of each of SHAPES (median of `repeats` after two warm-up products) for
    `dtype_name` on `device`, in this process; the peak is the best shape's."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    by_shape = {}
    for shape in SHAPES:
        gemm = Gemm(shape, device, dtype_name)
        times = [gemm.seconds() for _ in range(repeats + 2)][2:]
        by_shape["x".join(map(str, shape))] = gemm.flops / statistics.median(times)
    best = max(by_shape, key=by_shape.get)
    return {"flops_per_s": by_shape[best], "shape": [int(v) for v in best.split("x")],
            "by_shape": by_shape, "threads": torch.get_num_threads()}


def has_native_bf16(device: str) -> bool:
    """CUDA, or a CPU whose best kernels torch reports as AVX512 (BF16 and AMX ride on it)
    and whose flags show avx512_bf16 or amx_bf16."""
    import torch

    if device.startswith("cuda"):
        return True
    if "AVX512" not in torch.backends.cpu.get_cpu_capability():
        return False
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def peaks_in_fresh_process(device: str, threads: int | None, repeats: int = 9,
                           timeout_s: float = 600.0) -> dict:
    """{"float32": {...}, "bfloat16": {...} or None}, measured by a child interpreter."""
    command = [sys.executable, "-m", "xrec.bench.lib.peak", "--device", device, "--repeats", str(repeats)]
    if threads:
        command += ["--threads", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"GEMM peak measurement failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xrec.bench.lib.peak", description=__doc__)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    peaks = {"float32": measure(args.device, "float32", args.threads, args.repeats),
             "bfloat16": (measure(args.device, "bfloat16", args.threads, args.repeats)
                          if has_native_bf16(args.device) else None)}
    print(json.dumps(peaks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
