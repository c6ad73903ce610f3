"""A stand-in for an accelerator on a CPU-only machine. Test helper.

On a GPU, a tensor made without `device=` lands on the CPU and the next kernel
that mixes it with device tensors fails (or, for an index, copies it to the
device on every call). The meta device is lenient about some of those mixes
(an embedding, an index_copy_ or an advanced index with CPU indices runs), so
`only_meta()` makes them fail: inside it, every aten op whose tensors (inputs
and outputs of more than zero dimensions) are not all on the meta device raises.
Explicit moves (`.to`, `copy_`, `torch.tensor`) are the allowed way across, until
`forbid_moves()`: from then on a move from the host fails too (the decode rounds of a
capturable step neither read from nor upload from the host; tests/test_capturable.py).
"""

from __future__ import annotations

from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_MOVES = (torch.ops.aten._to_copy, torch.ops.aten.copy_, torch.ops.aten.to,
          torch.ops.aten.lift_fresh, torch.ops.aten.lift_fresh_copy)


class only_meta(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.is_moving_allowed = True
        self.num_ops = 0   # ops run since `forbid_moves` (0 before it)
        self._patches: list = []

    def forbid_moves(self) -> None:
        """From now on until the mode exits, an upload from the host fails: any op with a
        host tensor, and `torch.tensor` / `torch.as_tensor` / `torch.from_numpy`, which copy
        host values below the dispatcher."""
        self.is_moving_allowed = False
        for name in ("tensor", "as_tensor", "from_numpy"):
            def refuse(*args, _name=name, **kwargs):
                raise AssertionError(f"torch.{_name} uploads host values, not on the meta device")
            patch = mock.patch.object(torch, name, refuse)
            patch.start()
            self._patches.append(patch)

    def __exit__(self, *exc_info):
        while self._patches:
            self._patches.pop().stop()
        return super().__exit__(*exc_info)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.is_moving_allowed:
            self.num_ops += 1
        if func.overloadpacket not in _MOVES or not self.is_moving_allowed:
            for t in tree_flatten((args, kwargs, out))[0]:
                if isinstance(t, torch.Tensor) and t.dim() > 0 and t.device.type != "meta":
                    raise AssertionError(f"{func} got a tensor on {t.device}, not on the meta device")
        return out
