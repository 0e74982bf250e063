"""A decode step over static rows (``kvcache.static_rows``): one forward of fixed-shape tensors for
every running row, whatever requests they belong to.

The step's inputs are built once for all layers: each row's next token and position (read from
the pool's per-slot lengths), and an additive attention mask per kind of layer, ``(top, 1, 1, L)``,
that lets row ``i`` see its own keys ``[0, position_i]`` (and, in a sliding-window layer, only the
last ``window`` of them). The model then runs its own attention, once per layer over all rows, so
every family's variants (soft-capping, sinks, windows) are the model's own code, and the step's
operator count does not depend on how many requests share it.

``capture`` picks how the step runs: ``"static"`` runs it eagerly; ``"compile"`` runs it through
``torch.compile`` (inductor: C++ kernels on a CPU, Triton on a GPU), which turns a step's hundreds of
operator calls into a few kernels. Compiled steps are built per shape; the pool keeps the shapes to
a short list (``CAPACITY_STEP``, ``KEY_LENGTH_STEP``, rows up to ``top``).

Callers hold the engine lock.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from ..kvcache.static_rows import StaticRowPool, StaticRowsCache

# What a step's mask adds at a position a row must not see: the dtype's most negative value rather
# than -inf, as ``transformers`` builds its masks, so a row that sees nothing gives no NaN.
_MASKED = "min"

FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"


class StaticStep:
    """Runs decode steps of one model over a ``StaticRowPool``.

    Args:
        model: The ``transformers`` causal LM (attention layers only).
        cache_kwarg: The forward's name for its cache (``cache`` or ``past_key_values``).
        layer_types: Each layer's type (``full_attention`` / ``sliding_attention``).
        sliding_window: The window of the sliding layers (None when there are none).
        compiled: Run the step through ``torch.compile``.
    """

    def __init__(self, model: Any, cache_kwarg: str, layer_types: list[str], sliding_window: int | None,
                 compiled: bool = False) -> None:
        kinds = set(layer_types)
        unknown = kinds - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unknown:
            raise ValueError(f"static rows hold per-token KV only; the model has layers of type {sorted(unknown)}")
        if SLIDING_ATTENTION in kinds and not sliding_window:
            raise ValueError("a model with sliding-window layers needs its sliding_window")
        self.model, self.cache_kwarg = model, cache_kwarg
        self.kinds = sorted(kinds)
        self.window = int(sliding_window) if SLIDING_ATTENTION in kinds else None
        self.compiled = compiled
        self._run = _compiled_method(self, "_forward") if compiled else self._forward
        self.num_steps = 0

    def masks(self, positions: torch.Tensor, key_length: int, dtype: torch.dtype) -> Any:
        """The step's attention masks for queries at ``positions`` (top, T): one additive
        ``(top, 1, T, key_length)`` tensor when every layer is of one kind, else ``{layer kind:
        mask}`` (the form mixed models take). Query ``t`` of row ``i`` sees keys up to its own
        position (causal within a row's positions)."""
        keys = torch.arange(key_length, device=positions.device)[None, None, :]  # (1, 1, L)
        latest = positions[:, :, None]  # (top, T, 1)
        visible = keys <= latest
        masked = torch.finfo(dtype).min
        made = {}
        for kind in self.kinds:
            sees = visible if kind == FULL_ATTENTION else visible & (keys > latest - self.window)
            made[kind] = torch.zeros(sees.shape, dtype=dtype, device=positions.device).masked_fill_(
                ~sees, masked)[:, None, :, :]
        return made[self.kinds[0]] if len(made) == 1 else made

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 keys: list[torch.Tensor], values: list[torch.Tensor], key_length: int,
                 position_ids: torch.Tensor | None = None) -> torch.Tensor:
        # The masks are built here, inside what ``torch.compile`` compiles, so a compiled step runs
        # them in its kernels rather than as eager operators before it.
        masks = self.masks(positions, key_length, keys[0].dtype)
        cache = StaticRowsCache(keys, values, positions, key_length)
        # A decode step keeps the last position's logits; a drafted step keeps every position's.
        keep = 1 if input_ids.shape[1] == 1 else 0
        out = self.model(input_ids=input_ids, position_ids=positions if position_ids is None else position_ids,
                         attention_mask=masks,
                         use_cache=True, logits_to_keep=keep, **{self.cache_kwarg: cache})
        return out.logits

    @torch.inference_mode()
    def logits(self, pool: StaticRowPool, next_tokens: torch.Tensor) -> torch.Tensor:
        """One decode step of the rows ``[0, pool.top)``: feeds ``next_tokens[:top]`` at each row's
        position, writes their KV into the pool, and returns the next-token logits (top, V). The
        pool's lengths are the caller's to advance (``StaticRowPool.advance``)."""
        top = pool.top
        # A compiled step is built per shape: its rows are padded to a power of two (free slots,
        # whose rows nobody reads), so a batch that grows or shrinks a row at a time reuses a few.
        rows = bucket_rows(top, pool.num_slots) if self.compiled else top
        key_length = pool.key_length()
        positions = pool.lengths[:rows, None]
        self.num_steps += 1
        logits = self._run(next_tokens[:rows, None], positions, pool.keys, pool.values, key_length)[:, -1, :]
        return logits[:top] if rows > top else logits

    @torch.inference_mode()
    def drafted_logits(self, pool: StaticRowPool, inputs: torch.Tensor, last_position: int) -> torch.Tensor:
        """One drafted step of the rows ``[0, pool.top)``: feeds row ``i``'s ``inputs[i]`` (top, T)
        (its next token, then its draft, padded) at its positions from its length on, writes their
        KV into the pool, and returns every position's logits (top, T, V). The pool's lengths are the
        caller's to advance by what each row keeps (``StaticRowPool.advance_by``); the rest of what
        a row wrote lies past its length, where no mask shows it. The model is given positions up to
        ``last_position`` (its context's last): a row's padding may run past it, and nobody reads
        what the padding gives. It runs eagerly, compiled or not: its width changes from step to
        step, and each would be a shape to build."""
        top, width = inputs.shape
        positions = pool.lengths[:top, None] + torch.arange(width, device=pool.device)[None, :]
        self.num_steps += 1
        return self._forward(inputs, positions, pool.keys, pool.values, pool.key_length(width),
                             positions.clamp_max(last_position))


def _compiled_method(owner: Any, name: str) -> Any:
    """``torch.compile`` of ``owner.name`` with a compile cache of its own.

    Dynamo keeps its graphs, and counts its recompiles against ``recompile_limit``, per code object.
    Every step would share ``StaticStep._forward``'s: a second model in the process (a second engine,
    a benchmark's next family) adds its graphs to the first's, and once the shared count passes the
    limit (8) dynamo silently runs each step eagerly. A copy of the code object per step keeps each
    step's graphs its own, freed with it; one step builds a few (dynamo turns the rows and the key
    length symbolic once it sees them change)."""
    function = getattr(type(owner), name)
    own = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                             function.__defaults__, function.__closure__)
    return torch.compile(types.MethodType(own, owner), dynamic=None)


def bucket_rows(top: int, num_slots: int) -> int:
    """The rows a compiled step runs for ``top`` live ones: the next power of two, within the pool's
    slots (which grow by doubling, so they hold it). A padded row is a free slot at position 0: it
    writes there what ``write_prompt`` overwrites when the slot is taken, and its logits are dropped."""
    rows = 1
    while rows < top:
        rows *= 2
    return min(rows, max(num_slots, top))


def probe_static_rows(model: Any, step: StaticStep, forward: Any, tolerance: Any) -> tuple[bool, str]:
    """Check once, numerically, that ``model`` decodes the same over static rows: two prompts of
    different lengths (past a short sliding window) step together over a pool and each alone
    through the model's own ``DynamicCache``; the logits must agree to ``tolerance(want, dtype)``.
    Returns ``(supported, why not)``; an exception is returned as unsupported, with its text."""
    from transformers import DynamicCache

    from ..kvcache.cache_layers import new_kv_cache

    try:
        device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        config = model.config
        vocab = int(config.get_text_config().vocab_size)
        longest = 6 if step.window is None else min(step.window + 2, 64)
        prompts = [torch.tensor([[3 + (5 * i + j) % max(vocab - 3, 1) for i in range(length)]], device=device)
                   for j, length in enumerate((3, longest))]
        pool = StaticRowPool(device, dtype)
        wants = []
        with torch.inference_mode():
            for prompt in prompts:
                plain = DynamicCache(config=config)
                forward(prompt, plain)
                wants.append(forward(prompt.new_tensor([[min(7, vocab - 1)]]), plain).logits[0, -1].float())
                kept = new_kv_cache(config)
                forward(prompt, kept)
                kv = [(layer.keys, layer.values) for layer in kept.layers]
                pool.reserve(pool.top + 1, prompt.shape[1] + 2, [(k.shape[1], k.shape[3]) for k, _ in kv])
                rows = pool.rows(1)
                pool.write_prompt(rows.slots, kv)
                pool.next_tokens[rows.slots[0]] = min(7, vocab - 1)
            got = step.logits(pool, pool.next_tokens).float()
    except Exception as error:  # noqa: BLE001 - any failure means: do not decode this model this way
        return False, f"static-rows probe failed: {type(error).__name__}: {error}"
    for row, want in enumerate(wants):
        diff = float((got[row] - want).abs().max())
        bound = tolerance(want, dtype)
        if not diff <= bound:
            return False, f"static-rows logits differ from the plain path by {diff:.3g} (> {bound:.3g})"
    return True, ""
