"""The checks to run the day a GPU is lent (``benchmarks/gpu_check.py``, which
``benchmarks/gpu_check.sh`` runs on the device machine).

Each part prints its table and adds to one JSON file; a part that fails prints why and the rest
go on, so one broken part does not waste the machine's few minutes.

1. **exact**: greedy decoding of a few prompts against ``transformers``' ``generate`` on the same
   device, for each decode layout (``shared_prefix``, ``static_rows``, ``static_rows`` compiled). In
   float32 every token must match; in bfloat16 rounding may change a near-tie, so the figure is how
   many tokens match before the first difference (the stated tolerance: at least ``--bf16-tokens``).
2. **step**: per decode step, operator calls and host milliseconds, by rows and layout, each
   layout against ``generate`` on the same rows (``rksc_bench.step_overhead``), and the compiled
   static step against the model's bare compiled forward over ``transformers``' ``StaticCache``.
3. **branches**: the 8-branch job (one few-shot prompt, 8 sampled branches) against
   ``generate(num_return_sequences=8)`` and 8 sequential ``generate`` calls.
4. **drafting**: the same job and one greedy branch of it, decoded with drafts from the prompt and
   the sibling branches (``SchedulerConfig.draft_tokens``) against without: wall time, accepted
   draft tokens, and whether every branch's tokens are the ones decoded without drafts (in float32
   they must be; in bfloat16 a verifying forward's wider shape may turn a near-tie).

On a CPU (``quick``: a tiny model and small sizes) it checks that the check itself runs.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from rksc_bench.branch_runs import run_hf_batched, run_hf_sequential, run_rksc
from rksc_bench.families import char_tokenizer, make_family_model
from rksc_bench.step_overhead import engine_run, generate_run, no_end_of_text, per_step, time_per_step, workload
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import SchedulerConfig

LAYOUTS = {
    "shared_prefix": EngineConfig(decode_attention="shared_prefix"),
    "static_rows": EngineConfig(decode_attention="static_rows"),
    "compiled": EngineConfig(decode_capture="compile"),
}
PROMPTS = [
    "The capital of France is",
    "Q: A baker has 4 trays of 12 muffins and sells 30. How many are left?\nA:",
    "Write one sentence about the sea.",
]
STEP_PROMPTS = [f"Question {i}: a shelf holds {i + 3} boxes of {2 * i + 5} books. How many books?" for i in range(64)]


@dataclass(frozen=True)
class CheckOptions:
    """What the check runs on.

    Attributes:
        device: ``"cuda"``, ``"cpu"``, ... (None: the engine's ``"auto"``).
        model: A local model directory (None: the embedded default model).
        quick: A tiny seeded model and small sizes: checks that the check runs.
        rows: Rows of the step part.
        bf16_tokens: Tokens that must match before a bfloat16 difference.
        new_tokens: Tokens per greedy prompt.
    """

    device: str | None = None
    model: str | None = None
    quick: bool = False
    rows: tuple[int, ...] = (1, 8, 16, 32)
    bf16_tokens: int = 16
    new_tokens: int = 32


def model_and_tokenizer(options: CheckOptions, dtype: torch.dtype) -> tuple[Any, Any]:
    if options.quick:
        return make_family_model("llama3", dtype=dtype).to(options.device or "cpu"), char_tokenizer()
    engine = RKSCEngine.from_pretrained(options.model, device=options.device or "auto", dtype=dtype, progress=False)
    return engine.model, engine.tokenizer


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def part_exact(options: CheckOptions) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, tokenizer = model_and_tokenizer(options, dtype)
        tokens = 8 if options.quick else options.new_tokens
        want = []
        for prompt in PROMPTS:
            ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=model.device)
            with torch.inference_mode():
                generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                                           do_sample=False)
            want.append(generated[0, ids.shape[1]:].tolist())
        for layout, config in LAYOUTS.items():
            engine = RKSCEngine(model, tokenizer, config)
            with engine.exclusive():  # together, so they share their decode steps
                handles = [engine.submit(p, 1, SamplingParams(max_new_tokens=tokens)) for p in PROMPTS]
            got = [list(h.result()[0].token_ids) for h in handles]
            agree = [first_difference(g, w) for g, w in zip(got, want)]
            exact = all(g == w for g, w in zip(got, want))
            bound = tokens if dtype == torch.float32 else min(tokens, options.bf16_tokens)
            verdict = "PASS" if min(agree) >= bound else "FAIL"
            key = f"{str(dtype).removeprefix('torch.')}/{layout}"
            out[key] = {"exact": exact, "tokens_before_first_difference": agree, "verdict": verdict}
            print(f"exact {key:>24}: {verdict} (tokens before the first difference {agree}, of {tokens})", flush=True)
    return out


def timing_dtype(options: CheckOptions) -> torch.dtype:
    """The dtype the timed parts run in: bfloat16 on an accelerator, float32 on a CPU or quick."""
    return torch.float32 if (options.quick or (options.device or "").startswith("cpu")) else torch.bfloat16


def branch_job(options: CheckOptions) -> tuple[int, int, str]:
    """The branches job of the ``branches`` and ``drafting`` parts: branches, new tokens, the few-shot prompt."""
    n, new_tokens = (4, 8) if options.quick else (8, 128)
    prompt = "\n\n".join(f"Q: {i} + {i + 2} = ?\nA: {2 * i + 2}" for i in range(40 if not options.quick else 3))
    return n, new_tokens, prompt


def part_step(options: CheckOptions) -> dict[str, Any]:
    dtype = timing_dtype(options)
    model, tokenizer = model_and_tokenizer(options, dtype)
    rows_list = [r for r in options.rows if r <= 8] if options.quick else options.rows
    cells = []
    with no_end_of_text(model, tokenizer) as quiet:
        engines = {name: RKSCEngine(model, quiet, config) for name, config in LAYOUTS.items()}
        for layout in ("siblings", "independent"):
            for rows in rows_list:
                work = workload(layout, rows, STEP_PROMPTS)
                runs: dict[str, Callable[[int], int]] = {n: engine_run(e, work) for n, e in engines.items()}
                runs["generate"] = generate_run(model, quiet, work)
                cell: dict[str, Any] = {"layout": layout, "rows": rows}
                for name, run in runs.items():
                    # A compiled step's operators run inside its kernels, where a dispatch mode cannot
                    # count them (under one, the step runs eagerly): its count is the eager one's.
                    ops = None if name == "compiled" else per_step(run, 4, 12, count_python=False).operator_calls
                    ms = min(time_per_step(run, 4, 20, 1) for _ in range(2))
                    cell[name] = {"operator_calls": None if ops is None else round(ops, 1), "ms": round(ms, 3)}
                cells.append(cell)
                print(f"step {layout:>11} {rows:>3} rows: " + " | ".join(
                    f"{n} {cell[n]['operator_calls'] or '-'} ops {cell[n]['ms']:.2f} ms" for n in runs), flush=True)
    return {"cells": cells, "bare_compiled_forward_ms": bare_compiled_forward_ms(model, 8)}


def bare_compiled_forward_ms(model: Any, rows: int) -> float | None:
    """Milliseconds of the model's own compiled decode forward over ``transformers``' ``StaticCache``
    (no scheduler, no sampling): the floor a compiled step is held against."""
    from transformers import StaticCache

    try:
        cache = StaticCache(config=model.config, max_batch_size=rows, max_cache_len=256)
        forward = torch.compile(lambda ids, pos: model(ids, cache=cache, cache_position=pos, use_cache=True).logits)
        ids = torch.zeros(rows, 1, dtype=torch.long, device=model.device)
        with torch.inference_mode():
            for i in range(3):
                forward(ids, torch.tensor([i], device=model.device))
            sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
            sync()
            start = time.perf_counter()
            for i in range(3, 43):
                forward(ids, torch.tensor([i], device=model.device))
            sync()
        ms = 1000 * (time.perf_counter() - start) / 40
        print(f"step bare compiled forward, {rows} rows: {ms:.2f} ms", flush=True)
        return round(ms, 3)
    except Exception as error:  # noqa: BLE001 - a reference figure; the check goes on without it
        print(f"step bare compiled forward: failed ({type(error).__name__}: {error})")
        return None


def part_branches(options: CheckOptions) -> dict[str, Any]:
    dtype = timing_dtype(options)
    model, tokenizer = model_and_tokenizer(options, dtype)
    n, new_tokens, prompt = branch_job(options)
    out = {}
    for layout, config in LAYOUTS.items():
        engine = RKSCEngine(model, tokenizer, config)
        ids = engine.encode(prompt)
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.7, top_p=0.95, seed=0)
        run_rksc(engine, ids, n, params)  # warm: compiled steps, buffers
        engine.clear_cache()
        rksc = run_rksc(engine, ids, n, params)
        out[layout] = rksc.wall_s
    input_ids = torch.tensor([engine.encode(prompt)], device=model.device)
    batched = run_hf_batched(model, input_ids, n, new_tokens, seed=0)
    sequential = run_hf_sequential(model, input_ids, n, new_tokens, seed=0)
    for layout, wall_s in out.items():
        print(f"branches {layout:>14}: {wall_s:.2f} s; generate(num_return_sequences={n}) {batched.wall_s:.2f} s "
              f"({batched.wall_s / wall_s:.2f}x), {n} sequential {sequential.wall_s:.2f} s "
              f"({sequential.wall_s / wall_s:.2f}x)", flush=True)
    return {"rksc_s": out, "num_return_sequences_s": batched.wall_s, "sequential_s": sequential.wall_s,
            "prompt_tokens": len(input_ids[0]), "branches": n, "max_new_tokens": new_tokens}


def part_drafting(options: CheckOptions) -> dict[str, Any]:
    dtype = timing_dtype(options)
    model, tokenizer = model_and_tokenizer(options, dtype)
    n, new_tokens, prompt = branch_job(options)
    jobs = {"sampled": (n, SamplingParams(max_new_tokens=new_tokens, temperature=0.7, top_p=0.95, seed=0)),
            "greedy": (1, SamplingParams(max_new_tokens=new_tokens))}
    out: dict[str, Any] = {}
    for job, (branches, params) in jobs.items():
        tokens, cells, walls = {}, {}, {}
        for layout in ("shared_prefix", "static_rows"):
            for k in (0, 2, 4):
                arm = (layout, k)
                # Not the cache source: the warm run's answer would be a whole draft of the timed one.
                scheduler = SchedulerConfig(draft_tokens=k, draft_sources=("prompt", "siblings"))
                engine = RKSCEngine(model, tokenizer, EngineConfig(decode_attention=layout, scheduler=scheduler))
                ids = engine.encode(prompt)
                engine.generate_branches(ids, branches, params)  # warm; the prompt stays cached: a run is its decode
                engine.reset_stats()
                start = time.perf_counter()
                done = engine.generate_branches(ids, branches, params)
                walls[arm] = time.perf_counter() - start
                tokens[arm] = [c.token_ids for c in done]
                stats = engine.stats()
                off = walls[(layout, 0)]
                cells[f"{layout} k{k}"] = cell = {
                    "wall_s": round(walls[arm], 3), "identical": tokens[arm] == tokens[(layout, 0)],
                    "drafted": stats.drafted_tokens, "accepted": stats.accepted_draft_tokens}
                print(f"drafting {job} ({branches} branches) {layout} k={k}: {walls[arm]:.2f} s "
                      f"({off / walls[arm]:.2f}x its layout without drafts), accepted {cell['accepted']} of "
                      f"{cell['drafted']}, identical={cell['identical']}", flush=True)
        out[job] = {"branches": branches, "max_new_tokens": new_tokens, "cells": cells}
    return out


PARTS = ("exact", "step", "branches", "drafting")


def run_check(options: CheckOptions, parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """Run ``parts`` in turn; a part that fails records its traceback and the others still run."""
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    print(f"device: {results['device']}; torch {torch.__version__}", flush=True)
    run = {"exact": part_exact, "step": part_step, "branches": part_branches, "drafting": part_drafting}
    for name in parts:
        if name not in run:
            raise ValueError(f"parts must be of {PARTS}, got {name!r}")
        start = time.perf_counter()
        try:
            results[name] = run[name](options)
        except Exception:  # noqa: BLE001 - the other parts still run
            traceback.print_exc()
            results[name] = {"error": traceback.format_exc(limit=3)}
        print(f"[{name}: {time.perf_counter() - start:.0f} s]", flush=True)
    return results
