"""Where a ``transformers`` causal LM keeps its parts, for the modules that run the model layer by layer.

``verifier`` (CGEE's early exit) and ``asks`` (span similarity, first-layer probes) both read the
decoder layers, the final norm and the LM head; this module names them once, below both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def decoder_parts(model: Any) -> tuple[Sequence[torch.nn.Module], torch.nn.Module, torch.nn.Module]:
    """``(decoder layers, final norm, LM head)`` of a transformers causal LM (Llama-style layout).

    Raises:
        TypeError: The model has no ``.model.layers`` and ``.model.norm``.
    """
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if layers is None or norm is None:
        raise TypeError(f"layer exit needs a Llama-style model with .model.layers and .model.norm; "
                        f"got {type(model).__name__}")
    return layers, norm, model.get_output_embeddings()
