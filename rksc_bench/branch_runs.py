"""n sampled branches of one prompt, run by rksc and by plain ``transformers`` ``generate``, as the
branch benchmarks time them (``benchmarks/branches.py``, and the end-to-end arms of
``benchmarks/limits.py``).

Both sides sample at ``TEMPERATURE`` with nucleus ``TOP_P`` and top-k off, and count a branch's
generated tokens up to and including its EOS token, so that HF's padding after EOS is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from rksc_bench.harness import timed
from rksc_engine import RKSCEngine, SamplingParams

TEMPERATURE = 0.7
TOP_P = 0.95


@dataclass
class RunResult:
    """What one timed run of one arm did."""

    wall_s: float
    prompt_tokens_computed: int
    generated_tokens: int


def run_rksc(engine: RKSCEngine, prompt_ids: list[int], n: int, params: SamplingParams) -> RunResult:
    """One ``generate_branches`` call; prompt tokens computed come from the engine's own counters."""
    before = engine.stats()
    wall_s, generated = timed(
        lambda: sum(c.num_generated_tokens for c in engine.generate_branches(prompt_ids, n, params))
    )
    computed = engine.stats().prompt_tokens_computed - before.prompt_tokens_computed
    return RunResult(wall_s, computed, generated)


def count_generated(new_tokens: torch.Tensor, eos_ids: set[int]) -> int:
    """Generated tokens in a (rows, steps) block, each row counted up to and including its first EOS.

    HF pads rows that finished early (here the pad id is the EOS id), so that padding is cut off.
    """
    total = 0
    for row in new_tokens.tolist():
        end = next((i + 1 for i, token in enumerate(row) if token in eos_ids), len(row))
        total += end
    return total


def hf_eos_ids(model: Any) -> set[int]:
    """The EOS ids ``model.generate`` stops on."""
    eos = model.generation_config.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def hf_generate(model: Any, input_ids: torch.Tensor, num_return_sequences: int, max_new_tokens: int) -> torch.Tensor:
    """Sampled ``model.generate``; returns only the generated part, shape (num_return_sequences, steps)."""
    output = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=True,
        temperature=TEMPERATURE,
        top_p=TOP_P,
        top_k=0,  # HF would otherwise default to top-k 50; rksc samples with top-k off
        max_new_tokens=max_new_tokens,
        num_return_sequences=num_return_sequences,
        pad_token_id=model.generation_config.pad_token_id,
    )
    return output[:, input_ids.shape[1] :]


def run_hf_batched(model: Any, input_ids: torch.Tensor, n: int, max_new_tokens: int, seed: int) -> RunResult:
    """One ``generate(num_return_sequences=n)``: HF repeats the prompt n times, so it prefills n*T tokens."""
    torch.manual_seed(seed)
    eos_ids = hf_eos_ids(model)
    wall_s, generated = timed(lambda: count_generated(hf_generate(model, input_ids, n, max_new_tokens), eos_ids))
    return RunResult(wall_s, n * input_ids.shape[1], generated)


def run_hf_sequential(model: Any, input_ids: torch.Tensor, n: int, max_new_tokens: int, seed: int) -> RunResult:
    """n separate ``generate`` calls, each prefilling the whole prompt: n*T prompt tokens."""
    torch.manual_seed(seed)
    eos_ids = hf_eos_ids(model)

    def all_calls() -> int:
        return sum(count_generated(hf_generate(model, input_ids, 1, max_new_tokens), eos_ids) for _ in range(n))

    wall_s, generated = timed(all_calls)
    return RunResult(wall_s, n * input_ids.shape[1], generated)
