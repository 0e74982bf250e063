"""Drafting (speculative decoding from the prompt and sibling branches): the n-gram proposer, the
verification's draws, the config's refusals, and, on tiny seeded models of several families,
output token-identical to decoding without drafts: greedy and seeded sampling, alone, with
siblings and batched with other requests, and greedy against ``transformers``' ``generate``."""

from __future__ import annotations

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from rksc_bench.families import FAMILIES, char_tokenizer, make_family_model
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams, SchedulerConfig
from rksc_engine.runtime.drafted_step import StepInputs, verify
from rksc_engine.runtime.drafts import Draft, DraftIndex, NgramIndex
from rksc_engine.runtime.handle import BranchControl
from rksc_engine.runtime.sampling import choose_next_tokens

# Repetitive text, so drafts from the prompt and from the branches' own loops are accepted often.
PROMPT = "Q: 12 + 7 = 19. Q: 3 + 4 = 7. Q: 12 + 7 = 19. Q: 3 + 4 = 7. Q: 12 +"
GREEDY = SamplingParams(max_new_tokens=40)
# Low temperature: sampled branches that still repeat themselves and each other, but not in step.
SAMPLED = SamplingParams(max_new_tokens=40, temperature=0.3, seed=3)
ATTENTION_FAMILIES = [f.name for f in FAMILIES if not f.recurrent]
FAST_FAMILIES = ("llama3", "gemma2", "gpt-oss")  # full attention; sliding + soft-capping; sliding + sinks
FAMILY_CASES = [pytest.param(name, marks=() if name in FAST_FAMILIES else pytest.mark.slow)
                for name in ATTENTION_FAMILIES]
# Tiny random models whose text hardly repeats itself: their drafts are all rejected here, so these
# families check the multi-position forward and its roll-back, not a draft kept.
RARELY_REPEATING = {"gpt2"}


def drafting(draft_tokens: int = 4, sources: tuple[str, ...] = ("prompt", "siblings"), **engine) -> EngineConfig:
    return EngineConfig(scheduler=SchedulerConfig(draft_tokens=draft_tokens, draft_sources=sources), **engine)


def token_ids(completions) -> list[tuple[int, ...]]:
    return [c.token_ids for c in completions]


# -- the proposer ---------------------------------------------------------------------------------
def test_an_ngram_continues_from_its_latest_occurrence_that_has_tokens_after_it():
    index = NgramIndex([1, 2, 3, 4, 1, 2, 5, 6, 1, 2])
    assert index.continuation((1, 2), 3) == [5, 6, 1], "the occurrence at the very end has no continuation"
    assert index.continuation((2, 3), 5) == [4, 1, 2, 5, 6]
    assert index.continuation((7, 8), 3) == []


def test_an_index_catches_up_with_a_growing_sequence_and_starts_over_for_another():
    index = NgramIndex()
    index.catch_up([1, 2, 3])
    index.catch_up([1, 2, 3, 1, 2])
    assert index.continuation((1, 2), 2) == [3, 1]
    index.catch_up([9, 9, 9])  # a branch that started over (a preemption)
    assert index.tokens == [9, 9, 9] and index.continuation((1, 2), 2) == []


def test_a_draft_takes_the_longest_match_and_the_sources_in_their_order():
    index = DraftIndex([5, 6, 7, 8, 50, 6, 7, 60])
    own, sibling = [5, 6, 7], [40, 6, 7, 70, 71]
    index.catch_up([(0, own), (1, sibling)])
    # (5, 6, 7) is in the prompt only: the longest match wins over (6, 7) in the sibling.
    assert index.propose(0, own, 3, ("siblings", "prompt")) == Draft((8, 50, 6), "prompt")
    own += [9, 6, 7]  # now ends (9, 6, 7): only (6, 7) matches, in its own text, the prompt and the sibling
    index.catch_up([(0, own), (1, sibling)])
    assert index.propose(0, own, 2, ("siblings", "prompt")) == Draft((70, 71), "siblings")
    assert index.propose(0, own, 2, ("prompt", "siblings")) == Draft((9, 6), "prompt"), \
        "the branch's own earlier (6, 7) comes before the prompt's"
    assert index.propose(2, [6, 7], 2, ("prompt",)) == Draft((60,), "prompt"), \
        "the prompt's latest (6, 7) is followed by one token"
    assert index.propose(0, own, 0, ("prompt",)) is None


def test_the_siblings_source_never_reads_the_branch_itself():
    index = DraftIndex([1, 1, 1])
    own = [4, 5, 6, 4, 5]
    index.catch_up([(0, own)])
    assert index.propose(0, own, 2, ("siblings",)) is None
    assert index.propose(0, own, 2, ("prompt",)) == Draft((6, 4), "prompt"), "its own text is the prompt source's"


# -- verification ---------------------------------------------------------------------------------
def test_verification_draws_each_position_as_ordinary_decoding_would_and_no_further():
    torch.manual_seed(0)
    logits = torch.randn(3, 4, 20) * 3  # (rows, positions, vocabulary)
    params = SamplingParams(temperature=0.9, top_p=0.9)
    # What ordinary decoding draws at each position, one step at a time, from generators seeded alike.
    reference = [torch.Generator().manual_seed(10 + r) for r in range(3)]
    sequential = [[int(choose_next_tokens(logits[r, j][None], params, [reference[r]])[0]) for j in range(3)]
                  for r in range(3)]
    # Row 0's draft matches two tokens then differs; row 1's is wrong at once; row 2 has none.
    drafts = [Draft((sequential[0][0], sequential[0][1], (sequential[0][2] + 1) % 20), "prompt"),
              Draft(((sequential[1][0] + 1) % 20,), "siblings"), None]
    plan = StepInputs([[0, *drafts[0].tokens], [0, *drafts[1].tokens], [0]], drafts, True)
    generators = [torch.Generator().manual_seed(10 + r) for r in range(3)]
    taken = verify(logits, plan, params, generators)
    assert [tokens for tokens, _ in taken] == [sequential[0][:3], sequential[1][:1], sequential[2][:1]]
    # Each generator made exactly one draw per token taken: its next draw is ordinary decoding's next.
    for r, count in enumerate([3, 1, 1]):
        fresh = torch.Generator().manual_seed(10 + r)
        for j in range(count):
            choose_next_tokens(logits[r, j][None], params, [fresh])
        assert torch.equal(generators[r].get_state(), fresh.get_state()), f"row {r} drew more or less than it took"


def test_greedy_verification_keeps_the_draft_up_to_the_first_token_argmax_disagrees_with():
    logits = torch.zeros(1, 4, 10)
    for position, token in enumerate([3, 4, 5, 6]):
        logits[0, position, token] = 5.0
    plan = StepInputs([[1, 3, 4, 9]], [Draft((3, 4, 9), "prompt")], True)
    tokens, logprobs = verify(logits, plan, SamplingParams(), [])[0]
    assert tokens == [3, 4, 5], "two draft tokens kept, then argmax's own token where the draft was wrong"
    assert len(logprobs) == 3


def test_a_whole_accepted_draft_is_followed_by_the_token_after_it():
    logits = torch.zeros(1, 3, 10)
    for position, token in enumerate([3, 4, 7]):
        logits[0, position, token] = 5.0
    plan = StepInputs([[1, 3, 4]], [Draft((3, 4), "siblings")], True)
    assert verify(logits, plan, SamplingParams(), [])[0][0] == [3, 4, 7]


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad, error", [
    (dict(draft_tokens=-1), ValueError), (dict(draft_tokens=17), ValueError), (dict(draft_tokens=True), TypeError),
    (dict(draft_tokens=2.0), TypeError), (dict(draft_tokens=2, draft_sources=("radix",)), ValueError),
    (dict(draft_tokens=2, draft_sources=()), ValueError), (dict(draft_sources="prompt"), TypeError),
    (dict(draft_sources=("prompt", "prompt")), ValueError),
])
def test_scheduler_config_refuses_bad_drafting_settings_naming_them(bad, error):
    with pytest.raises(error, match="scheduler.draft_"):
        SchedulerConfig(**bad)


def test_a_decode_layout_that_cannot_draft_is_refused_naming_draft_tokens():
    with pytest.raises(ValueError, match="scheduler.draft_tokens"):
        drafting(decode_attention="dynamic_cache")
    EngineConfig(decode_attention="dynamic_cache")  # without drafting it is fine
    drafting(decode_attention="static_rows")
    drafting(decode_capture="compile")


def test_drafting_is_off_by_default():
    assert SchedulerConfig().draft_tokens == 0
    assert SchedulerConfig().draft_sources == ("prompt", "siblings", "cache")


# -- the engine: token identity -------------------------------------------------------------------
# Both layouts that draft: one-row members of the shared prefix, and static rows (every row drafts).
LAYOUTS = ("shared_prefix", "static_rows")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILY_CASES)
def test_drafted_branches_are_token_identical_to_decoding_without_drafts(family, layout):
    model, tokenizer = make_family_model(family), char_tokenizer()
    cases = [(params, n) for params in (GREEDY, SAMPLED) for n in (1, 4)]
    want = [token_ids(RKSCEngine(model, tokenizer).generate_branches(PROMPT, n, params)) for params, n in cases]
    engine = RKSCEngine(model, tokenizer, drafting(decode_attention=layout))
    assert engine.runner.decode_layout().value == layout
    got = [token_ids(engine.generate_branches(PROMPT, n, params)) for params, n in cases]
    assert got == want, f"{family}: drafting changed the tokens"
    stats = engine.stats()
    assert stats.drafted_tokens > 0, "nothing was drafted: the test did not exercise verification"
    if family not in RARELY_REPEATING:
        assert stats.accepted_draft_tokens > 0, "no draft was accepted: the test did not exercise keeping one"


@pytest.mark.parametrize("model_seed", [0, 1, 2])
def test_drafted_greedy_decoding_equals_transformers_generate(model_seed):
    model, tokenizer = make_tiny_model(model_seed), make_char_tokenizer()
    engine = RKSCEngine(model, tokenizer, drafting(draft_tokens=6))
    for prompt in [PROMPT, "abc abc abc abc abc", "The quick brown fox jumps over"]:
        ids = torch.tensor([tokenizer(prompt)["input_ids"]])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=30, do_sample=False)
        got = engine.generate(prompt, SamplingParams(max_new_tokens=30)).token_ids
        assert got == tuple(want[0, ids.shape[1]:].tolist()), f"drafted greedy differs from transformers for {prompt!r}"
    assert engine.stats().accepted_draft_tokens > 0


def test_a_drafting_request_decodes_each_branch_as_a_row_of_its_own_with_the_same_tokens():
    model, tokenizer = make_family_model("llama3"), char_tokenizer()
    want = token_ids(RKSCEngine(model, tokenizer).generate_branches(PROMPT, 4, SAMPLED))
    engine = RKSCEngine(model, tokenizer, drafting(sources=("siblings",)))
    handle = engine.submit(PROMPT, 4, SAMPLED)
    with engine.exclusive():
        engine.scheduler.step()  # admitted and started: its four branches are four members of one row
        members = engine.scheduler.requests.decoding()
        assert [len(m.active) for m in members] == [1, 1, 1, 1]
        assert {m.head for m in members} == {members[0]}
    assert token_ids(handle.result()) == want
    stats = engine.stats()
    assert stats.extra.get("accepted_draft_tokens_siblings", 0) > 0, "no sibling's text was ever a right guess"
    assert stats.rejected_draft_tokens > 0, "no draft was rejected: the test did not exercise the roll-back"
    assert "drafted_tokens_prompt" not in stats.extra, "a source that was not configured drafted"
    assert stats.draft_steps_saved > 0
    assert stats.branches_added == 0 if hasattr(stats, "branches_added") else "branches_added" not in stats.extra


@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_a_drafting_request_whose_first_branch_ends_at_once_still_returns_every_branch(max_new_tokens):
    model, tokenizer = make_tiny_model(0), make_char_tokenizer()
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, seed=4)
    want = token_ids(RKSCEngine(model, tokenizer).generate_branches(PROMPT, 3, params))
    got = RKSCEngine(model, tokenizer, drafting()).generate_branches(PROMPT, 3, params)
    assert [c.branch_index for c in got] == [0, 1, 2]
    assert token_ids(got) == want


def test_on_static_rows_every_branch_of_a_request_drafts_as_a_row_of_it():
    model, tokenizer = make_family_model("llama3"), char_tokenizer()
    want = token_ids(RKSCEngine(model, tokenizer).generate_branches(PROMPT, 4, SAMPLED))
    engine = RKSCEngine(model, tokenizer, drafting(sources=("siblings",), decode_attention="static_rows"))
    handle = engine.submit(PROMPT, 4, SAMPLED)
    pool = engine.scheduler.kv.static_pool
    with engine.exclusive():
        engine.scheduler.step()
        assert [len(m.active) for m in engine.scheduler.requests.decoding()] == [4], "its branches were split"
        while not handle.done():
            engine.scheduler.step()
            for request in engine.scheduler.requests.decoding():  # each row holds its tokens but the last
                # A row's next token is in the pool, or still to be written there (``next_tokens``).
                pending = request.next_tokens
                for row, (slot, b) in enumerate(zip(request.cache.slots, request.active)):
                    tokens = request.branches[b].token_ids
                    assert pool.length(slot) == len(request.head.prompt_ids) + len(tokens) - 1
                    assert int(pool.next_tokens[slot] if pending is None else pending[row]) == tokens[-1]
    assert token_ids(handle.result()) == want
    stats = engine.stats()
    assert stats.extra.get("accepted_draft_tokens_siblings", 0) > 0, "no sibling's text was ever a right guess"
    assert stats.rejected_draft_tokens > 0, "no draft was rejected: the test did not exercise the roll-back"
    assert stats.draft_forwards > 0


@pytest.mark.slow
def test_a_compiled_static_step_drafts_and_keeps_the_tokens():
    model, tokenizer = make_family_model("llama3"), char_tokenizer()
    cases = [(GREEDY, 1), (SAMPLED, 3)]
    want = [token_ids(RKSCEngine(model, tokenizer).generate_branches(PROMPT, n, params)) for params, n in cases]
    engine = RKSCEngine(model, tokenizer, drafting(decode_capture="compile"))
    got = [token_ids(engine.generate_branches(PROMPT, n, params)) for params, n in cases]
    assert got == want
    assert engine.stats().accepted_draft_tokens > 0
    assert engine.runner.static_step.num_steps > engine.stats().draft_forwards, "no ordinary (compiled) step ran"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_request_that_comes_again_drafts_what_the_cache_kept_of_its_first_answer(layout):
    model, tokenizer = make_tiny_model(2), make_char_tokenizer()
    prompt = "The quick brown fox jumps over"
    want = RKSCEngine(model, tokenizer).generate(prompt, GREEDY).token_ids
    engine = RKSCEngine(model, tokenizer, drafting(draft_tokens=8, sources=("cache",), decode_attention=layout))
    first = engine.generate(prompt, GREEDY)
    assert first.token_ids == want and first.drafted_tokens == 0, "nothing was cached after the prompt yet"
    again = engine.generate(prompt, GREEDY)
    assert again.token_ids == want
    # Every forward after the first token verifies 8 cached tokens and takes one more of its own.
    forwards = -(-(len(want) - 1) // 9)
    assert again.accepted_draft_tokens == again.drafted_tokens == len(want) - 1 - forwards, \
        "the cached answer was not drafted whole"
    assert engine.stats().extra["accepted_draft_tokens_cache"] == again.accepted_draft_tokens
    # The same prompt sampled: its branches leave the cached answer at their first other token, and
    # keep their own tokens.
    sampled = SamplingParams(max_new_tokens=40, temperature=0.8, seed=2)
    assert token_ids(engine.generate_branches(prompt, 3, sampled)) == token_ids(
        RKSCEngine(model, tokenizer).generate_branches(prompt, 3, sampled))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_branch_that_stops_inside_its_draft_keeps_the_kv_of_its_tokens_before_the_last(layout, monkeypatch):
    """A stop string met on an accepted draft token ends the branch there; its KV must hold its
    prompt and its tokens but the last, as without drafts, or its answer is not cached."""
    model, tokenizer = make_tiny_model(2), make_char_tokenizer()
    prompt = "The quick brown fox jumps over"
    engine = RKSCEngine(model, tokenizer, drafting(draft_tokens=8, sources=("cache",), decode_attention=layout))
    first = engine.generate(prompt, GREEDY)  # its answer is cached: the next request drafts it
    offset = next(i for i in range(3, 8) if first.text.find(first.text[i:i + 3]) == i)
    stop = first.text[offset:offset + 3]  # met on a token of the first draft (tokens 1 to 8)
    prompt_ids = engine.encode(prompt)
    inserted = []
    real = engine.prefix_cache.insert
    monkeypatch.setattr(engine.prefix_cache, "insert",
                        lambda ids, *args, **kwargs: inserted.append(list(ids)) or real(ids, *args, **kwargs))
    stopped = engine.generate(prompt, SamplingParams(max_new_tokens=40, stop=(stop,)))
    assert stopped.finish_reason == "stop" and stopped.accepted_draft_tokens > 0
    assert stopped.token_ids == first.token_ids[:len(stopped.token_ids)]
    assert prompt_ids + list(stopped.token_ids[:-1]) in inserted, "the stopped answer's KV had the wrong length"


class AddsABranchThenFails:
    """A monitor (its request may not draft) that adds a branch at once and raises two steps later."""

    def __init__(self) -> None:
        self.calls = 0

    def observe(self, events):
        self.calls += 1
        if self.calls >= 3:
            raise ValueError("the monitor failed")
        return BranchControl(add=1) if self.calls == 1 else None


def test_a_request_that_fails_in_a_drafted_static_step_fails_alone():
    """On static rows, a request with a monitor fails in a step where another request drafts: its
    added branch's wave is gone with it, and the drafting request and the pool go on as before."""
    model, tokenizer = make_family_model("llama3"), char_tokenizer()
    want = RKSCEngine(model, tokenizer).generate(PROMPT, GREEDY).token_ids
    engine = RKSCEngine(model, tokenizer, drafting(draft_tokens=8, sources=("cache",), decode_attention="static_rows"))
    engine.generate(PROMPT, GREEDY)  # cached: the greedy request below drafts at every step
    engine.reset_stats()
    with engine.exclusive():  # admitted together, decoded together: the failing one, its wave, the drafting one
        failing = engine.submit(PROMPT, 1, SamplingParams(max_new_tokens=40, temperature=0.8, seed=1),
                                monitor=AddsABranchThenFails(), max_branches=2)
        drafting_request = engine.submit(PROMPT, 1, GREEDY)
    with pytest.raises(ValueError, match="the monitor failed"):
        failing.result(timeout=60)
    assert drafting_request.result(timeout=60)[0].token_ids == want
    stats = engine.stats()
    assert stats.draft_forwards > 0 and stats.running_kv_bytes == 0
    assert engine.generate(PROMPT, GREEDY).token_ids == want, "the engine is not usable after it"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_requests_batched_together_draft_and_keep_the_tokens_they_get_alone(layout):
    model, tokenizer = make_tiny_model(1), make_char_tokenizer()

    def no_digit_nine(token_lists, logits):  # a logits processor: its request may not draft
        logits = logits.clone()
        logits[:, tokenizer.convert_tokens_to_ids("9")] = float("-inf")
        return logits

    jobs = [(PROMPT, 3, SAMPLED, None), ("abc abc abc abc abc", 1, GREEDY, None),
            ("The quick brown fox jumps over", 2, SamplingParams(max_new_tokens=25, temperature=0.8, seed=5), None),
            (PROMPT, 2, GREEDY, no_digit_nine),
            ("x y x y x y x y", 1, SamplingParams(max_new_tokens=30, stop=("y x y",)), None)]
    plain = RKSCEngine(model, tokenizer)
    want = [token_ids(plain.submit(p, n, params, logits_processor=lp).result()) for p, n, params, lp in jobs]
    engine = RKSCEngine(model, tokenizer, drafting(decode_attention=layout))
    with engine.exclusive():  # all admitted in one step, decoded together
        handles = [engine.submit(p, n, params, logits_processor=lp) for p, n, params, lp in jobs]
    got = [token_ids(handle.result()) for handle in handles]
    assert got == want, "a request's tokens changed when it drafted beside other requests"
    stats = engine.stats()
    assert stats.peak_batch_rows == 9 and stats.accepted_draft_tokens > 0
    assert all(c.drafted_tokens == 0 for c in handles[3].result()), "a request with a logits processor drafted"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_streamed_text_and_finish_reasons_are_the_same_with_drafts(layout):
    model, tokenizer = make_tiny_model(0), make_char_tokenizer()
    cases = [SamplingParams(max_new_tokens=23), SamplingParams(max_new_tokens=40, stop=("c a",)),
             SamplingParams(max_new_tokens=40, temperature=0.3, seed=1, stop=(" a",))]
    for params in cases:
        want = RKSCEngine(model, tokenizer).generate_branches("abc abc abc abc abc", 2, params)
        engine = RKSCEngine(model, tokenizer, drafting(draft_tokens=8, decode_attention=layout))
        chunks = list(engine.submit("abc abc abc abc abc", 2, params, stream=True))
        streamed = ["".join(c.text for c in chunks if c.branch_index == b) for b in range(2)]
        done = sorted((c.completion for c in chunks if c.completion is not None), key=lambda c: c.branch_index)
        assert [c.token_ids for c in done] == [c.token_ids for c in want]
        assert streamed == [c.text for c in want] and [c.finish_reason for c in done] == [c.finish_reason for c in want]
        assert max(len(c.token_ids) for c in done) <= params.max_new_tokens


@pytest.mark.parametrize("layout", LAYOUTS)
def test_completions_and_stats_count_the_same_drafts(layout):
    model, tokenizer = make_tiny_model(0), make_char_tokenizer()
    engine = RKSCEngine(model, tokenizer, drafting(decode_attention=layout))
    single = engine.generate(PROMPT, GREEDY)
    stats = engine.stats()
    assert single.drafted_tokens == stats.drafted_tokens > 0
    assert single.accepted_draft_tokens == stats.accepted_draft_tokens > 0
    assert single.rejected_draft_tokens == stats.rejected_draft_tokens == stats.drafted_tokens - stats.accepted_draft_tokens
    # One branch: every accepted token is a forward it did not run.
    assert stats.draft_steps_saved == single.accepted_draft_tokens
    assert 0 < stats.draft_forwards <= len(single.token_ids) - 1 - stats.draft_steps_saved
    assert "drafts:" in str(stats)
    engine.reset_stats()
    branches = engine.generate_branches(PROMPT, 3, SAMPLED)
    stats = engine.stats()
    assert sum(c.drafted_tokens for c in branches) == stats.drafted_tokens
    assert sum(c.accepted_draft_tokens for c in branches) == stats.accepted_draft_tokens
    longest = max(len(c.token_ids) for c in branches)
    assert stats.draft_steps_saved <= longest - 1 and stats.draft_steps_saved >= 0


def test_without_drafting_nothing_is_drafted_and_completions_say_so():
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer())
    completion = engine.generate(PROMPT, GREEDY)
    stats = engine.stats()
    assert (completion.drafted_tokens, completion.accepted_draft_tokens) == (0, 0)
    assert (stats.drafted_tokens, stats.draft_forwards, stats.draft_steps_saved) == (0, 0, 0)
    assert "drafts:" not in str(stats)
