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


def _generators(seed: int, rows: int) -> list[torch.Generator]:
    return [torch.Generator().manual_seed(seed + i) for i in range(rows)]


SAMPLED_A = SamplingParams(temperature=0.7, top_p=0.95)
SAMPLED_B = SamplingParams(temperature=1.3, top_k=50)


@pytest.mark.parametrize("requests", [
    [(SamplingParams(), 1), (SamplingParams(), 1)],
    [(SamplingParams(), 3), (SamplingParams(), 1), (SamplingParams(), 4)],
    [(SAMPLED_A, 8), (SAMPLED_A, 8)],
    [(SAMPLED_A, 2), (SamplingParams(), 3), (SAMPLED_B, 1), (SAMPLED_A, 1), (SAMPLED_B, 4), (None, 2)],
])
def test_batch_choices_give_each_request_its_own_tokens_and_bits(requests):
    """Requests that choose alike take their tokens from one call; each gets what it would get
    choosing alone (its generators drawn the same), and a request that chooses on its own (None: a
    logits processor) or alone in its kind is left to itself."""
    gen = torch.Generator().manual_seed(len(requests))
    rows = sum(n for _, n in requests)
    logits = torch.randn(rows, 4096, generator=gen) * 4
    logits[0, :] = 0.0  # a flat row: its nucleus is wider than the top-p candidates (the full sort)
    ranges, start = [], 0
    for _, n in requests:
        ranges.append((start, start + n))
        start += n
    choosers = [(params, [] if params is None or params.greedy else _generators(10 * i, n))
                for i, (params, n) in enumerate(requests)]
    tokens, logprobs, chosen = sampling.batch_choices(logits, choosers, ranges)
    kinds = [None if p is None else (p.temperature, p.top_k, p.top_p) for p, _ in requests]
    assert chosen == [k is not None and kinds.count(k) >= 2 for k in kinds]
    for i, ((params, n), (start, stop)) in enumerate(zip(requests, ranges)):
        if not chosen[i]:
            continue
        gens = [] if params.greedy else _generators(10 * i, n)
        want_tokens, want_logprobs = sampling.choose_next_tokens(logits[start:stop], params, gens)
        assert torch.equal(tokens[start:stop], want_tokens), f"request {i}"
        assert torch.equal(logprobs[start:stop], want_logprobs), f"request {i}"


def test_batch_choices_need_two_requests_that_choose_alike():
    logits = torch.randn(3, 10)
    assert sampling.batch_choices(logits, [(SamplingParams(), []), (None, [])], [(0, 1), (1, 3)]) is None
    assert sampling.batch_choices(logits, [(SamplingParams(), [])], [(0, 3)]) is None
    assert sampling.batch_choices(logits, [(SamplingParams(), []), (SAMPLED_A, _generators(0, 2))],
                                  [(0, 1), (1, 3)]) is None


def test_a_rows_top_p_nucleus_does_not_depend_on_the_rows_beside_it():
    """A row whose nucleus is wider than the candidates is ranked over the whole vocabulary; the
    rows beside it keep the candidates' ranking, so each row's mask is what it is alone."""
    # A row whose candidates' ranking and the whole vocabulary's disagree, within float rounding,
    # on one token at the edge of its 0.9 nucleus (found by search), beside a nearly flat row.
    edge = torch.randn(1, 4096, generator=torch.Generator().manual_seed(2672)) * 4
    flat = torch.randn(1, 4096, generator=torch.Generator().manual_seed(1)) * 0.01
    logits = torch.cat([edge, flat, edge.roll(7, dims=-1)])
    together = sampling.filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.9))
    for row in range(3):
        alone = sampling.filter_logits(logits[row:row + 1], SamplingParams(temperature=1.0, top_p=0.9))
        assert torch.equal(together[row:row + 1], alone), f"row {row}"
