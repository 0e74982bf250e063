"""Benchmark: many requests at once through the scheduler, against the same requests one at a time.

Arms, each measured side by side in one run (interleaved repeat by repeat, prefix cache cleared
before every timed run, so both arms start equal):

* ``callers``: ``--callers`` threads (default 8), each asking ``--branches`` branches (default 8) of
  its own question after the same few-shot GSM8K-style prompt (default ~1,300 tokens), against the
  same calls made one after another. Sampling is seeded, and a request's tokens do not depend on its
  batch, so both arms generate exactly the same tokens (checked): tokens/s compares like for like.
* ``reasoner``: LangChain ``MultiBranchReasoner.abatch`` of ``--callers`` questions against as many
  sequential ``invoke`` calls (same answers, checked).
* ``tree``: ``engine.tree_search`` (beam 3, breadth 3, depth 4) with every expansion of a level
  submitted together, against one frontier node per call (the same tree, checked).
* ``kv``: KV bytes held while the ``callers`` arm runs: the prefix cache plus what running requests
  hold outside it (``EngineStats.peak_running_kv_bytes``), against one copy of the prompt.

Run it on a quiet machine (ratios only mean something with nothing else running):

    flock /tmp/rksc-bench.lock ./dev python benchmarks/throughput.py
    ./dev python benchmarks/throughput.py --repeats 1 --arms callers   # a quick look
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections.abc import Callable

from rksc_bench import harness
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.workloads import synthetic_problems
from rksc_engine.reasoning.few_shot import Problem, few_shot_messages

ARMS = ("callers", "reasoner", "tree", "kv")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_count("--callers", 8, "concurrent callers")
    parser.add_count("--branches", 8, "branches per caller")
    parser.add_max_new_tokens(32, "tokens per branch")
    parser.add_count("--shots", 8, "few-shot examples in the prompt")
    parser.add_repeats(2)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated subset of {','.join(ARMS)}")
    args = parser.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; valid: {list(ARMS)}")
    return args


def workload(num_questions: int, num_shots: int) -> tuple[list[Problem], list[Problem]]:
    problems = synthetic_problems(num_questions + num_shots, seed=0)
    return problems[num_shots:], problems[:num_shots]


def side_by_side(engine: RKSCEngine, arms: dict[str, Callable[[], object]], repeats: int) -> dict[str, harness.Timings]:
    """``repeats`` interleaved runs of each arm, each on a cleared prefix cache; the last run's result
    of each arm serves the equality checks."""
    return harness.side_by_side(arms, repeats, before=lambda _: engine.clear_cache())


# -- arms ---------------------------------------------------------------------------------------
def callers_arm(engine: RKSCEngine, args: argparse.Namespace) -> dict:
    questions, shots = workload(args.callers, args.shots)
    prompts = [few_shot_messages(q.question, shots) for q in questions]
    params = [SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=args.max_new_tokens, seed=100 * i)
              for i in range(len(prompts))]

    def serial():
        return [[c.token_ids for c in engine.generate_branches(p, args.branches, sp)] for p, sp in zip(prompts, params)]

    def concurrent():
        out: list = [None] * len(prompts)

        def call(i):
            out[i] = [c.token_ids for c in engine.generate_branches(prompts[i], args.branches, params[i])]

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    engine.reset_stats()
    timings = side_by_side(engine, {"serial": serial, "concurrent": concurrent}, args.repeats)
    same = timings["serial"].result == timings["concurrent"].result
    tokens = sum(len(t) for request in timings["serial"].result for t in request)
    prompt_tokens = len(engine.encode(prompts[0]))
    return {
        "callers": args.callers, "branches": args.branches, "prompt_tokens": prompt_tokens,
        "generated_tokens": tokens, "same_tokens": same,
        "serial_s": timings["serial"].median_s, "concurrent_s": timings["concurrent"].median_s,
        "serial_tok_s": tokens / timings["serial"].median_s,
        "concurrent_tok_s": tokens / timings["concurrent"].median_s,
        "speedup": timings["serial"].median_s / timings["concurrent"].median_s,
        "peak_batch_rows": engine.stats().peak_batch_rows,
        "runs_s": {k: v.runs_s for k, v in timings.items()},
    }


def kv_arm(engine: RKSCEngine, args: argparse.Namespace) -> dict:
    questions, shots = workload(args.callers, args.shots)
    prompts = [few_shot_messages(q.question, shots) for q in questions]
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=args.max_new_tokens, seed=0)
    engine.clear_cache()
    engine.reset_stats()
    handles = [engine.submit(p, args.branches, params) for p in prompts]
    for h in handles:
        h.result()
    stats = engine.stats()
    one_prompt = engine.prefix_cache.total_bytes / max(1, engine.prefix_cache.total_tokens) * len(engine.encode(prompts[0]))
    return {
        "prefix_cache_peak_bytes": stats.cache_peak_bytes,
        "running_requests_peak_bytes": stats.peak_running_kv_bytes,
        "one_prompt_bytes": int(one_prompt),
        "total_over_one_prompt": (stats.cache_peak_bytes + stats.peak_running_kv_bytes) / one_prompt,
    }


def reasoner_arm(engine: RKSCEngine, args: argparse.Namespace) -> dict:
    from rksc_integrations.langchain import MultiBranchReasoner

    questions, shots = workload(args.callers, args.shots)
    reasoner = MultiBranchReasoner(engine=engine, n=args.branches, few_shot=shots, max_tokens=args.max_new_tokens,
                                   temperature=0.7, top_p=0.95, seed=0)
    inputs = [q.question for q in questions]

    def sequential():
        return [reasoner.invoke(q).answer for q in inputs]

    def batched():
        return [r.answer for r in asyncio.run(reasoner.abatch(inputs))]

    timings = side_by_side(engine, {"sequential invoke": sequential, "abatch": batched}, args.repeats)
    return {
        "questions": len(inputs), "same_answers": timings["sequential invoke"].result == timings["abatch"].result,
        "sequential_s": timings["sequential invoke"].median_s, "abatch_s": timings["abatch"].median_s,
        "speedup": timings["sequential invoke"].median_s / timings["abatch"].median_s,
    }


def tree_arm(engine: RKSCEngine, args: argparse.Namespace) -> dict:
    questions, shots = workload(1, min(args.shots, 4))
    params = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=args.max_new_tokens, seed=0)

    def search(together: bool):
        result = engine.tree_search(questions[0].question, breadth=3, depth=4, beam=3, params=params,
                                    few_shot=shots, expand_together=together)
        return [(n.parent, n.text) for n in result.nodes]

    timings = side_by_side(engine, {"one node per call": lambda: search(False),
                                    "level together": lambda: search(True)}, args.repeats)
    return {
        "nodes": len(timings["level together"].result),
        "same_tree": timings["one node per call"].result == timings["level together"].result,
        "one_node_s": timings["one node per call"].median_s, "level_s": timings["level together"].median_s,
        "speedup": timings["one node per call"].median_s / timings["level together"].median_s,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    engine = harness.load_engine(args)
    harness.warm_up(engine)
    report: dict[str, dict] = {}
    chosen = args.arms.split(",")
    for name, arm in (("callers", callers_arm), ("reasoner", reasoner_arm), ("tree", tree_arm), ("kv", kv_arm)):
        if name in chosen:
            report[name] = arm(engine, args)
            print(f"{name}: " + json.dumps({k: v for k, v in report[name].items() if k != 'runs_s'},
                                           default=float), flush=True)
    print()
    print("| arm | one at a time | together | ratio | same output |")
    print("|---|---:|---:|---:|---|")
    if "callers" in report:
        r = report["callers"]
        print(f"| {r['callers']} callers x {r['branches']} branches, {r['prompt_tokens']}-token prompt "
              f"| {r['serial_tok_s']:.0f} tok/s | {r['concurrent_tok_s']:.0f} tok/s | **{r['speedup']:.2f}x** "
              f"| {r['same_tokens']} |")
    if "reasoner" in report:
        r = report["reasoner"]
        print(f"| MultiBranchReasoner: {r['questions']} invokes vs abatch | {r['sequential_s']:.1f} s "
              f"| {r['abatch_s']:.1f} s | **{r['speedup']:.2f}x** | {r['same_answers']} |")
    if "tree" in report:
        r = report["tree"]
        print(f"| tree search b3 x3 d4 ({r['nodes']} nodes) | {r['one_node_s']:.1f} s | {r['level_s']:.1f} s "
              f"| **{r['speedup']:.2f}x** | {r['same_tree']} |")
    if "kv" in report:
        r = report["kv"]
        print(f"\nKV while {args.callers} requests share the prompt: prefix cache peak {r['prefix_cache_peak_bytes']:,} B"
              f" + running requests peak {r['running_requests_peak_bytes']:,} B"
              f" = {r['total_over_one_prompt']:.2f}x one prompt's KV ({r['one_prompt_bytes']:,} B)")
    harness.write_json(args.json_out, report)


if __name__ == "__main__":
    main()
