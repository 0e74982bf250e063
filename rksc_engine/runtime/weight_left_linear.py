"""Decode-step linear layers on a CPU with the weight as the left operand of the product.

``torch.nn.functional.linear(x, W)`` computes ``x @ W.T``. On a CPU, when ``x`` has a few rows and
``W`` is large, the BLAS behind it runs that product several times slower than ``(W @ x.T).T``,
the same numbers laid out the other way round: a decode step's linear layers have as many rows as
the batch has, and their time is the step's (timings in ``docs/bench/batch_curve.md``). Float32
only: in bfloat16 and float16 the weight-left product was no faster.

``install`` turns each plain float32 ``torch.nn.Linear`` of a model on the CPU into a
``WeightLeftLinear``, in place: its class changes, nothing else (the same parameters, hooks and
state dict). A ``WeightLeftLinear`` takes the weight-left product only inside
``weight_left_products()`` on the same thread and only for 2 to ``MAX_ROWS`` rows; anywhere else
(one row, a prompt's prefill, the user's own calls to the model on another thread) it is
``torch.nn.functional.linear`` as before, bit for bit.

Neither product is batch-invariant in its bits: with ``linear`` too, a row's result among 8 rows
differs in its last bits from the same row alone. Each is exact to float32 rounding.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

# Rows from which the weight-left product is taken: one row is a matrix-vector product either way,
# with the same bits, so it stays with ``linear``.
MIN_ROWS = 2
# Rows up to which it is taken. Its result comes out transposed and is copied to the usual layout
# (layers ``view`` their outputs); that strided copy grows with the rows until it costs what the
# product saves.
MAX_ROWS = 32
# Weights smaller than this many elements are left to ``linear``: their product costs microseconds
# either way, and the transposed result's copy would only add an operator call to every step.
MIN_WEIGHT_ELEMENTS = 1 << 16

_thread = threading.local()


@contextlib.contextmanager
def weight_left_products() -> Iterator[None]:
    """Within this block, on this thread, ``WeightLeftLinear`` layers take the weight-left product."""
    previous = getattr(_thread, "active", False)
    _thread.active = True
    try:
        yield
    finally:
        _thread.active = previous


def weight_left_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(x, weight, bias)`` computed as ``(weight @ x.T).T`` over ``x``'s rows."""
    rows = x.reshape(-1, x.shape[-1])
    if bias is None:
        out = torch.mm(weight, rows.T)
    else:
        out = torch.addmm(bias[:, None], weight, rows.T)
    return out.T.contiguous().reshape(*x.shape[:-1], weight.shape[0])


class WeightLeftLinear(torch.nn.Linear):
    """A ``torch.nn.Linear`` that takes the weight-left product inside ``weight_left_products()``,
    at 2 to ``MAX_ROWS`` rows of float32 on the CPU, and is ``linear`` everywhere else."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # the argument's name is nn.Linear's
        if (getattr(_thread, "active", False) and input.device.type == "cpu" and input.dim() >= 1
                and input.dtype == torch.float32 and self.weight.dtype == torch.float32):
            rows = input.numel() // max(1, input.shape[-1])
            if MIN_ROWS <= rows <= MAX_ROWS:
                return weight_left_linear(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias)


def takes_weight_left(module: Any, min_weight_elements: int | None = None) -> bool:
    """Whether ``install`` would turn ``module`` into a ``WeightLeftLinear``: a plain
    ``torch.nn.Linear`` (no subclass: quantized and adapter layers compute otherwise) with a plain
    float32 weight of at least ``min_weight_elements`` (default ``MIN_WEIGHT_ELEMENTS``) on the CPU
    (no tensor subclass), whose forward no one has replaced on the instance (accelerate's offload
    hooks do)."""
    smallest = MIN_WEIGHT_ELEMENTS if min_weight_elements is None else min_weight_elements
    return (type(module) is torch.nn.Linear and type(module.weight.data) is torch.Tensor
            and module.weight.device.type == "cpu" and module.weight.dtype == torch.float32
            and module.weight.numel() >= smallest and "forward" not in vars(module))


def install(model: torch.nn.Module, min_weight_elements: int | None = None) -> int:
    """Turn each of ``model``'s linear layers that ``takes_weight_left`` into a ``WeightLeftLinear``.
    Returns how many of its layers are one, including those an earlier call turned (another engine
    over the same model): 0 for a model on a GPU, or one whose layers are all small."""
    count = 0
    for module in model.modules():
        if takes_weight_left(module, min_weight_elements):
            module.__class__ = WeightLeftLinear
        count += type(module) is WeightLeftLinear
    return count


def uninstall(model: torch.nn.Module) -> int:
    """Turn ``model``'s ``WeightLeftLinear`` layers back into ``torch.nn.Linear``. Returns how many."""
    removed = 0
    for module in model.modules():
        if type(module) is WeightLeftLinear:
            module.__class__ = torch.nn.Linear
            removed += 1
    return removed
