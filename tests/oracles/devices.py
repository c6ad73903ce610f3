"""A stand-in for an accelerator on a CPU-only machine. Test helper.

On a GPU, a tensor made without `device=` lands on the CPU and the next kernel
that mixes it with device tensors fails (or, for an index, copies it to the
device on every call). The meta device is lenient about some of those mixes
(an embedding, an index_copy_ or an advanced index with CPU indices runs), so
`only_meta()` makes them fail: inside it, every aten op whose tensors (inputs
and outputs of more than zero dimensions) are not all on the meta device raises.
Explicit moves (`.to`, `copy_`, `torch.tensor`) are the allowed way across.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_MOVES = (torch.ops.aten._to_copy, torch.ops.aten.copy_, torch.ops.aten.to,
          torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy)


class only_meta(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket not in _MOVES:
            for t in tree_flatten((args, kwargs, out))[0]:
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device.type != "meta":
                    raise AssertionError(f"{func} got a tensor on {t.device}, not on the meta device")
        return out
