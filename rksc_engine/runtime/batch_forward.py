"""A decode step's forward: every running row's next token in one pass over the model, and, when
the scheduler has prompts to admit, their uncached tokens in the same pass.

On a CPU (and at small batches on a GPU) a forward mostly reads the weights, so a forward of 13
prompt tokens costs about what a decode step of 16 rows does. Prefilling an arriving prompt in the
decode step's forward instead of a forward of its own saves that whole read (what vLLM's chunked
prefill and SGLang's mixed chunks do). The rows and the prompts' tokens then go in as one
flattened row, ``(1, rows + prompt tokens)``; ``BatchDecodeCache`` routes each token to its own KV.

Callers hold the engine lock.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..kvcache.batch_decode import BatchDecodeCache
from ..kvcache.probe import logit_tolerance
from ..kvcache.shared_prefix import ATTENTION_NAME, attention_implementation
from ..kvcache.static_rows import StaticRowPool
from .model_runner import ModelRunner
from .prefill import Prefiller
from .prefix_access import Prefilled
from .request import Request


class MixedPrefillMismatch(RuntimeError):
    """A step that prefilled prompts with the decode gave logits other than the two apart (the
    model does not honour the flattened positions); the scheduler then stops mixing them."""


def forward_rows(runner: ModelRunner, requests: Sequence[Request]) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The running rows of ``requests`` (all on the shared-prefix path) one token further. Returns
    the next-token logits (rows, V) and each request's rows in them."""
    cache = BatchDecodeCache([r.cache for r in requests])
    input_ids = torch.cat([r.next_tokens for r in requests])[:, None]  # (B, 1)
    with attention_implementation(runner.model, ATTENTION_NAME):
        out = runner.decode_forward(input_ids, cache, position_ids=cache.position_ids(runner.device),
                                    **cache.forward_kwargs())
    return out.logits[:, -1, :], cache.row_ranges


def static_row_order(pool: StaticRowPool, requests: Sequence[Request]) -> tuple[list[int], list[tuple[int, int]], torch.Tensor]:
    """The running rows of ``requests`` (each ``cache`` a ``StaticRows`` of ``pool``), before a step
    over them: each row's slot in the requests' order (a list and a tensor) and each request's rows
    in it. A request's next tokens are in the pool already (the step before wrote them there), or in
    its ``next_tokens`` (its first step, a sampled request), which are written in now."""
    order: list[int] = []
    row_ranges = []
    pending: list[Request] = []
    for request in requests:
        slots = request.cache.slots
        row_ranges.append((len(order), len(order) + len(slots)))
        order += slots
        if request.next_tokens is not None:
            pending.append(request)
    if pending:
        pending_slots = torch.tensor([s for r in pending for s in r.cache.slots], device=pool.device)
        pool.next_tokens.index_copy_(0, pending_slots, torch.cat([r.next_tokens for r in pending]))
        for request in pending:
            request.next_tokens = None
    return order, row_ranges, torch.tensor(order, device=pool.device)


def forward_static_rows(runner: ModelRunner, pool: StaticRowPool, order: list[int], slots: torch.Tensor) -> torch.Tensor:
    """The rows ``order`` (``static_row_order``) one token further, in one forward over the pool's
    rows ``[0, top)``; returns their next-token logits (rows, V) in that order."""
    logits = runner.decode_static(pool)  # (top, V)
    live = torch.zeros(pool.top, dtype=torch.long, device=pool.device).index_fill_(0, slots, 1)
    pool.advance(live, order)
    return in_row_order(logits, order, slots)


def in_row_order(logits: torch.Tensor, order: list[int], slots: torch.Tensor) -> torch.Tensor:
    """A static-rows step's ``logits`` (one per slot of ``[0, top)``) as the rows ``order`` (their
    slots, also as the tensor ``slots``) come: a copy only when they come in another order."""
    return logits if order == list(range(logits.shape[0])) else logits.index_select(0, slots)


def suffix_lengths(requests: Sequence[Request]) -> list[int]:
    """Each request's suffix length in its cache (every layer holds as many): its generated tokens,
    after a copied prompt tail if it has one."""
    return [r.cache.layers[0].num_suffix_tokens for r in requests]


def roll_back(requests: Sequence[Request], lengths: Sequence[int]) -> None:
    """Forget what a forward wrote past ``lengths`` (``suffix_lengths`` before it) in every layer."""
    for request, length in zip(requests, lengths):
        for layer in request.cache.layers:
            if layer.num_suffix_tokens > length:
                layer.crop(length - layer.num_suffix_tokens)


def forward_rows_and_prompts(runner: ModelRunner, prefiller: Prefiller, requests: Sequence[Request],
                             prompts: Sequence[list[int]], *, check: bool
                             ) -> tuple[torch.Tensor, list[tuple[int, int]], list[Prefilled]]:
    """``forward_rows`` for ``requests`` and, in the same forward, the prefill of ``prompts``: each
    prompt's cached prefix comes from the radix cache, its other tokens are computed here, and its
    KV goes into the radix cache as ``Prefiller.prefill`` would put it.

    ``check`` compares the step with the two done apart: the first prompt against it prefilled alone,
    and the rows against a forward of their own (whose results are the ones kept, so the rows'
    KV is the plain path's); a difference beyond rounding raises ``MixedPrefillMismatch``.

    On an exception the rows' caches are rolled back to where they were, and nothing of the
    prompts is kept (the radix cache may hold what was inserted before the failure, which is exact).

    Returns the rows' logits (rows, V), their ranges per request, and the prompts' ``Prefilled``.
    """
    device = runner.device
    lengths = suffix_lengths(requests)
    matches = prefiller.match_prompts(prompts)
    try:
        cached = [matched for _, matched, _ in matches]
        cache = BatchDecodeCache([r.cache for r in requests], prompts=[
            ([(layer.keys, layer.values) for layer in prefix.layers] if matched else None, len(prompt) - matched)
            for prompt, (prefix, matched, _) in zip(prompts, matches)])
        new_ids = torch.tensor([t for prompt, m in zip(prompts, cached) for t in prompt[m:]], device=device)
        input_ids = torch.cat([r.next_tokens for r in requests] + [new_ids])[None]  # (1, rows + prompt tokens)
        rows = cache.num_rows
        keep = torch.tensor(list(range(rows)) + [stop - 1 for _, stop in cache.prompt_spans], device=device)
        with attention_implementation(runner.model, ATTENTION_NAME):
            out = runner.forward(input_ids, cache, position_ids=cache.position_ids(device, cached),
                                 logits_to_keep=keep, **cache.forward_kwargs())
        logits = out.logits[0]  # (rows + prompts, V)
        row_logits, prompt_logits = logits[:rows], logits[rows:]
        if check:
            row_logits = _checked_rows(runner, requests, lengths, row_logits)
            first = Prefilled(list(prompts[0]), None, prompt_logits[:1], cached[0])
            diff, tolerance = prefiller.packing.difference_from_alone(first)
            if not diff <= tolerance:
                raise MixedPrefillMismatch(f"a prompt prefilled in the decode step's forward changed its logits by "
                                           f"{diff:.3g} (> {tolerance:.3g})")
        prefilled = prefiller.packing.finish_prompts(prompts, matches, [cache.prompt_kv(i) for i in range(len(prompts))],
                                             prompt_logits)
    except BaseException:
        roll_back(requests, lengths)
        raise
    finally:
        prefiller.release_prompts(matches)
    return row_logits, cache.row_ranges, prefilled


def _checked_rows(runner: ModelRunner, requests: Sequence[Request], lengths: list[int],
                  mixed_logits: torch.Tensor) -> torch.Tensor:
    """The rows decoded again on their own, compared with ``mixed_logits``; returns the plain ones."""
    roll_back(requests, lengths)
    plain_logits, _ = forward_rows(runner, requests)
    want = plain_logits.float()
    diff = float((mixed_logits.float() - want).abs().max())
    tolerance = logit_tolerance(want, runner.dtype)
    if not diff <= tolerance:
        raise MixedPrefillMismatch(f"decoding rows in a step that also prefilled a prompt changed their logits by "
                                   f"{diff:.3g} (> {tolerance:.3g})")
    return plain_logits

