"""The scheduler on tiny seeded models: concurrent requests share decode batches without changing
any request's tokens, streams are plain queue consumers (closed, dropped or stalled from any thread
without blocking the engine), and cancellation frees a request's rows."""

import asyncio
import gc
import threading

import pytest
import torch
from conftest import MIXED_LENGTH_PROMPTS, engine_hf_greedy, make_char_tokenizer, make_tiny_model, wait_until

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import SchedulerConfig
from rksc_engine.kvcache.suffix_pool import SUFFIX_ALIGNMENT
from rksc_engine.runtime.handle import RequestCancelled
from rksc_engine.runtime.request import RequestStatus

PROMPTS = MIXED_LENGTH_PROMPTS


def engine_for(seed: int = 0, **config) -> RKSCEngine:
    return RKSCEngine(make_tiny_model(seed), make_char_tokenizer(), EngineConfig(**config))


hf_greedy = engine_hf_greedy


def alone(engine, prompt, n, params):
    return [c.token_ids for c in engine.generate_branches(prompt, n, params)]


@pytest.mark.parametrize("model_seed", [0, 1])
def test_concurrent_requests_of_different_lengths_get_the_tokens_they_get_alone(model_seed):
    engine = engine_for(model_seed)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=20, seed=11)
    greedy = SamplingParams(max_new_tokens=24)
    jobs = [(p, 1 + i % 3, sampled if i % 2 else greedy) for i, p in enumerate(PROMPTS)]
    want = [alone(engine, p, n, params) for p, n, params in jobs]
    engine.clear_cache()
    handles = [engine.submit(p, n, params) for p, n, params in jobs]  # all queued before any runs
    got = [[c.token_ids for c in h.result()] for h in handles]
    assert got == want, "a request's tokens changed when it shared its batch with other requests"
    assert engine.scheduler.peak_batch_rows > 3, "the requests were not decoded together"


def test_greedy_requests_batched_together_equal_transformers_generate():
    engine = engine_for(2)
    handles = [engine.submit(p, 1, SamplingParams(max_new_tokens=16)) for p in PROMPTS]
    for prompt, handle in zip(PROMPTS, handles):
        assert handle.result()[0].token_ids == hf_greedy(engine, prompt, 16), prompt


def test_generate_many_submits_every_prompt_at_once_and_matches_serial_generation():
    engine = engine_for(0)
    params = SamplingParams(max_new_tokens=12)
    serial = [engine.generate(p, params).token_ids for p in PROMPTS]
    engine.clear_cache()
    engine.scheduler.peak_batch_rows = 0
    assert [c.token_ids for c in engine.generate_many(PROMPTS, params)] == serial
    assert engine.scheduler.peak_batch_rows >= 2


def test_max_batch_rows_bounds_the_batch_and_queued_requests_still_finish():
    engine = engine_for(0, scheduler=SchedulerConfig(max_batch_rows=3))
    params = SamplingParams(temperature=0.8, max_new_tokens=10, seed=3)
    want = [alone(engine, p, 2, params) for p in PROMPTS]
    handles = [engine.submit(p, 2, params) for p in PROMPTS]
    assert [[c.token_ids for c in h.result()] for h in handles] == want
    assert engine.scheduler.peak_batch_rows <= 3


def test_a_request_wider_than_the_batch_limit_runs_alone():
    engine = engine_for(0, scheduler=SchedulerConfig(max_batch_rows=2))
    completions = engine.generate_branches("hello", 5, SamplingParams(temperature=1.0, max_new_tokens=6, seed=0))
    assert len(completions) == 5


def test_a_stream_read_in_one_thread_and_closed_in_another_cancels_it_and_the_engine_goes_on():
    engine = engine_for(0)
    stream = engine.stream("hello", SamplingParams(max_new_tokens=400))
    first = next(stream)
    assert isinstance(first.text, str)
    closer = threading.Thread(target=stream.close)
    closer.start()
    closer.join(5)
    assert not closer.is_alive(), "closing a stream from another thread blocked"
    # The engine is free at once: a request and stats() finish while nothing else runs.
    assert engine.generate("x", SamplingParams(max_new_tokens=4)).token_ids == hf_greedy(engine, "x", 4)
    engine.stats()
    # The close is seen at the scheduler's next step; poll a bounded while (order, not speed).
    assert wait_until(lambda: engine.scheduler.num_running_rows == 0, timeout_s=60), "the closed stream kept decoding"


def test_a_dropped_stream_is_cancelled_and_frees_its_rows():
    engine = engine_for(0)
    stream = engine.stream("hello", SamplingParams(max_new_tokens=400))
    next(stream)
    del stream
    gc.collect()
    engine.generate("x", SamplingParams(max_new_tokens=2))
    assert wait_until(lambda: engine.scheduler.num_running_rows == 0, timeout_s=60), "the dropped stream kept decoding"


def test_a_stalled_stream_consumer_does_not_hold_up_other_requests():
    engine = engine_for(0)
    stalled = engine.submit("hello", 1, SamplingParams(max_new_tokens=300), stream=True)
    chunks = iter(stalled)
    next(chunks)  # and then never read again (the iterator kept alive: dropping it would cancel)
    done = engine.submit("abc", 1, SamplingParams(max_new_tokens=8)).result(timeout=120)[0]
    assert done.num_generated_tokens == 8
    assert not stalled.done(), "the other request waited for the stalled stream to end"
    stalled.cancel()


def test_two_streams_interleave_in_one_thread():
    engine = engine_for(0)
    params = SamplingParams(max_new_tokens=10)
    a, b = engine.stream("hello", params), engine.stream("world", params)
    texts = {"a": "", "b": ""}
    for chunk_a, chunk_b in zip(a, b):
        texts["a"] += chunk_a.text
        texts["b"] += chunk_b.text
    for rest, key in ((a, "a"), (b, "b")):
        texts[key] += "".join(c.text for c in rest)
    assert texts["a"] == engine.generate("hello", params).text
    assert texts["b"] == engine.generate("world", params).text


def test_cancel_fails_result_with_request_cancelled():
    engine = engine_for(0)
    with engine.exclusive():  # nothing runs until the block ends, so the cancel lands first
        handle = engine.submit("hello", 2, SamplingParams(max_new_tokens=50))
        handle.cancel()
    with pytest.raises(RequestCancelled):
        handle.result(timeout=10)


def test_calls_inside_exclusive_are_driven_by_the_holding_thread():
    engine = engine_for(0)
    with engine.exclusive():
        before = engine.stats().decode_tokens
        engine.generate("hello", SamplingParams(max_new_tokens=5))
        assert engine.stats().decode_tokens - before == 5


def test_threads_sharing_one_engine_each_get_their_serial_answer():
    engine = engine_for(1)
    params = SamplingParams(temperature=0.7, max_new_tokens=12, seed=5)
    want = {p: alone(engine, p, 2, params) for p in PROMPTS}
    got: dict = {}
    errors: list = []

    def worker(prompt):
        try:
            got[prompt] = alone(engine, prompt, 2, params)
        except Exception as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and got == want


def test_asyncio_requests_run_concurrently_without_blocking_the_loop():
    engine = engine_for(0)
    params = SamplingParams(max_new_tokens=10)
    want = [engine.generate(p, params).token_ids for p in PROMPTS]

    async def main():
        results = await asyncio.gather(*(engine.agenerate(p, params) for p in PROMPTS))
        chunks = [c async for c in engine.astream(PROMPTS[0], params)]
        return results, chunks

    results, chunks = asyncio.run(main())
    assert [r.token_ids for r in results] == want
    assert chunks[-1].completion.token_ids == want[0]
    assert "".join(c.text for c in chunks) == chunks[-1].completion.text


def test_a_failing_logits_processor_fails_only_its_request():
    engine = engine_for(0)
    params = SamplingParams(max_new_tokens=8)
    want = engine.generate("world", params).token_ids

    def explode(_ids, _logits):
        raise RuntimeError("processor failed")

    bad = engine.submit("hello", 1, params, logits_processor=explode)
    good = engine.submit("world", 1, params)
    with pytest.raises(RuntimeError, match="processor failed"):
        bad.result(timeout=30)
    assert good.result(timeout=30)[0].token_ids == want


def test_submit_rejects_bad_input_before_anything_is_queued():
    engine = engine_for(0)
    before = engine.stats()
    with pytest.raises(TypeError, match="logits_processor"):
        engine.submit("hello", 1, None, logits_processor=3)
    with pytest.raises(ValueError, match="n must be"):
        engine.submit("hello", 0)
    assert engine.scheduler.num_waiting == 0
    assert engine.stats().requests == before.requests


def test_out_of_memory_in_a_shared_decode_step_preempts_the_newest_request_which_is_recomputed_exactly():
    from rksc_engine import RSBCMConfig

    engine = engine_for(0, rsbcm=RSBCMConfig(oom_max_attempts=1, oom_backoff_s=0.0))
    params = SamplingParams(temperature=0.8, max_new_tokens=12, seed=4)
    prompts = ["hello there", "general kenobi", "x"]
    want = [alone(engine, p, 2, params) for p in prompts]
    engine.clear_cache()
    forward = engine.model.forward

    def small_memory_forward(*args, **kwargs):
        input_ids = kwargs.get("input_ids", args[0] if args else None)
        if input_ids is not None and input_ids.shape[0] > 2 and input_ids.shape[1] == 1:
            raise torch.OutOfMemoryError("simulated: room for one request's two branches only")
        return forward(*args, **kwargs)

    engine.model.forward = small_memory_forward
    try:
        handles = [engine.submit(p, 2, params) for p in prompts[1:]]
        streamed = engine.submit(prompts[0], 2, params, stream=True)  # the newest: preempted first
        chunks = list(streamed)
        got = [[c.token_ids for c in h.result(timeout=60)] for h in handles]
    finally:
        engine.model.forward = forward
    finals = sorted((c for c in chunks if c.completion is not None), key=lambda c: c.branch_index)
    assert [c.completion.token_ids for c in finals] == want[0]
    for branch in range(2):  # the stream delivered each token once, whatever was preempted
        delivered = [t for c in chunks if c.branch_index == branch for t in c.token_ids]
        assert tuple(delivered) == want[0][branch]
        assert "".join(c.text for c in chunks if c.branch_index == branch) == finals[branch].completion.text
    assert got == want[1:], "a preempted request did not recompute the same tokens"
    assert engine.stats().extra.get("preemptions", 0) >= 2  # the stream, after delivering its first tokens, then more
    with engine.exclusive():  # after the last step has let go of the engine
        assert engine.stats().running_requests == 0
    engine.prefix_cache.check_consistency()


def test_concurrent_requests_read_a_shared_cached_prompt_prefix_in_place_instead_of_copying_it():
    engine = engine_for(0)
    prefix = "A long shared few-shot prefix, the same for every request. " * 7
    params = SamplingParams(temperature=0.8, max_new_tokens=6, seed=0)
    engine.generate(prefix + "warm", SamplingParams(max_new_tokens=1))  # the prefix is cached now
    engine.reset_stats()
    with engine.exclusive():  # all four are admitted in the same step
        handles = [engine.submit(prefix + f"question {i}", 2, params) for i in range(4)]
    for handle in handles:
        handle.result()
    prompt_bytes = len(engine.encode(prefix)) * engine.kv_bytes_per_token
    stats = engine.stats()
    assert stats.peak_batch_rows == 8
    # The rows' own tokens only: the suffix pool's slots, one aligned capacity each. A copy of the
    # prefix per request would be four prefixes.
    suffix_bytes = 8 * SUFFIX_ALIGNMENT * engine.kv_bytes_per_token
    assert suffix_bytes < 4 * prompt_bytes
    assert stats.peak_running_kv_bytes <= suffix_bytes, "running requests hold copies of the cached prefix"
    engine.prefix_cache.check_consistency()
    assert all(node.lock_ref == 0 for node in engine.prefix_cache._iter_nodes()), "a finished request kept its lock"


@pytest.mark.parametrize("mixed_prefill", [False, True])
def test_a_stalled_stream_does_not_delay_another_request_by_a_single_step(mixed_prefill):
    engine = engine_for(0, scheduler=SchedulerConfig(mixed_prefill=mixed_prefill))
    params = SamplingParams(max_new_tokens=8)

    def steps_taken() -> tuple[int, int]:
        """(steps from submission to the request's first token, steps its tokens span), read inside
        the scheduler step that samples each token, so the stream running beside it cannot race the
        count the way reading ``num_steps`` after ``result()`` would."""
        seen: list[int] = []

        def record_step(_prefixes, logits):
            seen.append(engine.scheduler.num_steps)
            return logits

        with engine.exclusive():  # no step runs between reading the counter and queueing the request
            submitted_at = engine.scheduler.num_steps
            handle = engine.submit("abc", 1, params, logits_processor=record_step)
        handle.result()
        return seen[0] - submitted_at, seen[-1] - seen[0]

    wait_alone, span_alone = steps_taken()
    stream = engine.stream("hello", SamplingParams(max_new_tokens=300))
    next(stream)  # and then never read again
    mixed_before = engine.stats().extra.get("mixed_prefills", 0)
    wait_beside, span_beside = steps_taken()
    mixed = engine.stats().extra.get("mixed_prefills", 0) - mixed_before  # 0 if the stream had ended
    stream.close()
    assert wait_beside <= wait_alone + 1  # +1: a chunked prefill of the stream may share the admitting step
    # Alone, the request's prompt is prefilled and its second token decoded in the step that admits
    # it. Beside a running row with mixed prefill, the prompt rides in that step's decode forward
    # instead, so the second token comes one step (and one forward fewer) later: the mixing, not the stall.
    assert mixed in ((0, 1) if mixed_prefill else (0,))
    assert span_beside == span_alone + mixed


def test_awaiting_a_request_inside_exclusive_does_not_deadlock():
    engine = engine_for(0)
    params = SamplingParams(max_new_tokens=5)
    want = engine.generate("hello", params).token_ids

    async def main():
        with engine.exclusive():
            first = await engine.agenerate("hello", params)
            chunks = [c async for c in engine.astream("hello", params)]
        return first, chunks

    first, chunks = asyncio.run(main())
    assert first.token_ids == want and chunks[-1].completion.token_ids == want


def test_a_long_prompt_is_prefilled_in_chunks_while_another_request_keeps_decoding():
    engine = engine_for(1, scheduler=SchedulerConfig(max_prefill_tokens=16))
    long_prompt = "A much longer prompt, repeated. " * 5  # 160 tokens: ten chunks
    greedy = SamplingParams(max_new_tokens=12)
    want_long = hf_greedy(engine, long_prompt, 12)
    want_short = hf_greedy(engine, "hi", 30)
    engine.reset_stats()
    with engine.exclusive():
        short = engine.submit("hi", 1, SamplingParams(max_new_tokens=30))
        long = engine.submit(long_prompt, 1, greedy)
        steps_before = engine.scheduler.num_steps
    got_short, got_long = short.result()[0], long.result()[0]
    assert got_long.token_ids == want_long, "chunked prefill changed the greedy tokens"
    assert got_short.token_ids == want_short
    stats = engine.stats()
    assert stats.prompt_tokens_computed == len(engine.encode(long_prompt)) + len(engine.encode("hi"))
    assert engine.scheduler.num_steps - steps_before >= 10  # one chunk per step, decode in between
    assert all(node.lock_ref == 0 for node in engine.prefix_cache._iter_nodes())


def test_cancelling_a_request_mid_prefill_unlocks_its_cached_prefix():
    engine = engine_for(0, scheduler=SchedulerConfig(max_prefill_tokens=8))
    prompt = "The same cached opening, then more. " * 4
    engine.generate(prompt[:40], SamplingParams(max_new_tokens=1))  # cache an opening it will match
    with engine.exclusive():
        handle = engine.submit(prompt, 1, SamplingParams(max_new_tokens=4))
        engine.scheduler.step()  # admitted: the first chunk ran, the matched prefix is locked
        assert [r.request_id for r in engine.scheduler.requests.of(RequestStatus.PREFILLING)] == [handle.request_id]
        handle.cancel()
        engine.scheduler.step()
    with pytest.raises(RequestCancelled):
        handle.result(timeout=10)
    assert all(node.lock_ref == 0 for node in engine.prefix_cache._iter_nodes()), "a cancelled prefill kept its lock"
    engine.prefix_cache.check_consistency()


def test_greedy_requests_decoding_together_take_their_tokens_from_one_choice_for_the_batch(monkeypatch):
    """One argmax and one log-softmax a step for four greedy requests, not one of each per request;
    the tokens are each request's alone, the log-probabilities too up to the batched matrix
    products' rounding (the choice itself is per row: see test_sampling)."""
    import rksc_engine.runtime.scheduler as scheduler

    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer(), EngineConfig(decode_attention="shared_prefix"))
    params = SamplingParams(max_new_tokens=6)
    prompts = MIXED_LENGTH_PROMPTS[:4]
    alone = [engine.generate(prompt, params) for prompt in prompts]
    per_request = []
    choose = scheduler.choose_next_tokens

    def counted(*args, **kwargs):
        per_request.append(1)
        return choose(*args, **kwargs)

    monkeypatch.setattr(scheduler, "choose_next_tokens", counted)
    with engine.exclusive():
        handles = [engine.submit(prompt, 1, params) for prompt in prompts]
    together = [h.result(timeout=60)[0] for h in handles]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    for got, want in zip(together, alone):
        assert got.logprobs == pytest.approx(want.logprobs, rel=1e-5, abs=1e-5)
    assert len(per_request) == 4, "only each request's first token (from its prefill) is chosen on its own"
