"""Decode-step linear layers on a CPU with the weight as the left operand of the product.

``torch.nn.functional.linear(x, W)`` computes ``x @ W.T``. On a CPU, when ``x`` has a few rows and
``W`` is large, the BLAS behind it runs that product several times slower than ``(W @ x.T).T``,
the same numbers laid out the other way round: a decode step's linear layers have as many rows as
the batch has, and their time is the step's. For the LM head of a small model (49,152 x 576, float32)
at 2 to 8 rows, ``linear`` took 24-35 ms a call on a 2-core CPU where ``(W @ x.T).T`` took 9-12 ms.
Float32 only: in bfloat16 and float16 the weight-left product was no faster there.

``install`` gives each plain ``torch.nn.Linear`` of a model on the CPU a forward that takes the
weight-left product, but only inside ``weight_left_products()`` on the same thread and only for 2 to
``MAX_ROWS`` rows; anywhere else (one row, a prompt's prefill, the user's own calls to the model on
another thread) it is ``torch.nn.functional.linear`` as before, bit for bit.

Neither product is batch-invariant in its bits: with ``linear`` too, a row's result among 8 rows
differs in its last bits from the same row alone. Each is exact to float32 rounding.
"""

from __future__ import annotations

import contextlib
import threading
import types
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

# Rows from which the weight-left product is taken: one row is a matrix-vector product either way,
# with the same bits, so it stays with ``linear``.
MIN_ROWS = 2
# Rows up to which it is taken. Its result comes out transposed and is copied to the usual layout
# (layers ``view`` their outputs); at 64 rows that strided copy cost what the product saved.
MAX_ROWS = 32

_thread = threading.local()


@contextlib.contextmanager
def weight_left_products() -> Iterator[None]:
    """Within this block, on this thread, installed linear layers take the weight-left product."""
    previous = getattr(_thread, "active", False)
    _thread.active = True
    try:
        yield
    finally:
        _thread.active = previous


def takes_weight_left(module: Any) -> bool:
    """Whether ``install`` would give ``module`` the weight-left forward: a plain ``torch.nn.Linear``
    (no subclass: quantized and adapter layers compute otherwise) with a float32 weight on the CPU,
    whose forward no one else has replaced (accelerate's offload hooks do, on the instance)."""
    return (type(module) is torch.nn.Linear and module.weight.device.type == "cpu"
            and module.weight.dtype == torch.float32 and "forward" not in vars(module))


def install(model: torch.nn.Module) -> int:
    """Give each of ``model``'s linear layers that ``takes_weight_left`` the gated forward. Returns
    how many of its layers have it, including those an earlier call gave it (another engine over
    the same model): 0 for a model on a GPU."""
    count = 0
    for module in model.modules():
        if _has_gated_forward(module):
            count += 1
        elif takes_weight_left(module):
            module.forward = types.MethodType(_forward, module)
            count += 1
    return count


def uninstall(model: torch.nn.Module) -> int:
    """Give the layers ``install`` changed their class's forward back. Returns how many."""
    removed = 0
    for module in model.modules():
        if _has_gated_forward(module):
            del module.forward
            removed += 1
    return removed


def _has_gated_forward(module: Any) -> bool:
    forward = vars(module).get("forward")
    return isinstance(forward, types.MethodType) and forward.__func__ is _forward


def weight_left_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(x, weight, bias)`` computed as ``(weight @ x.T).T`` over ``x``'s rows."""
    rows = x.reshape(-1, x.shape[-1])
    if bias is None:
        out = torch.mm(weight, rows.T)
    else:
        out = torch.addmm(bias[:, None], weight, rows.T)
    return out.T.contiguous().reshape(*x.shape[:-1], weight.shape[0])


def _forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if getattr(_thread, "active", False) and x.device.type == "cpu" and x.dim() >= 1:
        rows = x.numel() // max(1, x.shape[-1])
        if MIN_ROWS <= rows <= MAX_ROWS:
            return weight_left_linear(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


# A bound method pickles as ``getattr(module, __name__)``. Under the name it is installed as, a model
# with it still pickles (``torch.save`` of the whole model), and loads with a plain forward.
_forward.__name__ = "forward"
