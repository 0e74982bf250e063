"""A soak of many mixed concurrent requests on a tiny model with a cache budget small enough to
force eviction: threads and asyncio tasks, streams abandoned mid-way, cancellations. Afterwards the
cache is within budget, no radix node is left locked, no request is left running, and every answer
equals the same request run alone on a fresh engine."""

import asyncio
import random
import threading

import pytest
from conftest import make_char_tokenizer, make_tiny_model

from rksc_engine import EngineConfig, RKSCEngine, RSBCMConfig, SamplingParams
from rksc_engine.runtime.handle import RequestCancelled

pytestmark = pytest.mark.slow
NUM_REQUESTS = 520
BUDGET_MB = 0.25  # a few thousand tokens of the tiny model's KV: eviction is constant


def make_engine() -> RKSCEngine:
    return RKSCEngine(make_tiny_model(0), make_char_tokenizer(), EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=BUDGET_MB)))


def make_jobs(seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    stems = ["Q: add the numbers ", "Once upon a time ", "Translate: ", "x"]
    jobs = []
    for i in range(NUM_REQUESTS):
        prompt = rng.choice(stems) + "".join(rng.choice("abcdefgh 0123456789") for _ in range(rng.randint(0, 40)))
        sampled = rng.random() < 0.5
        params = SamplingParams(temperature=0.8 if sampled else 0.0, max_new_tokens=rng.randint(1, 12), seed=i,
                                stop=("9",) if rng.random() < 0.2 else ())
        kind = rng.choice(["thread", "thread", "async", "stream", "abandon", "cancel"])
        jobs.append({"prompt": prompt, "n": rng.choice([1, 1, 2, 3]) if kind != "stream" else 1, "params": params,
                     "kind": kind})
    return jobs


def tokens(completions):
    return [c.token_ids for c in completions]


def check_cache_invariants(engine: RKSCEngine) -> None:
    cache = engine.prefix_cache
    assert cache.total_bytes <= cache.budget_bytes, "cache bytes above budget"
    stack, locked = [cache.root], []
    while stack:
        node = stack.pop()
        stack.extend(node.children.values())
        if node is not cache.root and node.lock_ref:
            locked.append(node)
    assert not locked, f"{len(locked)} radix nodes left locked"
    assert engine.stats().running_requests == 0 and engine.stats().waiting_requests == 0


def test_a_soak_of_mixed_concurrent_requests_keeps_every_answer_and_the_cache_consistent():
    jobs = make_jobs()
    engine = make_engine()
    results: dict[int, list] = {}
    errors: list = []
    peak = {"bytes": 0}

    def run_sync(i, job):
        try:
            if job["kind"] == "stream":
                chunks = list(engine.stream(job["prompt"], job["params"]))
                results[i] = [chunks[-1].completion.token_ids]
            elif job["kind"] == "abandon":
                stream = engine.stream(job["prompt"], job["params"])
                next(stream, None)  # read one chunk, then drop it
                del stream
            elif job["kind"] == "cancel":
                handle = engine.submit(job["prompt"], job["n"], job["params"])
                handle.cancel()
                try:
                    handle.result(timeout=60)
                except RequestCancelled:
                    pass
            else:
                results[i] = tokens(engine.generate_branches(job["prompt"], job["n"], job["params"]))
            peak["bytes"] = max(peak["bytes"], engine.prefix_cache.total_bytes)
        except Exception as error:  # reported below
            errors.append((i, repr(error)))

    async def run_async(indices):
        async def one(i):
            job = jobs[i]
            results[i] = tokens(await engine.agenerate_branches(job["prompt"], job["n"], job["params"]))
        await asyncio.gather(*(one(i) for i in indices))

    async_indices = [i for i, j in enumerate(jobs) if j["kind"] == "async"]
    sync_indices = [i for i, j in enumerate(jobs) if j["kind"] != "async"]
    loop_thread = threading.Thread(target=lambda: asyncio.run(run_async(async_indices)))
    loop_thread.start()
    # 8 worker threads, each working through its share of the synchronous jobs.
    shares = [sync_indices[k::8] for k in range(8)]
    workers = [threading.Thread(target=lambda s=s: [run_sync(i, jobs[i]) for i in s]) for s in shares]
    for w in workers:
        w.start()
    for w in workers + [loop_thread]:
        w.join(600)
        assert not w.is_alive(), "the soak deadlocked"
    assert not errors, errors[:5]
    check_cache_invariants(engine)
    assert engine.stats().cache_evicted_tokens > 0, "the budget was not small enough to force eviction"
    assert peak["bytes"] <= engine.prefix_cache.budget_bytes

    reference = make_engine()
    mismatches = [i for i, got in results.items()
                  if got != tokens(reference.generate_branches(jobs[i]["prompt"], jobs[i]["n"], jobs[i]["params"]))]
    assert not mismatches, f"{len(mismatches)} of {len(results)} answers differ from the serial run: {mismatches[:5]}"
    assert len(results) > NUM_REQUESTS // 2
