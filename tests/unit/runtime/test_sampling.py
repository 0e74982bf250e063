"""The sampler's fast paths choose what the straightforward ones would: the batched draw equals
``torch.multinomial`` with the same generator, and top-p over the leading candidates equals top-p
over the fully sorted vocabulary."""

import pytest
import torch

from rksc_engine import SamplingParams
from rksc_engine.runtime import sampling
from rksc_engine.runtime.sampling import filter_logits, make_generators, sample_rows


def _full_sort_top_p_drop(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Reference nucleus: sort the whole vocabulary."""
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    drop_sorted = (probs.cumsum(dim=-1) - probs) >= top_p
    return drop_sorted.scatter(-1, order, drop_sorted)


@pytest.mark.parametrize("seed", range(6))
def test_the_batched_draw_picks_the_token_torch_multinomial_picks_with_the_same_generator(seed):
    torch.manual_seed(seed)
    logits = torch.randn(5, 3000) * 3
    logits[1, 100:] = float("-inf")  # a row with most of its mass masked to zero
    probs = logits.softmax(dim=-1)
    for step in range(4):  # several draws in a row: the generators' streams must stay in step
        ours = sample_rows(probs, make_generators(seed * 100 + step, 5, torch.device("cpu")))
        reference_gens = make_generators(seed * 100 + step, 5, torch.device("cpu"))
        theirs = torch.stack([torch.multinomial(probs[i], 1, generator=reference_gens[i])[0] for i in range(5)])
        assert ours.tolist() == theirs.tolist()
    assert int(ours[1]) < 100, "a zero-probability token must never be drawn"


def test_consecutive_draws_consume_each_generator_like_torch_multinomial():
    probs = torch.randn(3, 500).softmax(dim=-1)
    ours_gens, ref_gens = make_generators(9, 3, torch.device("cpu")), make_generators(9, 3, torch.device("cpu"))
    for _ in range(5):
        ours = sample_rows(probs, ours_gens)
        theirs = torch.stack([torch.multinomial(probs[i], 1, generator=ref_gens[i])[0] for i in range(3)])
        assert ours.tolist() == theirs.tolist()


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("sharpness", [0.3, 2.0, 8.0])
def test_top_p_over_the_leading_candidates_equals_top_p_over_the_sorted_vocabulary(top_p, sharpness, monkeypatch):
    monkeypatch.setattr(sampling, "TOP_P_CANDIDATES", 64)  # small, so flat rows take the fallback
    torch.manual_seed(int(top_p * 1000) + int(sharpness * 10))
    logits = torch.randn(6, 5000) * sharpness
    got = filter_logits(logits, SamplingParams(temperature=0.7, top_p=top_p)) == float("-inf")
    want = _full_sort_top_p_drop(logits / 0.7, top_p)
    # Only a token whose preceding mass is within float rounding of top_p may be decided differently.
    scaled = logits / 0.7
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = torch.empty_like(probs).scatter_(-1, order, probs.cumsum(dim=-1) - probs)
    on_the_boundary = (mass_before - top_p).abs() < 1e-6
    assert torch.equal(got[~on_the_boundary], want[~on_the_boundary])
    assert not got.all(dim=-1).any(), "every row must keep at least its top token"


@pytest.mark.parametrize("splits", [(1, 1), (3, 1, 4), (8, 8)])
def test_greedy_choices_for_a_batch_are_each_requests_own_bits(splits):
    gen = torch.Generator().manual_seed(len(splits))
    logits = torch.randn(sum(splits), 4096, generator=gen) * 4
    tokens, logprobs = sampling.greedy_choices(logits, [True] * len(splits))
    start = 0
    for rows in splits:
        want_tokens, want_logprobs = sampling.choose_next_tokens(logits[start:start + rows], SamplingParams(), [])
        assert torch.equal(tokens[start:start + rows], want_tokens)
        assert torch.equal(logprobs[start:start + rows], want_logprobs)
        start += rows


def test_greedy_choices_need_two_greedy_requests():
    logits = torch.randn(3, 10)
    assert sampling.greedy_choices(logits, [True, False]) is None
    assert sampling.greedy_choices(logits, [True]) is None
