"""Which dtype a model runs in: option `dtype` ("auto" or a name) on a device, for a family.

"auto" is bfloat16 where the hardware computes it natively and float32 elsewhere:

- CUDA: bfloat16 where the device has it (`torch.cuda.is_bf16_supported`, no emulation);
- CPU: bfloat16 where the CPU has AMX-BF16 or AVX512-BF16 (`amx_bf16` / `avx512_bf16` in
  /proc/cpuinfo) **and** the family's `RecModel.cpu_auto_bf16` says its quality holds in
  bfloat16 (issue 23's gate: HR@10 and NDCG@10 within 1% of float32, top-10 overlap
  >= 0.95, on a trained model). Until a family's gate is measured its flag is False, so
  "auto" on a CPU is float32. The environment variable `XREC_CPU_AUTO_DTYPE` (`float32` or
  `bfloat16`) overrides what "auto" means on a CPU, for every family: an operator who wants
  float32 everywhere without naming it in each command, and the test suite, whose
  results must not depend on the machine it runs on (tests/conftest.py sets `float32`;
  tests of bfloat16 name it).

A bfloat16 asked for by name on hardware without it still runs (emulated, slow): the
engine logs one warning (`emulation_warning`).
"""

from __future__ import annotations

import functools
import os

import torch

from xrec.config.keys import DTYPES

# /proc/cpuinfo flags of the x86 instructions that compute bfloat16 products natively
CPU_BF16_FLAGS = ("amx_bf16", "avx512_bf16")
CPU_AUTO_DTYPE_ENV = "XREC_CPU_AUTO_DTYPE"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The `flags` of a /proc/cpuinfo text (the union over its processors)."""
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            flags.update(value.split())
    return frozenset(flags)


@functools.cache
def _this_cpu_flags() -> frozenset[str]:
    """This machine's CPU flags, read once per process (none where /proc/cpuinfo is absent)."""
    try:
        with open("/proc/cpuinfo") as f:
            return cpu_flags(f.read())
    except OSError:
        return frozenset()


def cpu_native_bf16(cpuinfo: str | None = None) -> bool:
    """The CPU computes bfloat16 products natively (AMX-BF16 or AVX512-BF16). `cpuinfo`: a
    /proc/cpuinfo text to read instead of this machine's (tests)."""
    flags = _this_cpu_flags() if cpuinfo is None else cpu_flags(cpuinfo)
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def native_bf16(device: torch.device | str, cpuinfo: str | None = None) -> bool:
    """`device` computes bfloat16 natively: a CUDA device with bf16 (no emulation), or a CPU
    with AMX-BF16 / AVX512-BF16 (`cpuinfo` as in `cpu_native_bf16`)."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return cpu_native_bf16(cpuinfo)
    return False


def resolve_dtype(name: str, device: torch.device | str, cpu_auto_bf16: bool = False,
                  cpuinfo: str | None = None) -> torch.dtype:
    """The torch dtype of option `dtype` `name` on `device`. "auto": bfloat16 where
    `native_bf16(device)`, on a CPU only if `cpu_auto_bf16` (the family's
    `RecModel.cpu_auto_bf16`); float32 otherwise. A name is taken as it is."""
    if name == "auto":
        device = torch.device(device)
        forced = os.environ.get(CPU_AUTO_DTYPE_ENV) if cpuinfo is None else None
        if device.type == "cpu" and forced:
            if forced not in ("float32", "bfloat16"):
                raise ValueError(f"{CPU_AUTO_DTYPE_ENV}: got {forced!r}, expected float32 or "
                                 "bfloat16 (or unset)")
            return getattr(torch, forced)
        is_bf16 = native_bf16(device, cpuinfo) and (device.type != "cpu" or cpu_auto_bf16)
        return torch.bfloat16 if is_bf16 else torch.float32
    if name not in DTYPES:
        raise ValueError(f"option dtype: got {name!r}, allowed: 'auto', {', '.join(DTYPES)}")
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """"float32" for torch.float32 (the names option `dtype` takes)."""
    return str(dtype).removeprefix("torch.")


def emulation_warning(dtype: torch.dtype, device: torch.device | str,
                      cpuinfo: str | None = None) -> str | None:
    """One line to log when `dtype` runs emulated on `device` (bfloat16 without native
    support: correct, but slower than float32), else None."""
    if dtype != torch.bfloat16 or native_bf16(device, cpuinfo):
        return None
    where = "this CPU has neither AMX-BF16 nor AVX512-BF16" if torch.device(device).type == "cpu" \
        else f"{device} has no native bfloat16"
    return (f"dtype bfloat16 on {device} is emulated ({where}): results are correct but "
            f"slower than float32; use dtype='float32' or 'auto'")
