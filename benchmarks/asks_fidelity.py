"""Benchmark: ASKS final-answer fidelity at scale, with CacheBlend-style repair and a deviation gate.

``benchmarks/asks.py`` decodes every arm on its own, which limits it to a dozen requests on a
2-core CPU. This one decodes all arms of a request as one greedy batch (each row its own KV, all
rows the same length, so one ``DynamicCache`` holds them), which makes a few hundred decodes
affordable, and it measures the one thing a 99% fidelity claim needs: how often the final answer
equals full recompute's.

Workload: prompt-ensemble self-consistency on GSM8K (``--data``) or the synthetic set: for each of
``--questions`` questions, ``--wordings`` instruction wordings before the same ~1,300-token few-shot
context (each question its own shots) and the question. Wording 0 of a question only seeds the
caches; wordings 1.. are the measured requests, each against caches holding the earlier wordings.

Rows of each request's batch:

* ``exact``: token-exact radix caching, ASKS off; the reference (token-identical to full recompute
  by the tested anchor invariant).
* ``single pass``: the whole prompt prefilled in one pass with no cache. In exact arithmetic it
  equals ``exact``; in float32 the two differ by rounding (the header comes from another pass).
  How often that alone changes the final answer is the noise floor of any answer-agreement figure.
* ``asks f=x``: ASKS at ``tau=0`` (reuse whenever a realignment exists) with the default deviation
  probe, recomputing the most-deviating share ``x`` of the remainder.
* ``asks nearest f=x``: the same share recomputed right after the span instead (the earlier rule).

Gates are replayed from the measured rows, not run: a request reuses under a gate when its
measured ``sigma >= tau`` (span similarity) or its measured mean deviation ``<= g`` (the remainder
probe), taking that arm's outcome, else the exact outcome. Per arm and gate the table gives the
reuse rate, extra prompt tokens served from cache over token-exact caching, the prefill time ratio
to ``exact`` (summed; a gated fallback costs its probe plus an exact prefill), and final-answer
agreement with its 95% Wilson interval.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/asks_fidelity.py --data ../shared/data/gsm8k_train.jsonl
    ./dev python benchmarks/asks_fidelity.py --questions 2 --wordings 3   # a quick look, synthetic
    ./dev python benchmarks/asks_fidelity.py --report-only                # the table of the rows so far
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rksc_bench import harness
from rksc_bench.prompts import shots_to_length
from rksc_bench.reworded_prompts import WORDINGS, answer_of, answer_settled
from rksc_engine import ASKSConfig, EngineConfig, RKSCEngine
from rksc_engine.evaluation.calibration import wilson_interval
from rksc_engine.evaluation.workloads import load_gsm8k_jsonl, synthetic_problems
from rksc_engine.reasoning.few_shot import few_shot_messages

WORKLOAD = "prompt-ensemble SC"


def build_arms(base: RKSCEngine, args: argparse.Namespace) -> dict[str, RKSCEngine | None]:
    common = dict(decode_attention="dynamic_cache")
    arms: dict[str, RKSCEngine | None] = {"exact": RKSCEngine(base.model, base.tokenizer, EngineConfig(**common))}
    arms["single pass"] = None  # no engine: a cold prefill of the whole prompt
    for fraction in args.recompute:
        arms[f"asks f={fraction:g}"] = RKSCEngine(base.model, base.tokenizer, EngineConfig(
            asks=ASKSConfig(enabled=True, tau=0.0, recompute_fraction=fraction), **common))
    for fraction in args.nearest:
        arms[f"asks nearest f={fraction:g}"] = RKSCEngine(base.model, base.tokenizer, EngineConfig(
            asks=ASKSConfig(enabled=True, tau=0.0, recompute_fraction=fraction, recompute_selection="nearest"),
            **common))
    return arms


@torch.inference_mode()
def single_pass(base: RKSCEngine, ids: list[int]):
    from transformers import DynamicCache

    cache = DynamicCache(config=base.model.config)
    logits = base.forward(torch.tensor([ids], device=base.device), cache, logits_to_keep=1).logits[:, -1, :]
    return cache, logits


@torch.inference_mode()
def batched_greedy(base: RKSCEngine, caches: list, logits: list[torch.Tensor], max_new_tokens: int) -> list[list[int]]:
    """Greedy-decode every row together; a row stops at EOS or once its ``#### x`` line is complete.
    Finished rows keep running (their tokens are ignored) so the batch shape, and with it the
    kernels' rounding, stays the same for every row at every step."""
    from transformers import DynamicCache

    layers = [(torch.cat([c.layers[i].keys for c in caches]), torch.cat([c.layers[i].values for c in caches]))
              for i in range(len(caches[0].layers))]
    cache = DynamicCache(ddp_cache_data=layers, config=base.model.config)
    step_logits = torch.cat(logits)  # (B, V)
    rows = len(caches)
    tokens: list[list[int]] = [[] for _ in range(rows)]
    done = [False] * rows
    for _ in range(max_new_tokens):
        chosen = step_logits.argmax(-1)
        for row, token in enumerate(chosen.tolist()):
            if done[row]:
                continue
            tokens[row].append(token)
            done[row] = token in base.eos_token_ids or answer_settled(base, WORKLOAD, tokens[row])
        if all(done):
            break
        step_logits = base.forward(chosen[:, None], cache).logits[:, -1, :]
    return tokens


def build_requests(base: RKSCEngine, args: argparse.Namespace) -> list[tuple[int, int, list[int]]]:
    """``(question, wording, prompt ids)``, wordings of a question in order."""
    if args.data:
        pool = load_gsm8k_jsonl(args.data, limit=args.questions + 400)
        questions, pool = pool[-args.questions:], pool[:-args.questions]
    else:
        pool = synthetic_problems(400, seed=args.seed)
        questions = synthetic_problems(args.questions, seed=args.seed + 1000)
    out = []
    for q, problem in enumerate(questions):
        shots = shots_to_length(base, "?", pool, args.context_tokens, start=q * 37)
        for w in range(args.wordings):
            messages = few_shot_messages(problem.question, shots, system_prompt=WORDINGS[w % len(WORDINGS)])
            out.append((q, w, base.encode(messages)))
    return out


def run(args: argparse.Namespace) -> list[dict]:
    """Every measured request's rows; each request's rows are also appended to ``--records-out``
    (JSON lines) as soon as it is decoded, so a long run that is stopped still leaves its data."""
    base = harness.load_engine(args, progress=True)
    args.records_out.parent.mkdir(parents=True, exist_ok=True)
    args.records_out.write_text("")
    arms = build_arms(base, args)
    records = []
    for q, w, ids in tqdm(build_requests(base, args), desc="requests"):
        if w == 0:  # a new question: its first wording seeds every arm's cache and is not measured
            for engine in arms.values():
                if engine is not None:
                    engine.clear_cache()
                    engine.warm_cache(ids)
            continue
        caches, logits, rows = [], [], []
        for name, engine in arms.items():
            start = time.perf_counter()
            if engine is None:
                cache, last = single_pass(base, ids)
                decision, cached = None, 0
            else:
                with engine.exclusive():
                    prefilled = engine.prefill(ids)
                cache, last, decision, cached = (prefilled.cache, prefilled.last_logits, prefilled.asks,
                                                 prefilled.num_cached_tokens)
            elapsed = time.perf_counter() - start
            caches.append(cache)
            logits.append(last)
            rows.append(dict(question=q, wording=w, arm=name, prompt_tokens=len(ids), cached_tokens=cached,
                             prefill_s=elapsed, reused=bool(decision and decision.reused),
                             sigma=None if decision is None else decision.sigma,
                             mean_deviation=None if decision is None else decision.mean_deviation,
                             max_deviation=None if decision is None else decision.max_deviation,
                             recomputed=None if decision is None else decision.recomputed_tokens))
        outputs = batched_greedy(base, caches, logits, args.max_new_tokens)
        reference = outputs[0]
        for row, tokens in zip(rows, outputs):
            first_diff = next((i for i, (x, y) in enumerate(zip(tokens, reference)) if x != y), None)
            row.update(answer=answer_of(base, WORKLOAD, tokens), tokens=len(tokens), first_diff=first_diff)
        for row in rows:
            row["reference_answer"] = rows[0]["answer"]
            row["agree"] = row["answer"] == rows[0]["answer"]
        records.extend(rows)
        with args.records_out.open("a") as sink:
            sink.writelines(json.dumps(row) + "\n" for row in rows)
    return records


def gated(rows_by_arm: dict[str, list[dict]], arm: str, reuse) -> list[dict]:
    """The arm's rows where ``reuse(row)`` holds, else the exact row (a gated fallback, whose cost is
    the arm's prefill of the same request plus the exact prefill: the probe ran before deciding)."""
    out = []
    for row, exact in zip(rows_by_arm[arm], rows_by_arm["exact"]):
        if row["reused"] and reuse(row):
            out.append(row)
        else:
            out.append(dict(exact, prefill_s=exact["prefill_s"] + (row["prefill_s"] if row["reused"] else 0.0),
                            reused=False))
    return out


def summarise(rows: list[dict], exact_rows: list[dict]) -> dict:
    prompt = sum(r["prompt_tokens"] for r in rows)
    agree = sum(r["agree"] for r in rows)
    low, high = wilson_interval(agree, len(rows))
    reused = [r for r in rows if r["reused"]]
    reused_agree = sum(r["agree"] for r in reused)
    return dict(
        requests=len(rows), reuses=len(reused),
        extra_reused=(sum(r["cached_tokens"] for r in rows) - sum(r["cached_tokens"] for r in exact_rows)) / prompt,
        prefill_ratio=sum(r["prefill_s"] for r in rows) / sum(r["prefill_s"] for r in exact_rows),
        agree=agree / len(rows), agree_low=low, agree_high=high,
        reused_agree=reused_agree / len(reused) if reused else None,
    )


def report(records: list[dict], args: argparse.Namespace) -> tuple[str, list[dict]]:
    arms = list(dict.fromkeys(r["arm"] for r in records))
    by_arm = {a: [r for r in records if r["arm"] == a] for a in arms}
    exact_rows = by_arm["exact"]
    variants: list[tuple[str, list[dict]]] = [(a, by_arm[a]) for a in arms]
    for arm in arms:
        if not arm.startswith("asks f="):
            continue
        for tau in args.gate_taus:
            variants.append((f"{arm}, sigma >= {tau:g}", gated(by_arm, arm, lambda r, t=tau: max(r["sigma"], 0) >= t)))
        for g in args.gate_deviations:
            variants.append((f"{arm}, deviation <= {g:g}",
                             gated(by_arm, arm, lambda r, g=g: r["mean_deviation"] is not None and r["mean_deviation"] <= g)))
    lines = [f"{len(exact_rows)} measured requests, {sum(r['prompt_tokens'] for r in exact_rows):,} prompt tokens",
             "", "| arm (gate replayed) | reused | extra reused | prefill vs exact | answer agreement [95% Wilson] "
             "| agreement of reused |", "|---|---:|---:|---:|---:|---:|"]
    summary = []
    for name, rows in variants:
        s = summarise(rows, exact_rows)
        summary.append(dict(arm=name, **s))
        reused_agree = "-" if s["reused_agree"] is None else f"{s['reused_agree']:.3f}"
        lines.append(f"| {name} | {s['reuses']}/{s['requests']} | {s['extra_reused']:+.1%} | {s['prefill_ratio']:.2f}x "
                     f"| {s['agree']:.3f} [{s['agree_low']:.3f}, {s['agree_high']:.3f}] | {reused_agree} |")
    return "\n".join(lines), summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_argument("--data", default=None, help="GSM8K-format JSONL for shots and questions (default: synthetic)")
    parser.add_count("--questions", 16)
    parser.add_argument("--wordings", type=int, default=6, help="per question; wording 0 only seeds the caches")
    parser.add_argument("--context-tokens", type=int, default=1300)
    parser.add_argument("--recompute", type=harness.float_list, default=[0.0, 0.15, 0.3], help="deviation-ranked shares")
    parser.add_argument("--nearest", type=harness.float_list, default=[0.3], help="nearest-first shares")
    parser.add_argument("--gate-taus", type=harness.float_list, default=[0.98, 0.975, 0.97])
    parser.add_argument("--gate-deviations", type=harness.float_list, default=[0.0015, 0.002, 0.003, 0.005])
    parser.add_max_new_tokens(256)
    parser.add_seed(0, "seed of the synthetic problems")
    parser.add_threads()
    parser.add_argument("--records-out", type=Path, default=harness.results_path(__file__, "asks_fidelity.jsonl"),
                        help="per-request rows, appended as the run goes")
    parser.add_argument("--report-only", action="store_true",
                        help="print the table from an existing --records-out file, running nothing")
    args = parser.parse_args(argv)
    if args.wordings < 2:
        parser.error("--wordings must be >= 2 (wording 0 only seeds the caches)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_grad_enabled(False)
    started = time.perf_counter()
    if args.report_only:
        records = [json.loads(line) for line in args.records_out.read_text().splitlines() if line.strip()]
    else:
        harness.start_run(args)
        records = run(args)
    text, summary = report(records, args)
    print(text)
    print(f"\ntotal wall time {time.perf_counter() - started:.0f} s")
    harness.write_json(args.json_out, dict(args=vars(args), summary=summary, records=records))


if __name__ == "__main__":
    main()
