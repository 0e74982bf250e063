"""Where a ``transformers`` causal LM keeps its parts, for the modules that run the model layer by layer.

``verifier`` (CGEE's early exit) and ``asks`` (span similarity, first-layer probes) both read the
decoder layers, the final norm and the LM head; this module names them once, below both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# Attribute names of the decoder layer list and of the final norm across ``transformers`` families
# (Llama-style first; GPT-2 ``h``/``ln_f``, GPT-NeoX ``final_layer_norm``, Falcon-H1
# ``final_layernorm``, LFM2 ``embedding_norm``).
_LAYER_LISTS = ("layers", "h")
_FINAL_NORMS = ("norm", "final_layernorm", "final_layer_norm", "ln_f", "embedding_norm", "final_norm")


def decoder_parts(model: Any) -> tuple[Sequence[torch.nn.Module], torch.nn.Module, torch.nn.Module]:
    """``(decoder layers, final norm, LM head)`` of a transformers causal LM.

    Raises:
        TypeError: The model's decoder has no layer list or no final norm under a known name.
    """
    getter = getattr(model, "get_decoder", None)
    base = getter() if callable(getter) else getattr(model, "model", None)
    if base is None:
        base = getattr(model, "model", None)
    layers = next((getattr(base, name) for name in _LAYER_LISTS if hasattr(base, name)), None)
    norm = next((getattr(base, name) for name in _FINAL_NORMS if hasattr(base, name)), None)
    if layers is None or norm is None:
        raise TypeError(f"layer exit needs a decoder with a layer list ({' or '.join(_LAYER_LISTS)}) and a final "
                        f"norm ({', '.join(_FINAL_NORMS)}); got {type(model).__name__}")
    return layers, norm, model.get_output_embeddings()
