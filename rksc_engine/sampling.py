"""Next-token choice for a batch of branches, each with its own random generator.

Row i of the batch is processed with exactly the operations it would see alone (all transforms are
row-wise), and draws from its own ``torch.Generator``, so a branch's tokens do not depend on which
siblings share its batch.
"""

from __future__ import annotations

import torch

from .config import SamplingParams


def make_generators(seed: int, num_branches: int, device: torch.device) -> list[torch.Generator]:
    """One generator per branch, branch i seeded ``seed + i``."""
    gens = []
    for i in range(num_branches):
        g = torch.Generator(device=device)
        g.manual_seed(seed + i)
        gens.append(g)
    return gens


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k and top-p applied row-wise. ``logits``: (B, V) float32."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (cum - sorted_logits.softmax(dim=-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


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
        tokens = torch.stack(
            [torch.multinomial(probs[i], 1, generator=generators[i])[0] for i in range(probs.shape[0])]
        )
    logprobs = logits.log_softmax(dim=-1).gather(-1, tokens[:, None])[:, 0]
    return tokens, logprobs
