"""Fused element-wise chains: a model's small pure tensor functions, each compiled into one
kernel by torch.compile (Inductor, dynamic shapes), where that pays (docs/model.md,
"Fused element-wise chains").

A bfloat16 step on a CPU with AMX spends a third of its time between the products: an
RMSNorm is six passes over memory with float32 temporaries, the gated SiLU two, the
unshared stage and the merge a handful each. Compiled, each chain is one loop over its
inputs. Measured on the AMX machine (docs/decisions.md): 1.18x a qwen3-sid-small bfloat16
step, nothing in float32 (whose RMSNorm is already one kernel) and little on onerec-0.1b.

A module names its chains in `fusable`: attributes holding plain functions (staticmethods
on the class). `fuse(model)` gives each module instance the compiled function instead;
`unfuse(model)` takes it away again. The compiled functions are process-wide, one per
function (`compiled`), so every engine in the process shares their compiled code; dynamo
compiles under its own lock, and `warm_up` (the engine, at load) compiles the variants
serving meets (dimensions of size 1 or more, the slot counts, the layouts of q) before any
request, so that no request pays a compile (tests/test_fusion.py counts them). dynamo's
settings live per thread, so each thread that calls a compiled function sets them first.

The chains compute what the eager functions compute, in the same steps: Inductor is asked
to round where eager code rounds (`emulate_precision_casts`), so results differ from the
eager ones only by the order of float32 sums (a bfloat16 unit in the last place, now and
then).
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn
from torch.fx.experimental import _config as fx_config

from xrec.model.inputs import ModelInputs

FUSED_ENV = "XREC_FUSED_KERNELS"
# the dtypes whose element-wise chains are fused on a CPU: where conversions cost passes
FUSED_DTYPES = (torch.bfloat16, torch.float16)
# and the hidden widths: a compiled call costs ~30 µs more than an eager op, and over rows of
# 128 its loops ran slower than ATen's (a step of onerec-0.015b 0.87x; 512 and up 1.02-1.19x)
FUSED_MIN_WIDTH = 512

# dynamo compiles a function apart per rank and per layout of its inputs (strided views,
# offsets: up to 8 variants of one function in a model); past its default limit of 8 it
# would run the rest eagerly
RECOMPILE_LIMIT = 64

_lock = threading.Lock()
_compiled: dict[Callable, Callable] = {}
# dynamo's settings are per thread (torch.utils._config_module keeps them in ContextVars):
# a limit set where the model was fused binds neither the warm-up's thread nor a pipeline's
_configured: ContextVar[bool] = ContextVar("xrec_fusion_configured", default=False)


def fused_by_default() -> bool:
    """Whether option `fused_kernels` left unset may fuse: yes, unless the environment
    variable XREC_FUSED_KERNELS is 0/false/off (the test suite sets it: compiling costs
    seconds per engine; tests of fusion name the option)."""
    return os.environ.get(FUSED_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def should_fuse(option: bool | None, device: torch.device, dtype: torch.dtype,
                width: int) -> bool:
    """Option `fused_kernels` resolved: None fuses a CPU model in bfloat16 or float16 whose
    hidden width is at least FUSED_MIN_WIDTH (`fused_by_default`); True fuses (a CPU model
    only); False never."""
    if option and device.type != "cpu":
        raise ValueError(f"option fused_kernels=true needs a CPU model, got {device}")
    if option is None:
        return (device.type == "cpu" and dtype in FUSED_DTYPES and width >= FUSED_MIN_WIDTH
                and fused_by_default())
    return option


def compiled(fn: Callable) -> Callable:
    """`fn` compiled by torch.compile with dynamic shapes: one per function in the process,
    callable from any thread (each calling thread gets dynamo's settings first)."""
    with _lock:
        if fn not in _compiled:
            compiled_fn = torch.compile(fn, dynamic=True,
                                        options={"emulate_precision_casts": True})

            @functools.wraps(fn)
            def run(*args, **kwargs):
                if not _configured.get():   # a ContextVar read: ~40 ns (a config read: ~9 µs)
                    _configure_this_thread()
                return compiled_fn(*args, **kwargs)

            _compiled[fn] = run
        return _compiled[fn]


def _configure_this_thread() -> None:
    """dynamo's settings for the compiles this thread may run."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                               RECOMPILE_LIMIT)
    # no equalities guessed from sizes that happen to match in one batch (k's offset and q's
    # stride, say): each would compile the function again when a later batch breaks it
    fx_config.use_duck_shape = False
    # one variant for sizes 1 and larger where the arithmetic allows: fewer compiles
    fx_config.backed_size_oblivious = True
    _configured.set(True)


def fuse(model: nn.Module) -> None:
    """Every module of `model` runs its `fusable` chains compiled."""
    for module in model.modules():
        for name in getattr(module, "fusable", ()):
            setattr(module, name, compiled(getattr(type(module), name)))


def unfuse(model: nn.Module) -> None:
    """Every module of `model` runs its chains eagerly again (its class's functions)."""
    for module in model.modules():
        for name in getattr(module, "fusable", ()):
            module.__dict__.pop(name, None)


def is_fused(model: nn.Module) -> bool:
    return any(name in module.__dict__ for module in model.modules()
               for name in getattr(module, "fusable", ()))


def warm_up(model: Any, rounds: int) -> None:
    """Run `model` (a `RecModel`) on small synthetic batches, so that every chain is compiled
    before serving: dynamo compiles a function apart for each dimension of size 1, so the
    batches are every combination of 1 or 2 requests, beams and prompt positions; `rounds`
    rounds each (the unshared stage reads 1 slot in round 1 and more later)."""
    device = model.device
    start = model.config.decoder_start_len
    with torch.inference_mode():
        for num_batch, num_beams, length in itertools.product((1, 2), repeat=3):
            inputs = ModelInputs(token_ids=torch.zeros(num_batch, length, dtype=torch.long),
                                 lengths=[length] * num_batch, embedding_rows=[], embeddings=None,
                                 context_rows=[], contexts=None, prefix_lengths=[start] * num_batch)
            _, context = model.prefill(inputs.to(device))
            beams = model.new_beam_kv(num_batch, num_beams, rounds)
            token_ids = torch.zeros(num_batch, num_beams, dtype=torch.long, device=device)
            for round_index in range(1, rounds):
                model.decode_step(token_ids, round_index, context, beams)
