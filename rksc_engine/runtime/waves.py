"""Branch control while a request runs: the branches its caller or its monitor stops, and the waves
of branches its monitor adds.

A request's monitor (``BranchMonitor``) sees each step its branches take and may answer with
branches to stop and a number of branches to add. Stopped branches end before the next forward
(``finish_reason="cancelled"``). Added branches fork off the prompt as a **wave**: a member request
of its own (``owner`` set) with a cache of its own, decoding from the next step on, that shares its
owner's branches, generators, channel and radix lock. Branch ``i`` is seeded ``seed + i`` whichever
wave it is in, so it draws the tokens it would have drawn in the first.

Callers hold the engine lock.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..kvcache.cache_layers import select_rows
from ..results import BranchControl, BranchEvent
from .branch_output import completion, emit
from .request import Branch, Request
from .request_kv import RequestKV
from .sampling import make_generators
from .stats import Counters


def observe(request: Request, tokens: list[int], logprobs: list[float]) -> BranchControl | None:
    """Show the monitor of ``request``'s submitted request the step ``request``'s rows just took
    (``tokens`` and ``logprobs`` by row); its answer, or None (no monitor, or nothing to do)."""
    monitor = request.head.branching.monitor
    if monitor is None:
        return None
    events = []
    for row, b in enumerate(request.active):
        branch = request.branches[b]
        done = completion(request, branch) if branch.finish_reason is not None else None
        events.append(BranchEvent(b, tokens[row], logprobs[row], len(branch.token_ids), branch.text, done))
    return monitor.observe(events)


def running_branches(members: Iterable[Request]) -> set[int]:
    """The branches that ``members`` (a submitted request and its waves) decode."""
    return {b for member in members for b in member.active}


def fork_wave(owner: Request, count: int, request_id: int, kv: RequestKV, device: torch.device
              ) -> tuple[Request, torch.Tensor] | None:
    """A wave of ``count`` branches added to ``owner`` (fewer if ``max_branches`` leaves fewer),
    forked off its prompt, with the logits its rows take their first tokens from (rows, V). They
    take the owner's next branch indices and count as one more live member of it. None when no
    branch may be added."""
    branching = owner.branching
    first = len(owner.branches)
    count = min(count, branching.max_branches - first)
    if count <= 0 or branching.fork is None:
        return None
    wave = Request(request_id, owner.prompt_ids, count, owner.params, owner.channel, owner.stream,
                   owner.logits_processor, owner.seed)
    wave.owner = owner
    wave.layout, wave.max_new = owner.layout, owner.max_new
    wave.num_cached_tokens, wave.exact, wave.reuse_decision = owner.num_cached_tokens, owner.exact, owner.reuse_decision
    wave.num_private_segments = owner.num_private_segments
    wave.cache = kv.fork_cache(branching.fork, count, owner.max_new, static=owner.static)
    owner.branches.extend(Branch(first + j) for j in range(count))
    if not owner.params.greedy:
        owner.generators.extend(make_generators(owner.seed + first, count, device))
    wave.branches, wave.generators = owner.branches, owner.generators  # shared with the owner
    wave.active = list(range(first, first + count))
    branching.live_members += 1
    last_logits = branching.fork.last_logits
    return wave, last_logits if count == 1 else last_logits.expand(count, -1)


def stop_branches(request: Request, counters: Counters, device: torch.device) -> bool:
    """Retire ``request``'s finished rows, and end (``"cancelled"``) those its owner was asked to
    stop; its cache keeps only the rows that go on. Returns whether any row is left."""
    branching = request.head.branching
    keep_rows = []
    for row, b in enumerate(request.active):
        branch = request.branches[b]
        if branch.finish_reason is None and b in branching.pending_stop:
            branch.finish_reason = "cancelled"
            branching.stopped = True
            counters.count("branches_cancelled")
            if request.stream:
                emit(request, branch)
        if branch.finish_reason is None:
            keep_rows.append(row)
    branching.pending_stop -= set(request.active)
    if not keep_rows:
        request.active = []
        return False
    if len(keep_rows) < len(request.active):
        index = torch.tensor(keep_rows, device=device)
        select_rows(request.cache, index)
        if request.next_tokens is not None and request.next_tokens.shape[0] == len(request.active):
            request.next_tokens = request.next_tokens[index]
        request.active = [request.active[r] for r in keep_rows]
    return True
