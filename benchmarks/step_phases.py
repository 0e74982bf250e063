"""Benchmark: where a decode step's time goes, independent requests against sibling branches.

Runs ``batch_curve.py``'s two arms (``rksc_bench.prompts.CHAT_ARMS``: ``--rows`` single-branch chat
requests, and one request of ``--rows`` branches), steps the scheduler from this thread, and times
the step's phases by wrapping the functions that run them: the model forward, the split attention,
the KV write of the batch, the MLP, the norms and the rotary embedding. Wall-clock per decode step,
the admission step (prefill) apart. Unlike ``torch.profiler`` or ``cProfile`` it adds almost nothing
per call, so Python-heavy phases are not inflated.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/step_phases.py
"""

from __future__ import annotations

import argparse
import collections
import functools
import time
from collections.abc import Callable
from typing import Any

from rksc_bench import harness
from rksc_bench.prompts import CHAT_ARMS
from rksc_engine import RKSCEngine, SamplingParams


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_count("--rows", 16, "rows of each arm")
    parser.add_max_new_tokens(64, "tokens per row")
    parser.add_repeats(2, "runs per arm, alternating")
    return parser.parse_args(argv)


def time_phases(engine: RKSCEngine) -> collections.Counter:
    """Wrap each phase's function (on its class or module, for every caller) to add its wall time
    to the returned counter, under the phase's name."""
    from transformers import AttentionInterface

    import rksc_engine.kvcache.batch_decode as batch_decode
    import rksc_engine.kvcache.shared_prefix as shared_prefix
    import rksc_engine.runtime.model_runner as model_runner

    spent: collections.Counter = collections.Counter()

    def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return wrapper

    model_runner.ModelRunner.forward = timed("model forward", model_runner.ModelRunner.forward)
    attention = timed("split attention", shared_prefix.shared_prefix_attention)
    AttentionInterface.register(shared_prefix.ATTENTION_NAME, attention)
    batch_decode.BatchDecodeLayer.update = timed("KV write", batch_decode.BatchDecodeLayer.update)
    modeling = __import__(type(engine.model).__module__, fromlist=["_"])
    for class_name, phase in (("MLP", "MLP"), ("RMSNorm", "norms")):
        for name in dir(modeling):
            cls = getattr(modeling, name)
            if name.endswith(class_name) and isinstance(cls, type) and "forward" in vars(cls):
                cls.forward = timed(phase, cls.forward)
    if hasattr(modeling, "apply_rotary_pos_emb"):
        modeling.apply_rotary_pos_emb = timed("rotary", modeling.apply_rotary_pos_emb)
    return spent


def run_arm(engine: RKSCEngine, name: str, spent: collections.Counter, args: argparse.Namespace) -> dict:
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    engine.clear_cache()
    with engine.exclusive():  # this thread steps the scheduler, so every step is timed here
        handles = CHAT_ARMS[name](engine, args.rows, params)
        start = time.perf_counter()
        engine.scheduler.step()
        admission = time.perf_counter() - start
        spent.clear()
        steps, start = 0, time.perf_counter()
        while not all(h.done() for h in handles):
            engine.scheduler.step()
            steps += 1
        decode = time.perf_counter() - start
    row = {"arm": name, "admission_ms": admission * 1e3, "decode_steps": steps, "step_ms": decode / steps * 1e3}
    row.update({f"{phase}_ms": seconds / steps * 1e3 for phase, seconds in spent.items()})
    return row


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    engine = harness.load_engine(args)
    harness.warm_up(engine)
    spent = time_phases(engine)
    rows = [run_arm(engine, name, spent, args) for _ in range(args.repeats) for name in CHAT_ARMS]
    phases = [key for key in rows[0] if key.endswith("_ms") and key not in ("admission_ms", "step_ms")]
    print(f"{args.rows} rows, {args.max_new_tokens} tokens; ms per decode step (the admission step apart)\n")
    print("| arm | admission step | decode step | " + " | ".join(p[:-3] for p in phases) + " |")
    print("|---|" + "---:|" * (2 + len(phases)))
    for row in rows:
        print(f"| {row['arm']} | {row['admission_ms']:.0f} | {row['step_ms']:.1f} | "
              + " | ".join(f"{row.get(p, 0.0):.1f}" for p in phases) + " |")
    harness.write_json(args.json_out, {"rows": args.rows, "max_new_tokens": args.max_new_tokens, "runs": rows})


if __name__ == "__main__":
    main()
