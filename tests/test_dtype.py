"""Which dtype serves (`xrec.model.dtype`): "auto" by hardware and by the family's
`cpu_auto_bf16`, bfloat16 emulated with one warning, a bfloat16 checkpoint in either
dtype, and the engines saying what they run in. CPU flags come from fake /proc/cpuinfo
texts, so the tests hold on any machine."""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from xrec import Engine, RecRequest
from xrec.demo import write_random_model
from xrec.model import dtype as dtypes
from xrec.model.dtype import (cpu_flags, cpu_native_bf16, emulation_warning, native_bf16,
                              resolve_dtype)
from xrec.model.onerec import OneRecModel
from xrec.model.qwen import QwenModel

AMX = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n\nprocessor\t: 1\n" \
      "flags\t\t: fpu sse avx2 avx512f amx_bf16 amx_tile\n"
ZEN4 = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
OLD = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f\n"
REQUEST = RecRequest(token_ids=[5, 17, 9], beam_width=4)


@pytest.fixture(scope="module")
def bf16_model_dir(tmp_path_factory):
    """A tiny random model whose checkpoint is stored in bfloat16."""
    model_dir = write_random_model(tmp_path_factory.mktemp("bf16"), "tiny", seed=4, num_items=200)
    for path in model_dir.glob("*.safetensors"):
        tensors = {k: v.to(torch.bfloat16) for k, v in load_file(str(path)).items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
    return model_dir


def _fake_cpu(monkeypatch, cpuinfo: str) -> None:
    """This machine's CPU seen as `cpuinfo`, with "auto" left to the hardware (conftest.py
    pins it to float32 for the rest of the suite)."""
    monkeypatch.setattr(dtypes, "_this_cpu_flags", lambda: cpu_flags(cpuinfo))
    monkeypatch.delenv(dtypes.CPU_AUTO_DTYPE_ENV, raising=False)


def test_cpu_flags_and_native_bf16():
    assert {"amx_bf16", "avx512f"} <= cpu_flags(AMX) and "model" not in cpu_flags(ZEN4)
    assert cpu_native_bf16(AMX) and cpu_native_bf16(ZEN4) and not cpu_native_bf16(OLD)
    assert not cpu_native_bf16("")                        # no /proc/cpuinfo: not native
    assert native_bf16("cpu", AMX) and not native_bf16(torch.device("cpu"), OLD)


@pytest.mark.parametrize("cpuinfo,is_allowed,expected", [
    (AMX, True, torch.bfloat16), (ZEN4, True, torch.bfloat16),
    (AMX, False, torch.float32), (OLD, True, torch.float32), (OLD, False, torch.float32)])
def test_auto_on_a_cpu_follows_the_hardware_and_the_family(cpuinfo, is_allowed, expected):
    assert resolve_dtype("auto", "cpu", cpu_auto_bf16=is_allowed, cpuinfo=cpuinfo) == expected


def test_auto_on_cuda_follows_the_device_not_the_cpu_flag(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for has_bf16, expected in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True,
                            has=has_bf16: has)
        assert resolve_dtype("auto", "cuda", cpu_auto_bf16=False, cpuinfo=OLD) == expected


def test_named_dtypes_are_taken_as_they_are_and_unknown_ones_refused():
    for name in ("float32", "bfloat16", "float16"):
        assert resolve_dtype(name, "cpu", cpuinfo=OLD) == getattr(torch, name)
    with pytest.raises(ValueError, match=r"option dtype: got 'float64', allowed: 'auto', float32, "
                                         r"bfloat16, float16"):
        resolve_dtype("float64", "cpu")


def test_emulation_warning_only_for_bf16_without_hardware():
    assert emulation_warning(torch.bfloat16, "cpu", OLD).startswith(
        "dtype bfloat16 on cpu is emulated (this CPU has neither AMX-BF16 nor AVX512-BF16)")
    assert emulation_warning(torch.bfloat16, "cpu", AMX) is None
    assert emulation_warning(torch.float32, "cpu", OLD) is None


def test_auto_is_bf16_on_cpus_only_for_the_family_whose_gate_held():
    """Issue 23: "auto" picks bfloat16 on a CPU only for a family whose bf16 quality gate
    held on a trained model: both families on ML-1M, once the scores kept float32
    precision (docs/decisions.md)."""
    assert QwenModel.cpu_auto_bf16 is True and OneRecModel.cpu_auto_bf16 is True
    assert (OneRecModel.family, QwenModel.family) == ("onerec", "qwen")


def test_the_environment_overrides_auto_on_a_cpu(monkeypatch):
    _fake_cpu(monkeypatch, AMX)
    assert resolve_dtype("auto", "cpu", cpu_auto_bf16=True) == torch.bfloat16
    monkeypatch.setenv(dtypes.CPU_AUTO_DTYPE_ENV, "float32")
    assert resolve_dtype("auto", "cpu", cpu_auto_bf16=True) == torch.float32
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16     # a name is taken as it is
    monkeypatch.setenv(dtypes.CPU_AUTO_DTYPE_ENV, "bfloat16")
    assert resolve_dtype("auto", "cpu", cpu_auto_bf16=False) == torch.bfloat16
    monkeypatch.setenv(dtypes.CPU_AUTO_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match="XREC_CPU_AUTO_DTYPE: got 'fp8', expected float32 or "
                                         "bfloat16"):
        resolve_dtype("auto", "cpu")


@pytest.mark.parametrize("is_allowed", [False, True])
def test_engine_auto_dtype_on_a_native_cpu(bf16_model_dir, monkeypatch, is_allowed):
    _fake_cpu(monkeypatch, AMX)
    monkeypatch.setattr(OneRecModel, "cpu_auto_bf16", is_allowed)
    with Engine.from_pretrained(bf16_model_dir, isolation="thread", device="cpu") as engine:
        expected = "bfloat16" if is_allowed else "float32"
        assert engine.dtype == expected == engine.describe()["dtype"]
        assert engine.model.dtype == getattr(torch, expected) and engine.family == "onerec"
        assert engine.recommend(REQUEST)[0].results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_bf16_checkpoint_loads_in_either_dtype(bf16_model_dir, dtype):
    with Engine.from_pretrained(bf16_model_dir, isolation="thread", device="cpu",
                                dtype=dtype) as engine:
        assert engine.dtype == dtype
        assert all(p.dtype == getattr(torch, dtype) for p in engine.model.parameters())
        response = engine.recommend(REQUEST)[0]
        assert len(response.results) >= 1 and all(r.score <= 0 for r in response.results)


def test_emulated_bf16_runs_with_one_warning(bf16_model_dir, monkeypatch, caplog):
    _fake_cpu(monkeypatch, OLD)
    with caplog.at_level(logging.WARNING, logger="xrec"):
        with Engine.from_pretrained(bf16_model_dir, isolation="thread", device="cpu",
                                    dtype="bfloat16") as engine:
            assert engine.dtype == "bfloat16"
            engine.recommend([REQUEST, REQUEST])
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "emulated" in warnings[0], warnings


def test_a_process_engine_says_its_dtype(bf16_model_dir):
    with Engine.from_pretrained(bf16_model_dir, isolation="process", device="cpu",
                                dtype="bfloat16", num_threads=1) as engine:
        assert (engine.dtype, engine.family) == ("bfloat16", "onerec")
        assert engine.recommend(REQUEST)[0].results
