"""Faults in one request stay in that request: a caller's closed event loop, a hook raising a
``BaseException``, a stream left mid-way, out of memory in a prefill or in a lone decode. Each
test builds the fault and checks that the other requests finish with the tokens they get alone,
and that the engine is usable and consistent afterwards. Nothing here asserts on wall time."""

import asyncio
import threading

import pytest
from conftest import make_char_tokenizer, make_tiny_model, no_locked_nodes, run_out_of_memory_in_a_decode

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import SchedulerConfig
from rksc_engine.kvcache.memory import ForwardOutOfMemoryError
from rksc_engine.runtime.handle import RequestCancelled

GREEDY = SamplingParams(max_new_tokens=12)
SAMPLED = SamplingParams(temperature=0.9, max_new_tokens=12, seed=5)


def engine_for(seed: int = 0, **config) -> RKSCEngine:
    return RKSCEngine(make_tiny_model(seed), make_char_tokenizer(), EngineConfig(**config))


def tokens(completions):
    return [c.token_ids for c in completions]


class Gate:
    """A logits processor that blocks the scheduler's step on its first call until released, so a
    test can arrange what happens 'between' steps by order, not by time."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, _ids, logits):
        self.entered.set()
        assert self.release.wait(60), "the test never released the gate"
        return logits


def test_a_request_awaited_from_a_loop_that_closed_does_not_fail_the_others():
    engine = engine_for()
    want = tokens(engine.generate_branches("the other request", 2, SAMPLED))
    gate = Gate()
    other = engine.submit("the other request", 2, SAMPLED, logits_processor=gate)
    assert gate.entered.wait(60)
    # While the step is held, a caller times out on its own request and closes its loop: the waiter
    # it registered belongs to a closed loop when the scheduler next notifies that request.
    abandoned = engine.submit("abandoned by its caller", 1, SamplingParams(max_new_tokens=40))
    loop = asyncio.new_event_loop()

    async def register_waiter():
        return abandoned._channel.async_waiter()

    loop.run_until_complete(register_waiter())
    loop.close()
    gate.release.set()
    assert tokens(other.result(timeout=120)) == want, "the closed loop's request broke another request"
    assert len(abandoned.result(timeout=120)[0].token_ids) > 0
    assert engine.generate("after", GREEDY).token_ids  # still usable


async def _await(handle):
    return await handle


def test_a_waiter_whose_loop_closed_is_dropped_and_never_notified():
    engine = engine_for()
    gate = Gate()
    handle = engine.submit("slow", 1, SamplingParams(max_new_tokens=30), logits_processor=gate)
    assert gate.entered.wait(60)

    async def time_out():
        try:
            await asyncio.wait_for(_await(handle), 0.01)
        except asyncio.TimeoutError:
            pass

    asyncio.run(time_out())  # wait_for cancels the awaiting task: its waiter future is cancelled
    assert handle.cancelled, "a task cancelled while awaiting its handle must cancel the request"
    assert handle._channel._waiters == [], "the cancelled waiter was left registered"
    gate.release.set()
    with pytest.raises(RequestCancelled):
        handle.result(timeout=120)


class Exit(BaseException):
    """A BaseException that is not an Exception, as a user's hook might raise."""


def test_a_base_exception_from_a_requests_hook_fails_that_request_only():
    engine = engine_for()
    want = tokens(engine.generate_branches("bystander", 2, SAMPLED))
    calls = {"n": 0}

    def explode(_ids, logits):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Exit("hook gave up")
        return logits

    bad = engine.submit("faulty", 1, SamplingParams(max_new_tokens=20), logits_processor=explode)
    good = engine.submit("bystander", 2, SAMPLED)
    with pytest.raises(RuntimeError) as failure:
        bad.result(timeout=120)
    assert isinstance(failure.value.__cause__, Exit), "the caller should see what interrupted its request"
    assert tokens(good.result(timeout=120)) == want
    assert no_locked_nodes(engine)


def test_a_keyboard_interrupt_a_hook_raises_on_the_loop_thread_fails_that_request_only():
    # No signal reaches the scheduler's own thread: a KeyboardInterrupt there is the hook's own raise.
    engine = engine_for()
    want = tokens(engine.generate_branches("bystander", 2, SAMPLED))
    calls = {"n": 0}

    def interrupt(_ids, logits):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return logits

    with engine.exclusive():  # both queued before the loop's first step: they decode in the same steps
        bad = engine.submit("faulty", 1, SamplingParams(max_new_tokens=20), logits_processor=interrupt)
        good = engine.submit("bystander", 2, SAMPLED)
    with pytest.raises(RuntimeError) as failure:
        bad.result(timeout=120)
    assert isinstance(failure.value.__cause__, KeyboardInterrupt)
    assert tokens(good.result(timeout=120)) == want, "the hook's KeyboardInterrupt failed another request"
    assert no_locked_nodes(engine)


def test_ctrl_c_on_the_main_thread_inside_a_hook_stops_the_step_and_fails_its_requests():
    # The main thread drives the steps inside exclusive(): Ctrl-C arrives wherever it is, a hook too.
    assert threading.current_thread() is threading.main_thread()
    engine = engine_for()
    want = engine.generate("exact after", GREEDY).token_ids
    engine.clear_cache()

    def ctrl_c(_ids, logits):
        raise KeyboardInterrupt

    with engine.exclusive():
        hooked = engine.submit("hooked", 1, SamplingParams(max_new_tokens=20), logits_processor=ctrl_c)
        bystander = engine.submit("bystander", 2, SAMPLED)
        with pytest.raises(KeyboardInterrupt):
            for _ in range(50):
                engine.scheduler.step()
    for handle in (hooked, bystander):
        assert handle.done(), "a request of the interrupted step was left waiting"
        with pytest.raises(RuntimeError) as failure:
            handle.result(timeout=30)
        assert isinstance(failure.value.__cause__, KeyboardInterrupt)
    assert engine.generate("exact after", GREEDY).token_ids == want
    assert no_locked_nodes(engine)


def test_a_base_exception_in_the_forward_fails_the_step_s_requests_and_the_loop_serves_the_next():
    engine = engine_for()
    want = engine.generate("next call", GREEDY).token_ids
    engine.clear_cache()
    raised = {"n": 0}

    def hook(*_):
        if raised["n"] == 0:
            raised["n"] += 1
            raise Exit("a model hook exited")

    handle_hook = engine.model.model.layers[0].register_forward_hook(hook)
    try:
        first = engine.submit("stranded?", 2, SAMPLED)
        with pytest.raises(RuntimeError):
            first.result(timeout=120)  # failed, not left waiting forever
    finally:
        handle_hook.remove()
    assert engine.generate("next call", GREEDY).token_ids == want
    assert engine.stats().running_requests == 0 and no_locked_nodes(engine)


def test_ctrl_c_while_waiting_cancels_the_request_and_the_next_call_is_exact(monkeypatch):
    engine = engine_for()
    want = engine.generate("exact after", GREEDY).token_ids
    engine.clear_cache()
    scheduler = engine.scheduler
    real_wait = scheduler.wait_for
    interrupted = {"n": 0}

    def interrupt_once(channel, timeout):
        if interrupted["n"] == 0:
            interrupted["n"] += 1
            raise KeyboardInterrupt
        return real_wait(channel, timeout)

    monkeypatch.setattr(scheduler, "wait_for", interrupt_once)
    with pytest.raises(KeyboardInterrupt):
        engine.generate("interrupted", SamplingParams(max_new_tokens=200))
    monkeypatch.setattr(scheduler, "wait_for", real_wait)
    assert engine.generate("exact after", GREEDY).token_ids == want
    with engine.exclusive():  # after the last step has let go of the engine
        assert engine.stats().running_requests == 0


def test_leaving_a_for_loop_over_a_handle_cancels_the_request():
    engine = engine_for()
    handle = engine.submit("stream me", 1, SamplingParams(max_new_tokens=200), stream=True)
    for _chunk in handle:
        break
    assert handle.cancelled, "breaking out of the loop left the request running"
    with pytest.raises(RequestCancelled):
        handle.result(timeout=120)
    with engine.exclusive():  # the step that failed it may still hold the engine: wait, then read fresh
        assert engine.stats().running_requests == 0


def test_stats_answer_while_another_thread_holds_the_engine():
    engine = engine_for()
    engine.generate("warm", GREEDY)
    inside, release = threading.Event(), threading.Event()

    def hold():
        with engine.exclusive():
            inside.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    assert inside.wait(60)
    answered = []
    reader = threading.Thread(target=lambda: answered.append(engine.stats()))
    reader.start()
    reader.join(30)
    got_it_while_held = bool(answered) and not release.is_set()
    release.set()
    holder.join(30)
    assert got_it_while_held, "stats() waited for the engine lock"
    assert answered[0].decode_tokens >= 1, "the published snapshot lost the counters"


def test_stats_after_a_result_include_that_request():
    engine = engine_for()
    for i in range(5):
        before = engine.stats().decode_tokens
        completion = engine.generate(f"count me {i}", GREEDY)
        after = engine.stats()
        assert after.decode_tokens - before == len(completion.token_ids)
        assert after.running_requests == 0


def test_holds_engine_is_true_only_in_the_holding_thread():
    engine = engine_for()
    assert not engine.holds_engine()
    seen = []
    with engine.exclusive():
        assert engine.holds_engine()
        with engine.exclusive():  # re-entrant
            assert engine.holds_engine()
        assert engine.holds_engine()
        other = threading.Thread(target=lambda: seen.append(engine.holds_engine()))
        other.start()
        other.join()
    assert seen == [False] and not engine.holds_engine()


def test_a_step_never_prefills_more_than_its_token_budget(monkeypatch):
    budget = 16
    engine = engine_for(scheduler=SchedulerConfig(max_prefill_tokens=budget))
    engine.generate("w", GREEDY)  # the one-off shared-prefix probe runs its own forwards: not prefill
    per_step: dict[int, int] = {}
    real_forward = engine.runner.forward

    def counting(input_ids, cache, **kwargs):
        if input_ids.shape[1] > 1 or "logits_to_keep" in kwargs:  # a prefill pass
            step = engine.scheduler.num_steps
            per_step[step] = per_step.get(step, 0) + input_ids.shape[1]
        return real_forward(input_ids, cache, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", counting)
    prompts = ["a long prompt number one, long enough", "another prompt, also long enough to chunk",
               "and a third that needs chunks too"]
    handles = [engine.submit(p, 1, GREEDY) for p in prompts]
    for handle in handles:
        handle.result(timeout=120)
    assert per_step and max(per_step.values()) <= budget, f"prefill tokens per step: {per_step}"
    assert sum(per_step.values()) >= sum(len(engine.encode(p)) for p in prompts) - 3


def test_out_of_memory_in_a_prefill_requeues_it_while_others_run_and_both_stay_exact(monkeypatch):
    # The arrival's own prefill forward, which mixed prefill would fold into the decode's
    # (test_mixed_prefill.py covers running out of memory there).
    engine = engine_for(scheduler=SchedulerConfig(mixed_prefill=False))
    want_long = tokens(engine.generate_branches("running request", 2, SAMPLED))
    want_new = engine.generate("late arrival", GREEDY).token_ids
    engine.clear_cache()
    real_forward = engine.runner.forward
    late_ids = engine.encode("late arrival")
    injected = {"n": 0}

    def oom_on_late_prefill(input_ids, cache, **kwargs):
        if injected["n"] == 0 and input_ids.shape[1] > 1 and input_ids[0].tolist() == late_ids[-input_ids.shape[1]:]:
            injected["n"] += 1
            raise ForwardOutOfMemoryError("injected: no room for this prefill")
        return real_forward(input_ids, cache, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", oom_on_late_prefill)
    gate = Gate()
    running = engine.submit("running request", 2, SAMPLED, logits_processor=gate)
    assert gate.entered.wait(60)
    late = engine.submit("late arrival", 1, GREEDY)
    gate.release.set()
    assert tokens(running.result(timeout=120)) == want_long
    assert late.result(timeout=120)[0].token_ids == want_new, "the requeued prefill changed its tokens"
    assert injected["n"] == 1 and engine.stats().extra.get("preemptions", 0) >= 1
    assert no_locked_nodes(engine)


def test_out_of_memory_in_a_lone_prefill_fails_that_request_and_the_engine_goes_on(monkeypatch):
    engine = engine_for()
    real_forward = engine.runner.forward
    armed = {"on": True}

    def oom(input_ids, cache, **kwargs):
        if armed["on"] and input_ids.shape[1] > 1:
            raise ForwardOutOfMemoryError("injected")
        return real_forward(input_ids, cache, **kwargs)

    monkeypatch.setattr(engine.runner, "forward", oom)
    with pytest.raises(ForwardOutOfMemoryError):
        engine.generate("nothing else could make room", GREEDY)
    armed["on"] = False
    assert engine.generate("fine now", GREEDY).token_ids
    assert no_locked_nodes(engine)


@pytest.mark.parametrize("decode_attention", ["shared_prefix", "dynamic_cache"])
def test_out_of_memory_in_decode_preempts_the_newest_request_on_either_decode_path(monkeypatch, decode_attention):
    engine = engine_for(decode_attention=decode_attention)
    jobs = [("first request", 2, SAMPLED), ("second request", 1, GREEDY)]
    want = [tokens(engine.generate_branches(p, n, params)) for p, n, params in jobs]
    engine.clear_cache()
    run_out_of_memory_in_a_decode(engine, monkeypatch, 3)
    handles = [engine.submit(p, n, params) for p, n, params in jobs]
    assert [tokens(h.result(timeout=120)) for h in handles] == want
    assert engine.stats().extra.get("preemptions", 0) == 1
    assert no_locked_nodes(engine)


def test_a_cancelled_branch_leaves_the_batch_and_the_others_keep_their_tokens():
    engine = engine_for()
    params = SamplingParams(temperature=0.9, max_new_tokens=40, seed=3)
    want = tokens(engine.generate_branches("branches", 4, params))
    engine.clear_cache()
    gate = Gate()
    handle = engine.submit("branches", 4, params, logits_processor=gate)
    assert gate.entered.wait(60)
    handle.cancel_branches([1, 3])
    gate.release.set()
    got = handle.result(timeout=120)
    assert [c.finish_reason for c in got][1::2] == ["cancelled", "cancelled"]
    assert [got[0].token_ids, got[2].token_ids] == [want[0], want[2]]
    for index in (1, 3):
        assert want[index][:len(got[index].token_ids)] == got[index].token_ids
        assert len(got[index].token_ids) < len(want[index]), "the cancelled branch ran to its end"


def test_cancel_branches_rejects_bad_indices_before_anything_changes():
    engine = engine_for()
    handle = engine.submit("x", 2, GREEDY)
    with pytest.raises(TypeError, match="branch_indices"):
        handle.cancel_branches(["0"])
    with pytest.raises(ValueError, match="branch_indices"):
        handle.cancel_branches([-1])
    assert len(handle.result(timeout=120)) == 2
