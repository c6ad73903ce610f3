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
serving meets (a dimension of size 1 and the rest) before any request, so that no request
pays a compile.

The chains compute what the eager functions compute, in the same steps: Inductor is asked
to round where eager code rounds (`emulate_precision_casts`), so results differ from the
eager ones only by the order of float32 sums (a bfloat16 unit in the last place, now and
then).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from xrec.model.inputs import ModelInputs

FUSED_ENV = "XREC_FUSED_KERNELS"
# the dtypes whose element-wise chains are fused on a CPU: where conversions cost passes
FUSED_DTYPES = (torch.bfloat16, torch.float16)

# dynamo compiles a function apart per rank and per dimension of size 1 (about 8 variants of
# an RMSNorm in one model); past its default of 8 it would run the rest eagerly
RECOMPILE_LIMIT = 64

_lock = threading.Lock()
_compiled: dict[Callable, Callable] = {}


def fused_by_default() -> bool:
    """Whether option `fused_kernels` left unset may fuse: yes, unless the environment
    variable XREC_FUSED_KERNELS is 0/false/off (the test suite sets it: compiling costs
    seconds per engine; tests of fusion name the option)."""
    return os.environ.get(FUSED_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def should_fuse(option: bool | None, device: torch.device, dtype: torch.dtype) -> bool:
    """Option `fused_kernels` resolved: None fuses a CPU model in bfloat16 or float16
    (`fused_by_default`); True fuses (a CPU model only); False never."""
    if option and device.type != "cpu":
        raise ValueError(f"option fused_kernels=true needs a CPU model, got {device}")
    if option is None:
        return device.type == "cpu" and dtype in FUSED_DTYPES and fused_by_default()
    return option


def compiled(fn: Callable) -> Callable:
    """`fn` compiled by torch.compile with dynamic shapes: one per function in the process."""
    with _lock:
        if fn not in _compiled:
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit,
                                                       RECOMPILE_LIMIT)
            _compiled[fn] = torch.compile(fn, dynamic=True,
                                          options={"emulate_precision_casts": True})
        return _compiled[fn]


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
    """Run `model` (a `RecModel`) on two small synthetic batches, so that every chain is
    compiled before serving: one request with one beam (dimensions of size 1, which
    dynamo compiles apart) and two requests of two positions with two beams; `rounds`
    rounds each (the unshared stage reads 1 slot in round 1 and more later)."""
    device = model.device
    start = model.config.decoder_start_len
    with torch.inference_mode():
        for num_batch, num_beams, length in ((1, 1, 1), (2, 2, 2)):
            inputs = ModelInputs(token_ids=torch.zeros(num_batch, length, dtype=torch.long),
                                 lengths=[length] * num_batch, embedding_rows=[], embeddings=None,
                                 context_rows=[], contexts=None, prefix_lengths=[start] * num_batch)
            _, context = model.prefill(inputs.to(device))
            beams = model.new_beam_kv(num_batch, num_beams, rounds)
            token_ids = torch.zeros(num_batch, num_beams, dtype=torch.long, device=device)
            for round_index in range(1, rounds):
                model.decode_step(token_ids, round_index, context, beams)
