"""This machine's GEMM peak per dtype, measured in a fresh process: `python -m xrec.bench.lib.peak`.

The roofline's denominator. A fresh process, because a process that already ran other
torch work may hold OpenMP teams or allocator state that slow (or warm) the product.
For each dtype the peak is the best FLOP/s of any product over a few large shapes (square
1024³ to 4096³, and the tall-skinny shapes of a batch of positions through a projection),
with the same intra-op thread count as the run it is compared with: a product never runs
faster than the machine can, so the best timing is the honest ceiling, and a slow one
says only that a neighbour took the cores for a moment. On a CPU each shape is timed
through both libraries PyTorch carries, ATen's product (MKL for float32) and oneDNN's
linear, and the peak is the best of either: xrec's float32 products take oneDNN where it
is faster (`xrec.model.gemm`; MKL runs AVX2 kernels on AMD CPUs with AVX-512), and a
ceiling one library does not reach would flatter the other. Each shape gets two warm-up
products, then up to `repeats` timed ones within `budget_s` (at least three), so the
whole measurement takes seconds (two cores: ~8 s for float32, less for bfloat16).

`Gemm` is also the roofline's interleaved reference: a mid-sized shape's product timed
between xrec's steps (`reference_shape`). bfloat16 is measured by default where the device
computes it natively (`xrec.model.dtype.native_bf16`: CUDA, a CPU with AMX-BF16 or
AVX512-BF16); asked for elsewhere, it is measured emulated and marked `native: false`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

# (m, k, n): square, and a few thousand positions through D -> 4D / 4D -> D projections
SHAPES = ((1024, 1024, 1024), (2048, 2048, 2048), (4096, 1024, 4096), (4096, 4096, 1024),
          (4096, 4096, 4096))
QUICK_SHAPES = ((512, 512, 512),)
# the interleaved reference's shape: the best of the shapes up to this many FLOPs (the
# 4096³ product would add seconds around every timed step)
REFERENCE_MAX_FLOPS = 2.0 * 4096 * 1024 * 4096


# the libraries a product is timed through: ATen's `torch.mm` everywhere, oneDNN's linear
# on a CPU (in bfloat16 only where the CPU has it natively: on an AVX2-only CPU oneDNN
# builds no bfloat16 linear at all, "could not create a primitive descriptor")
LIBRARIES = ("aten", "onednn")


def libraries(device: str, dtype_name: str) -> tuple[str, ...]:
    import torch

    from xrec.model.dtype import native_bf16

    has_onednn = device == "cpu" and torch.backends.mkldnn.is_available() and (
        dtype_name != "bfloat16" or native_bf16(device))
    return LIBRARIES if has_onednn else ("aten",)


class Gemm:
    """One `[m, k] @ [k, n]` product on `device` in `dtype_name` through `library`, timed
    (synchronised)."""

    def __init__(self, shape: tuple[int, int, int], device: str, dtype_name: str,
                 library: str = "aten"):
        import torch

        from xrec.model.gemm import onednn_linear

        m, k, n = shape
        dtype = getattr(torch, dtype_name)
        self.shape, self.device, self.flops = shape, device, 2.0 * m * k * n
        self.library = library
        self.a = torch.randn(m, k, device=device).to(dtype)
        self.b = torch.randn(k, n, device=device).to(dtype)
        self.out = torch.empty(m, n, device=device, dtype=dtype)
        if library == "onednn":
            weight = self.b.T.contiguous()                              # [n, k]
            self._product = lambda: onednn_linear(self.a, weight)
        else:
            self._product = lambda: torch.mm(self.a, self.b, out=self.out)

    def seconds(self) -> float:
        import torch

        is_cuda = self.device.startswith("cuda")
        if is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        self._product()
        if is_cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - start


def measure(device: str, dtype_name: str, threads: int | None, repeats: int = 7,
            shapes: tuple[tuple[int, int, int], ...] = SHAPES, budget_s: float = 1.5) -> dict:
    """For each of `shapes` in `dtype_name` on `device`, through each library, in this
    process: two warm-up products, then `repeats` timed ones (fewer once `budget_s` is
    spent, never under three); the best and the median FLOP/s per shape (the better
    library's) and per library. The peak is the best of all."""
    import torch

    from xrec.model.dtype import native_bf16

    if threads:
        torch.set_num_threads(threads)
    best: dict[str, float] = {}
    median: dict[str, float] = {}
    by_library: dict[str, float] = {}
    best_library: dict[str, str] = {}
    for shape in shapes:
        key = "x".join(map(str, shape))
        for library in libraries(device, dtype_name):
            gemm = Gemm(shape, device, dtype_name, library)
            gemm.seconds(), gemm.seconds()
            times: list[float] = []
            started = time.perf_counter()
            while len(times) < repeats and (len(times) < 3 or time.perf_counter() - started < budget_s):
                times.append(gemm.seconds())
            rate = gemm.flops / min(times)
            by_library[library] = max(by_library.get(library, 0.0), rate)
            if rate > best.get(key, 0.0):
                best[key], best_library[key] = rate, library
                median[key] = gemm.flops / statistics.median(times)
    top = max(best, key=best.get)
    return {"flops_per_s": best[top], "shape": _shape(top), "library": best_library[top],
            "by_shape": best, "median_by_shape": median, "by_library": by_library,
            "threads": torch.get_num_threads(),
            "native": dtype_name != "bfloat16" or native_bf16(device)}


def reference_gemm(peak: dict, device: str, dtype_name: str) -> Gemm:
    """The interleaved reference: `reference_shape`'s product through the peak's library."""
    return Gemm(reference_shape(peak), device, dtype_name, peak["library"])


def reference_shape(peak: dict) -> tuple[int, int, int]:
    """The interleaved reference's product: the fastest shape of `peak` (a `measure`
    result) of at most REFERENCE_MAX_FLOPS."""
    small = {k: v for k, v in peak["by_shape"].items()
             if 2.0 * _volume(_shape(k)) <= REFERENCE_MAX_FLOPS}
    return _shape(max(small or peak["by_shape"], key=(small or peak["by_shape"]).get))


def default_dtypes(device: str) -> list[str]:
    """float32, and bfloat16 where `device` computes it natively."""
    from xrec.model.dtype import native_bf16

    return ["float32"] + (["bfloat16"] if native_bf16(device) else [])


def peaks_in_fresh_process(device: str, threads: int | None, dtypes: list[str],
                           repeats: int = 7, quick: bool = False,
                           timeout_s: float = 600.0) -> dict[str, dict]:
    """{dtype: `measure`'s result} for each of `dtypes`, measured by a child interpreter."""
    command = [sys.executable, "-m", "xrec.bench.lib.peak", "--device", device,
               "--repeats", str(repeats), "--dtypes", ",".join(dtypes)]
    if threads:
        command += ["--threads", str(threads)]
    if quick:
        command.append("--quick")
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"GEMM peak measurement failed: {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


def _shape(key: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in key.split("x"))
    return m, k, n


def _volume(shape: tuple[int, int, int]) -> int:
    m, k, n = shape
    return m * k * n


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m xrec.bench.lib.peak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtypes", default=None, help="comma-separated (default: float32, and "
                        "bfloat16 where the device has it natively)")
    parser.add_argument("--quick", action="store_true", help="the 512³ product only")
    args = parser.parse_args(argv)
    dtypes = args.dtypes.split(",") if args.dtypes else default_dtypes(args.device)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    print(json.dumps({dtype: measure(args.device, dtype, args.threads, args.repeats, shapes)
                      for dtype in dtypes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
