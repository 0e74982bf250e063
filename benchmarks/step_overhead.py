"""Benchmark: the host's cost of a decode step, rksc's decode layouts against ``transformers``' ``generate``.

Per decode step: ATen operator calls (each one a kernel launch on a GPU), Python calls, and wall
milliseconds; by rows (``--rows``) and layout (one request of N ``siblings``, N ``independent``
requests, a ``mix`` of both); on tiny configs of several families (``--families``), where a forward
costs almost nothing so the figures are each framework's own cost, and on the default model
(``--default-model``). Arms: rksc with ``decode_attention="shared_prefix"`` (the default layout),
``"static_rows"``, and ``"static_rows"`` compiled (``decode_capture="compile"``, ``--compile``);
``transformers``' ``generate`` on the same rows left-padded into one batch. Greedy (or sampled,
``--temperature``), end-of-text off,
arms alternating within each cell. Counts are exact; times only mean something with nothing else
running:

    flock /tmp/rksc-bench.lock ./dev python benchmarks/step_overhead.py
"""

from __future__ import annotations

import argparse

import torch

from rksc_bench import harness
from rksc_bench.families import char_tokenizer, make_family_model
from rksc_bench.step_overhead import (
    LAYOUTS,
    StepTimings,
    engine_run,
    generate_run,
    no_end_of_text,
    per_step,
    workload,
)
from rksc_engine import RKSCEngine
from rksc_engine.config import EngineConfig

ARMS = ("shared_prefix", "static_rows", "compiled", "generate")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__, model=False)
    parser.add_argument("--families", nargs="*", default=["llama3", "qwen2.5", "gemma2"],
                        help="tiny-config families (default llama3 qwen2.5 gemma2)")
    parser.add_argument("--default-model", action="store_true", help="also the embedded default model")
    parser.add_argument("--rows", type=harness.positive_int_list, default=[1, 8, 32, 64],
                        help="comma-separated rows (default 1,8,32,64)")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {LAYOUTS}")
    parser.add_argument("--compile", action="store_true", help="add the compiled static-rows arm (slow to build)")
    parser.add_count("--short", 4, "tokens of the short run (default 4)")
    parser.add_count("--long", 36, "tokens of the long run (default 36)")
    parser.add_repeats(5)
    parser.add_argument("--no-time", action="store_true", help="counts only (no wall time)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample every request at this temperature, top-p 0.95, request i seeded i "
                             "(default 0: greedy)")
    args = parser.parse_args(argv)
    args.layouts = args.layouts.split(",")
    if args.long <= args.short or args.short < 2:
        parser.error("need 2 <= --short < --long")
    return args


def prompts_for(rows: int) -> list[str]:
    """``rows`` distinct prompts of similar lengths (different questions, one frame)."""
    return [f"Question {i}: a shelf holds {i + 3} boxes of {2 * i + 5} books. How many books?" for i in range(rows)]


def measure_model(name: str, model, tokenizer, args: argparse.Namespace) -> list[dict]:
    rows_out = []
    arms = [a for a in ARMS if a != "compiled" or args.compile]
    with no_end_of_text(model, tokenizer) as tokenizer:
        engines = {}
        for arm in arms:
            if arm == "generate":
                continue
            config = EngineConfig(decode_attention="static_rows" if arm != "shared_prefix" else "shared_prefix",
                                  decode_capture="compile" if arm == "compiled" else "off")
            engines[arm] = RKSCEngine(model, tokenizer, config)
        for layout in args.layouts:
            for rows in args.rows:
                work = workload(layout, rows, prompts_for(max(rows, 2)), args.temperature)
                runs = {arm: (generate_run(model, tokenizer, work) if arm == "generate" else engine_run(engines[arm], work))
                        for arm in arms}
                cell = {"model": name, "layout": layout, "rows": rows}
                for arm, run in runs.items():
                    if arm == "compiled":  # its operators run inside its kernels, where none can be counted
                        run(args.short)  # warm: the compiled step is built for these shapes here
                        cell[arm] = {"operator_calls": None, "python_calls": None}
                        continue
                    cost = per_step(run, args.short, args.long)
                    cell[arm] = {"operator_calls": round(cost.operator_calls, 1), "python_calls": round(cost.python_calls, 1)}
                if not args.no_time:
                    timings = {arm: StepTimings() for arm in runs}
                    for _ in range(args.repeats):  # arms alternate, a pair of runs each
                        for arm, run in runs.items():
                            timings[arm].add(run, args.short, args.long)
                    for arm in runs:
                        cell[arm]["ms"] = round(timings[arm].ms_per_step(), 3)
                rows_out.append(cell)
                print(format_cell(cell, arms), flush=True)
    return rows_out


def format_cell(cell: dict, arms: list[str]) -> str:
    parts = [f"{cell['model']:>14} {cell['layout']:>11} {cell['rows']:>3}"]
    for arm in arms:
        figures = cell[arm]
        ms = f" {figures['ms']:7.2f} ms" if "ms" in figures else ""
        counts = ("" if figures["operator_calls"] is None
                  else f"{figures['operator_calls']:6.0f} ops {figures['python_calls']:7.0f} py")
        parts.append(f"{arm}: {counts}{ms}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    harness.start_run(args)
    torch.manual_seed(0)
    results = []
    for name in args.families:
        results += measure_model(name, make_family_model(name), char_tokenizer(), args)
    if args.default_model:
        engine = RKSCEngine.from_pretrained()
        results += measure_model("SmolLM2-135M", engine.model, engine.tokenizer, args)
    harness.write_json(args.json_out, {"arguments": vars(args), "cells": results})


if __name__ == "__main__":
    main()
