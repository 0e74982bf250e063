"""Benchmark: drafting from the prompt, the sibling branches and the radix cache
(``SchedulerConfig.draft_tokens``).

Per workload and arm: decode tokens/s with and without drafting side by side (arms alternating
within each repeat, the prompt cached so a run is its decode), whether every arm's tokens equal
the arm without drafting, and per source the draft tokens proposed and accepted, the verifying
forwards and the forwards saved (the request's, whose longest branch sets its count). Arms: drafting
off, and each ``k`` of ``--ks`` with each source set of ``--sources``, per decode layout of
``--layouts``. ``--curve`` adds the cost of one verifying forward by rows and positions a row.

Workloads: ``few-shot``: the ``rksc ask`` job on the default model (its 8-shot synthetic GSM8K-style
prompt and question, 8 branches sampled at temperature 0.7, top-p 0.95, ``<|im_end|>`` as the stop
string, no monitor, no CGEE); ``ladder`` (``--ladder``): the ladder's 8 questions asked that way, one
after the other; ``agent turns`` (``--agent``): a tool-calling loop's greedy turns on
the default model (``agent_job``); ``tiny``: the same chat prompt's worked examples as plain text on
tiny-config families (``--families``), where a forward costs almost nothing and a step is host
cost, the GPU's stand-in. Times only mean something with nothing else running:

    flock /tmp/rksc-bench.lock ./dev python benchmarks/drafting.py
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from rksc_bench import harness
from rksc_bench.families import char_tokenizer, make_family_model
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams, SchedulerConfig
from rksc_engine.config import DRAFT_SOURCES
from rksc_engine.evaluation.workloads import LADDER_LEVELS, ladder_problems, ladder_shots, synthetic_problems
from rksc_engine.kvcache.cache_layers import new_kv_cache
from rksc_engine.kvcache.static_rows import StaticRowPool
from rksc_engine.reasoning.few_shot import few_shot_messages

QUESTION = "A farmer has 17 sheep and buys 3 times as many goats as sheep. How many animals does he have?"
SOURCE_SETS = {"prompt": ("prompt",), "siblings": ("siblings",), "both": ("prompt", "siblings"), "cache": ("cache",),
               "all": DRAFT_SOURCES}
# The agent workload: a tool described in the system message, and the items it is asked about.
AGENT_SYSTEM = ("You are a shopping assistant with one tool. To look up a price, answer with one line of JSON and "
                'nothing else, for example: {"tool": "get_price", "item": "apples"}')
AGENT_ITEMS = ("apples", "bread", "milk", "eggs", "apples", "coffee")
# One worked turn before the first question, as a tool-calling prompt shows the model its format.
AGENT_EXAMPLE = ({"role": "user", "content": "What does rice cost?"},
                 {"role": "assistant", "content": '{"tool": "get_price", "item": "rice"}'})
# Characters (one token each) of the tiny families' context window (1,024) a prompt may take.
TINY_CONTEXT_CHARS = 1000
COUNTERS = ("decode_tokens", "drafted_tokens", "accepted_draft_tokens", "rejected_draft_tokens", "draft_forwards",
            "draft_steps_saved")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_argument("--families", nargs="*", default=["llama3", "qwen2.5", "gemma2"],
                        help="tiny-config families (default llama3 qwen2.5 gemma2; none: skip the tiny workload)")
    parser.add_argument("--no-default-model", action="store_true", help="skip the few-shot job on the default model")
    parser.add_argument("--ks", type=harness.positive_int_list, default=[2, 4, 8],
                        help="comma-separated draft lengths (default 2,4,8)")
    parser.add_argument("--sources", default="prompt,siblings,both",
                        help=f"comma-separated source sets, of {list(SOURCE_SETS)} (default prompt,siblings,both)")
    parser.add_count("--branches", 8, "branches of the request")
    parser.add_count("--shots", 8, "worked examples in the prompt")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7; 0 greedy)")
    parser.add_max_new_tokens(160)
    parser.add_seed()
    parser.add_repeats(3)
    parser.add_argument("--layouts", default="shared_prefix",
                        help="comma-separated decode layouts (EngineConfig.decode_attention), of "
                             f"{list(LAYOUTS)}; each has its arm without drafting (default shared_prefix)")
    parser.add_argument("--ladder", action="store_true",
                        help="also run the ladder's 8 questions (2 per level) as the few-shot job runs its one")
    parser.add_argument("--agent", action="store_true",
                        help="also run an agent's tool-call turns on the default model (greedy, one branch, the "
                             "conversation sent again each turn, the loop run twice; the cache cleared before each run)")
    parser.add_argument("--curve", action="store_true",
                        help="also time one verifying forward of the default model over static rows, by rows "
                             "(1, 2, 4, 8) and positions a row (1, 3, 5, 9), the few-shot prompt's KV in each row")
    parser.add_threads()
    args = parser.parse_args(argv)
    args.layouts = args.layouts.split(",")
    if any(layout not in LAYOUTS for layout in args.layouts):
        parser.error(f"--layouts must name layouts of {list(LAYOUTS)}, got {args.layouts}")
    args.sources = args.sources.split(",")
    unknown = [s for s in args.sources if s not in SOURCE_SETS]
    if unknown:
        parser.error(f"--sources must name source sets of {list(SOURCE_SETS)}, got {unknown}")
    return args


def arm_configs(args: argparse.Namespace) -> dict[str, EngineConfig]:
    """The arms, per decode layout: ``off``, then ``k<k>-<sources>`` for every draft length and
    source set (named with the layout, ``static`` for static rows, after the first layout's)."""
    arms = {}
    for layout in args.layouts:
        suffix = "" if layout == args.layouts[0] else f" {LAYOUTS[layout]}"
        arms[f"off{suffix}"] = EngineConfig(decode_attention=layout)
        for k in args.ks:
            for name in args.sources:
                arms[f"k{k}-{name}{suffix}"] = EngineConfig(
                    decode_attention=layout, scheduler=SchedulerConfig(draft_tokens=k, draft_sources=SOURCE_SETS[name]))
    return arms


def counters(engine: RKSCEngine) -> dict[str, float]:
    stats = engine.stats()
    found: dict[str, float] = {name: getattr(stats, name) for name in COUNTERS}
    found.update({name: value for name, value in stats.extra.items() if "draft" in name})
    return found


# The decode layouts that draft, and what an arm's name calls them.
LAYOUTS = {"shared_prefix": "shared", "static_rows": "static"}


def measure(label: str, engine: RKSCEngine, job: Callable[[RKSCEngine], list[tuple[int, ...]]],
            args: argparse.Namespace, before: Callable[[], object] | None = None) -> dict[str, Any]:
    """Every arm running ``job`` on ``engine`` (its config swapped per run; ``before`` untimed ahead
    of each run), arms alternating within each repeat."""
    configs = arm_configs(args)
    deltas: dict[str, list[dict[str, float]]] = {arm: [] for arm in configs}

    def run(arm: str) -> list[tuple[int, ...]]:
        engine.config = configs[arm]
        before_counts = counters(engine)
        tokens = job(engine)
        after = counters(engine)
        deltas[arm].append({name: after.get(name, 0) - before_counts.get(name, 0) for name in after})
        return tokens

    timings = harness.side_by_side({arm: (lambda arm=arm: run(arm)) for arm in configs}, args.repeats,
                                   before=None if before is None else (lambda arm: before()))

    # Each arm's arm without drafts: the one of its decode layout.
    layout_off = {arm: next(other for other, plain in configs.items() if plain.scheduler.draft_tokens == 0
                            and plain.decode_attention == config.decode_attention)
                  for arm, config in configs.items()}
    cells = []
    for arm, timing in timings.items():
        delta = deltas[arm][-1]
        seconds = min(timing.runs_s)
        drafted = delta["drafted_tokens"]
        want = timings[layout_off[arm]].results[0]
        cell = {"workload": label, "arm": arm, "identical": all(result == want for result in timing.results),
                "runs_s": [round(s, 4) for s in timing.runs_s], "decode_tokens_per_s": delta["decode_tokens"] / seconds,
                "acceptance": delta["accepted_draft_tokens"] / drafted if drafted else None, **delta}
        cells.append(cell)
    by_arm = {cell["arm"]: cell for cell in cells}
    for cell in cells:
        cell["speedup"] = cell["decode_tokens_per_s"] / by_arm["off"]["decode_tokens_per_s"]
        cell["speedup_in_layout"] = cell["decode_tokens_per_s"] / by_arm[layout_off[cell["arm"]]]["decode_tokens_per_s"]
        print(format_cell(cell), flush=True)
    return {"workload": label, "cells": cells}


def cached(engine: RKSCEngine, prompts: list[Any]) -> Callable[[], None]:
    """A ``before`` for ``measure``: the cache cleared, then ``prompts`` cached, so every run is its
    decode and no run finds an earlier run's answer in the cache (the ``"cache"`` source's)."""
    def before() -> None:
        engine.clear_cache()
        for prompt in prompts:
            engine.warm_cache(prompt)
    return before


def branches_job(prompt: Any, args: argparse.Namespace) -> Callable[[RKSCEngine], list[tuple[int, ...]]]:
    """``--branches`` branches of ``prompt``, sampled as the ``rksc ask`` job samples them."""
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=0.95,
                            seed=args.seed, stop=("<|im_end|>",))
    return lambda engine: [c.token_ids for c in engine.generate_branches(prompt, args.branches, params)]


def ladder_job(args: argparse.Namespace) -> tuple[list[Any], Callable[[RKSCEngine], list[tuple[int, ...]]]]:
    """The ladder's 8 questions (2 per level, ``ladder_problems`` seed 0) each asked as the few-shot
    job asks its question (``branches_job``), one after the other; returns the prompts and the job."""
    shots = ladder_shots(args.shots, seed=1)
    prompts = [few_shot_messages(problem.question, shots) for problem in ladder_problems(2, LADDER_LEVELS, seed=0)]
    jobs = [branches_job(prompt, args) for prompt in prompts]
    return prompts, lambda engine: [tokens for job in jobs for tokens in job(engine)]


def agent_job(engine: RKSCEngine) -> list[tuple[int, ...]]:
    """An agent's tool-call turns, greedy, as a tool-calling loop sends them: each turn's request is
    the whole conversation so far (the model's earlier calls, each tool result, the next question),
    and the model answers with a one-line JSON call. The loop runs twice over the same items (an agent
    re-run on the same input), so its second pass meets contexts the cache has seen."""
    params = SamplingParams(max_new_tokens=40, stop=("<|im_end|>",))
    tokens = []
    for _ in range(2):
        messages = [{"role": "system", "content": AGENT_SYSTEM}, *AGENT_EXAMPLE]
        question = f"Result: 0.99 dollars. What does {AGENT_ITEMS[0]} cost?"
        for turn in range(len(AGENT_ITEMS)):
            messages.append({"role": "user", "content": question})
            answer = engine.generate(messages, params)
            tokens.append(answer.token_ids)
            messages.append({"role": "assistant", "content": answer.text})
            if turn + 1 < len(AGENT_ITEMS):
                question = f"Result: {1.25 + turn:.2f} dollars. What does {AGENT_ITEMS[turn + 1]} cost?"
    return tokens


def verify_curve(engine: RKSCEngine, messages: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Milliseconds of one verifying forward (``StaticStep.drafted_logits``) by rows and positions a
    row, each row holding the prompt's KV: what a drafted step costs against an ordinary one (one
    position), which is what a draft must save to pay. Arms alternate; the median of ``--repeats``."""
    engine.config = EngineConfig(decode_attention="static_rows")
    engine.runner.decode_layout()  # builds the static step
    step, model, tokenizer = engine.runner.static_step, engine.model, engine.tokenizer
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]], device=model.device)
    kept = new_kv_cache(model.config)
    with torch.inference_mode():
        model(input_ids=prompt, past_key_values=kept, use_cache=True)
    kv = [(layer.keys, layer.values) for layer in kept.layers]
    cells, last = [], engine.context_window - 1

    def verify_forward(pool: StaticRowPool, rows: int, width: int) -> Callable[[], Any]:
        return lambda: step.drafted_logits(pool, torch.full((rows, width), 7, device=model.device), last)

    for rows in (1, 2, 4, 8):
        pool = StaticRowPool(prompt.device, next(model.parameters()).dtype)
        pool.reserve(rows, prompt.shape[1] + 16, [(k.shape[1], k.shape[3]) for k, _ in kv])
        pool.write_prompt(pool.rows(rows).slots, kv)
        arms = {width: verify_forward(pool, rows, width) for width in (1, 3, 5, 9)}
        timings = harness.side_by_side(arms, max(args.repeats, 5))
        one = statistics.median(timings[1].runs_s)
        for width, timing in timings.items():
            ms = statistics.median(timing.runs_s) * 1000
            cells.append({"rows": rows, "positions": width, "prompt_tokens": prompt.shape[1], "ms": ms,
                          "vs_one_position": ms / (one * 1000)})
            print(f"verify forward: {rows} rows x {width} positions: {ms:7.1f} ms ({ms / (one * 1000):.2f}x one position)",
                  flush=True)
    return cells


def format_cell(cell: dict[str, Any]) -> str:
    acceptance = "    -" if cell["acceptance"] is None else f"{cell['acceptance']:5.1%}"
    return (f"{cell['workload']:>16} {cell['arm']:>21}: {cell['decode_tokens_per_s']:8.1f} tok/s "
            f"({cell['speedup']:.2f}x, {cell['speedup_in_layout']:.2f}x its layout's off) identical={cell['identical']!s:>5} | accepted {acceptance} of "
            f"{cell['drafted_tokens']:5.0f} drafted | {cell['draft_forwards']:4.0f} verifying forwards, "
            f"{cell['draft_steps_saved']:4.0f} forwards saved")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    torch.manual_seed(0)
    shots = synthetic_problems(args.shots, seed=1)
    results, curve = [], []
    if not args.no_default_model:
        engine = harness.load_engine(args)
        harness.warm_up(engine)
        prompt = few_shot_messages(QUESTION, shots)
        results.append(measure("few-shot", engine, branches_job(prompt, args), args, before=cached(engine, [prompt])))
        if args.ladder:
            prompts, job = ladder_job(args)
            results.append(measure("ladder", engine, job, args, before=cached(engine, prompts)))
        if args.agent:
            results.append(measure("agent turns", engine, agent_job, args, before=engine.clear_cache))
        if args.curve:
            curve = verify_curve(engine, few_shot_messages(QUESTION, shots), args)
    text = f"Q: {QUESTION}\nA:"
    for shot in reversed(shots):  # as many worked examples as the tiny models' context leaves room for
        example = f"Q: {shot.question}\nA: {shot.solution}\n\n"
        if len(example) + len(text) + args.max_new_tokens > TINY_CONTEXT_CHARS:
            break
        text = example + text
    for name in args.families:
        engine = RKSCEngine(make_family_model(name), char_tokenizer())
        results.append(measure(f"tiny {name}", engine, branches_job(text, args), args, before=cached(engine, [text])))
    harness.write_json(args.json_out, {"arguments": vars(args), "workloads": results, "verify_curve": curve})


if __name__ == "__main__":
    main()
