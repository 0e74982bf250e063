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
    if k < logits.shape[-1] and bool((mass_before[:, -1] + top_probs[:, -1] < top_p).any()):
        # Some row's nucleus is wider than the candidates: rank the whole vocabulary.
        sorted_logits, top_index = torch.sort(logits, dim=-1, descending=True)
        top_probs = sorted_logits.softmax(dim=-1)
        mass_before = top_probs.cumsum(dim=-1) - top_probs
    keep_ranked = mass_before < top_p  # (B, k) or (B, V), in rank order
    keep_ranked[:, 0] = True
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep.scatter_(-1, top_index, keep_ranked)
    return ~keep


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


# What ``greedy_choices`` picks by: argmax.
GREEDY = SamplingParams(temperature=0.0)


def greedy_choices(logits: torch.Tensor, greedy: list[bool]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``choose_next_tokens`` for every row of a step's ``logits`` (B, V) at once, as greedy: the
    tokens and log-probabilities each greedy request takes from its rows, one argmax and one
    log-softmax for the batch instead of one per request (both are per row, so a row's results are
    the same bits in any batch). ``greedy`` says, per request, whether it may take them; None when
    fewer than two requests may, where one call gains nothing."""
    if sum(greedy) < 2:
        return None
    return choose_next_tokens(logits, GREEDY, [])
