"""Count how often a free-text self-consistency vote has a majority: the old exact vote against the
clustered vote, on the same branches.

Workloads:

* ``llama_index``: the LlamaIndex example -- the README's one-document index ("Who keeps the
  lighthouse?") and the four documents and eight questions of ``benchmarks/llama_index_vs_hf.py``
  (all-MiniLM-L6-v2 embeddings, offline), each asked of a compact query engine. The prompt each query
  sends is captured once (LlamaIndex's ``LLMChatStartEvent``); no gold answers.
* ``rag_facts``: ``--rag-queries`` questions of ``rksc_engine.evaluation.rag_facts`` (invented towns,
  the relevant paragraph among ``--chunks - 1`` others), with gold answers.

For each prompt, ``--samples`` times, ``--branches`` branches are sampled (seeded, the settings of
``RKSCLLM(branches=n)``: temperature ``branch_temperature`` 0.7, ``--max-new-tokens``), and the
query engine's own ``decide`` votes them three ways, verifier off:

* ``before``: the vote as it was, exact on ``normalise_answer``;
* ``answer_key``: exact on the new ``answer_key``;
* ``cluster``: the new default, clustered, with the query's words not counting as agreement.

Per arm, over every sampled query: those whose largest cluster holds more than half the branches
("majority"), at least two ("top >= 2"), the mean largest cluster and number of clusters, and on
``rag_facts`` how often the returned branch contains the gold answer. Counting, not timing.

    nice -n 10 python benchmarks/free_text_vote.py --out docs/bench/free_text_vote.md
"""

from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rksc_bench import harness
from rksc_bench.llama_index_workload import QUERIES, build_index
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.evaluation.rag_facts import fact_corpus, rag_messages, rag_queries
from rksc_engine.reasoning.answers import VoteConfig, answer_key
from rksc_engine.reasoning.cgee import CGEEConfig

README_DOCUMENT = "The lighthouse on Gull Island is kept by Mara Voss."
README_QUESTION = "Who keeps the lighthouse?"
ARMS = ("before", "answer_key", "cluster")


@dataclass
class Prompt:
    """One query as the engine sees it."""

    workload: str
    question: str
    messages: list[dict[str, str]]
    gold: str | None = None


@dataclass
class ArmCounts:
    """One arm's vote, per prompt."""

    top: list[int] = field(default_factory=list)
    clusters: list[int] = field(default_factory=list)
    branches: list[int] = field(default_factory=list)
    gold_hits: list[bool] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        majority = sum(top * 2 > n for top, n in zip(self.top, self.branches))
        return {
            "queries": len(self.top), "majority": majority, "top_at_least_2": sum(top >= 2 for top in self.top),
            "mean_top": round(statistics.fmean(self.top), 2), "mean_clusters": round(statistics.fmean(self.clusters), 2),
            "gold_in_answer": sum(self.gold_hits) if self.gold_hits else None,
        }


def llama_index_prompts(engine: RKSCEngine, top_k: int) -> list[Prompt]:
    """The prompts the README's query engine and ``llama_index_vs_hf.py``'s compact query engine send."""
    from llama_index.core import Document, VectorStoreIndex
    from llama_index.core.embeddings import MockEmbedding
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler
    from llama_index.core.instrumentation.events.llm import LLMChatStartEvent

    from rksc_integrations.llama_index import RKSCLLM
    from rksc_integrations.llama_index.messages import to_engine_messages

    class Capture(BaseEventHandler):
        messages: list = []

        def handle(self, event: Any, **kwargs: Any) -> None:
            if isinstance(event, LLMChatStartEvent):
                self.messages.append(event.messages)

    capture = Capture(messages=[])
    get_dispatcher().add_event_handler(capture)
    llm = RKSCLLM(engine=engine, max_new_tokens=1)  # only the prompt is wanted
    readme_index = VectorStoreIndex.from_documents([Document(text=README_DOCUMENT)], embed_model=MockEmbedding(embed_dim=8))
    # A fixed folder, not a fresh temporary one: the file path is part of each node's text in the
    # prompt, so a new path each run would sample other branches.
    folder = Path(tempfile.gettempdir()) / "rksc-free-text-vote"
    folder.mkdir(exist_ok=True)
    index = build_index(folder)
    asked = [(readme_index.as_query_engine(llm=llm), README_QUESTION)]
    asked += [(index.as_query_engine(llm=llm, response_mode="compact", similarity_top_k=top_k), q) for q in QUERIES]
    prompts = []
    for query_engine, question in asked:
        capture.messages.clear()
        query_engine.query(question)
        prompts.append(Prompt("llama_index", question, to_engine_messages(capture.messages[-1], llm.system_prompt)))
    get_dispatcher().event_handlers.remove(capture)
    return prompts


def rag_fact_prompts(num: int, chunks: int, seed: int) -> list[Prompt]:
    queries = rag_queries(fact_corpus(60, seed=seed), num, chunks_per_query=chunks, seed=seed)
    return [Prompt("rag_facts", q.question, rag_messages(q), q.answer) for q in queries]


def vote_arms(completions: list[Any], prompt: Prompt) -> dict[str, Any]:
    """Each arm's ``BranchDecision`` on the same branches, as ``RKSCLLM`` makes it."""
    from rksc_integrations.llama_index.branches import decide, normalise_answer

    off = CGEEConfig.off()
    return {
        "before": decide(completions, normalise_answer, off, vote=VoteConfig("exact")),
        "answer_key": decide(completions, answer_key, off, vote=VoteConfig("exact")),
        "cluster": decide(completions, answer_key, off, vote=VoteConfig("cluster"), query=prompt.question),
    }


def main(argv: list[str] | None = None) -> None:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_count("--branches", 4, "branches per query (the README's 4)")
    parser.add_max_new_tokens(32, "the README's 32")
    parser.add_count("--top-k", 3, "retrieved chunks per query")
    parser.add_count("--rag-queries", 8, "rag_facts questions")
    parser.add_count("--chunks", 3, "rag_facts chunks per question")
    parser.add_count("--samples", 3, "branch sets sampled per prompt (other seeds)")
    parser.add_seed()
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown table here")
    args = parser.parse_args(argv)
    harness.start_run(args)

    start = time.perf_counter()
    engine = harness.load_engine(args, progress=False)
    prompts = llama_index_prompts(engine, args.top_k) + rag_fact_prompts(args.rag_queries, args.chunks, args.seed)
    counts = {(w, arm): ArmCounts() for w in ("llama_index", "rag_facts") for arm in ARMS}
    rows = []
    for number, (prompt, sample) in enumerate((p, k) for p in prompts for k in range(args.samples)):
        # Branch i of a call draws from seed + i, so calls' seeds lie further apart than their branches.
        seed = args.seed + 1000 * (number // args.samples) + 100 * sample
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.7, seed=seed)
        completions = engine.generate_branches(prompt.messages, args.branches, params)
        decisions = vote_arms(completions, prompt)
        row = {"workload": prompt.workload, "question": prompt.question, "gold": prompt.gold, "seed": seed,
               "branches": [c.text for c in completions]}
        for arm, decision in decisions.items():
            arm_counts = counts[(prompt.workload, arm)]
            sizes = decision.vote.sizes
            arm_counts.top.append(sizes[0] if sizes else 0)
            arm_counts.clusters.append(len(sizes))
            arm_counts.branches.append(len(completions))
            if prompt.gold is not None:
                arm_counts.gold_hits.append(prompt.gold.lower() in completions[decision.chosen_branch].text.lower())
            row[arm] = {"sizes": list(sizes), "chosen_branch": decision.chosen_branch}
        rows.append(row)
        print(f"[{number + 1}/{len(prompts) * args.samples}] {prompt.question} (seed {seed}): " +
              "  ".join(f"{arm} {row[arm]['sizes']}" for arm in ARMS), flush=True)

    summary = {f"{w}/{arm}": c.summary() for (w, arm), c in counts.items()}
    table = ["| workload | vote | queries | majority (top > n/2) | top cluster >= 2 | mean top cluster | mean clusters | gold in answer |",
             "|---|---|---|---|---|---|---|---|"]
    for (workload, arm), c in counts.items():
        s = c.summary()
        gold = "-" if s["gold_in_answer"] is None else f"{s['gold_in_answer']}/{s['queries']}"
        table.append(f"| {workload} | {arm} | {s['queries']} | {s['majority']}/{s['queries']} | "
                     f"{s['top_at_least_2']}/{s['queries']} | {s['mean_top']} | {s['mean_clusters']} | {gold} |")
    print("\n".join(table))
    print(f"{len(prompts)} prompts x {args.samples} samples x {args.branches} branches in {time.perf_counter() - start:.0f}s")
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    if args.json_out:
        harness.write_json(args.json_out, {"args": vars(args), "summary": summary, "rows": rows})


if __name__ == "__main__":
    main()
