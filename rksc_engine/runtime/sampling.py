"""Next-token choice for a batch of branches, each with its own random generator.

Row i of the batch is processed with exactly the operations it would see alone (all transforms are
row-wise), and draws from its own ``torch.Generator``, so a branch's tokens do not depend on which
siblings share its batch.

Speed without changing draws: the per-step cost on a 49k-token vocabulary was dominated by a full
sort for top-p and by ``torch.multinomial``'s argument checks, one row at a time. Top-p now looks
only at the ``top_p_candidates`` most likely tokens when they already hold the nucleus (falling back
to the full sort when they do not), and sampling draws each row's exponential noise from its own
generator and takes one batched ``argmax(p / q)``, which is the algorithm ``torch.multinomial`` uses
for one sample, so the same generator state gives the same token (tested against it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config import SamplingParams, check_branch_seeds

# Tokens examined by the fast top-p path before falling back to a full-vocabulary sort.
TOP_P_CANDIDATES = 1024
# Bytes per vocabulary entry that choosing one row's next token holds at its peak, beyond the
# forward's logits: the float32 logits, their temperature-scaled copy and probabilities, the full
# sort's values and int64 indices with its cumulative sums and masks (top-p's fallback), the noise.
# Measured on CPU as the peak resident bytes over rows x vocabulary (400 rows, 49k entries): 32 for
# top-p's fallback on float32 logits (36 on bfloat16 ones, the upcast included), 12 for plain
# sampling, 4 for greedy rows.
SAMPLING_BYTES_PER_LOGIT = 32


def decode_bytes_per_row(vocab_size: int, logits_dtype: torch.dtype) -> int:
    """Bytes one decoding row needs for its next token at the worst: the forward's logits over
    ``vocab_size`` in ``logits_dtype``, their float32 copy (none when they are float32 already), and
    ``choose_next_tokens``'s buffers (``SAMPLING_BYTES_PER_LOGIT``). A request's ``n`` rows take
    ``n`` times this in the step that starts them, and in every step after."""
    upcast = 0 if logits_dtype == torch.float32 else 4
    return vocab_size * (logits_dtype.itemsize + upcast + SAMPLING_BYTES_PER_LOGIT)


def make_generators(seed: int, num_branches: int, device: torch.device) -> list[torch.Generator]:
    """One generator per branch, branch i seeded ``seed + i``.

    Raises:
        ValueError: a branch's seed is outside ``[0, MAX_BRANCH_SEED]`` (``manual_seed`` would fail
            with an opaque overflow).
    """
    check_branch_seeds(seed, num_branches)
    gens = []
    for i in range(num_branches):
        g = torch.Generator(device=device)
        g.manual_seed(seed + i)
        gens.append(g)
    return gens


def _top_p_drop_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Tokens outside each row's nucleus. ``logits``: (B, V), already temperature-scaled.

    A token is dropped when the probability mass of the tokens ranked before it already reaches
    ``top_p``; the top token always stays, whatever ``top_p`` (one under float32's smallest positive
    value, ~1.4e-45, rounds to 0 in the comparison and would otherwise drop every token, leaving a
    NaN distribution). The fast path sums the same probabilities in the same order as a full sort,
    but they are normalised over the vocabulary in its own order, so a token whose preceding mass is
    within float rounding (~1e-7) of ``top_p`` can land on the other side.
    """
    probs = logits.softmax(dim=-1)  # (B, V)
    k = min(TOP_P_CANDIDATES, logits.shape[-1])
    top_probs, top_index = torch.topk(probs, k, dim=-1)  # sorted, descending
    mass_before = top_probs.cumsum(dim=-1) - top_probs  # (B, k)
    keep = _keep_ranked(mass_before, top_index, top_p, probs.shape)
    if k < logits.shape[-1]:
        wide = mass_before[:, -1] + top_probs[:, -1] < top_p
        if bool(wide.any()):
            # These rows' nuclei are wider than the candidates: rank their whole vocabulary. Only
            # theirs, so a row's mask never depends on the rows it is batched with.
            rows = wide.nonzero()[:, 0]
            sorted_logits, order = torch.sort(logits[rows], dim=-1, descending=True)
            ranked = sorted_logits.softmax(dim=-1)
            keep[rows] = _keep_ranked(ranked.cumsum(dim=-1) - ranked, order, top_p, ranked.shape)
    return ~keep


def _keep_ranked(mass_before: torch.Tensor, index: torch.Tensor, top_p: float, shape: torch.Size) -> torch.Tensor:
    """The nucleus as a (B, V) mask, from each row's ranked tokens ``index`` and the mass before each."""
    keep_ranked = mass_before < top_p
    keep_ranked[:, 0] = True
    return torch.zeros(shape, dtype=torch.bool, device=index.device).scatter_(-1, index, keep_ranked)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied row-wise. ``logits``: (B, V) float32."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(_top_p_drop_mask(logits, params.top_p), float("-inf"))
    return logits


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """One token per row, row i drawn with ``generators[i]``; the same token ``torch.multinomial(
    probs[i], 1, generator=generators[i])`` returns, but with one batched argmax.

    ``torch.multinomial`` draws one sample as ``argmax(p / q)`` with ``q ~ Exp(1)`` filled from the
    generator over the row; doing exactly that per row keeps every generator's stream the same.

    Args:
        probs: (B, V) non-negative, each row with positive mass.
        generators: One per row.

    Returns:
        (B,) int64 token ids.
    """
    noise = torch.empty_like(probs)
    for row, generator in enumerate(generators):
        noise[row].exponential_(1, generator=generator)
    return (probs / noise).argmax(dim=-1)


def choose_next_tokens(
    logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row.

    Args:
        logits: (B, V) raw next-token logits.
        params: Sampling settings.
        generators: One per row (unused when greedy).

    Returns:
        ``(tokens, logprobs)``, each (B,): the chosen ids and their log-probability under the raw
        (temperature 1) distribution.
    """
    logits = logits.float()
    if params.greedy:
        tokens = logits.argmax(dim=-1)
    else:
        probs = filter_logits(logits, params).softmax(dim=-1)
        tokens = sample_rows(probs, generators)
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, logprobs


def batch_choices(logits: torch.Tensor, requests: Sequence[tuple[SamplingParams | None, list[torch.Generator]]],
                  row_ranges: Sequence[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor, list[bool]] | None:
    """``choose_next_tokens`` for the rows of a step's ``logits`` (B, V), one call for all the
    requests that choose alike instead of one per request: every greedy request's rows in one, the
    rows of sampled requests with the same temperature, top-k and top-p in one, each row still drawn
    with its own generator. Every operation is per row (the top-p nucleus included), so a row's
    token and log-probability are the same bits in any batch.

    Args:
        logits: The step's logits, (B, V).
        requests: Per request, its sampling settings (None: it chooses on its own, as a request with
            a logits processor does) and its rows' generators (none when greedy).
        row_ranges: Per request, its rows ``[start, stop)`` of ``logits``.

    Returns:
        ``(tokens, logprobs, chosen)``: (B,) each, with the rows of requests not chosen for left 0,
        and per request whether its rows were chosen; None when no two requests choose alike, where
        one call gains nothing.
    """
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, (params, _) in enumerate(requests):
        if params is not None:
            key = (0.0, 0, 1.0) if params.greedy else (params.temperature, params.top_k, params.top_p)
            groups.setdefault(key, []).append(i)
    groups = {key: members for key, members in groups.items() if len(members) >= 2}
    if not groups:
        return None
    chosen = [False] * len(requests)
    if len(groups) == 1 and sum(len(m) for m in groups.values()) == len(requests):  # every row alike
        (members,) = groups.values()
        params = requests[members[0]][0]
        tokens, logprobs = choose_next_tokens(logits, params, [g for _, gens in requests for g in gens])
        return tokens, logprobs, [True] * len(requests)
    tokens = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    logprobs = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    for members in groups.values():
        rows = torch.tensor([row for i in members for row in range(*row_ranges[i])], device=logits.device)
        params = requests[members[0]][0]
        got, got_logprobs = choose_next_tokens(logits[rows], params, [g for i in members for g in requests[i][1]])
        tokens[rows], logprobs[rows] = got, got_logprobs
        for i in members:
            chosen[i] = True
    return tokens, logprobs, chosen
