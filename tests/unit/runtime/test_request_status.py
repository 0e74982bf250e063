"""A request's status, which only the scheduler's ``RequestRegistry`` changes: the statuses each kind
of request goes through (a prompt prefilled in passes, a pack, a preemption, a cancellation, a
failing hook, a wave of added branches), the moves the registry refuses, and a step interrupted in
any of its phases failing every request it had admitted while the queued ones wait for the next
step: no caller is left waiting for a step that will not come."""

from __future__ import annotations

import pytest
from conftest import (
    engine_hf_greedy,
    make_char_tokenizer,
    make_tiny_model,
    no_locked_nodes,
    run_out_of_memory_in_a_decode,
)

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import SchedulerConfig
from rksc_engine.results import BranchControl
from rksc_engine.runtime.handle import RequestCancelled, RequestChannel
from rksc_engine.runtime.registry import RequestRegistry
from rksc_engine.runtime.request import Request, RequestStatus

GREEDY = SamplingParams(max_new_tokens=6)
SAMPLED = SamplingParams(temperature=0.9, max_new_tokens=12, seed=5)
LONG = "a prompt long enough to be prefilled in several passes"
BUDGET = 16


def engine_for(**config) -> RKSCEngine:
    return RKSCEngine(make_tiny_model(0), make_char_tokenizer(), EngineConfig(**config))


class StatusLog:
    """Every status the registry gives each request, in order, recorded as the registry sets it."""

    def __init__(self, engine: RKSCEngine, monkeypatch: pytest.MonkeyPatch) -> None:
        registry = engine.scheduler.requests
        self.by_request: dict[int, list[str]] = {}
        self.order: list[tuple[int, str]] = []
        add, move = registry.add, registry.move

        def recording_add(request, status=RequestStatus.WAITING):
            add(request, status)
            self._record(request)

        def recording_move(request, status, *, first=False):
            live = request.status is not None and request.status.live
            move(request, status, first=first)
            if live:  # ending an ended request again changes nothing
                self._record(request)

        monkeypatch.setattr(registry, "add", recording_add)
        monkeypatch.setattr(registry, "move", recording_move)

    def _record(self, request: Request) -> None:
        self.by_request.setdefault(request.request_id, []).append(request.status.name)
        self.order.append((request.request_id, request.status.name))


# -- the statuses each kind of request goes through ----------------------------------------------
def test_a_long_prompt_is_prefilled_a_pass_a_step_then_runs_and_finishes(monkeypatch):
    engine = engine_for(scheduler=SchedulerConfig(max_prefill_tokens=8))
    log = StatusLog(engine, monkeypatch)
    handle = engine.submit(LONG, 1, GREEDY)
    got = handle.result(timeout=120)[0]
    passes = -(-len(engine.encode(LONG)) // 8)
    assert passes >= 3, "test setup: the prompt must take several passes"
    # Each pass but the last sends it to the back of the prefilling ones, PREFILLING again.
    assert log.by_request[handle.request_id] == ["WAITING", "ADMITTED", *["PREFILLING"] * passes, "RUNNING",
                                                 "FINISHED"]
    assert got.token_ids == engine_hf_greedy(engine, LONG, 6)
    assert engine.scheduler.requests.live() == []


def test_prompts_admitted_together_are_packed_prefilled_in_one_forward_and_run(monkeypatch):
    engine = engine_for()
    log = StatusLog(engine, monkeypatch)
    prompts = ["first", "second", "third"]
    with engine.exclusive():
        handles = [engine.submit(p, 1, GREEDY) for p in prompts]
        engine.scheduler.step()
        running = engine.scheduler.requests.of(RequestStatus.RUNNING)
        assert [r.request_id for r in running] == [h.request_id for h in handles], "they run in the order they came"
    for prompt, handle in zip(prompts, handles):
        assert handle.result(timeout=120)[0].token_ids == engine_hf_greedy(engine, prompt, 6)
        assert log.by_request[handle.request_id] == ["WAITING", "ADMITTED", "PACKED", "RUNNING", "FINISHED"]
    assert engine.stats().extra.get("packed_prefills") == 1


def test_a_request_preempted_by_out_of_memory_waits_at_the_head_of_the_queue_then_runs_again(monkeypatch):
    engine = engine_for()
    jobs = [("first request", 2, SAMPLED), ("second request", 1, GREEDY)]
    want = [[c.token_ids for c in engine.generate_branches(p, n, params)] for p, n, params in jobs]
    engine.clear_cache()
    log = StatusLog(engine, monkeypatch)
    run_out_of_memory_in_a_decode(engine, monkeypatch, 3)
    with engine.exclusive():
        handles = [engine.submit(p, n, params) for p, n, params in jobs]
    assert [[c.token_ids for c in h.result(timeout=120)] for h in handles] == want
    first, second = (log.by_request[h.request_id] for h in handles)
    assert first == ["WAITING", "ADMITTED", "PACKED", "RUNNING", "FINISHED"], "the older request was preempted"
    # The newest is the victim; packed alone on its return, it takes the usual path through PREFILLING.
    assert second == ["WAITING", "ADMITTED", "PACKED", "RUNNING", "WAITING", "ADMITTED", "PACKED", "PREFILLING",
                      "RUNNING", "FINISHED"]
    assert engine.stats().extra.get("preemptions") == 1


def test_cancelled_requests_end_cancelled_whether_queued_or_running(monkeypatch):
    engine = engine_for()
    log = StatusLog(engine, monkeypatch)
    with engine.exclusive():
        running = engine.submit("running", 1, SamplingParams(max_new_tokens=40))
        engine.scheduler.step()
        queued = engine.submit("queued", 1, GREEDY)
        running.cancel()
        queued.cancel()
        engine.scheduler.step()
        assert engine.scheduler.requests.live() == [], "a cancelled request is still registered"
    for handle in (running, queued):
        with pytest.raises(RequestCancelled):
            handle.result(timeout=10)
    assert log.by_request[queued.request_id] == ["WAITING", "CANCELLED"]
    # Alone in its pack, its prompt takes the usual path.
    assert log.by_request[running.request_id] == ["WAITING", "ADMITTED", "PACKED", "PREFILLING", "RUNNING",
                                                  "CANCELLED"]
    assert no_locked_nodes(engine)


def test_a_request_whose_hook_fails_ends_failed_and_frees_what_it_held(monkeypatch):
    engine = engine_for()
    log = StatusLog(engine, monkeypatch)

    def fails_on_the_third_token(ids, logits):
        if len(ids[0]) == 2:
            raise ValueError("the hook failed")
        return logits

    handle = engine.submit("a hook that fails", 1, GREEDY, logits_processor=fails_on_the_third_token)
    with pytest.raises(ValueError, match="the hook failed"):
        handle.result(timeout=60)
    assert log.by_request[handle.request_id] == ["WAITING", "ADMITTED", "PACKED", "PREFILLING", "RUNNING", "FAILED"]
    assert engine.scheduler.requests.live() == [] and no_locked_nodes(engine)
    assert engine.stats().running_kv_bytes == 0


class AddsOneBranch:
    """A monitor that adds one branch the first time it is asked, and, once ``armed``, another."""

    def __init__(self) -> None:
        self.calls, self.armed = 0, False

    def observe(self, events):
        self.calls += 1
        return BranchControl(add=1) if self.calls == 1 or self.armed else None


def test_a_wave_of_added_branches_runs_from_its_birth_and_its_owner_finishes_after_it(monkeypatch):
    engine = engine_for()
    params = SamplingParams(temperature=0.9, max_new_tokens=8, seed=3)
    want = [c.token_ids for c in engine.generate_branches("waves", 2, params)]
    engine.clear_cache()
    log = StatusLog(engine, monkeypatch)
    handle = engine.submit("waves", 1, params, monitor=AddsOneBranch(), max_branches=2)
    assert [c.token_ids for c in handle.result(timeout=120)] == want
    waves = [request_id for request_id in log.by_request if request_id != handle.request_id]
    assert len(waves) == 1, f"one wave expected, saw {log.by_request}"
    assert log.by_request[waves[0]] == ["RUNNING", "FINISHED"]
    assert log.by_request[handle.request_id] == ["WAITING", "ADMITTED", "PACKED", "PREFILLING", "RUNNING", "FINISHED"]
    assert log.order[-1] == (handle.request_id, "FINISHED"), "the owner finished before its wave"


# -- the registry refuses what no request may do -----------------------------------------------------
def make_request(request_id: int) -> Request:
    return Request(request_id, [1, 2, 3], 1, GREEDY, RequestChannel(), False, None, 0)


def test_the_registry_allows_only_the_moves_a_request_can_make():
    registry = RequestRegistry()
    request = make_request(0)
    with pytest.raises(RuntimeError, match="cannot be registered"):
        registry.add(request, RequestStatus.PREFILLING)
    registry.add(request)
    with pytest.raises(RuntimeError, match="cannot be registered"):
        registry.add(request)
    with pytest.raises(RuntimeError, match="from WAITING to RUNNING"):
        registry.move(request, RequestStatus.RUNNING)
    with pytest.raises(RuntimeError, match="cannot finish from WAITING"):
        registry.move(request, RequestStatus.FINISHED)
    assert request.status is RequestStatus.WAITING and registry.of(RequestStatus.WAITING) == [request]
    registry.move(request, RequestStatus.FAILED)
    registry.move(request, RequestStatus.CANCELLED)  # ending it again changes nothing
    assert request.status is RequestStatus.FAILED and registry.live() == [] and not registry
    with pytest.raises(RuntimeError, match="has ended"):
        registry.move(request, RequestStatus.WAITING)


def test_a_preempted_request_goes_to_the_head_of_the_queue_and_a_pass_to_the_back_of_the_prefilling():
    registry = RequestRegistry()
    requests = [make_request(i) for i in range(3)]
    for request in requests:
        registry.add(request)
    for request in requests:
        registry.move(request, RequestStatus.ADMITTED)
        registry.move(request, RequestStatus.PREFILLING)
    registry.move(requests[0], RequestStatus.PREFILLING)  # a pass done, more to go
    assert registry.of(RequestStatus.PREFILLING) == [requests[1], requests[2], requests[0]]
    later = make_request(3)
    registry.add(later)
    registry.move(requests[2], RequestStatus.WAITING, first=True)
    assert registry.of(RequestStatus.WAITING) == [requests[2], later]
    assert registry.admitted() == [requests[1], requests[0]]
    assert registry.members(requests[1]) == [requests[1]]


# -- a step interrupted in any phase -----------------------------------------------------------------
def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def with_a_running_and_a_prefilling_request(engine: RKSCEngine, running_kwargs=None):
    """Steps ``engine`` (held) until one request runs and a long one is half prefilled, then queues
    one that the next step cannot admit (its budget goes to the long prompt's next pass)."""
    running = engine.submit("running", 2, SAMPLED, **(running_kwargs or {}))
    engine.scheduler.step()
    prefilling = engine.submit(LONG, 1, GREEDY)
    engine.scheduler.step()
    waiting = engine.submit("waiting", 1, GREEDY)
    return [running, prefilling], [(waiting, "waiting")]


def fault_in_reap(engine, monkeypatch):
    admitted, waiting = with_a_running_and_a_prefilling_request(engine)
    monkeypatch.setattr(admitted[0]._channel, "take_branch_cancellations", interrupt)
    admitted[0]._channel.asks_to_stop = True  # as cancel_branches leaves it: the reap takes its branches
    return admitted, waiting


def fault_in_a_prefill_pass(engine, monkeypatch):
    admitted, waiting = with_a_running_and_a_prefilling_request(engine)
    real_forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda ids, cache, **kw: interrupt() if ids.shape[1] > 1
                        else real_forward(ids, cache, **kw))
    return admitted, waiting


def fault_in_the_decode_forward(engine, monkeypatch):
    admitted, waiting = with_a_running_and_a_prefilling_request(engine)
    monkeypatch.setattr(engine.runner, "decode_forward", interrupt)
    return admitted, waiting


def fault_in_a_hook(engine, monkeypatch):
    armed = {"on": False}

    def hook(ids, logits):
        if armed["on"]:
            raise KeyboardInterrupt
        return logits

    admitted, waiting = with_a_running_and_a_prefilling_request(engine, {"logits_processor": hook})
    armed["on"] = True
    return admitted, waiting


def fault_when_a_wave_forks(engine, monkeypatch):
    monitor = AddsOneBranch()
    admitted, waiting = with_a_running_and_a_prefilling_request(engine, {"monitor": monitor, "max_branches": 4})
    monitor.armed = True
    monkeypatch.setattr(engine.scheduler.kv, "fork_cache", interrupt)
    return admitted, waiting


def fault_in_the_packed_forward(engine, monkeypatch):
    running = engine.submit("running", 2, SAMPLED)
    engine.scheduler.step()
    packed = [engine.submit(p, 1, GREEDY) for p in ("cc", "dd")]
    waiting = engine.submit("the budget has no room", 1, GREEDY)
    monkeypatch.setattr(engine.scheduler.prefiller.packing, "packed_pass", interrupt)
    return [running, *packed], [(waiting, "the budget has no room")]


def fault_when_a_prompt_starts(engine, monkeypatch):
    running = engine.submit("running", 2, SAMPLED)
    engine.scheduler.step()
    arriving = engine.submit("arriving", 1, GREEDY)
    waiting = engine.submit("the budget has no room", 1, GREEDY)
    monkeypatch.setattr(engine.scheduler.kv, "decode_cache", interrupt)
    return [running, arriving], [(waiting, "the budget has no room")]


@pytest.mark.parametrize("arrange", [fault_in_reap, fault_in_a_prefill_pass, fault_in_the_packed_forward,
                                     fault_when_a_prompt_starts, fault_in_the_decode_forward, fault_in_a_hook,
                                     fault_when_a_wave_forks])
def test_an_interrupted_step_fails_every_admitted_request_and_the_queued_ones_run_later(monkeypatch, arrange):
    engine = engine_for(scheduler=SchedulerConfig(max_prefill_tokens=BUDGET))
    with engine.exclusive():
        admitted, waiting = arrange(engine, monkeypatch)
        with pytest.raises(KeyboardInterrupt):
            engine.scheduler.step()
        registry = engine.scheduler.requests
        assert registry.admitted() == [], f"left registered: {[(r.request_id, r.status) for r in registry.admitted()]}"
        assert [r.request_id for r in registry.of(RequestStatus.WAITING)] == [h.request_id for h, _ in waiting]
        for handle in admitted:
            assert handle.done(), f"request {handle.request_id} was left waiting for a step that will not come"
            with pytest.raises(RuntimeError) as failure:
                handle.result(timeout=10)
            assert isinstance(failure.value.__cause__, KeyboardInterrupt)
        assert no_locked_nodes(engine)
    monkeypatch.undo()
    for handle, prompt in waiting:
        assert handle.result(timeout=120)[0].token_ids == engine_hf_greedy(engine, prompt, 6)
    with engine.exclusive():  # after the last step has let go of the engine
        stats = engine.stats()
        assert stats.running_requests == 0 and stats.waiting_requests == 0 and stats.running_kv_bytes == 0
    assert no_locked_nodes(engine)
