"""Branch control through a ``BranchMonitor``: it sees each branch's tokens as they are sampled, stops
branches (``finish_reason="cancelled"``, rows and KV freed before the next forward) and adds
branches forked off the prompt, which continue the indices and so the seeds: branch ``i`` is
token-identical whether it ran in the first wave or a later one, on either decode path."""

import threading

import pytest
from conftest import make_char_tokenizer, make_tiny_model, run_out_of_memory_in_a_decode

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.results import BranchControl

PARAMS = SamplingParams(temperature=0.9, max_new_tokens=16, seed=21)


def engine_for(**config) -> RKSCEngine:
    return RKSCEngine(make_tiny_model(0), make_char_tokenizer(), EngineConfig(**config))


class Waves:
    """Adds ``wave`` branches each time every running branch has finished, up to ``total``."""

    def __init__(self, first: int, wave: int, total: int):
        self.launched, self.wave, self.total = first, wave, total
        self.running = set(range(first))
        self.seen: list[tuple[int, int]] = []  # (branch, num_tokens) in the order observed

    def observe(self, events):
        for event in events:
            self.seen.append((event.branch_index, event.num_tokens))
            if event.completion is not None:
                self.running.discard(event.branch_index)
        if not self.running and self.launched < self.total:
            add = min(self.wave, self.total - self.launched)
            self.running |= set(range(self.launched, self.launched + add))
            self.launched += add
            return BranchControl(add=add)
        return None


@pytest.mark.parametrize("decode_attention", ["shared_prefix", "dynamic_cache"])
@pytest.mark.parametrize("params", [PARAMS, SamplingParams(max_new_tokens=12)])
def test_branches_added_in_waves_equal_the_same_branches_launched_at_once(decode_attention, params):
    engine = engine_for(decode_attention=decode_attention)
    at_once = engine.generate_branches("Q: fork me\nA:", 6, params)
    engine.clear_cache()
    monitor = Waves(first=2, wave=2, total=6)
    waved = engine.submit("Q: fork me\nA:", 2, params, monitor=monitor, max_branches=6).result(timeout=120)
    assert [c.branch_index for c in waved] == list(range(6))
    assert [c.token_ids for c in waved] == [c.token_ids for c in at_once], "a later wave drew other tokens"
    for w, a in zip(waved, at_once):  # the linear layers saw other batch widths: float noise only
        assert w.logprobs == pytest.approx(a.logprobs, rel=1e-5, abs=1e-5)
    assert engine.stats().extra["branches_added"] == 4
    assert engine.stats().running_requests == 0 and engine.stats().running_kv_bytes == 0


def test_a_monitor_sees_every_token_of_every_branch_in_order():
    engine = engine_for()
    monitor = Waves(first=3, wave=0, total=3)
    completions = engine.submit("watch", 3, PARAMS, monitor=monitor).result(timeout=120)
    for c in completions:
        counts = [k for b, k in monitor.seen if b == c.branch_index]
        assert counts == list(range(1, len(c.token_ids) + 1)), f"branch {c.branch_index} events out of order"


class StopAfter:
    """Stops every other branch once branch 0 has ``tokens`` tokens."""

    def __init__(self, tokens: int):
        self.tokens, self.stopped_at_step = tokens, None
        self.steps = 0

    def observe(self, events):
        self.steps += 1
        for event in events:
            if event.branch_index == 0 and event.num_tokens == self.tokens:
                self.stopped_at_step = self.steps
                return BranchControl(stop=frozenset({1, 2, 3}))
        return None


def test_branches_a_monitor_stops_end_cancelled_at_once_and_free_their_rows():
    engine = engine_for()
    params = SamplingParams(temperature=0.9, max_new_tokens=30, seed=4)
    full = engine.generate_branches("stop some", 4, params)
    engine.clear_cache()
    monitor = StopAfter(tokens=3)
    handle = engine.submit("stop some", 4, params, monitor=monitor, stream=True)
    chunks = list(handle)
    got = handle.result()
    assert got[0].token_ids == full[0].token_ids
    for index in (1, 2, 3):
        if full[index].num_generated_tokens > 3:
            assert got[index].finish_reason == "cancelled"
            assert got[index].token_ids == full[index].token_ids[:3], "a stopped branch decoded past the step"
    last = {c.branch_index: c for c in chunks if c.completion is not None}
    assert {i: c.completion.finish_reason for i, c in last.items()} == {i: g.finish_reason for i, g in enumerate(got)}
    assert engine.stats().extra.get("branches_cancelled", 0) == sum(g.finish_reason == "cancelled" for g in got)


def test_a_monitor_that_raises_fails_its_own_request_only():
    engine = engine_for()
    want = [c.token_ids for c in engine.generate_branches("bystander", 2, PARAMS)]
    engine.clear_cache()

    class Broken:
        def observe(self, events):
            raise ValueError("monitor bug")

    bad = engine.submit("broken monitor", 2, PARAMS, monitor=Broken())
    good = engine.submit("bystander", 2, PARAMS)
    with pytest.raises(ValueError, match="monitor bug"):
        bad.result(timeout=120)
    assert [c.token_ids for c in good.result(timeout=120)] == want


def test_submit_checks_monitor_and_max_branches_before_queuing():
    engine = engine_for()
    with pytest.raises(TypeError, match="monitor"):
        engine.submit("x", 2, PARAMS, monitor=object())
    with pytest.raises(ValueError, match="max_branches"):
        engine.submit("x", 2, PARAMS, monitor=Waves(2, 1, 2), max_branches=1)
    with pytest.raises(ValueError, match="max_branches"):
        engine.submit("x", 2, PARAMS, max_branches=4)  # nobody to add them
    with pytest.raises(TypeError, match="max_branches"):
        engine.submit("x", 2, PARAMS, monitor=Waves(2, 1, 2), max_branches=2.5)
    assert engine.stats().requests == 0


class ForkThenPause:
    """Adds two branches at the first step and stops branch 0 (so only the wave runs on); at the
    wave's third token it waits until the test has asked for a cancellation."""

    def __init__(self):
        self.steps = 0
        self.paused, self.resume = threading.Event(), threading.Event()

    def observe(self, events):
        self.steps += 1
        if self.steps == 1:
            return BranchControl(stop=frozenset({0}), add=2)
        if any(e.branch_index == 1 and e.num_tokens == 3 for e in events):
            self.paused.set()
            assert self.resume.wait(60)
        return None


def test_cancel_branches_reaches_a_wave_after_the_first_wave_has_ended():
    engine = engine_for()
    params = SamplingParams(temperature=0.9, max_new_tokens=40, seed=8)
    full = engine.generate_branches("waves", 3, params)
    engine.clear_cache()
    monitor = ForkThenPause()
    handle = engine.submit("waves", 1, params, monitor=monitor, max_branches=3)
    assert monitor.paused.wait(60)
    handle.cancel_branches([1])
    monitor.resume.set()
    got = handle.result(timeout=120)
    assert got[0].finish_reason == "cancelled" and got[2].token_ids == full[2].token_ids
    if full[1].num_generated_tokens > 4:
        assert got[1].finish_reason == "cancelled", "the caller's cancellation never reached the wave"
        assert len(got[1].token_ids) < full[1].num_generated_tokens


class Counting:
    def __init__(self):
        self.tokens: dict[int, int] = {}

    def observe(self, events):
        for e in events:
            self.tokens[e.branch_index] = self.tokens.get(e.branch_index, 0) + 1
        return None


def test_out_of_memory_never_preempts_a_request_whose_monitor_has_seen_its_tokens(monkeypatch):
    engine = engine_for()
    params = SamplingParams(temperature=0.9, max_new_tokens=16, seed=2)
    want = [c.token_ids for c in engine.generate_branches("watched", 2, params)]
    engine.clear_cache()
    run_out_of_memory_in_a_decode(engine, monkeypatch, 2)
    plain = engine.submit("plain", 1, SamplingParams(max_new_tokens=16))
    monitor = Counting()
    watched = engine.submit("watched", 2, params, monitor=monitor)  # the newest: still not the victim
    got = watched.result(timeout=120)
    plain.result(timeout=120)
    assert [c.token_ids for c in got] == want
    assert monitor.tokens == {c.branch_index: len(c.token_ids) for c in got}, "the monitor saw tokens twice"
