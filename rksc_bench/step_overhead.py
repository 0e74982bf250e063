"""The host's cost of a decode step: operator calls, Python calls and wall time per step, rksc's
engine against ``transformers``' ``generate`` on the same rows left-padded into one batch.

On a GPU a small model's decode step is the host's work (Python, tensor metadata, kernel launches);
on this CPU the arithmetic hides it. Counting what the host does per step shows it anyway: every
ATen operator call (a ``TorchDispatchMode``) is a kernel launch on a GPU, and every Python call is
interpreter time. Both counts are exact and repeatable, unlike a timing on a shared machine, so
tests can hold them; ``benchmarks/step_overhead.py`` adds the wall time.

A step's cost is what a longer run costs more than a shorter one, divided by the steps between
them, so the prefill and the first token cancel out. Rows never end early: the models' end-of-text
token is turned off for the measurement (``no_end_of_text``), so every row decodes every step.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LAYOUTS = ("siblings", "independent", "mix")


class OperatorCounter(TorchDispatchMode):
    """Counts the ATen operator calls made while it is active (on this thread), by operator."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.by_operator: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.calls += 1
        self.by_operator[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def python_calls() -> Iterator[list[int]]:
    """Counts the Python and builtin function calls made on this thread while the block runs; the
    count is in the yielded list's first item when it ends."""
    count = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            count[0] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield count
    finally:
        sys.setprofile(previous)


@dataclass(frozen=True)
class Workload:
    """The requests of one measurement: ``(prompt, branches)`` each, greedy (``temperature`` 0) or
    all sampled at ``temperature`` with top-p ``SAMPLED_TOP_P``, request ``i`` seeded ``i``."""

    layout: str
    rows: int
    requests: tuple[tuple[str, int], ...]
    temperature: float = 0.0


# The nucleus of a sampled workload, as the ``rksc ask`` job samples.
SAMPLED_TOP_P = 0.95


def workload(layout: str, rows: int, prompts: list[str], temperature: float = 0.0) -> Workload:
    """``rows`` rows laid out as ``layout``: one request of ``rows`` branches (``siblings``), ``rows``
    requests of one branch each (``independent``), or half of each (``mix``); sampled at
    ``temperature`` (0: greedy)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if rows < 1:
        raise ValueError(f"rows must be >= 1, got {rows}")
    if len(prompts) < rows:
        raise ValueError(f"{rows} rows need at least {rows} prompts, got {len(prompts)}")
    if layout == "siblings":
        requests = [(prompts[0], rows)]
    elif layout == "independent":
        requests = [(p, 1) for p in prompts[:rows]]
    else:
        together = rows // 2
        requests = ([(prompts[0], together)] if together else []) + [(p, 1) for p in prompts[1:rows - together + 1]]
    return Workload(layout, rows, tuple(requests), temperature)


@dataclass
class StepCost:
    """What one decode step cost the host, on average over the steps measured."""

    operator_calls: float
    python_calls: float
    ms: float | None = None
    by_operator: dict[str, float] = field(default_factory=dict)


@contextlib.contextmanager
def no_end_of_text(model: Any, tokenizer: Any) -> Iterator[Any]:
    """For the block, turn the model's end-of-text token off (its generation config's), and yield a
    copy of ``tokenizer`` without one, for the engines built in the block: every row then decodes
    to its token limit."""
    config = model.generation_config
    saved = config.eos_token_id
    quiet = copy.deepcopy(tokenizer)
    quiet.eos_token = None
    config.eos_token_id = None
    try:
        yield quiet
    finally:
        config.eos_token_id = saved


def per_step(run: Callable[[int], int], short: int, long: int, *, count_python: bool = True) -> StepCost:
    """The cost of one step of ``run(max_new_tokens) -> steps taken``: the long run's less the
    short run's, over the steps between them (operator calls, Python calls; no timing). A first,
    uncounted short run takes what happens once (probes, buffers, compiled steps)."""
    run(short)
    counts = []
    for tokens in (short, long):
        counter = OperatorCounter()
        with python_calls() if count_python else contextlib.nullcontext([0]) as python, counter:
            steps = run(tokens)
        counts.append((counter, python[0], steps))
    (short_ops, short_py, short_steps), (long_ops, long_py, long_steps) = counts
    steps = long_steps - short_steps
    if steps <= 0:
        raise RuntimeError(f"the long run took {long_steps} steps, the short one {short_steps}")
    by_operator = {name: (long_ops.by_operator[name] - short_ops.by_operator.get(name, 0)) / steps
                   for name in long_ops.by_operator}
    return StepCost((long_ops.calls - short_ops.calls) / steps, (long_py - short_py) / steps,
                    by_operator={k: v for k, v in sorted(by_operator.items(), key=lambda kv: -kv[1]) if v})


def time_per_step(run: Callable[[int], int], short: int, long: int, repeats: int) -> float:
    """Milliseconds per step of ``run``: the fastest long run less the fastest short run, over the
    steps between them."""
    timings = StepTimings()
    for _ in range(repeats):
        timings.add(run, short, long)
    return timings.ms_per_step()


@dataclass
class StepTimings:
    """Wall times of one arm's short and long runs, gathered a pair at a time so that arms can
    alternate; the step's time is the fastest long run less the fastest short run, over the steps
    between them (the fastest run is the one least disturbed by anything else)."""

    best: dict[int, tuple[float, int]] = field(default_factory=dict)

    def add(self, run: Callable[[int], int], short: int, long: int) -> None:
        for tokens in (short, long):
            start = time.perf_counter()
            steps = run(tokens)
            elapsed = time.perf_counter() - start
            if tokens not in self.best or elapsed < self.best[tokens][0]:
                self.best[tokens] = (elapsed, steps)

    def ms_per_step(self) -> float:
        (short_s, short_steps), (long_s, long_steps) = (self.best[t] for t in sorted(self.best))
        return 1000.0 * (long_s - short_s) / max(1, long_steps - short_steps)


def engine_run(engine: Any, work: Workload) -> Callable[[int], int]:
    """``run(max_new_tokens)`` for ``per_step``: the workload's requests on ``engine``, stepped on
    this thread (``exclusive()``), each from a cold prefix cache. Returns the decode steps taken."""
    from rksc_engine import SamplingParams

    def run(max_new_tokens: int) -> int:
        engine.clear_cache()
        sampled = work.temperature > 0
        params = [SamplingParams(max_new_tokens=max_new_tokens, temperature=work.temperature,
                                 top_p=SAMPLED_TOP_P if sampled else 1.0, seed=i if sampled else None)
                  for i in range(len(work.requests))]
        with engine.exclusive():
            before = engine.scheduler.num_steps
            handles = [engine.submit(prompt, n, p) for (prompt, n), p in zip(work.requests, params)]
            results = [h.result() for h in handles]
            steps = engine.scheduler.num_steps - before
        lengths = {len(c.token_ids) for completions in results for c in completions}
        if lengths != {max_new_tokens}:
            raise RuntimeError(f"rows ended early ({sorted(lengths)} tokens): turn end-of-text off (no_end_of_text)")
        return steps

    return run


def generate_run(model: Any, tokenizer: Any, work: Workload) -> Callable[[int], int]:
    """``run(max_new_tokens)`` for ``per_step``: ``transformers``' ``generate`` on the workload's
    rows (each request's prompt once per branch) left-padded into one batch, greedy or sampled as the
    workload is. Returns the
    decode steps (tokens generated per row, less the first, which the prefill's logits give)."""
    prompts = [prompt for prompt, n in work.requests for _ in range(n)]
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        batch = tokenizer(prompts, return_tensors="pt", padding=True).to(model.device)
    finally:
        tokenizer.padding_side = side
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    sampling = (dict(do_sample=True, temperature=work.temperature, top_p=SAMPLED_TOP_P, top_k=0)
                if work.temperature > 0 else dict(do_sample=False))

    def run(max_new_tokens: int) -> int:
        with torch.inference_mode():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=pad, **sampling)
        generated = out.shape[1] - batch["input_ids"].shape[1]
        if generated != max_new_tokens:
            raise RuntimeError(f"generate stopped after {generated} tokens: turn end-of-text off (no_end_of_text)")
        return generated - 1

    return run
