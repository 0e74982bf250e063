"""A decode step that verifies drafts: speculative decoding, token-identical to decoding without it.

With ``SchedulerConfig.draft_tokens`` set, a request that may draft (no logits processor, no branch
monitor: both see one token a branch a step) decodes each branch as a member of one row (the
scheduler starts its other branches as waves), since a member's rows share one suffix length. Each
such row proposes up to ``k`` next tokens (``drafts``). A step with a draft anywhere runs every
shared-prefix row over ``T`` positions in one forward (``forward_drafted``): the row's next token,
its draft, and padding to ``T``; attention is causal within a row's positions, so padding changes
nothing before it. Then, for each drafting row (``verify``):

* its token after its next token is chosen from that position's logits exactly as an ordinary step
  chooses it (``choose_next_tokens``: argmax, or one draw from the branch's own generator); while it
  equals the draft's token there, the next position's is chosen the same way; the first token that
  differs, or the one after the whole draft, ends the row's step. Every token a row takes costs one
  draw, as in ordinary decoding, and no draw is made past it, so a seeded branch takes the tokens it
  takes without drafting (the bits of the logits may differ, as any batched product's do);
* its KV keeps the positions of its next token and the draft tokens it accepted, and forgets the
  rest (``batch_forward.roll_back``).

A request that may not draft takes its rows' tokens from their first position, as in an ordinary
step, and forgets the rest. Callers hold the engine lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..kvcache.batch_decode import BatchDecodeCache
from ..kvcache.shared_prefix import ATTENTION_NAME, attention_implementation
from ..kvcache.static_rows import StaticRowPool
from .batch_forward import in_row_order
from .drafts import CachedTokens, Draft, DraftIndex
from .model_runner import ModelRunner
from .request import Request
from .sampling import choose_next_tokens


@dataclass(frozen=True)
class StepInputs:
    """What one request's rows feed a drafted step.

    Attributes:
        rows: Per row, its next token and then its draft's tokens.
        drafts: Per row, its draft (None when it has none).
        verifies: Whether the request takes its tokens by verification (it may draft); otherwise
            it takes one token a row from its first position.
    """

    rows: list[list[int]]
    drafts: list[Draft | None]
    verifies: bool

    @property
    def width(self) -> int:
        return max(len(row) for row in self.rows)

    def padded(self, width: int) -> list[list[int]]:
        """Its rows padded to ``width`` positions with their last input (causal attention within a
        row leaves everything before the padding as it is)."""
        return [row + [row[-1]] * (width - len(row)) for row in self.rows]


def may_draft(request: Request) -> bool:
    """Whether ``request``'s branches may draft: nothing watches its tokens one step at a time (a
    logits processor sees one position a call, a monitor one token a branch a step)."""
    return request.logits_processor is None and request.head.branching.monitor is None


def propose_drafts(request: Request, draft_tokens: int, sources: Sequence[str], cached: CachedTokens | None
                   ) -> list[Draft | None]:
    """A draft (or None) for each of ``request``'s running rows, from its head's index caught up
    with every branch's tokens (``cached``: the radix cache's continuations, ``DraftIndex``). A
    draft may not run past its branch's budget: the branch's last token is the one chosen after
    the draft."""
    head = request.head
    if head.draft_index is None:
        head.draft_index = DraftIndex(head.prompt_ids, cached)
    head.draft_index.catch_up((b.index, b.token_ids) for b in head.branches)
    drafts = []
    for b in request.active:
        branch = request.branches[b]
        limit = min(draft_tokens, request.max_new - len(branch.token_ids) - 1)
        drafts.append(head.draft_index.propose(branch.index, branch.token_ids, limit, sources))
    return drafts


def plan_step(requests: Sequence[Request], next_ids: Sequence[int], draft_tokens: int, sources: Sequence[str],
              cached: CachedTokens | None = None, *, every_row: bool = False) -> list[StepInputs] | None:
    """Each of ``requests``' inputs to a drafted step, drafts proposed now for the rows of the
    requests that may draft (``may_draft``); None when no row has a draft (an ordinary step then
    does the same work in one position a row). ``next_ids``: the rows' next tokens, in the
    requests' order. ``every_row``: every row of a request drafts (static rows, each keeping its own
    length); else only a request of one row does (shared prefix: a request's rows share one suffix
    length, so a row could not keep more of its draft than its siblings)."""
    plans, start, drafted = [], 0, False
    for request in requests:
        rows = len(request.active)
        ids, start = list(next_ids[start:start + rows]), start + rows
        if not may_draft(request) or (rows != 1 and not every_row):
            plans.append(StepInputs([[t] for t in ids], [None] * rows, False))
            continue
        drafts = propose_drafts(request, draft_tokens, sources, cached)
        drafted = drafted or any(d is not None for d in drafts)
        plans.append(StepInputs([[t, *(d.tokens if d is not None else ())] for t, d in zip(ids, drafts)], drafts, True))
    return plans if drafted else None


def forward_drafted(runner: ModelRunner, requests: Sequence[Request], plans: Sequence[StepInputs]
                    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The rows of ``requests`` (all on the shared-prefix path) over their ``plans``' positions in
    one forward, each row padded to the widest with its last input (positions past the context
    window are numbered at its end: their results are never read). Returns the logits (rows, T, V)
    and each request's rows in them. Every request's KV grows by ``T``: roll it back after."""
    cache = BatchDecodeCache([r.cache for r in requests])
    width = max(plan.width for plan in plans)
    rows = [row for plan in plans for row in plan.padded(width)]
    device = runner.device
    input_ids = torch.tensor(rows, device=device)  # (B, T)
    positions = cache.position_ids(device) + torch.arange(width, device=device)[None, :]  # (B, T)
    positions = positions.clamp_max(runner.context_window - 1)
    with attention_implementation(runner.model, ATTENTION_NAME):
        out = runner.decode_forward(input_ids, cache, position_ids=positions, **cache.forward_kwargs())
    return out.logits, cache.row_ranges


def forward_static_drafted(runner: ModelRunner, pool: StaticRowPool, order: list[int], slots: torch.Tensor,
                           plans: Sequence[StepInputs], next_ids: Sequence[int]) -> torch.Tensor:
    """The static rows ``order`` (``batch_forward.static_row_order``) over their ``plans``'
    positions in one forward of the pool's rows ``[0, top)``, each padded to the widest with its last
    input; a row of ``[0, top)`` outside ``order`` feeds its next token (``next_ids``, per slot)
    and keeps nothing. Returns the logits (rows, T, V) in ``order``; the pool's lengths are the
    caller's to advance by what each row keeps."""
    width = max(plan.width for plan in plans)
    inputs = [[token] * width for token in next_ids[:pool.top]]
    for slot, row in zip(order, (row for plan in plans for row in plan.padded(width))):
        inputs[slot] = row
    logits = runner.decode_static_drafted(pool, torch.tensor(inputs, device=pool.device))  # (top, T, V)
    return in_row_order(logits, order, slots)


def verify(logits: torch.Tensor, plan: StepInputs, params: SamplingParams, generators: list[torch.Generator]
           ) -> list[tuple[list[int], list[float]]]:
    """Per row of one request, the tokens it takes from its drafted step and their log-probabilities
    (module docstring): its accepted draft tokens, then the token chosen where the draft stopped
    matching or ended. ``logits``: the request's rows (R, T, V), each row's next token at position 0;
    ``generators``: one per row (none when greedy). Tokens at one position are chosen for all rows
    still verifying in one call."""
    taken: list[tuple[list[int], list[float]]] = [([], []) for _ in plan.rows]
    open_rows = list(range(len(plan.rows)))
    position = 0
    while open_rows:
        rows = torch.tensor(open_rows, device=logits.device)
        tokens, logprobs = choose_next_tokens(logits[rows, position], params,
                                              [generators[r] for r in open_rows] if generators else [])
        still_open = []
        for r, token, logprob in zip(open_rows, tokens.tolist(), logprobs.tolist()):
            taken[r][0].append(token)
            taken[r][1].append(logprob)
            draft = plan.drafts[r]
            if draft is not None and position < len(draft.tokens) and token == draft.tokens[position]:
                still_open.append(r)
        open_rows = still_open
        position += 1
    return taken
