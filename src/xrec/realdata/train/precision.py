"""Mixed precision for `xrec train`: option `dtype` ("auto", "float32", "bfloat16").

In bfloat16 the weights, their gradients and the optimizer state stay float32; the forward
pass runs under `torch.autocast` (bfloat16 products, float32 reductions and losses), with
three measured adjustments (docs/decisions.md, "Training in bfloat16"):

- attention stays float32 (`FLOAT32_SDPA`): PyTorch's CPU flash kernel ran its bfloat16
  backward at a third of the float32 one's rate on these shapes (4 heads of 32, 151
  positions), which ate the products' gain;
- the model's forward passes are compiled (torch.compile, dynamic shapes), so that the
  conversions autocast inserts between the products fuse into the element-wise chains
  around them; eager autocast was no faster than float32 (0.89-1.0x);
- the linear layers are PyTorch's own (the oneDNN float32 route of `xrec.model.gemm` is for
  float32 products, and Inductor cannot lower its autograd function).

The model written after each epoch is float32 either way: serving picks its own dtype.

"auto" is bfloat16 where the CPU computes it natively (`xrec.model.dtype.resolve_dtype`,
which also honours `XREC_CPU_AUTO_DTYPE`) and the family's quality held in bfloat16 training
on ML-1M validation (`AUTO_BF16`), float32 elsewhere.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch.fx.experimental import _config as fx_config

from xrec.model.fusion import RECOMPILE_LIMIT
from xrec.realdata.train.options import check_train_dtype

__all__ = ["AUTO_BF16", "FLOAT32_SDPA", "autocast", "compile_settings", "compiled_pass",
           "resolve_train_dtype", "use_float32_attention"]

# families whose bfloat16 training validated as well as float32 on ML-1M (decisions.md)
AUTO_BF16 = {"qwen3": True, "onerec": False}
FLOAT32_SDPA = "xrec_float32_sdpa"


def resolve_train_dtype(name: str, family: str, cpuinfo: str | None = None) -> torch.dtype:
    """The dtype option `dtype` trains `family` in (float32 or bfloat16); `cpuinfo`: a
    /proc/cpuinfo text to read instead of this machine's (tests)."""
    from xrec.model.dtype import resolve_dtype

    check_train_dtype(name)
    return resolve_dtype(name, "cpu", cpu_auto_bf16=AUTO_BF16.get(family, False),
                         cpuinfo=cpuinfo)


def autocast(dtype: torch.dtype):
    """The context a training forward pass runs in: bfloat16 autocast, or nothing."""
    return torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16)


def compiled_pass(fn):
    """`fn` (a forward pass or a loss) compiled for training: dynamic shapes (windows of
    every length), and OpenMP teams sized when a kernel runs, so that the compiled loops
    follow the thread count `FollowFreeCores` sets under contention as the products do.
    dynamo guards on the thread count (and specialises batches of one), so the first step
    at a new count compiles again: a variant per count (`compile_settings`)."""
    compiled_fn = torch.compile(fn, dynamic=True, options={"cpp.dynamic_threads": True})

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with compile_settings():
            return compiled_fn(*args, **kwargs)

    return run


@contextlib.contextmanager
def compile_settings() -> Iterator[None]:
    """dynamo's settings for training's compiles, whatever the thread had (they are per
    thread): a variant per thread count up to `RECOMPILE_LIMIT`, and the default shape
    rules. A thread that fused a serving model keeps `fusion.configure_this_thread`'s rules
    (no duck shapes, size-oblivious ones), and under them Inductor's training graphs
    asserted on a stride. Python floats (the modules' scales, dropout rates, epsilons; all
    constant in a run) are specialised: traced as symbols under dynamic shapes, they made
    dynamo trace every pass twice (a restart to turn them into tensors), ~10 s of a cold
    compile on 2 cores. The trainer runs its steps, backward passes included (Inductor
    compiles a backward at its first call), inside it."""
    with (torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT, specialize_float=True),
          fx_config.patch(use_duck_shape=True, backed_size_oblivious=False)):
        yield


def _float32_sdpa(module, query, key, value, attention_mask, **kwargs):
    """Hugging Face's SDPA attention computed in float32 whatever autocast says."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    with torch.autocast("cpu", enabled=False):
        return sdpa_attention_forward(module, query.float(), key.float(), value.float(),
                                      attention_mask, **kwargs)


def use_float32_attention(hf) -> None:
    """A Hugging Face decoder-only model computes its attention with `_float32_sdpa`."""
    from transformers import AttentionInterface

    AttentionInterface.register(FLOAT32_SDPA, _float32_sdpa)
    hf.config._attn_implementation = FLOAT32_SDPA
