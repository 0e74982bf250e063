"""Benchmark: retrieved-context reuse (``ASKSConfig(reuse_chunks=True)``) against token-exact caching
and full recompute on a RAG workload, arms side by side in one run.

Workload: the seeded corpus of ``rksc_engine.evaluation.rag_facts`` (``--corpus`` invented-town paragraphs of
60-100 tokens) and ``--queries`` questions, each with the relevant paragraph and ``--chunks - 1``
others in shuffled order; or ``--data`` (JSONL of ``{chunks, question, answer}``). Queries arrive
one at a time, as in a RAG service; every arm sees them in the same order, interleaved query by
query so the machine's state is the same for all arms.

Arms (each its own engine over the same model weights):

* ``recompute``: no prefix cache; the reference for answer agreement.
* ``token-exact``: the radix prefix cache (reuses the chat header, and a chunk only when the
  context starts the same way).
* ``chunks f=x``: chunk reuse recomputing the most-deviating share ``x`` of the reused tokens;
  ``gate g``: a prompt whose mean deviation exceeds ``g`` is computed exactly instead.

Per arm: prompt tokens run through the model (chunks cached on first sight included), time to first
token (``engine.stream``, first chunk), the greedy answer's agreement with ``recompute`` (95%
Wilson interval), outputs token-identical to ``recompute``, and accuracy against the gold answer
(what the model can do; not rksc). "warm" repeats the token and time figures over the queries whose
chunks had all been seen before (``chunks_cached == 0``), the steady state of a RAG service.

    flock /tmp/rksc-bench.lock ./dev python benchmarks/rag_reuse.py --out docs/bench/rag_reuse.md
    ./dev python benchmarks/rag_reuse.py --queries 6 --corpus 8   # a quick look
    ./dev python benchmarks/rag_reuse.py --json-out per_query.json  # also every query's measurements
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rksc_bench import harness
from rksc_engine import ASKSConfig, EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import RSBCMConfig
from rksc_engine.evaluation.calibration import wilson_interval
from rksc_engine.evaluation.rag_facts import fact_corpus, load_rag_jsonl, rag_messages, rag_queries


@dataclass
class ArmResult:
    """One arm's measurements, one entry per query."""

    computed: list[int] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)
    tokens: list[tuple[int, ...]] = field(default_factory=list)
    warm: list[bool] = field(default_factory=list)
    deviations: list[float | None] = field(default_factory=list)


def normalise(text: str) -> str:
    """The answer as a reader would compare it: first line, case and surrounding punctuation ignored."""
    first = text.strip().split("\n", 1)[0] if text.strip() else ""
    return " ".join(first.lower().strip(" .!\"'").split())


def build_arms(base: RKSCEngine, fractions: list[float], gates: list[float], gate_fraction: float
               ) -> dict[str, RKSCEngine]:
    common = dict(decode_attention="dynamic_cache")
    arms = {
        "recompute": RKSCEngine(base.model, base.tokenizer,
                                EngineConfig(rsbcm=RSBCMConfig(enabled=False), **common)),
        "token-exact": RKSCEngine(base.model, base.tokenizer, EngineConfig(**common)),
    }
    settings = [(f, math.inf) for f in fractions] + [(gate_fraction, g) for g in gates if not math.isinf(g)]
    for fraction, gate in settings:
        name = f"chunks f={fraction:g}" + ("" if math.isinf(gate) else f" gate {gate:g}")
        asks = ASKSConfig.for_retrieved_context(fraction, max_mean_deviation=gate)
        arms[name] = RKSCEngine(base.model, base.tokenizer, EngineConfig(asks=asks, **common))
    return arms


def run_query(engine: RKSCEngine, messages: list[dict], params: SamplingParams, result: ArmResult) -> None:
    before = engine.stats().prompt_tokens_computed
    start = time.perf_counter()
    handle = engine.submit(messages, 1, params, stream=True)
    first = None
    for _chunk in handle:
        if first is None:
            first = time.perf_counter() - start
    completion = handle.result()[0]
    result.ttft.append(first if first is not None else time.perf_counter() - start)
    result.computed.append(engine.stats().prompt_tokens_computed - before)
    result.answers.append(normalise(completion.text))
    result.tokens.append(completion.token_ids)
    decision = completion.asks
    result.warm.append(decision is None or getattr(decision, "chunks_cached", 0) == 0)
    result.deviations.append(getattr(decision, "mean_deviation", None))


def report(results: dict[str, ArmResult], golds: list[str], args: argparse.Namespace) -> str:
    reference, exact = results["recompute"], results["token-exact"]
    n = len(golds)
    lines = [
        f"Queries: {n} ({args.chunks} chunks each, corpus {args.corpus}, seed {args.seed}); greedy, "
        f"{args.max_new_tokens} new tokens; model {args.model or 'default (SmolLM2-135M-Instruct)'}, "
        f"torch threads {torch.get_num_threads()}.",
        "",
        "| arm | prompt tokens computed | vs token-exact | TTFT mean (s) | TTFT vs token-exact | warm: tokens vs token-exact "
        "| warm: TTFT vs token-exact | answer = recompute (95% CI) | token-identical | gold accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in results.items():
        warm = [i for i in range(n) if all(r.warm[i] for r in results.values())]
        same = sum(a == b for a, b in zip(result.answers, reference.answers))
        low, high = wilson_interval(same, n)
        identical = sum(a == b for a, b in zip(result.tokens, reference.tokens))
        gold = sum(g.lower() in a for g, a in zip(golds, result.answers))
        warm_tokens = sum(exact.computed[i] for i in warm) / max(1, sum(result.computed[i] for i in warm))
        warm_ttft = (sum(exact.ttft[i] for i in warm) / max(1e-9, sum(result.ttft[i] for i in warm))) if warm else float("nan")
        lines.append(
            f"| {name} | {sum(result.computed):,} | {sum(exact.computed) / max(1, sum(result.computed)):.2f}x fewer "
            f"| {statistics.mean(result.ttft):.3f} | {sum(exact.ttft) / sum(result.ttft):.2f}x faster "
            f"| {warm_tokens:.2f}x ({len(warm)} queries) | {warm_ttft:.2f}x "
            f"| {same}/{n} = {same / n:.1%} [{low:.1%}, {high:.1%}] | {identical}/{n} | {gold}/{n} |")
    deviations = {name: [d for d in r.deviations if d is not None] for name, r in results.items()}
    shown = [f"{name}: median {statistics.median(d):.3f}, max {max(d):.3f}" for name, d in deviations.items() if d]
    if shown:
        lines += ["", "Mean KV deviation of the reused tokens at the probe layer, per prompt: " + "; ".join(shown) + "."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = harness.bench_parser(__file__, __doc__, json_out="optional")
    parser.add_argument("--data", default=None, help="JSONL of {chunks, question, answer} instead of the generator")
    parser.add_argument("--corpus", type=int, default=60)
    parser.add_argument("--queries", type=int, default=60)
    parser.add_argument("--chunks", type=int, default=4)
    parser.add_seed(0, "seed of the corpus and the queries")
    parser.add_max_new_tokens(12, "greedy tokens per answer")
    parser.add_argument("--fractions", default="0,0.05,0.15,0.3")
    parser.add_argument("--gates", default="0.03", help="deviation gates (max_mean_deviation) to try, comma-separated")
    parser.add_argument("--gate-fraction", type=float, default=0.15, help="recompute_fraction of the gated arms")
    parser.add_argument("--out", default=None, help="also write the markdown report here")
    args = parser.parse_args(argv)
    harness.start_run(args)

    base = harness.load_engine(args)
    if args.data:
        queries = load_rag_jsonl(args.data, limit=args.queries)
    else:
        queries = rag_queries(fact_corpus(args.corpus, seed=args.seed), args.queries, args.chunks, seed=args.seed)
    arms = build_arms(base, [float(f) for f in args.fractions.split(",")],
                      [float(g) for g in args.gates.split(",") if g], args.gate_fraction)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    results = {name: ArmResult() for name in arms}
    for query in tqdm(queries, desc="queries"):
        messages = rag_messages(query)
        for name, engine in arms.items():
            run_query(engine, messages, params, results[name])
    text = report(results, [q.answer for q in queries], args)
    print(text)
    if args.out:
        settings = {k: v for k, v in vars(args).items() if v is not None and k not in ("out", "json_out", "no_lock")}
        command = "flock /tmp/rksc-bench.lock ./dev python benchmarks/rag_reuse.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in settings.items())
        Path(args.out).write_text(f"# Retrieved-context reuse\n\nCommand: `{command}`\n\n{text}\n")
    if args.json_out:
        harness.write_json(args.json_out, {name: vars(r) for name, r in results.items()})


if __name__ == "__main__":
    main()
