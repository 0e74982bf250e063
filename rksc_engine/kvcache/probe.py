"""Whether a model decodes correctly through the shared-prefix path: a one-time numerical check.

``shared_prefix_attention`` reaches the model's attention through the forward's keyword arguments,
and applies sliding windows, soft-capping and sinks as the model's own attention does. Not every
model passes what its attention needs, so ``probe`` runs one decode step both ways and compares the
logits; the engine falls back to ``DynamicCache`` for a model that fails. ``logit_tolerance`` is
the rounding bound of that comparison, which the runtime's other exactness checks use too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .cache_layers import has_sliding_layers, keeps_token_kv, layer_types, new_kv_cache
from .shared_prefix import ATTENTION_NAME, SharedPrefixCache, attention_implementation


@dataclass(frozen=True)
class ProbeResult:
    """Whether a model decodes correctly through the shared-prefix path, and why not if not."""

    supported: bool
    reason: str = ""
    max_abs_logit_diff: float = 0.0
    # True when the probe could not run (an exception other than an unsupported feature): it says
    # nothing about the model, so the engine probes again on a later request.
    inconclusive: bool = False


def logit_tolerance(want: torch.Tensor, dtype: torch.dtype) -> float:
    """How far logits computed another exact way may stray from ``want`` by rounding alone, for a
    model of ``dtype``: relative to the largest logit (at least 1)."""
    return (1e-4 if dtype == torch.float32 else 5e-2) * max(float(want.abs().max()), 1.0)


# Prompt tokens the probe prefills: past a sliding window of up to this many minus two tokens, so that
# the window bites in the probe's decode step; a longer window is checked by the test suite's
# tiny models instead of by a long probe at load.
MAX_PROBE_PROMPT_TOKENS = 64


def probe(model: Any, forward: Any) -> ProbeResult:
    """Check once, numerically, that ``model`` decodes the same through ``SharedPrefixCache``.

    It prefills a short prompt (past the model's sliding window where that is short), decodes one
    step for two branches both through the model's own ``DynamicCache`` (repeated rows) and
    through the shared-prefix path, and requires every attention layer to have gone through
    ``shared_prefix_attention`` and the logits to agree to the model dtype's rounding.

    Args:
        model: A ``transformers`` causal LM.
        forward: ``forward(input_ids, cache, **kwargs)`` returning an output with ``.logits``.
    """
    from transformers import DynamicCache

    try:
        config = model.config
        if not keeps_token_kv(config):
            return ProbeResult(False, f"the model has layers without per-token KV: {sorted(set(layer_types(config)))}")
        layers = layer_types(config)
        device = next(model.parameters()).device
        text_config = config.get_text_config()
        vocab = int(text_config.vocab_size)
        length = 4
        if has_sliding_layers(config):
            length = max(length, min(int(getattr(text_config, "sliding_window", 0) or 0) + 2,
                                     MAX_PROBE_PROMPT_TOKENS))
        prompt = torch.tensor([[3 + (5 * i) % max(vocab - 3, 1) for i in range(length)]], device=device)
        step = torch.tensor([[min(7, vocab - 1)], [min(11, vocab - 1)]], device=device)
        with torch.inference_mode():
            plain = DynamicCache(config=config)  # the model's own cache: the reference
            forward(prompt, plain)
            kept = new_kv_cache(config)  # every token's KV, as rksc keeps it
            forward(prompt, kept)
            shared = SharedPrefixCache.from_dynamic_cache(kept, num_branches=2, suffix_capacity=2)
            plain.batch_repeat_interleave(2)
            want = forward(step, plain).logits[:, -1].float()
            with attention_implementation(model, ATTENTION_NAME):
                got = forward(step, shared, **shared.forward_kwargs()).logits[:, -1].float()
    except NotImplementedError as error:  # a layer the split attention refuses
        return ProbeResult(False, f"shared-prefix forward is not supported: {error}")
    except Exception as error:  # out of memory, an interrupted kernel...: try again later
        return ProbeResult(False, f"shared-prefix probe failed: {type(error).__name__}: {error}", inconclusive=True)
    if shared.num_attention_calls != len(layers):
        return ProbeResult(
            False, f"the model ran shared_prefix_attention in {shared.num_attention_calls} of {len(layers)} layers"
        )
    diff = float((got - want).abs().max())
    tolerance = logit_tolerance(want, model.dtype)
    if not math.isfinite(diff) or diff > tolerance:
        return ProbeResult(False, f"logits differ from the plain path by {diff:.3g} (> {tolerance:.3g})", diff)
    return ProbeResult(True, "", diff)
