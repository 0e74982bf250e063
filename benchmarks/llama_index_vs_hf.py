"""RKSCLLM vs llama-index-llms-huggingface's HuggingFaceLLM in the same LlamaIndex query engines.

Both LLMs drive the same loaded weights (the embedded default model; HuggingFaceLLM gets the
engine's model and tokenizer objects), the same chat-template formatting, greedy decoding and the
same ``max_new_tokens``, over the same index (all-MiniLM-L6-v2 embeddings, offline) and query set in
refine and compact modes. Greedy on both sides, so the answers should be identical; only the time
differs. The HF arm runs first, then rksc with a cold cache; wall time per arm and the ratio are
printed.

    python benchmarks/llama_index_vs_hf.py [--max-new-tokens 24] [--top-k 3] [--json-out results.json]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from rksc_bench import harness
from rksc_bench.llama_index_workload import QUERIES, build_index


def run_arm(index, llm, modes: list[str], top_k: int) -> tuple[float, list[str]]:
    answers = []
    start = time.perf_counter()
    for mode in modes:
        engine = index.as_query_engine(llm=llm, response_mode=mode, similarity_top_k=top_k)
        answers += [engine.query(q).response for q in QUERIES]
    return time.perf_counter() - start, answers


def main(argv: list[str] | None = None) -> None:
    parser = harness.bench_parser(__file__, __doc__, json_out="optional")
    parser.add_max_new_tokens(24, "tokens per answer")
    parser.add_argument("--top-k", type=int, default=3)
    parser.add_argument("--modes", default="refine,compact")
    args = parser.parse_args(argv)
    harness.start_run(args)

    from llama_index.llms.huggingface import HuggingFaceLLM

    from rksc_integrations.llama_index import RKSCLLM
    from rksc_integrations.llama_index.messages import to_engine_messages

    engine = harness.load_engine(args, progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        index = build_index(Path(tmp))
    modes = args.modes.split(",")
    hf = HuggingFaceLLM(
        model=engine.model, tokenizer=engine.tokenizer, model_name=engine.model_name, tokenizer_name=engine.model_name,
        context_window=engine.context_window, max_new_tokens=args.max_new_tokens, is_chat_model=True,
        messages_to_prompt=lambda messages: engine.render_chat(to_engine_messages(messages)),
        generate_kwargs={"do_sample": False, "temperature": None, "top_p": None, "top_k": None},
    )
    rksc = RKSCLLM(engine=engine, max_new_tokens=args.max_new_tokens)
    # Warm both code paths on an unrelated prompt, so neither arm pays first-call overheads.
    hf.complete("Hello", formatted=True)
    rksc.complete("Hello", formatted=True)
    engine.clear_cache()
    engine.reset_stats()

    hf_s, hf_answers = run_arm(index, hf, modes, args.top_k)
    rksc_s, rksc_answers = run_arm(index, rksc, modes, args.top_k)
    stats = engine.stats()
    same = sum(a.strip() == b.strip() for a, b in zip(hf_answers, rksc_answers))
    result = {
        "queries": len(QUERIES) * len(modes), "modes": modes, "max_new_tokens": args.max_new_tokens,
        "hf_s": round(hf_s, 3), "rksc_s": round(rksc_s, 3), "hf_over_rksc": round(hf_s / rksc_s, 3),
        "identical_answers": same, "rksc_prompt_reuse_rate": round(stats.prompt_reuse_rate, 3),
        "rksc_prompt_tokens_computed": stats.prompt_tokens_computed, "rksc_prompt_tokens_reused": stats.prompt_tokens_reused,
    }
    print(f"HuggingFaceLLM: {hf_s:.2f}s   RKSCLLM: {rksc_s:.2f}s   wall-time ratio HF/rksc = {hf_s / rksc_s:.2f}x "
          f"over {result['queries']} queries ({'+'.join(modes)}), {same}/{len(hf_answers)} answers identical, "
          f"rksc prompt reuse {stats.prompt_reuse_rate:.0%}")
    print(json.dumps(result))
    if args.json_out:
        harness.write_json(args.json_out, result)


if __name__ == "__main__":
    main()
