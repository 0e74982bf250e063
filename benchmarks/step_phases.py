"""Benchmark: where a decode step's time goes, independent requests against sibling branches.

Runs ``batch_curve.py``'s two arms (``--rows`` single-branch chat requests, and one request of
``--rows`` branches), steps the scheduler from this thread, and times the step's phases by wrapping
the functions that run them: the model forward, the split attention, the KV write of the batch, the
MLP, the norms and the rotary embedding. Wall-clock per decode step, the admission step (prefill)
apart. Unlike ``torch.profiler`` or ``cProfile`` it adds almost nothing per call, so Python-heavy
phases are not inflated.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/step_phases.py
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from batch_curve import ARMS
from rksc_engine import RKSCEngine, SamplingParams

DEFAULT_JSON_OUT = Path(__file__).resolve().parent / "results" / "step_phases.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="local HF model directory (default: the embedded model)")
    parser.add_argument("--rows", type=int, default=16, help="rows of each arm (default 16)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="tokens per row (default 64)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per arm, alternating (default 2)")
    parser.add_argument("--json-out", type=Path, default=DEFAULT_JSON_OUT)
    args = parser.parse_args(argv)
    for name in ("rows", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


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
        handles = ARMS[name](engine, args.rows, params)
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
    engine = RKSCEngine.from_pretrained(args.model)
    engine.generate("warm up", SamplingParams(max_new_tokens=4))
    spent = time_phases(engine)
    rows = [run_arm(engine, name, spent, args) for _ in range(args.repeats) for name in ARMS]
    phases = [key for key in rows[0] if key.endswith("_ms") and key not in ("admission_ms", "step_ms")]
    print(f"{args.rows} rows, {args.max_new_tokens} tokens; ms per decode step (the admission step apart)\n")
    print("| arm | admission step | decode step | " + " | ".join(p[:-3] for p in phases) + " |")
    print("|---|" + "---:|" * (2 + len(phases)))
    for row in rows:
        print(f"| {row['arm']} | {row['admission_ms']:.0f} | {row['step_ms']:.1f} | "
              + " | ".join(f"{row.get(p, 0.0):.1f}" for p in phases) + " |")
    args.json_out.parent.mkdir(parents=True, exist_ok=True)
    args.json_out.write_text(json.dumps({"rows": args.rows, "max_new_tokens": args.max_new_tokens, "runs": rows},
                                        indent=2))


if __name__ == "__main__":
    main()
