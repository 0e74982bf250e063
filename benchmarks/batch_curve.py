"""Benchmark: independent requests against sibling branches of one request, row for row, and where a
decode step's time goes.

Both arms decode the same number of rows, greedy, ``--max-new-tokens`` each, on chat prompts of
about the same length:

* ``independent``: ``rows`` single-branch requests, each its own chat turn, submitted together (the
  plain-chat workload of a server);
* ``siblings``: one request of ``rows`` branches of one chat turn (the multi-branch workload). Greedy
  siblings decode the same tokens, so the rows' work is the same as the independent arm's;
* ``one_by_one``: the independent requests again, on the same model with ``packed_prefill`` off, so
  each prompt is prefilled in a forward of its own;
* ``tails_in_place``: the independent requests again, with ``max_copied_prompt_tail=0``: each
  request's own prompt tokens are read from the prefix cache in place instead of copied in front
  of its suffix, so each request makes two attention calls a layer for its own tokens, not one;
* ``suffixes_apart``: the independent requests again, with ``max_pooled_suffix_tokens=0``: each
  request keeps its generated tokens in buffers of its own, so a step writes the new KV and attends
  to the suffixes with one operation per request and layer, not one per layer;
* ``linear_products``: the independent requests again, with ``EngineConfig(decode_matmul="linear")``:
  the decode step's linear layers compute ``x @ W.T`` as the model's own do, not ``(W @ x.T).T``.

For each batch size (``--rows``, default 1,4,8,16,32,64) it reports decode tokens/s of both arms
and their ratio, measured side by side (arms alternated, prefix cache cleared before each run).
With ``--profile ROWS`` it also runs ``torch.profiler`` over both arms at that size and prints the
top operators by self CPU time: what a step spends per request, beyond the rows.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/batch_curve.py --profile 16
"""

from __future__ import annotations

import argparse
import functools

import torch

from rksc_bench import harness
from rksc_bench.prompts import CHAT_ARMS, submit_independent
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams, SchedulerConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_argument("--rows", type=harness.positive_int_list, default="1,4,8,16,32,64",
                        help="comma-separated batch sizes (default 1,4,8,16,32,64)")
    parser.add_max_new_tokens(64, "tokens per row")
    parser.add_repeats(2)
    parser.add_argument("--profile", type=harness.positive_int, default=None,
                        help="profile one step loop at this many rows")
    return parser.parse_args(argv)


def generated_tokens(engine: RKSCEngine, arm, rows: int, params: SamplingParams) -> int:
    """Submit ``arm``'s requests of ``rows`` rows on ``engine`` and wait: the tokens they generated."""
    return sum(len(c.token_ids) for h in arm(engine, rows, params) for c in h.result())


def curve(engine: RKSCEngine, variants: dict[str, RKSCEngine], args: argparse.Namespace) -> list[dict]:
    """The table; ``variants`` are the same model under other settings (``one_by_one``,
    ``tails_in_place``), each running the independent requests for a column of its own."""
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    runs = {name: (engine, arm) for name, arm in CHAT_ARMS.items()}
    runs.update((name, (variant, submit_independent)) for name, variant in variants.items())
    table = []
    for rows in args.rows:
        arms = {name: functools.partial(generated_tokens, runner, arm, rows, params) for name, (runner, arm) in runs.items()}
        timings = harness.side_by_side(arms, args.repeats, before=lambda name: runs[name][0].clear_cache())
        row = {"rows": rows}
        for name, timing in timings.items():
            row[f"{name}_tok_s"] = timing.result / timing.median_s
            row[f"{name}_tokens"] = timing.result
        row["ratio"] = row["independent_tok_s"] / row["siblings_tok_s"]
        row["packed_gain"] = row["independent_tok_s"] / row["one_by_one_tok_s"]
        row["tail_copy_gain"] = row["independent_tok_s"] / row["tails_in_place_tok_s"]
        row["pool_gain"] = row["independent_tok_s"] / row["suffixes_apart_tok_s"]
        row["weight_left_gain"] = row["independent_tok_s"] / row["linear_products_tok_s"]
        print(f"| {rows} | {row['independent_tok_s']:.1f} | {row['one_by_one_tok_s']:.1f} | "
              f"{row['tails_in_place_tok_s']:.1f} | {row['suffixes_apart_tok_s']:.1f} | {row['siblings_tok_s']:.1f} | "
              f"{row['ratio']:.2f} | {row['suffixes_apart_tok_s'] / row['siblings_tok_s']:.2f} | "
              f"{row['packed_gain']:.2f}x | {row['tail_copy_gain']:.2f}x | {row['pool_gain']:.2f}x | "
              f"{row['linear_products_tok_s']:.1f} | {row['weight_left_gain']:.2f}x |", flush=True)
        table.append(row)
    return table


def profile(engine: RKSCEngine, rows: int, args: argparse.Namespace) -> dict:
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    out = {}
    for name, arm in CHAT_ARMS.items():
        engine.clear_cache()
        # The profiler records the thread it runs on, so this thread drives the steps itself: inside
        # ``exclusive()`` the scheduler's own thread cannot take a step.
        with engine.exclusive():
            handles = arm(engine, rows, params)
            steps = engine.scheduler.num_steps
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                while not all(h.done() for h in handles):
                    engine.scheduler.step()
            steps = engine.scheduler.num_steps - steps
        events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:15]
        total = sum(e.self_cpu_time_total for e in prof.key_averages())
        out[name + "_steps"] = steps
        out[name] = [{"op": e.key, "calls": e.count, "self_cpu_ms": e.self_cpu_time_total / 1e3,
                      "share": e.self_cpu_time_total / total} for e in events]
        print(f"\n{name}, {rows} rows, {steps} steps: top operators by self CPU time (total {total / 1e6:.1f} s, "
              f"{total / 1e3 / steps:.0f} ms a step)")
        print("| op | calls | self CPU ms | share |\n|---|---:|---:|---:|")
        for e in out[name]:
            print(f"| `{e['op']}` | {e['calls']:,} | {e['self_cpu_ms']:.0f} | {e['share']:.1%} |")
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    engine = harness.load_engine(args)
    variants = {
        "one_by_one": RKSCEngine(engine.model, engine.tokenizer,
                                 EngineConfig(scheduler=SchedulerConfig(packed_prefill=False))),
        "tails_in_place": RKSCEngine(engine.model, engine.tokenizer,
                                     EngineConfig(scheduler=SchedulerConfig(max_copied_prompt_tail=0))),
        "suffixes_apart": RKSCEngine(engine.model, engine.tokenizer,
                                     EngineConfig(scheduler=SchedulerConfig(max_pooled_suffix_tokens=0))),
        "linear_products": RKSCEngine(engine.model, engine.tokenizer, EngineConfig(decode_matmul="linear")),
    }
    harness.warm_up(engine, *variants.values())
    print("| rows | independent tok/s | prompts prefilled one by one | own prompt tokens read in place | "
          "suffixes apart | siblings tok/s | independent / siblings | apart / siblings | packed prefill gain | "
          "tail copy gain | pool gain | linear products tok/s | weight-left gain |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    report: dict = {"max_new_tokens": args.max_new_tokens, "curve": curve(engine, variants, args)}
    if args.profile is not None:
        report["profile"] = profile(engine, args.profile, args)
    harness.write_json(args.json_out, report)


if __name__ == "__main__":
    main()
