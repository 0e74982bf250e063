"""Several prompts' KV in one forward: packed into one row (``PromptPacker.prefill_packed``), or
computed by another forward, the decode step's (``PromptPacker.finish_prompts``).

On a CPU (and at small batches on a GPU) a forward mostly reads the weights, so prompts prefilled
together read them once instead of once each. Each prompt's longest cached prefix still comes from
the radix cache, through ``PrefixAccess``, which holds its locks.

Callers hold the engine lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kvcache.cache_layers import has_sliding_layers
from ..kvcache.packed_prompts import PackedPromptsCache
from ..kvcache.probe import logit_tolerance
from ..kvcache.shared_prefix import ATTENTION_NAME, attention_implementation
from .model_runner import ran_out_of_memory
from .prefix_access import LockedPrefix, Prefilled, PrefixAccess


class PackedPrefillMismatch(RuntimeError):
    """A packed prefill's logits differed from the same prompt prefilled alone (the model does not
    honour the packed mask or positions); packing is then off for the engine."""


class PromptPacker:
    """Prefills prompts together, and decides once whether this engine may (see the module docstring).

    Args:
        access: The radix cache's door: the prompts' cached prefixes, locks and inserts.
    """

    def __init__(self, access: PrefixAccess) -> None:
        self.access = access
        self._packs_prompts: bool | None = None
        self._packing_checked = False

    def packs_prompts(self) -> bool:
        """Whether ``prefill_packed`` may serve prompts here: every prompt takes the token-exact path
        (ASKS cannot act), the model's cache layers keep the whole prefix, and, for a model with
        sliding-window layers, each prompt attends on its own (``packed_pass``): one mask for the
        whole row could not carry a window."""
        if self._packs_prompts is None:  # the model and the settings are fixed for the engine's life
            access = self.access
            config = access.asks_config
            asks_may_act = config.enabled and config.tau < 1.0 and access.cacheable
            runner = access.runner
            self._packs_prompts = (not asks_may_act and runner.supports_prefix_cache()
                                   and (not has_sliding_layers(runner.model.config) or self._splits_attention()))
        return self._packs_prompts

    def _splits_attention(self) -> bool:
        """Whether the model runs the shared-prefix attention, so a packed prompt can attend on its
        own; the shared-prefix probe decides, once (a forced mode that fails it raises there, at
        the decode, not here)."""
        try:
            return self.access.runner.decodes_with_shared_prefix()
        except Exception:  # noqa: BLE001 - then prompts are packed the other way, or not at all
            return False

    def prefill_packed(self, prompts: Sequence[list[int]], max_context_tokens: int | None = None) -> list[Prefilled]:
        """Several prompts' KV in one forward: each prompt's longest cached prefix served by the radix
        cache, and every prompt's remaining tokens packed into one row, each token attending to its
        own prompt only (a block-diagonal causal mask) at its own positions. The linear layers read
        their weights once for all prompts instead of once per prompt.

        Token-exact like ``Prefiller.prefill``; the bits may differ from a prompt prefilled alone, as
        a batched matmul's do. Counted like as many prefills. Callers use it only where
        ``packs_prompts()`` holds and give prompts that share no uncached prefix (each would compute
        it again).

        The first packed forward is checked against the first prompt prefilled alone: a model that
        does not honour the mask or the positions gets a ``PackedPrefillMismatch``, and packing is
        off for this engine from then on (``packs_prompts()`` turns False); so it is after a packed
        forward fails for any reason but running out of memory.

        ``max_context_tokens`` bounds what one forward attends to (the prompts' cached prefixes, a
        prefix several prompts share counted once, plus their new tokens): the mask and the packed
        copy of the prefixes grow with it. Prompts beyond it go into further forwards."""
        if len(prompts) < 1:
            raise ValueError("prefill_packed needs at least one prompt")
        if max_context_tokens is not None and max_context_tokens < 1:
            raise ValueError(f"max_context_tokens must be >= 1, got {max_context_tokens}")
        prompts = [list(p) for p in prompts]
        matches = self.access.match_prompts(prompts)
        prefilled: list[Prefilled] = []
        try:
            with torch.inference_mode():
                for group in context_groups(prompts, matches, max_context_tokens):
                    try:
                        results = self.packed_pass([prompts[i] for i in group], [matches[i] for i in group])
                    except Exception as error:
                        if not ran_out_of_memory(error):
                            # the model cannot take a packed pass: stop trying
                            self._packs_prompts = False
                            self.access.counters.count("packed_prefill_disabled")
                        raise
                    if not self._packing_checked:
                        self._check_packing(results[0])
                    prefilled += results
                    self.access.counters.count("packed_prefills")
                self.access.insert_and_count(prefilled)
        finally:
            self.access.release_prompts(matches)
        return prefilled

    def _check_packing(self, packed: Prefilled) -> None:
        """Compare one packed prompt's last logits with the same prompt prefilled alone, once."""
        diff, tolerance = self.difference_from_alone(packed)
        if not diff <= tolerance:  # also catches NaN
            self._packs_prompts = False
            self.access.counters.count("packed_prefill_disabled")
            raise PackedPrefillMismatch(
                f"packed prefill changed the logits by {diff:.3g} (> {tolerance:.3g}): this model does not honour "
                "a packed mask or positions, so prompts are prefilled one by one from now on")
        self._packing_checked = True

    def difference_from_alone(self, prefilled: Prefilled) -> tuple[float, float]:
        """How far ``prefilled``'s last logits are from its prompt prefilled alone in a fresh cache,
        and how far rounding alone may take them (``logit_tolerance``)."""
        runner = self.access.runner
        alone = runner.forward(torch.tensor([prefilled.prompt_ids], device=runner.device), runner.new_cache(),
                               logits_to_keep=1)
        want, got = alone.logits[:, -1].float(), prefilled.last_logits.float()
        return float((got - want).abs().max()), logit_tolerance(want, runner.dtype)

    def finish_prompts(self, prompts: Sequence[list[int]], matches: Sequence[LockedPrefix],
                       new_kv: Sequence[list[tuple[torch.Tensor, torch.Tensor]]], last_logits: torch.Tensor
                       ) -> list[Prefilled]:
        """The ``Prefilled`` of prompts whose uncached tokens another forward computed: each prompt's
        cached prefix (``matches``, from ``PrefixAccess.match_prompts``) joined with its new KV
        (``new_kv``, per layer (1, H_kv, T, D)), inserted into the radix cache and counted like a
        prefill. ``last_logits`` (prompts, V)."""
        results = self._joined(prompts, matches, new_kv, last_logits)
        self.access.insert_and_count(results)
        return results

    def _joined(self, prompts: Sequence[list[int]], matches: Sequence[LockedPrefix],
                new_kv: Sequence[list[tuple[torch.Tensor, torch.Tensor]]], last_logits: torch.Tensor
                ) -> list[Prefilled]:
        """Each prompt's cached prefix joined with its new KV, as a ``Prefilled``; nothing inserted."""
        runner = self.access.runner
        results = []
        for index, (prompt_ids, (cached, matched, _), layers) in enumerate(zip(prompts, matches, new_kv)):
            if matched:
                kv = [(torch.cat([old.keys, keys], dim=2), torch.cat([old.values, values], dim=2))
                      for old, (keys, values) in zip(cached.layers, layers)]
            else:  # a copy: the new KV is a view of the whole forward's projections
                kv = [(keys.clone(), values.clone()) for keys, values in layers]
            cache = runner.new_cache(kv)
            results.append(Prefilled(list(prompt_ids), cache, last_logits[index:index + 1], matched))
        return results

    def packed_pass(self, prompts: list[list[int]], matches: list[LockedPrefix]) -> list[Prefilled]:
        """One packed forward over ``prompts`` after their cached prefixes (``matches``); nothing
        inserted or counted. Where the model runs the shared-prefix attention, each prompt attends
        to itself alone (``PackedPromptsCache``); otherwise through the model's own attention with a
        block-diagonal mask over the whole row, which costs the square of the pack's length."""
        if self._splits_attention():
            return self.split_pass(prompts, matches)
        return self.masked_pass(prompts, matches)

    def split_pass(self, prompts: list[list[int]], matches: list[LockedPrefix]) -> list[Prefilled]:
        """``packed_pass`` through ``PackedPromptsCache``: each prompt's attention computed on its own."""
        runner = self.access.runner
        device = runner.device
        matched = [m for _, m, _ in matches]
        new_tokens = [prompt[m:] for prompt, m in zip(prompts, matched)]
        prefixes = [[(layer.keys, layer.values) for layer in cache.layers] if m else None for cache, m, _ in matches]
        cache = PackedPromptsCache(prefixes, [len(t) for t in new_tokens], int(runner.text_config.num_hidden_layers))
        input_ids = torch.tensor([[t for tokens in new_tokens for t in tokens]], device=device)
        positions = torch.cat([torch.arange(m, m + len(t), device=device) for m, t in zip(matched, new_tokens)])
        last_rows = torch.tensor([stop - 1 for _, stop in cache.spans], device=device)
        with attention_implementation(runner.model, ATTENTION_NAME):
            out = runner.forward(input_ids, cache, logits_to_keep=last_rows, position_ids=positions[None],
                                 **cache.forward_kwargs())
        return self._joined(prompts, matches, [cache.prompt_kv(i) for i in range(len(prompts))], out.logits[0])

    def masked_pass(self, prompts: list[list[int]], matches: list[LockedPrefix]) -> list[Prefilled]:
        """``packed_pass`` through the model's own attention and a block-diagonal mask."""
        runner = self.access.runner
        device, dtype = runner.device, runner.dtype
        matched = [m for _, m, _ in matches]
        new_tokens = [prompt[m:] for prompt, m in zip(prompts, matched)]
        # The packed cache: the prompts' cached prefixes one after another, a prefix that several
        # prompts matched to the same radix node held once.
        prefix_starts: list[int] = []
        unique: dict[tuple[int, int], int] = {}
        sources = []
        num_prefix = 0
        for cache, m, node in matches:
            key = (id(node), m)
            if m and key not in unique:
                unique[key] = num_prefix
                sources.append(cache)
                num_prefix += m
            prefix_starts.append(unique.get(key, 0))
        num_new = sum(len(t) for t in new_tokens)
        if sources:
            num_layers = len(sources[0].layers)
            layers = [(torch.cat([c.layers[i].keys for c in sources], dim=2),
                       torch.cat([c.layers[i].values for c in sources], dim=2)) for i in range(num_layers)]
            packed = runner.new_cache(layers)
        else:
            packed = runner.new_cache()
        visible = torch.zeros(num_new, num_prefix + num_new, dtype=torch.bool, device=device)
        positions, last_rows = [], []
        new_start = 0
        for m, tokens, prefix_start in zip(matched, new_tokens, prefix_starts):
            rows = slice(new_start, new_start + len(tokens))
            visible[rows, prefix_start:prefix_start + m] = True
            visible[rows, num_prefix + new_start:num_prefix + new_start + len(tokens)] = torch.ones(
                len(tokens), len(tokens), dtype=torch.bool, device=device).tril()
            positions.append(torch.arange(m, m + len(tokens), device=device))
            last_rows.append(new_start + len(tokens) - 1)
            new_start += len(tokens)
        mask = torch.zeros(1, 1, num_new, num_prefix + num_new, dtype=dtype, device=device)
        mask.masked_fill_(~visible, torch.finfo(dtype).min)
        input_ids = torch.tensor([[t for tokens in new_tokens for t in tokens]], device=device)
        out = runner.forward(input_ids, packed, logits_to_keep=torch.tensor(last_rows, device=device),
                             position_ids=torch.cat(positions)[None], attention_mask=mask)
        logits = out.logits[0]  # (prompts, V)
        results = []
        new_start = 0
        for index, (prompt, m, tokens, prefix_start) in enumerate(zip(prompts, matched, new_tokens, prefix_starts)):
            spans = [(prefix_start, prefix_start + m), (num_prefix + new_start, num_prefix + new_start + len(tokens))]
            layers = [(torch.cat([layer.keys[:, :, a:b] for a, b in spans if b > a], dim=2),
                       torch.cat([layer.values[:, :, a:b] for a, b in spans if b > a], dim=2))
                      for layer in packed.layers]
            cache = runner.new_cache(layers)
            results.append(Prefilled(prompt, cache, logits[index:index + 1], m))
            new_start += len(tokens)
        return results


def context_groups(prompts: list[list[int]], matches: list[LockedPrefix],
                   max_context_tokens: int | None) -> list[list[int]]:
    """Indices of ``prompts`` in order, cut into groups whose packed forward attends to at most
    ``max_context_tokens`` (cached prefixes, a shared one counted once, plus new tokens); a prompt
    over the bound on its own gets a group of its own."""
    groups: list[list[int]] = []
    seen: set[tuple[int, int]] = set()
    size = 0
    for index, (prompt, (_, matched, node)) in enumerate(zip(prompts, matches)):
        key = (id(node), matched)
        cost = len(prompt) - matched + (matched if key not in seen else 0)
        if groups and max_context_tokens is not None and size + cost > max_context_tokens:
            groups.append([])
            seen, size = set(), 0
            cost = len(prompt)
        if not groups:
            groups.append([])
        groups[-1].append(index)
        seen.add(key)
        size += cost
    return groups
