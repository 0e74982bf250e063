"""The paper's comparison, measured in one run: verified self-consistency under several KV-reuse arms.

Every arm answers the same questions with the same ``n`` sampled branches per question (branch ``i``
of question ``q`` is seeded ``seed + 1000 q + i`` everywhere), extracts and votes the answers, and
verifies the vote with the model as a Yes/No judge. The arms differ only in what they recompute:

    ``no_reuse``      every branch and every verifier call computes its whole prompt (no cache);
    ``cgee_only``     as ``no_reuse``, with CGEE deciding whether and how deeply to verify;
    ``token_exact``   one prefill per prompt shared by its branches, plus a token-exact radix cache
                      across calls: what vLLM's / SGLang's prefix caching give you;
    ``asks``          ``token_exact`` plus ASKS, reusing KV across prompts that differ in wording;
    ``rksc``          ASKS and CGEE together, the engine's defaults;
    ``langchain_hf``  what users run today: ``langchain-huggingface``'s ``HuggingFacePipeline`` over
                      the same loaded weights, one pipeline call per branch and per judged candidate.

Arms run interleaved, question by question in a rotating order, so machine drift cancels out of the
ratios. With ``ensemble > 1`` branches are split over that many differently worded instructions
(prompt-ensemble self-consistency), the case where token-exact caching cannot share a prompt across
branches and ASKS can.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rksc_engine import RKSCEngine
from rksc_engine.answers import extract_gsm8k_answer
from rksc_engine.cgee import CGEEConfig
from rksc_engine.config import EngineConfig, PrefixCacheConfig, SamplingParams, _check_type
from rksc_engine.datasets import (
    CHOICE_SYSTEM_PROMPT,
    LADDER_LEVELS,
    SYSTEM_PROMPT,
    LadderProblem,
    Problem,
    few_shot_messages,
    ladder_problems,
    ladder_shots,
    load_choice_jsonl,
    load_gsm8k_jsonl,
    solution_steps,
    synthetic_choice_problems,
    synthetic_problems,
)
from rksc_engine.early_stop import EarlyStopConfig, EarlyStopMonitor, resolve_early_stop
from rksc_engine.reasoning import BranchAnswer, branch_answers, extract_choice_letter, submit_branches, verify_and_pick
from rksc_engine.verifier import JUDGE_SYSTEM_PROMPT, JUDGE_TEMPLATE, CallableVerifier, LLMJudgeVerifier

ARMS = ("no_reuse", "cgee_only", "token_exact", "asks", "rksc", "langchain_hf")
WORKLOADS = ("gsm8k", "choice", "ladder")
# The answer format of each workload: it picks the instruction wordings, the judge prompt and the
# answer extractor. The ladder's questions are GSM8K-style word problems with ``#### n`` answers,
# so it is asked, extracted and judged exactly as the gsm8k workload is.
ANSWER_FORMATS = {"gsm8k": "gsm8k", "choice": "choice", "ladder": "gsm8k"}

# Differently worded instructions for prompt-ensemble self-consistency, per answer format; the
# first is the engine's default system prompt, the others say the same thing another way.
INSTRUCTION_WORDINGS = {
    "gsm8k": (
        SYSTEM_PROMPT,
        "Work through the question carefully and finish with a line of the form '#### <number>'.",
        "Think it over one step at a time. End your reply with '#### ' followed by the number.",
        "Reason about the problem in short steps and write the result last, as '#### <number>'.",
        "Explain your working briefly, then state the numeric answer after '#### '.",
        "Break the problem into steps, solve each, and close with '#### <number>'.",
        "Carefully compute the answer, showing each step, and put '#### <number>' at the end.",
        "Solve it. Show your reasoning, then write '#### ' and the final number.",
    ),
    "choice": (
        CHOICE_SYSTEM_PROMPT,
        "Pick the correct option. Think briefly, then finish with 'The answer is <letter>.'",
        "Read the choices, reason in a sentence or two, and end with 'The answer is <letter>.'",
        "Choose one letter. Explain shortly, then write 'The answer is <letter>.'",
        "Answer the multiple-choice question: brief reasoning, then 'The answer is <letter>.'",
        "Decide which option is right, say why in short, and close with 'The answer is <letter>.'",
        "Consider each option briefly and end your reply with 'The answer is <letter>.'",
        "Solve it and give the letter of the right option last, as 'The answer is <letter>.'",
    ),
}
JUDGE_PROMPTS = {
    "gsm8k": JUDGE_SYSTEM_PROMPT,
    "choice": "You check answers to multiple-choice questions. Reply with Yes or No only.",
}
MAX_ENSEMBLE = min(len(w) for w in INSTRUCTION_WORDINGS.values())


@dataclass(frozen=True)
class BenchConfig:
    """One ``rksc bench`` run.

    Attributes:
        workload: ``"gsm8k"`` (8-shot chain of thought, ``#### x`` answers), ``"choice"``
            (multiple-choice few-shot, letter answers) or ``"ladder"`` (the difficulty ladder:
            generated word problems of exactly 1 to 4 steps, ``#### x`` answers, one-step worked
            examples worded unlike the questions, so the model must transfer the method rather
            than copy a wording). Default ``"gsm8k"``.
        data: JSONL of questions (GSM8K ``question``/``answer``; multiple-choice
            ``question``/``choices``/``answerKey``). None uses the built-in synthetic generator.
            The ladder is always generated (its levels are what it measures), so it takes no data:
            run a GSM8K JSONL as ``workload="gsm8k"``.
        questions: Questions answered per arm (>= 1). Default 8. On the ladder they are spread
            evenly over ``levels`` (interleaved level by level, so any count is as balanced as it
            can be).
        levels: The ladder's levels (distinct ints from 1 to 4) to draw questions from. Default
            all four; only the ladder workload takes other values.
        branches: Sampled branches per question (>= 1). Default 8.
        shots: Worked examples in the prompt (>= 0). Default 8, about 1,300 tokens on the default model.
        ensemble: Instruction wordings the branches are split over (1..8, must divide ``branches``);
            1 is plain self-consistency. Default 1.
        max_new_tokens: Per branch (>= 1). Default 128.
        temperature / top_p: Branch sampling. Default 0.7 / 0.95.
        seed: Base seed. Default 0.
        arms: Which arms to run, a subset of ``ARMS``. Default all.
        model: A local model directory, or None for the embedded default.
        tree_depth: Depth of one RSBCM tree search (breadth 3, beam 2) on the first question whose
            cache bytes are plotted; 0 skips it. Default 4.
        tree_budget_mb: The cache budget of that search, in MiB (> 0). Default 64.
    """

    workload: str = "gsm8k"
    data: str | None = None
    questions: int = 8
    branches: int = 8
    shots: int = 8
    ensemble: int = 1
    max_new_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 0.95
    seed: int = 0
    arms: tuple[str, ...] = ARMS
    model: str | None = None
    tree_depth: int = 4
    tree_budget_mb: float = 64.0
    levels: tuple[int, ...] = LADDER_LEVELS

    def __post_init__(self) -> None:
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {list(WORKLOADS)}, got {self.workload!r}")
        _check_type("levels", self.levels, (tuple, list))
        levels = tuple(self.levels)
        if (not levels or not all(isinstance(x, int) and not isinstance(x, bool) and x in LADDER_LEVELS for x in levels)
                or len(set(levels)) != len(levels)):
            raise ValueError(f"levels must be distinct ints from 1 to 4, got {list(levels)}")
        if self.workload != "ladder" and levels != LADDER_LEVELS:
            raise ValueError(f"levels applies to the ladder workload only, got {list(levels)} with workload {self.workload!r}")
        if self.workload == "ladder" and self.data is not None:
            raise ValueError("data cannot be used with the ladder workload, whose questions are generated; "
                             "run a GSM8K JSONL with workload 'gsm8k'")
        for name, low in (("questions", 1), ("branches", 1), ("shots", 0), ("max_new_tokens", 1), ("seed", 0), ("tree_depth", 0)):
            value = getattr(self, name)
            _check_type(name, value, int)
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        _check_type("ensemble", self.ensemble, int)
        if not 1 <= self.ensemble <= MAX_ENSEMBLE or self.branches % self.ensemble:
            raise ValueError(f"ensemble must be in [1, {MAX_ENSEMBLE}] and divide branches "
                             f"({self.branches}), got {self.ensemble}")
        _check_type("tree_budget_mb", self.tree_budget_mb, (int, float))
        if not self.tree_budget_mb > 0:
            raise ValueError(f"tree_budget_mb must be > 0, got {self.tree_budget_mb}")
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown or not self.arms:
            raise ValueError(f"arms must be a non-empty subset of {list(ARMS)}, got {list(self.arms)}")
        object.__setattr__(self, "levels", levels)  # a list becomes a tuple: the config stays hashable

    @property
    def answer_format(self) -> str:
        """``"gsm8k"`` or ``"choice"``: how this workload's answers are asked for, extracted and judged."""
        return ANSWER_FORMATS[self.workload]


@dataclass
class ArmRecord:
    """What one arm did for one question."""

    arm: str
    question_index: int
    wall_s: float
    prompt_tokens_computed: int
    answer: str | None
    gold: str
    difficulty: int
    verified: bool
    skipped: bool
    exit_layers: list[int] = field(default_factory=list)
    num_layers: int | None = None
    level: int | None = None  # the question's ladder level; None outside the ladder workload

    @property
    def correct(self) -> bool:
        return self.answer is not None and _same_answer(self.answer, self.gold)

    @property
    def early_exited(self) -> bool:
        return bool(self.exit_layers) and self.num_layers is not None and min(self.exit_layers) < self.num_layers - 1


@dataclass
class BenchReport:
    config: BenchConfig
    records: list[ArmRecord]
    unavailable: dict[str, str]  # arm -> why it did not run
    machine: dict[str, Any]
    tree_cache_bytes: list[int] = field(default_factory=list)  # after each expansion of the tree search
    tree_budget_bytes: int = 0

    def arm_records(self, arm: str) -> list[ArmRecord]:
        return [r for r in self.records if r.arm == arm]

    def arms_run(self) -> list[str]:
        return [a for a in self.config.arms if self.arm_records(a)]

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per arm: totals, ratios to ``no_reuse`` and ``token_exact``, accuracy and agreement."""
        walls = {a: sum(r.wall_s for r in self.arm_records(a)) for a in self.arms_run()}
        reference = {r.question_index: r.answer for r in self.arm_records("token_exact")}
        out = {}
        for arm in self.arms_run():
            records = self.arm_records(arm)
            verified = [r for r in records if r.verified]
            out[arm] = {
                "wall_s": walls[arm],
                "speedup_vs_no_reuse": walls["no_reuse"] / walls[arm] if "no_reuse" in walls else None,
                "speedup_vs_token_exact": walls["token_exact"] / walls[arm] if "token_exact" in walls else None,
                "prompt_tokens_computed": sum(r.prompt_tokens_computed for r in records),
                "verifier_skipped": sum(r.skipped for r in records),
                "verifier_early_exited": sum(r.early_exited for r in verified),
                "questions": len(records),
                "accuracy": sum(r.correct for r in records) / len(records),
                "agreement_with_token_exact": (
                    sum(reference.get(r.question_index) == r.answer for r in records) / len(records)
                    if reference else None
                ),
            }
        return out

    def skip_rate_by_difficulty(self, arm: str = "rksc") -> dict[int, tuple[int, int]]:
        """Difficulty (solution steps) -> (verifier calls skipped, questions)."""
        table: dict[int, list[int]] = defaultdict(lambda: [0, 0])
        for r in self.arm_records(arm):
            table[r.difficulty][0] += r.skipped
            table[r.difficulty][1] += 1
        return {k: (v[0], v[1]) for k, v in sorted(table.items())}

    def by_level(self, arm: str) -> dict[int, tuple[int, int, int]]:
        """Ladder level -> (answered correctly, verifier calls skipped, questions) for ``arm``;
        empty outside the ladder workload."""
        table: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])
        for r in self.arm_records(arm):
            if r.level is not None:
                row = table[r.level]
                row[0], row[1], row[2] = row[0] + r.correct, row[1] + r.skipped, row[2] + 1
        return {k: (v[0], v[1], v[2]) for k, v in sorted(table.items())}

    def to_json(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "machine": self.machine,
            "unavailable": self.unavailable,
            "summary": self.summary(),
            "skip_rate_by_difficulty": {str(k): v for k, v in self.skip_rate_by_difficulty().items()},
            "tree_search": {"cache_bytes_after_each_expansion": self.tree_cache_bytes, "budget_bytes": self.tree_budget_bytes},
            "records": [dataclasses.asdict(r) | {"correct": r.correct, "early_exited": r.early_exited} for r in self.records],
        }


# -- questions ------------------------------------------------------------------------------------
def _same_answer(a: str, b: str) -> bool:
    def norm(x: str) -> str:
        x = x.strip().replace(",", "").rstrip(".")
        return x[:-2] if x.endswith(".0") else x
    return norm(a).lower() == norm(b).lower()


def load_problems(config: BenchConfig) -> tuple[list[Problem], list[Problem]]:
    """``(few-shot examples, questions)`` for the configured workload."""
    if config.workload == "ladder":
        # Fixed shots (seed 1, as benchmarks/cgee.py uses) so runs with different seeds see the same
        # prompt; the first ``questions`` of an interleaved draw take every level in turn.
        per_level = math.ceil(config.questions / len(config.levels))
        questions = ladder_problems(per_level, config.levels, seed=config.seed)[: config.questions]
        return list(ladder_shots(config.shots, seed=1)), list(questions)
    total = config.shots + config.questions
    if config.workload == "gsm8k":
        problems = load_gsm8k_jsonl(config.data, limit=total) if config.data else synthetic_problems(total, seed=config.seed + 1)
    else:
        problems = load_choice_jsonl(config.data, limit=total) if config.data else synthetic_choice_problems(total, seed=config.seed + 1)
    if len(problems) < total:
        raise ValueError(f"need {total} problems (shots + questions), the data has {len(problems)}")
    return problems[: config.shots], problems[config.shots:]


def _messages(answer_format: str, question: str, shots: list[Problem], wording: int) -> list[dict]:
    return few_shot_messages(question, shots, system_prompt=INSTRUCTION_WORDINGS[answer_format][wording])


def _level(problem: Problem) -> int | None:
    return problem.level if isinstance(problem, LadderProblem) else None


# -- arms -----------------------------------------------------------------------------------------
class _EngineArm:
    """An arm that runs the rksc engine in one configuration."""

    def __init__(self, name: str, engine: RKSCEngine, *, share_prefill: bool, cgee: CGEEConfig,
                 extract: Callable[[str], str | None], early_stop: EarlyStopConfig | None = None) -> None:
        self.name, self.engine, self.share_prefill, self.cgee, self.extract = name, engine, share_prefill, cgee, extract
        self.early_stop = early_stop

    def run(self, q: int, problem: Problem, shots: list[Problem], config: BenchConfig) -> ArmRecord:
        engine = self.engine
        before = engine.stats().prompt_tokens_computed
        start = time.perf_counter()
        completions, branches = [], []
        per_wording = config.branches // config.ensemble
        for w in range(config.ensemble):
            messages = _messages(config.answer_format, problem.question, shots, w)
            base = config.seed + 1000 * q + w * per_wording
            params = _params(config, base)
            if self.share_prefill and self.early_stop is not None:
                branches += self._early_stopped(messages, per_wording, params)
                continue
            if self.share_prefill:
                completions += engine.generate_branches(messages, per_wording, params)
            else:
                # Each branch on its own: same seed as branch i of the batch, so the same text.
                completions += [engine.generate(messages, _params(config, base + i)) for i in range(per_wording)]
        branches += [BranchAnswer(c.text, self.extract(c.text), c.confidence) for c in completions]
        judge = LLMJudgeVerifier(engine, system_prompt=JUDGE_PROMPTS[config.answer_format])
        answer, report, _ = verify_and_pick(problem.question, branches, judge, self.cgee)
        wall = time.perf_counter() - start
        return ArmRecord(
            self.name, q, wall, engine.stats().prompt_tokens_computed - before, answer, problem.answer,
            solution_steps(problem), verified=bool(report.scores), skipped=report.skipped,
            exit_layers=[x for x in report.exit_layers if x is not None], num_layers=report.num_layers,
            level=_level(problem),
        )


    def _early_stopped(self, messages: list[dict], n: int, params: SamplingParams) -> list[BranchAnswer]:
        """``n`` branches under the arm's early-stop rules, as ``engine.reason`` runs them; branches a
        rule took out of the vote stay, unvoted."""
        monitor = EarlyStopMonitor(self.early_stop, n=n, extract=self.extract, max_new_tokens=params.max_new_tokens)
        return branch_answers(submit_branches(self.engine, messages, n, params, monitor).result(), self.extract, monitor)


class _LangChainHFArm:
    """``langchain-huggingface`` as users run it: a ``HuggingFacePipeline`` per role over the same
    weights, one pipeline call per branch, and the judge asked once per candidate for a Yes/No."""

    name = "langchain_hf"

    def __init__(self, model: Any, tokenizer: Any, config: BenchConfig, extract: Callable[[str], str | None]) -> None:
        from langchain_huggingface import HuggingFacePipeline
        from transformers import pipeline

        self.tokenizer, self.extract, self.answer_format = tokenizer, extract, config.answer_format
        self.branch_llm = HuggingFacePipeline(pipeline=pipeline(
            "text-generation", model=model, tokenizer=tokenizer, max_new_tokens=config.max_new_tokens,
            do_sample=True, temperature=config.temperature, top_p=config.top_p, return_full_text=False))
        self.judge_llm = HuggingFacePipeline(pipeline=pipeline(
            "text-generation", model=model, tokenizer=tokenizer, max_new_tokens=1, do_sample=False,
            return_full_text=False))
        self.prompt_tokens = 0

    def _render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def _count(self, text: str) -> None:
        self.prompt_tokens += len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _judge(self, question: str, candidates: Sequence[str]) -> list[float]:
        scores = []
        for candidate in candidates:
            text = self._render([{"role": "system", "content": JUDGE_PROMPTS[self.answer_format]},
                                 {"role": "user", "content": JUDGE_TEMPLATE.format(question=question, answer=candidate)}])
            self._count(text)
            scores.append(1.0 if self.judge_llm.invoke(text).strip().lower().startswith("yes") else 0.0)
        return scores

    def run(self, q: int, problem: Problem, shots: list[Problem], config: BenchConfig) -> ArmRecord:
        import torch

        self.prompt_tokens = 0
        start = time.perf_counter()
        texts = []
        per_wording = config.branches // config.ensemble
        for w in range(config.ensemble):
            prompt = self._render(_messages(config.answer_format, problem.question, shots, w))
            for i in range(per_wording):
                torch.manual_seed(config.seed + 1000 * q + w * per_wording + i)
                self._count(prompt)
                texts.append(self.branch_llm.invoke(prompt))
        # No logprobs come back from the pipeline, so every branch counts with confidence 1.
        branches = [BranchAnswer(t, self.extract(t), 1.0) for t in texts]
        answer, report, _ = verify_and_pick(problem.question, branches, CallableVerifier(self._judge), CGEEConfig.off())
        wall = time.perf_counter() - start
        return ArmRecord(self.name, q, wall, self.prompt_tokens, answer, problem.answer, solution_steps(problem),
                         verified=bool(report.scores), skipped=False, level=_level(problem))


def _params(config: BenchConfig, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                          top_p=config.top_p, seed=seed, stop=("<|im_end|>",))


def _engine_config(name: str) -> EngineConfig | None:
    """The engine configuration of an arm; None when this rksc build lacks what the arm needs."""
    if name == "rksc":
        return EngineConfig()  # the shipped defaults, whatever they are
    has_asks = "asks" in {f.name for f in dataclasses.fields(EngineConfig)}
    kwargs: dict[str, Any] = {"prefix_cache": PrefixCacheConfig(enabled=name not in ("no_reuse", "cgee_only"))}
    if has_asks:
        from rksc_engine.config import ASKSConfig

        kwargs["asks"] = ASKSConfig(enabled=name == "asks")
    elif name == "asks":
        return None
    return EngineConfig(**kwargs)


def build_arms(config: BenchConfig, model: Any, tokenizer: Any) -> tuple[list[Any], dict[str, str]]:
    extract = extract_gsm8k_answer if config.answer_format == "gsm8k" else extract_choice_letter
    cgee_on, cgee_off = CGEEConfig(), CGEEConfig.off()
    specs = {  # arm -> (share one prefill across branches, CGEE)
        "no_reuse": (False, cgee_off),
        "cgee_only": (False, cgee_on),
        "token_exact": (True, cgee_off),
        "asks": (True, cgee_off),
        "rksc": (True, cgee_on),
    }
    arms, unavailable = [], {}
    for name in config.arms:
        if name == "langchain_hf":
            try:
                arms.append(_LangChainHFArm(model, tokenizer, config, extract))
            except ImportError:
                unavailable[name] = "langchain-huggingface is not installed (pip install langchain-huggingface)"
            continue
        share, cgee = specs[name]
        engine_config = _engine_config(name)
        if engine_config is None:
            unavailable[name] = "this rksc build has no ASKS"
            continue
        # The rksc arm runs reason's shipped default, early stop "decided" (the vote's winner is the
        # full vote's). Not with an ensemble: there the vote pools several prompts' branches, and a
        # decision per prompt says nothing about the pooled winner.
        early_stop = resolve_early_stop("decided") if name == "rksc" and config.ensemble == 1 else None
        arms.append(_EngineArm(name, RKSCEngine(model, tokenizer, engine_config), share_prefill=share, cgee=cgee,
                               extract=extract, early_stop=early_stop))
    return arms, unavailable


# -- run and report -------------------------------------------------------------------------------
def run_bench(config: BenchConfig, *, model_and_tokenizer: tuple[Any, Any] | None = None, progress: bool = True) -> BenchReport:
    """Run every arm on every question, interleaved, and return the records.

    Args:
        config: What to run.
        model_and_tokenizer: An already loaded pair (tests pass a tiny model); default loads ``config.model``.
        progress: Show a tqdm bar over (question, arm) steps.
    """
    import os
    import platform

    import torch

    if model_and_tokenizer is None:
        loaded = RKSCEngine.from_pretrained(config.model, progress=progress)
        model_and_tokenizer = (loaded.model, loaded.tokenizer)
    model, tokenizer = model_and_tokenizer
    shots, problems = load_problems(config)
    arms, unavailable = build_arms(config, model, tokenizer)
    records: list[ArmRecord] = []
    bar = tqdm(total=len(problems) * len(arms), desc="rksc bench", disable=not progress)
    for q, problem in enumerate(problems):
        # Rotate the arm order per question so no arm always runs first (cold caches, warm CPU).
        for k in range(len(arms)):
            arm = arms[(q + k) % len(arms)]
            bar.set_postfix_str(f"q{q} {arm.name}")
            records.append(arm.run(q, problem, shots, config))
            bar.update()
    tree_bytes, tree_budget = _tree_search_trace(config, model, tokenizer, shots, problems[0]) if config.tree_depth else ([], 0)
    bar.close()
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
               "threads": torch.get_num_threads(), "dtype": str(next(model.parameters()).dtype)}
    return BenchReport(config, records, unavailable, machine, tree_bytes, tree_budget)


def _tree_search_trace(config: BenchConfig, model: Any, tokenizer: Any, shots: list[Problem],
                       problem: Problem) -> tuple[list[int], int]:
    """Cache bytes after each expansion of one seeded RSBCM tree search, and its budget."""
    from rksc_engine.config import RSBCMConfig

    engine = RKSCEngine(model, tokenizer, EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=config.tree_budget_mb)))
    result = engine.tree_search(
        problem.question, breadth=3, depth=config.tree_depth, beam=2,
        few_shot=shots, answer_extractor=config.answer_format,
        params=SamplingParams(temperature=config.temperature, top_p=config.top_p,
                              max_new_tokens=min(40, config.max_new_tokens), seed=config.seed),
    )
    return result.cache_bytes_trace, engine.prefix_cache.budget_bytes


def render_markdown(report: BenchReport) -> str:
    """The per-arm table, the ablation and the skip rate by difficulty (on the ladder, accuracy and
    skip rate by level), as markdown."""
    summary = report.summary()
    cfg = report.config

    def ratio(x: float | None) -> str:
        return "" if x is None else f"{x:.2f}x"

    workload = f"`{cfg.workload}`"
    if cfg.workload == "ladder":
        workload += f" (the difficulty ladder, levels {', '.join(map(str, cfg.levels))})"
    lines = [
        f"workload {workload}, {cfg.questions} questions x {cfg.branches} branches, {cfg.shots}-shot, "
        f"ensemble {cfg.ensemble}, up to {cfg.max_new_tokens} new tokens; {report.machine['cpus']} CPUs, "
        f"{report.machine['dtype']}",
        "",
        "| arm | wall s | vs no reuse | vs token-exact | prompt tokens computed | verifier skipped | early-exited | accuracy | agrees with token-exact |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for arm, s in summary.items():
        agree = "" if s["agreement_with_token_exact"] is None else f"{s['agreement_with_token_exact']:.0%}"
        lines.append(
            f"| {arm} | {s['wall_s']:.1f} | {ratio(s['speedup_vs_no_reuse'])} | {ratio(s['speedup_vs_token_exact'])} | "
            f"{s['prompt_tokens_computed']:,} | {s['verifier_skipped']}/{s['questions']} | "
            f"{s['verifier_early_exited']}/{s['questions']} | {s['accuracy']:.0%} | {agree} |"
        )
    for arm, why in report.unavailable.items():
        lines.append(f"| {arm} | not run: {why} | | | | | | | |")
    ablation = [(label, arm) for label, arm in (("neither", "no_reuse"), ("KV sharing (ASKS) alone", "asks"),
                                                ("CGEE alone", "cgee_only"), ("both", "rksc")) if arm in summary]
    if len(ablation) > 1 and "no_reuse" in summary:
        lines += ["", "| ablation | arm | speedup vs no reuse |", "|---|---|---:|"]
        lines += [f"| {label} | {arm} | {ratio(summary[arm]['speedup_vs_no_reuse'])} |" for label, arm in ablation]
    by_difficulty = report.skip_rate_by_difficulty()
    levels = {arm: report.by_level(arm) for arm in summary}
    if any(levels.values()):
        # A ladder level is its solution steps, so this table replaces the one by difficulty.
        arms = list(levels)
        skip = "rksc" in levels
        lines += ["", "| ladder level | questions | " + " | ".join(f"accuracy ({a})" for a in arms)
                  + (" | CGEE skipped (rksc arm) |" if skip else " |"),
                  "|---:|---:|" + "---:|" * (len(arms) + skip)]
        for level in sorted({lv for table in levels.values() for lv in table}):
            cells = [(levels[a].get(level) or (0, 0, 0)) for a in arms]
            n = max(c[2] for c in cells)
            row = [str(level), str(n)] + [f"{c[0] / c[2]:.0%}" if c[2] else "" for c in cells]
            if skip:
                s = levels["rksc"].get(level) or (0, 0, 0)
                row.append(f"{s[1]}/{s[2]}")
            lines.append("| " + " | ".join(row) + " |")
    elif by_difficulty:
        lines += ["", "| solution steps | CGEE skipped (rksc arm) |", "|---:|---:|"]
        lines += [f"| {d} | {s}/{n} |" for d, (s, n) in by_difficulty.items()]
    return "\n".join(lines)


def save_report(report: BenchReport, out_dir: Path, plots: bool = True) -> list[Path]:
    """Write ``bench.json``, ``bench.md`` and (with matplotlib) the PNG plots; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "bench.md"]
    paths[0].write_text(json.dumps(report.to_json(), indent=2))
    paths[1].write_text(render_markdown(report) + "\n")
    if plots:
        from .plots import plot_report

        paths += plot_report(report, out_dir)
    return paths

