"""What kinds of cache layers a model has, and the ``transformers`` cache rksc prefills into.

``transformers`` gives a sliding-window layer a cache that keeps only its last ``window - 1``
tokens (``DynamicSlidingWindowLayer``). That KV cannot be sliced into the radix tree or shared by
branches that grow past it, so rksc keeps every attention layer's whole KV instead
(``DynamicLayer``): the model's own sliding-window mask still applies the window in a prefill, and
the shared-prefix attention applies it in a decode step. The tokens are those of the model's own
cache; the memory is that of a full-attention layer, until out-of-window KV is evicted.

Recurrent layers (Mamba, gated delta nets, short convolutions) keep a state, not per-token KV:
their cache is the model's own.
"""

from __future__ import annotations

from typing import Any

import torch

# Layer types (``config.layer_types`` or inferred as ``transformers`` infers them) whose KV rksc
# keeps token by token: every token's keys and values, nothing else.
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention"})


def layer_types(config: Any) -> list[str]:
    """Each decoder layer's cache type as ``transformers`` decides it for ``DynamicCache(config=...)``
    (inferred the same way on releases without ``get_layer_types_and_kwargs``)."""
    decoder = config.get_text_config(decoder=True)
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:
        types = getattr(decoder, "layer_types", None)
        if types is None:
            kind = "sliding_attention" if getattr(decoder, "sliding_window", None) is not None else "full_attention"
            types = [kind] * int(decoder.num_hidden_layers)
        return list(types)
    types, _ = get_layer_types_and_kwargs(decoder)
    return list(types)


def keeps_token_kv(config_or_types: Any) -> bool:
    """Whether every layer of the model attends over per-token KV (full or sliding-window
    attention), so its whole KV can be kept, sliced and shared exactly. Takes the model's config
    or its ``layer_types`` already worked out."""
    types = config_or_types if isinstance(config_or_types, list) else layer_types(config_or_types)
    return bool(types) and all(t in ATTENTION_LAYER_TYPES for t in types)


def has_sliding_layers(config: Any) -> bool:
    """Whether some layer attends within a sliding window."""
    return "sliding_attention" in layer_types(config)


def unsupported_layer_types(types: list[str]) -> list[str]:
    """Of a model's ``layer_types``, those ``transformers``' own ``DynamicCache`` cannot hold (so
    neither can rksc), in first-seen order."""
    try:
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING
    except ImportError:  # a release whose DynamicCache knows only attention layers
        DYNAMIC_LAYER_TYPE_MAPPING = ATTENTION_LAYER_TYPES  # noqa: N806
    seen: list[str] = []
    for kind in types:
        if kind not in DYNAMIC_LAYER_TYPE_MAPPING and kind not in seen:
            seen.append(kind)
    return seen


def prefix_cache_refusal(types: list[str]) -> str:
    """Why the radix cache cannot hold the prompts of a model of these ``layer_types`` ("" when it can)."""
    other = sorted(set(types) - ATTENTION_LAYER_TYPES)
    if not other:
        return ""
    return (f"layers of type {other} keep a recurrent state or a cache the radix tree cannot slice by token: "
            "a prompt reuses only the snapshot an earlier prompt left after all its tokens but the last "
            "(when it starts with them), and branches fork from the prompt's state")


def new_kv_cache(config: Any, kv: list[tuple[Any, Any]] | None = None, types: list[str] | None = None) -> Any:
    """A batch cache for ``config``'s model, optionally holding ``kv`` (per layer ``(keys, values)``,
    each (B, H_kv, T, D)).

    For a model of attention layers only, every layer keeps its whole KV (``DynamicLayer``), sliding
    ones included (see the module docstring). Otherwise the model's own cache, ``kv`` not allowed.
    ``types`` is ``layer_types(config)`` when the caller holds it already (it costs about a
    millisecond to work out for a 30-layer model)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    types = layer_types(config) if types is None else types
    if keeps_token_kv(types):
        if kv and kv[0][0].shape[-2] > 0:
            return DynamicCache(ddp_cache_data=kv)
        # Every layer built now, not lazily on its first update: a pass that fails part-way must
        # leave layers whose lengths say what they hold, so that it can be rolled back.
        cache = DynamicCache()
        cache.layers = [DynamicLayer() for _ in types]
        return cache
    if kv:
        raise ValueError("kv can only be given for models whose every layer keeps per-token KV")
    return DynamicCache(config=config)


def has_recurrent_state(cache: Any) -> bool:
    """Whether some layer of a ``transformers`` cache keeps a recurrent (or convolution) state,
    which each pass overwrites in place."""
    return any(hasattr(layer, "recurrent_states") for layer in getattr(cache, "layers", ()))


def layer_tensors(layer: Any) -> list[torch.Tensor]:
    """The tensors one cache layer holds: its keys and values, or its conv and recurrent states."""
    found = [getattr(layer, "keys", None), getattr(layer, "values", None)]
    for states in (getattr(layer, "conv_states", None), getattr(layer, "recurrent_states", None)):
        found += list(states.values()) if isinstance(states, dict) else list(states or ())
    return [t for t in found if isinstance(t, torch.Tensor)]


def repeat_rows(cache: Any, repeats: int) -> None:
    """Each row of a ``transformers`` cache repeated ``repeats`` times, in place (row i becomes rows
    ``i * repeats`` to ``(i + 1) * repeats - 1``): branches forking from one prefilled prompt.

    KV layers repeat their KV; recurrent layers (``transformers``' linear-attention layers, which
    have no ``batch_repeat_interleave``) copy their conv and recurrent states, so every branch
    starts from the one state the prompt left."""
    if repeats == 1:
        return
    if not has_recurrent_state(cache):
        cache.batch_repeat_interleave(repeats)
        return
    rows = _batch_size(cache)
    if rows is None:  # nothing cached yet: the next forward starts every row afresh
        return
    index = torch.arange(rows).repeat_interleave(repeats)
    cache.reorder_cache(index)


def select_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep only the rows ``index`` of a ``transformers`` cache, in place (finished branches dropped)."""
    if has_recurrent_state(cache) and _batch_size(cache) is not None:
        cache.reorder_cache(index)
    else:
        cache.batch_select_indices(index)


def _batch_size(cache: Any) -> int | None:
    for layer in cache.layers:
        for tensor in layer_tensors(layer):
            if tensor.dim() >= 2:
                return int(tensor.shape[0])
    return None
