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

What a run is asked (``BenchConfig``) lives in ``rksc_bench.config`` and what it measured
(``BenchReport``) in ``rksc_bench.report``; this module runs the arms and fills the report.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from rksc_bench.config import INSTRUCTION_WORDINGS, BenchConfig
from rksc_bench.report import ArmRecord, ArmSetup, BenchReport, render_markdown
from rksc_engine import RKSCEngine
from rksc_engine.config import EngineConfig, RSBCMConfig, SamplingParams
from rksc_engine.evaluation.workloads import (
    LadderProblem,
    ladder_problems,
    ladder_shots,
    load_choice_jsonl,
    load_gsm8k_jsonl,
    solution_steps,
    synthetic_choice_problems,
    synthetic_problems,
)
from rksc_engine.reasoning.answers import extract_gsm8k_answer
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.early_stop import EARLY_STOP_RULES, EarlyStopConfig, EarlyStopMonitor, resolve_early_stop
from rksc_engine.reasoning.few_shot import Problem, few_shot_messages
from rksc_engine.reasoning.self_consistency import (
    BranchAnswer,
    branch_answers,
    extract_choice_letter,
    submit_branches,
    verify_and_pick,
)
from rksc_engine.reasoning.verifier import JUDGE_SYSTEM_PROMPT, JUDGE_TEMPLATE, CallableVerifier, LLMJudgeVerifier

JUDGE_PROMPTS = {
    "gsm8k": JUDGE_SYSTEM_PROMPT,
    "choice": "You check answers to multiple-choice questions. Reply with Yes or No only.",
}


# -- questions ------------------------------------------------------------------------------------
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

    @property
    def setup(self) -> ArmSetup:
        """What this arm runs, read from its engine's configuration (an older build may lack a part)."""
        config = self.engine.config
        cache = getattr(config, "rsbcm", None) or getattr(config, "prefix_cache", None)
        asks = getattr(config, "asks", None)
        return ArmSetup(
            shared_prefill=self.share_prefill, prefix_cache=bool(getattr(cache, "enabled", False)),
            asks=bool(getattr(asks, "enabled", False)), cgee=self.cgee.skip_enabled or self.cgee.exit_enabled,
            early_stop=_rules_on(self.early_stop))

    def run(self, q: int, problem: Problem, shots: list[Problem], config: BenchConfig) -> ArmRecord:
        engine = self.engine
        before = engine.stats()
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
        after = engine.stats()
        return ArmRecord(
            self.name, q, wall, after.prompt_tokens_computed - before.prompt_tokens_computed, answer, problem.answer,
            solution_steps(problem), verified=bool(report.scores), skipped=report.skipped,
            exit_layers=[x for x in report.exit_layers if x is not None], num_layers=report.num_layers,
            level=_level(problem), asks_reused_tokens=after.asks_reused_tokens - before.asks_reused_tokens,
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


def _rules_on(early_stop: EarlyStopConfig | None) -> str | None:
    """The early-stop rules ``early_stop`` runs, comma-joined (``"decided"``); None when off."""
    if early_stop is None:
        return None
    rules = [rule for rule in EARLY_STOP_RULES if getattr(early_stop, rule)]
    return ", ".join(rules) or None


def _params(config: BenchConfig, seed: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                          top_p=config.top_p, seed=seed, stop=("<|im_end|>",))


def _engine_config(name: str) -> EngineConfig | None:
    """The engine configuration of an arm; None when this rksc build lacks what the arm needs."""
    if name == "rksc":
        return EngineConfig()  # the shipped defaults, whatever they are
    has_asks = "asks" in {f.name for f in dataclasses.fields(EngineConfig)}
    reuse = name not in ("no_reuse", "cgee_only")
    if "enabled" in {f.name for f in dataclasses.fields(RSBCMConfig)}:
        kwargs: dict[str, Any] = {"rsbcm": RSBCMConfig(enabled=reuse)}
    else:  # a build from before the cache had one config
        from rksc_engine.config import PrefixCacheConfig  # type: ignore[attr-defined]

        kwargs = {"prefix_cache": PrefixCacheConfig(enabled=reuse)}
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
    setups = {arm.name: arm.setup for arm in arms if isinstance(arm, _EngineArm)}
    return BenchReport(config, records, unavailable, machine, tree_bytes, tree_budget, setups)


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


def save_report(report: BenchReport, out_dir: Path, plots: bool = True) -> list[Path]:
    """Write ``bench.json``, ``bench.md`` and (with matplotlib) the PNG plots; returns the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / "bench.json", out_dir / "bench.md"]
    paths[0].write_text(json.dumps(report.to_json(), indent=2))
    paths[1].write_text(render_markdown(report) + "\n")
    if plots:
        from rksc_bench.plots import plot_report

        paths += plot_report(report, out_dir)
    return paths

