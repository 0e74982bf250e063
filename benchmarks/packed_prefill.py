"""Benchmark: prompts prefilled together, each attending to itself alone against one mask over the pack.

``SchedulerConfig(packed_prefill=True)`` (the default) prefills the prompts one step admits in one
forward. Two ways to attend within it, side by side (arms alternating, cold prefix cache each run,
the fastest of ``--repeats`` reported):

* ``split``: each prompt's queries over its own cached prefix and new tokens
  (``rksc_engine/kvcache/packed_prompts.py``, what the engine does wherever the shared-prefix
  attention runs), so a pack costs what its prompts cost apart;
* ``masked``: the model's own attention over the whole packed row with a block-diagonal mask (the
  engine's fallback for a model whose attention it cannot route), whose cost grows with the square of
  the pack's length.

Workloads: ``tiny``, 8 prompts of 60 to 230 tokens on the tiny llama3 config (``rksc_bench.families``),
where attention is most of a forward; on the model (default: the embedded SmolLM2-135M-Instruct),
``chats``, 8 short chat requests, and ``long``, 8 chat requests of 150 to 260 tokens.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/packed_prefill.py
"""

from __future__ import annotations

import argparse
import time

import torch

from rksc_bench import harness
from rksc_bench.families import char_tokenizer, make_family_model
from rksc_engine import EngineConfig, RKSCEngine

TOPICS = ["rivers", "bread", "stars", "trains", "bees", "glass", "maps", "salt"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_repeats(5, "timed runs per arm; the fastest is reported")
    parser.add_threads()
    return parser.parse_args(argv)


def measure(engine: RKSCEngine, prompts: list[list[int]], repeats: int) -> dict:
    """Milliseconds of one packed forward over ``prompts`` each way, the fastest of ``repeats``."""
    packing = engine.scheduler.prefiller.packing
    access = packing.access
    arms = {"split": packing.split_pass, "masked": packing.masked_pass}
    best = {arm: float("inf") for arm in arms}
    with engine.exclusive(), torch.inference_mode():
        for round_index in range(repeats + 1):  # round 0 warms up (and runs the shared-prefix probe)
            for arm, packed_pass in arms.items():
                engine.clear_cache()
                matches = access.match_prompts(prompts)
                try:
                    start = time.perf_counter()
                    packed_pass(prompts, matches)
                    seconds = time.perf_counter() - start
                finally:
                    access.release_prompts(matches)
                if round_index:
                    best[arm] = min(best[arm], seconds)
    return {"prompts": len(prompts), "tokens": sum(len(p) for p in prompts),
            "split_ms": best["split"] * 1e3, "masked_ms": best["masked"] * 1e3,
            "masked_over_split": best["masked"] / best["split"]}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    tiny = RKSCEngine(make_family_model("llama3"), char_tokenizer(), EngineConfig())
    rows = {"tiny": measure(tiny, [tiny.encode(f"Request {i}: " + "tell me about the mill. " * (2 + i))
                                   for i in range(8)], args.repeats)}
    engine = harness.load_engine(args, progress=False)
    chat = [engine.encode_chat([{"role": "user", "content": f"Write a short paragraph about {t}."}]) for t in TOPICS]
    long = [engine.encode_chat([{"role": "user", "content": f"Question {i}: "
                                 + "Tom has 3 bags of 4 apples, so he has 12. " * (6 + i)}]) for i in range(8)]
    rows["chats"] = measure(engine, chat, args.repeats)
    rows["long"] = measure(engine, long, args.repeats)
    print("| workload | prompts | tokens | split ms | masked ms | masked / split |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        print(f"| {name} | {row['prompts']} | {row['tokens']} | {row['split_ms']:.1f} | {row['masked_ms']:.1f} "
              f"| {row['masked_over_split']:.2f}x |")
    harness.write_json(args.json_out, {"repeats": args.repeats, "rows": rows})


if __name__ == "__main__":
    main()
