"""A decode step that verifies drafts: speculative decoding, token-identical to decoding without it.

With ``SchedulerConfig.draft_tokens`` set, each running branch of a request that may draft (no
logits processor, no branch monitor: both see one token a branch a step) proposes up to ``k`` next
tokens (``drafts``). A step with a draft or a backlog anywhere runs every shared-prefix row over
``T`` positions in one forward (``forward_drafted``): the row's known tokens (its backlog, then its
next token), its draft, and padding to ``T``; attention is causal within a row's positions, so
padding changes nothing before it. Then, row by row (``verify``):

* the row's token after its last known token is chosen from that position's logits exactly as an
  ordinary step chooses it (``choose_next_tokens``: argmax, or one draw from the branch's own
  generator); while it equals the draft's token there, the next position's is chosen the same way;
  the first token that differs, or the one after the whole draft, ends the row's step. Every token
  a row takes costs one draw, as in ordinary decoding, and no draw is made past it, so a seeded
  branch takes the tokens it takes without drafting (the bits of the logits may differ, as any
  batched product's do);
* a request's rows share one suffix length, so its KV keeps the positions that every one of its
  rows verified (``kept_positions``) and forgets the rest (``batch_forward.roll_back``); a row that
  verified more keeps the tokens past that as its **backlog**, fed again before its next token in
  the next step. A row's inputs never exceed ``k + 1`` positions, backlog included.

A request that may not draft takes its rows' tokens from their first position, as in an ordinary
step. Callers hold the engine lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import SamplingParams
from ..kvcache.batch_decode import BatchDecodeCache
from ..kvcache.shared_prefix import ATTENTION_NAME, attention_implementation
from .drafts import Draft, DraftIndex
from .model_runner import ModelRunner
from .request import Request
from .sampling import choose_next_tokens


@dataclass(frozen=True)
class StepInputs:
    """What one request's rows feed a drafted step.

    Attributes:
        rows: Per row, its known tokens (backlog, then its next token) and then its draft's.
        num_known: Per row, how many of ``rows`` are known.
        drafts: Per row, its draft (None when it has none).
        verifies: Whether the request takes its tokens by verification; otherwise it may not draft,
            and takes one token a row from its first position.
    """

    rows: list[list[int]]
    num_known: list[int]
    drafts: list[Draft | None]
    verifies: bool

    @property
    def width(self) -> int:
        return max(len(row) for row in self.rows)


def may_draft(request: Request) -> bool:
    """Whether ``request``'s branches may draft: nothing watches its tokens one step at a time (a
    logits processor sees one position a call, a monitor one token a branch a step)."""
    return request.logits_processor is None and request.head.branching.monitor is None


def plan_step(requests: Sequence[Request], draft_tokens: int, sources: Sequence[str]) -> list[StepInputs] | None:
    """Each of ``requests``' inputs to a drafted step, drafts proposed now; None when no row has a
    draft or a backlog (an ordinary step then does the same work in one position a row)."""
    next_ids = torch.cat([r.next_tokens for r in requests]).tolist()  # one read for the batch
    plans, start, wide = [], 0, False
    for request in requests:
        rows = len(request.active)
        ids, start = next_ids[start:start + rows], start + rows
        if not may_draft(request):
            plans.append(StepInputs([[t] for t in ids], [1] * rows, [None] * rows, False))
            continue
        head = request.head
        if head.draft_index is None:
            head.draft_index = DraftIndex(head.prompt_ids)
        head.draft_index.catch_up((branch.index, branch.token_ids) for branch in head.branches)
        inputs, known, drafts = [], [], []
        for row, b in enumerate(request.active):
            branch = request.branches[b]
            row_inputs = [*(request.backlog[row] if request.backlog else ()), ids[row]]
            # A row feeds at most k + 1 positions; the draft may not run past the branch's budget.
            limit = min(draft_tokens, draft_tokens + 1 - len(row_inputs),
                        request.max_new - len(branch.token_ids) - 1)
            draft = head.draft_index.propose(branch.index, branch.token_ids, limit, sources)
            inputs.append(row_inputs + list(draft.tokens) if draft is not None else row_inputs)
            known.append(len(row_inputs))
            drafts.append(draft)
        plan = StepInputs(inputs, known, drafts, True)
        wide = wide or plan.width > 1
        plans.append(plan)
    return plans if wide else None


def forward_drafted(runner: ModelRunner, requests: Sequence[Request], plans: Sequence[StepInputs]
                    ) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """The rows of ``requests`` (all on the shared-prefix path) over their ``plans``' positions in
    one forward, each row padded to the widest with its last input (positions past the context
    window are numbered at its end: their results are never read). Returns the logits (rows, T, V)
    and each request's rows in them. Every request's KV grows by ``T``: roll it back after."""
    cache = BatchDecodeCache([r.cache for r in requests])
    width = max(plan.width for plan in plans)
    rows = [row + [row[-1]] * (width - len(row)) for plan in plans for row in plan.rows]
    device = runner.device
    input_ids = torch.tensor(rows, device=device)  # (B, T)
    positions = cache.position_ids(device) + torch.arange(width, device=device)[None, :]  # (B, T)
    positions = positions.clamp_max(runner.context_window - 1)
    with attention_implementation(runner.model, ATTENTION_NAME):
        out = runner.decode_forward(input_ids, cache, position_ids=positions, **cache.forward_kwargs())
    return out.logits, cache.row_ranges


def verify(logits: torch.Tensor, plan: StepInputs, params: SamplingParams, generators: list[torch.Generator]
           ) -> list[tuple[list[int], list[float]]]:
    """Per row of one request, the tokens it takes from its drafted step and their log-probabilities
    (module docstring): its accepted draft tokens, then the token chosen where the draft stopped
    matching or ended. ``logits``: the request's rows (R, T, V); ``generators``: one per row (none
    when greedy). Tokens at one position are chosen for all rows still verifying in one call."""
    taken: list[tuple[list[int], list[float]]] = [([], []) for _ in plan.rows]
    open_rows = list(range(len(plan.rows)))
    offset = 0
    while open_rows:
        rows = torch.tensor(open_rows, device=logits.device)
        positions = torch.tensor([plan.num_known[r] - 1 + offset for r in open_rows], device=logits.device)
        tokens, logprobs = choose_next_tokens(logits[rows, positions], params,
                                              [generators[r] for r in open_rows] if generators else [])
        still_open = []
        for r, token, logprob in zip(open_rows, tokens.tolist(), logprobs.tolist()):
            taken[r][0].append(token)
            taken[r][1].append(logprob)
            draft = plan.drafts[r]
            if draft is not None and offset < len(draft.tokens) and token == draft.tokens[offset]:
                still_open.append(r)
        open_rows = still_open
        offset += 1
    return taken


def kept_positions(plan: StepInputs, verified: Sequence[int | None]) -> int:
    """How many of this step's positions a request's KV keeps: those every row that goes on
    verified (``verified[row]``: its known tokens plus its accepted draft tokens; None for a row that
    has finished). At least one: every row's next token was known."""
    going_on = [count for count in verified if count is not None]
    return min(going_on) if going_on else 1
