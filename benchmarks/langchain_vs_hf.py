"""Benchmark: an 8-branch self-consistency chain in LangChain, langchain-huggingface versus rksc.

Each question is answered by the same chain, ``few-shot prompt -> n sampled branches -> extract
answers -> vote``, over a ~1,300-token few-shot chat prompt (seeded synthetic GSM8K-style problems),
with the same loaded weights (the embedded SmolLM2-135M-Instruct, fp32) and the same sampling
settings (temperature 0.7, top-p 0.95, up to ``--max-new-tokens`` per branch). Three arms:

* ``HF pipeline``: ``HuggingFacePipeline(pipeline=transformers.pipeline("text-generation", ...),
  batch_size=n).batch([prompt] * n)``, the fastest way langchain-huggingface offers to draw n
  samples: one ``model.generate`` over an n-row batch, which prefills the prompt n times.
  (``ChatHuggingFace`` keeps one generation per call, so n samples cost n separate calls; the
  pipeline arm is the stronger baseline.) Plain majority vote, as the pipeline returns no logprobs.
* ``ChatRKSC(n)``: ``ChatRKSC(n=8)`` on the same chat prompt; the n branches share one prefill of
  the prompt and decode as one batch, and the prefix cache serves the few-shot part from the
  previous question. Plain majority vote: the same chain, only the model swapped.
* ``MultiBranchReasoner``: the full rksc pipeline, confidence-weighted vote plus the engine's Yes/No
  judge under CGEE (it skips the judge only when the vote is confident), so it does more work than
  the other two arms.

The rksc arms each get their own engine (own prefix cache) over the same model object. Arms run
interleaved, their order rotating per question, so machine drift hits all alike. Reported per arm:
total wall time and its ratio to the HF arm, prompt tokens computed (HF: counted by a hook on the
decoder's prefill calls; rksc: the engine's counters, judge included), and answers: agreement of
each rksc arm's answer with the HF arm's vote winner, and accuracy against the problems' answers.
The arms sample with different random generators, so agreement measures how stable the vote is
under resampling, not exactness (greedy exactness is checked by the tests).

Run it (results also go to ``benchmarks/results/langchain_vs_hf.json``):

    flock /tmp/rksc-bench.lock ./dev python benchmarks/langchain_vs_hf.py --questions 2 --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch
from tqdm.auto import tqdm

from rksc_bench import harness
from rksc_bench.prompts import shots_to_length
from rksc_engine import RKSCEngine
from rksc_engine.evaluation.workloads import synthetic_problems
from rksc_engine.reasoning.answers import extract_gsm8k_answer, majority_vote
from rksc_engine.reasoning.few_shot import Problem, few_shot_messages

TEMPERATURE, TOP_P = 0.7, 0.95
ARM_HF = "HF pipeline (langchain-huggingface)"
ARM_CHAT = "ChatRKSC(n) + vote"
ARM_REASONER = "MultiBranchReasoner (vote + judge/CGEE)"
ARMS = (ARM_HF, ARM_CHAT, ARM_REASONER)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__)
    parser.add_count("--questions", 2, "questions answered by every arm (~10 minutes on a busy 2-core machine)")
    parser.add_count("--branches", 8, "sampled branches per question")
    parser.add_max_new_tokens(96, "token budget per branch")
    parser.add_count("--prompt-tokens", 1300, "few-shot prompt length to reach")
    parser.add_seed(0, "seed of the problems and of the samplers")
    parser.add_threads()
    return parser.parse_args(argv)


class PrefillCounter:
    """Counts the tokens the decoder body computes, split into prefill calls (more than one token per
    row) and decode calls, via a forward pre-hook; shared by all arms, reset around each one."""

    def __init__(self, decoder: torch.nn.Module) -> None:
        self.prefill_tokens = self.decode_tokens = 0
        self.handle = decoder.register_forward_pre_hook(self._count, with_kwargs=True)

    def _count(self, _module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            return
        batch, length = ids.shape  # (B, T)
        if length > 1:
            self.prefill_tokens += batch * length
        else:
            self.decode_tokens += batch

    def reset(self) -> None:
        self.prefill_tokens = self.decode_tokens = 0


@dataclass
class ArmRecord:
    wall_s: list[float] = field(default_factory=list)
    prompt_tokens_computed: list[int] = field(default_factory=list)
    answers: list[str | None] = field(default_factory=list)


def build_shots(engine: RKSCEngine, question: str, target_tokens: int, seed: int) -> list[Problem]:
    """Synthetic shots added until the rendered prompt for ``question`` reaches ``target_tokens``."""
    return shots_to_length(engine, question, synthetic_problems(400, seed=seed + 1000), target_tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from langchain_huggingface import HuggingFacePipeline
    except ImportError as exc:
        raise SystemExit("this benchmark needs langchain-huggingface: .venv/bin/pip install langchain-huggingface") from exc
    from langchain_core.prompts import ChatPromptTemplate
    from transformers import pipeline

    from rksc_integrations.langchain import ChatRKSC, MultiBranchReasoner

    harness.start_run(args)
    torch.manual_seed(args.seed)
    base = harness.load_engine(args)
    model, tokenizer = base.model, base.tokenizer
    problems = synthetic_problems(args.questions, seed=args.seed)
    shots = build_shots(base, problems[0].question, args.prompt_tokens, args.seed)
    prompt_lengths = [len(base.encode(few_shot_messages(p.question, shots))) for p in problems]
    n, max_new = args.branches, args.max_new_tokens

    # -- the three chains, over the same model object ------------------------------------------
    def template(question: str) -> ChatPromptTemplate:
        messages = few_shot_messages(question, shots)
        role = {"system": "system", "user": "human", "assistant": "ai"}
        return ChatPromptTemplate.from_messages(
            [(role[m["role"]], m["content"].replace("{", "{{").replace("}", "}}")) for m in messages]
        )

    hf_llm = HuggingFacePipeline(
        pipeline=pipeline("text-generation", model=model, tokenizer=tokenizer, max_new_tokens=max_new,
                          do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0, return_full_text=False),
        batch_size=n,
    )
    chat = ChatRKSC(engine=RKSCEngine(model, tokenizer), n=n, temperature=TEMPERATURE, top_p=TOP_P,
                    max_tokens=max_new, seed=args.seed)
    reasoner = MultiBranchReasoner(engine=RKSCEngine(model, tokenizer), n=n, temperature=TEMPERATURE, top_p=TOP_P,
                                   max_tokens=max_new, seed=args.seed, few_shot=shots)

    def run_hf(problem: Problem) -> tuple[str | None, int | None]:
        # The same messages through the model's chat template, as ChatHuggingFace renders them.
        rendered = tokenizer.apply_chat_template(few_shot_messages(problem.question, shots), tokenize=False,
                                                 add_generation_prompt=True)
        texts = hf_llm.batch([rendered] * n)
        return majority_vote([extract_gsm8k_answer(t) for t in texts])[0], None

    def run_chat(problem: Problem) -> tuple[str | None, int | None]:
        before = chat.engine.stats().prompt_tokens_computed
        messages = template(problem.question).invoke({}).to_messages()
        result = chat.generate([messages])
        answers = [extract_gsm8k_answer(g.text) for g in result.generations[0]]
        return majority_vote(answers)[0], chat.engine.stats().prompt_tokens_computed - before

    def run_reasoner(problem: Problem) -> tuple[str | None, int | None]:
        out = reasoner.invoke(problem.question)
        return out.answer, out.cache.prompt_tokens_computed

    runners: dict[str, Callable[[Problem], tuple[str | None, int | None]]] = {
        ARM_HF: run_hf, ARM_CHAT: run_chat, ARM_REASONER: run_reasoner,
    }
    records = {arm: ArmRecord() for arm in ARMS}
    counter = PrefillCounter(model.get_decoder())
    print(f"{len(shots)}-shot prompt of {prompt_lengths[0]} tokens; {n} branches x up to {max_new} new tokens; "
          f"{args.questions} questions; torch threads {torch.get_num_threads()}", flush=True)
    try:
        for q, problem in enumerate(tqdm(problems, desc="questions")):
            order = ARMS[q % 3:] + ARMS[:q % 3]  # rotate, so no arm always runs first
            for arm in order:
                counter.reset()
                start = time.perf_counter()
                answer, engine_prompt_tokens = runners[arm](problem)
                records[arm].wall_s.append(time.perf_counter() - start)
                computed = counter.prefill_tokens if engine_prompt_tokens is None else engine_prompt_tokens
                records[arm].prompt_tokens_computed.append(computed)
                records[arm].answers.append(answer)
                tqdm.write(f"  q{q} {arm}: {records[arm].wall_s[-1]:.1f}s, prompt tokens computed {computed}, "
                           f"answer {answer} (gold {problem.answer})")
    finally:
        counter.handle.remove()

    gold = [p.answer for p in problems]
    hf = records[ARM_HF]
    rows = []
    for arm in ARMS:
        rec = records[arm]
        rows.append({
            "arm": arm,
            "total_wall_s": sum(rec.wall_s),
            "ratio_to_hf": sum(rec.wall_s) / sum(hf.wall_s),
            "hf_speedup": sum(hf.wall_s) / sum(rec.wall_s),
            "prompt_tokens_computed": sum(rec.prompt_tokens_computed),
            "agreement_with_hf_vote": sum(a == b for a, b in zip(rec.answers, hf.answers)) / len(problems),
            "accuracy": sum(a == g for a, g in zip(rec.answers, gold)) / len(problems),
            "wall_s_per_question": rec.wall_s,
            "prompt_tokens_per_question": rec.prompt_tokens_computed,
            "answers": rec.answers,
        })
    print(f"\n{'arm':<42} {'wall s':>8} {'ratio to HF':>12} {'HF/arm':>7} {'prompt tok':>11} {'agree HF':>9} {'acc':>5}")
    for r in rows:
        print(f"{r['arm']:<42} {r['total_wall_s']:>8.1f} {r['ratio_to_hf']:>11.2f}x {r['hf_speedup']:>6.2f}x "
              f"{r['prompt_tokens_computed']:>11,} {r['agreement_with_hf_vote']:>9.0%} {r['accuracy']:>5.0%}")
    print(f"gold answers: {gold}")
    harness.write_json(args.json_out, {
        "args": vars(args),
        "num_shots": len(shots), "prompt_tokens": prompt_lengths, "gold": gold,
        "torch_threads": torch.get_num_threads(), "arms": rows,
        "records": {arm: asdict(rec) for arm, rec in records.items()},
    })
    print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
