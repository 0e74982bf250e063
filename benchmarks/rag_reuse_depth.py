"""Diagnostic: how far reused chunk KV is from full recompute, layer by layer.

For a few queries of the RAG workload (``rksc_engine.evaluation.rag_facts``), the prompt is prefilled with
retrieved-context reuse (after a first query has cached the chunks) and, separately, exactly; the
table gives the mean relative KV deviation ``||kv_reused - kv_exact|| / ||kv_exact||`` over the
prompt's chunk tokens at a few depths, and the largest last-position logit difference, for a sweep
of ``recompute_fraction``. CacheBlend's premise is that few tokens deviate much; this shows whether
it holds for a model.

    ./dev python benchmarks/rag_reuse_depth.py
    ./dev python benchmarks/rag_reuse_depth.py --model PATH --fractions 0,0.15,0.5,0.95
"""

from __future__ import annotations

import torch

from rksc_bench import harness
from rksc_engine import ASKSConfig, EngineConfig, RKSCEngine
from rksc_engine.evaluation.rag_facts import fact_corpus, rag_messages, rag_queries


def prefilled(engine: RKSCEngine, messages: list[dict]) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(KV (L, 2, H, T, D), last logits, segments) of ``messages`` through the engine's prefill."""
    ids = engine.encode(messages)
    segments = engine.prompt_segments(messages, ids)
    with engine.exclusive():
        steps = engine.prefill_steps(ids, None, segments)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                result = done.value
                break
    kv = torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in result.cache.layers])
    return kv, result.last_logits, segments


def main(argv: list[str] | None = None) -> None:
    parser = harness.bench_parser(__file__, __doc__, json_out="optional")
    parser.add_count("--queries", 3)
    parser.add_argument("--fractions", type=harness.float_list, default="0,0.15,0.5,0.95,0.99")
    args = parser.parse_args(argv)
    harness.start_run(args)
    base = harness.load_engine(args)
    queries = rag_queries(fact_corpus(6), args.queries + 1, 4)
    num_layers = base.model.config.num_hidden_layers
    depths = sorted({1, 2, num_layers // 6, num_layers // 2, num_layers - 1})
    print("| recompute_fraction | " + " | ".join(f"layer {d}" for d in depths) + " | max logit diff |")
    print("|---" * (len(depths) + 2) + "|")
    rows = []
    for fraction in args.fractions:
        engine = RKSCEngine(base.model, base.tokenizer,
                            EngineConfig(asks=ASKSConfig.for_retrieved_context(fraction)))
        prefilled(engine, rag_messages(queries[0]))  # caches the chunks
        deviations, logit_diffs = [], []
        for query in queries[1:]:
            kv, logits, segments = prefilled(engine, rag_messages(query))
            exact_kv, exact_logits, _ = prefilled(RKSCEngine(base.model, base.tokenizer), rag_messages(query))
            start, end = segments[1][0], segments[-1][0]
            diff = (kv - exact_kv)[:, :, :, start:end].square().sum(dim=(1, 2, 3, 4)).sqrt()
            deviations.append(diff / exact_kv[:, :, :, start:end].square().sum(dim=(1, 2, 3, 4)).sqrt())
            logit_diffs.append(float((logits - exact_logits).abs().max()))
        mean = torch.stack(deviations).mean(0)
        rows.append({"recompute_fraction": fraction, "deviation_by_layer": {d: float(mean[d]) for d in depths},
                     "max_logit_diff": max(logit_diffs)})
        print(f"| {fraction:g} | " + " | ".join(f"{float(mean[d]):.3f}" for d in depths)
              + f" | {max(logit_diffs):.2f} |")
    if args.json_out:
        harness.write_json(args.json_out, {"queries": args.queries, "rows": rows})


if __name__ == "__main__":
    main()
