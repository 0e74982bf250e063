"""Self-consistency with a verifier: n branches over one shared prefix, answers voted, the vote
verified (or the verification skipped by CGEE level 1), and one answer picked.

Picking rule: when verification runs, each candidate's confidence-weighted vote share ``p(a)`` is
multiplied by its verifier score ``s(a)`` and the largest product wins (ties: the vote winner).
When it is skipped, the vote winner is the answer.
"""

from __future__ import annotations

import re
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .answers import extract_gsm8k_answer, majority_vote
from .cgee import VoteSummary, pick_answer, should_skip, summarise_votes
from .config import CGEEConfig, SamplingParams
from .datasets import Problem, check_problems, few_shot_messages
from .verifier import CandidateScore, LLMJudgeVerifier, Verifier, as_verifier

AnswerExtractor = Callable[[str], "str | None"]
_LETTER = re.compile(r"(?:answer(?: is)?\s*[:(]?\s*|\(|^|\s)([A-E])(?:\)|\.|\s|$)", re.IGNORECASE | re.MULTILINE)


_STATED = re.compile(r"answer(?: is)?\s*[:(]?\s*\(?([A-E])\b", re.IGNORECASE)


def extract_choice_letter(text: str) -> str | None:
    """A multiple-choice letter A-E, upper-cased: the last one stated as "answer is X" / "answer: (X)",
    else the last standalone letter (``(B)``, ``D.``)."""
    stated = _STATED.findall(text)
    if stated:
        return stated[-1].upper()
    hits = _LETTER.findall(text)
    return hits[-1].upper() if hits else None


def regex_extractor(pattern: str, group: int = 1) -> AnswerExtractor:
    """An extractor returning ``group`` of the last match of ``pattern``, stripped."""
    compiled = re.compile(pattern)

    def extract(text: str) -> str | None:
        matches = list(compiled.finditer(text))
        return matches[-1].group(group).strip() if matches else None

    return extract


EXTRACTORS: dict[str, AnswerExtractor] = {"gsm8k": extract_gsm8k_answer, "choice": extract_choice_letter}
# Sampling of each branch when ``reason`` is given no ``params``.
DEFAULT_REASON_PARAMS = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=160, stop=("<|im_end|>",))


@dataclass(frozen=True)
class BranchAnswer:
    text: str
    answer: str | None
    confidence: float


@dataclass
class VerificationReport:
    """What verification did for one question.

    Attributes:
        skipped: CGEE level 1 skipped the verifier.
        reason: Why it skipped or not.
        p / lead: The winner's confidence-weighted share and its lead over the runner-up.
        scores: Per-candidate verifier scores (empty when skipped).
        exit_layers: Per candidate, the layer the pass stopped at (``num_layers - 1`` = full depth).
        num_layers: Decoder layers of the judge model, when it has them.
        verify_s: Wall time spent verifying.
        check_s: Part of ``verify_s`` spent on the layer-exit checks themselves.
        time_saved_s: An *estimate* of the wall time CGEE saved on this call against verifying every
            candidate at full depth (see ``rksc_engine.verifier``): for a skip, the verifier's
            measured full-depth cost per candidate times the candidates; for a pass that stopped
            early, its measured seconds per layer times the layers not run, minus the checks' cost,
            so it is negative when the checks cost more than they saved. 0 for full verification;
            None for a skip before the verifier has measured any pass.
    """

    skipped: bool
    reason: str
    p: float
    lead: float
    scores: list[CandidateScore] = field(default_factory=list)
    exit_layers: list[int | None] = field(default_factory=list)
    num_layers: int | None = None
    verify_s: float = 0.0
    check_s: float = 0.0
    time_saved_s: float | None = 0.0

    @property
    def layers_saved(self) -> int:
        if self.num_layers is None:
            return 0
        return sum(self.num_layers - 1 - layer for layer in self.exit_layers if layer is not None)

    def summary(self) -> str:
        saved = "unknown" if self.time_saved_s is None else f"{self.time_saved_s * 1000:+.0f} ms"
        if self.skipped:
            return f"CGEE: verification skipped ({self.reason}); estimated time saved {saved}"
        parts = [f"CGEE: verified {len(self.scores)} candidates ({self.reason}) in {self.verify_s:.2f}s"]
        parts += [f"  {s.answer}: score={s.score:.3f} exit_layer={s.exit_layer}" for s in self.scores]
        if self.num_layers:
            parts.append(f"  layers saved: {self.layers_saved} of {self.num_layers * len(self.scores)} "
                         f"(exit checks cost {self.check_s * 1000:.1f} ms); estimated time saved {saved}")
        return "\n".join(parts)

    __str__ = summary


@dataclass
class ReasoningResult:
    """The chosen answer, the vote, every branch, and the verification report."""

    answer: str | None
    votes: Counter
    branches: list[BranchAnswer]
    verification: VerificationReport
    vote_summary: VoteSummary
    generate_s: float = 0.0
    completions: list = field(default_factory=list)  # the branches' Completions (token ids, cache reuse)

    @property
    def num_truncated(self) -> int:
        """Branches cut by ``max_new_tokens`` before stating an answer. When every branch was,
        ``answer`` is None and ``votes`` empty for want of tokens, not of agreement."""
        return sum(b.answer is None and c.finish_reason == "length" for b, c in zip(self.branches, self.completions))


def check_branch_count(name: str, value: Any) -> None:
    """``TypeError`` unless ``value`` is an int (not a bool), ``ValueError`` unless it is >= 1."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= 1, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def resolve_extractor(answer_extractor: str | AnswerExtractor) -> AnswerExtractor:
    """A built-in extractor by name (``"gsm8k"``, ``"choice"``) or the callable itself; anything else
    is a clear error."""
    if isinstance(answer_extractor, str):
        if answer_extractor not in EXTRACTORS:
            raise ValueError(f"answer_extractor must be a callable or one of {sorted(EXTRACTORS)}, got {answer_extractor!r}")
        return EXTRACTORS[answer_extractor]
    if not callable(answer_extractor):
        raise TypeError(f"answer_extractor must be a callable or a name, got {type(answer_extractor).__name__}")
    return answer_extractor


# One default judge per engine, so its measured pass costs carry across calls (time-saved estimates
# of skipped calls); weak keys let an engine be collected with its judge.
_DEFAULT_JUDGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def resolve_verifier(engine: Any, verifier: Verifier | Callable | None) -> Verifier:
    """The engine's own default judge (one per engine) for None, a ``Verifier`` as is, or a callable
    wrapped as a ``CallableVerifier``."""
    if verifier is None:
        judge = _DEFAULT_JUDGES.get(engine)
        if judge is None:
            judge = _DEFAULT_JUDGES[engine] = LLMJudgeVerifier(engine)
        return judge
    resolved = as_verifier(verifier)
    if resolved is None:
        raise TypeError(f"verifier must be a Verifier, a callable or None, got {type(verifier).__name__}")
    return resolved


def reason(
    engine: Any,
    question: str,
    *,
    n: int = 8,
    params: SamplingParams | None = None,
    few_shot: Sequence[Problem] = (),
    prompt: Any = None,
    answer_extractor: str | AnswerExtractor = "gsm8k",
    verifier: Verifier | Callable | None = None,
    cgee: CGEEConfig | None = None,
) -> ReasoningResult:
    """Answer ``question`` by verified self-consistency; see ``RKSCEngine.reason``.

    ``cgee=None`` uses the engine's ``EngineConfig.cgee``. Every argument is checked before anything
    is generated: a bad one raises ``TypeError``/``ValueError`` naming it, with the engine untouched.
    """
    plan = plan_reasoning(engine, question, n=n, params=params, few_shot=few_shot, prompt=prompt,
                          answer_extractor=answer_extractor, verifier=verifier, cgee=cgee)
    start = time.perf_counter()
    completions = engine.generate_branches(plan.messages, plan.n, plan.params)
    return finish_reasoning(plan, completions, time.perf_counter() - start)


async def areason(engine: Any, question: str, **kwargs: Any) -> ReasoningResult:
    """``reason`` for asyncio: the branches are awaited from the scheduler (the event loop stays
    free while they decode, batched with every other request); the verifier's one pass runs in a
    worker thread. Same arguments and result as ``reason``."""
    import asyncio

    plan = plan_reasoning(engine, question, **kwargs)
    start = time.perf_counter()
    completions = await engine.submit(plan.messages, plan.n, plan.params)
    return await asyncio.to_thread(finish_reasoning, plan, completions, time.perf_counter() - start)


@dataclass(frozen=True)
class ReasoningPlan:
    """A checked ``reason`` call: what to generate and how to judge it."""

    question: str
    messages: Any
    n: int
    params: SamplingParams
    extract: AnswerExtractor
    judge: Verifier
    cgee: CGEEConfig


def default_cgee(engine: Any) -> CGEEConfig:
    """The CGEE thresholds ``reason`` uses when given none: the engine's ``EngineConfig.cgee``, else the defaults."""
    return getattr(getattr(engine, "config", None), "cgee", None) or CGEEConfig()


def plan_reasoning(
    engine: Any,
    question: str,
    *,
    n: int = 8,
    params: SamplingParams | None = None,
    few_shot: Sequence[Problem] = (),
    prompt: Any = None,
    answer_extractor: str | AnswerExtractor = "gsm8k",
    verifier: Verifier | Callable | None = None,
    cgee: CGEEConfig | None = None,
) -> ReasoningPlan:
    """Check every argument of ``reason`` (nothing runs): ``TypeError``/``ValueError`` naming the bad one."""
    if not isinstance(question, str):
        raise TypeError(f"question must be a non-empty string, got {type(question).__name__}")
    if not question.strip():
        raise ValueError("question must be a non-empty string")
    check_branch_count("n", n)
    if params is None:
        params = DEFAULT_REASON_PARAMS
    elif not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams or None, got {type(params).__name__}")
    shots = check_problems(few_shot, "few_shot")
    if shots and prompt is not None:
        raise ValueError("pass few_shot or prompt, not both (prompt replaces the few-shot prompt)")
    if cgee is None:
        cgee = default_cgee(engine)
    if not isinstance(cgee, CGEEConfig):
        raise TypeError(f"cgee must be a CGEEConfig, got {type(cgee).__name__}")
    extract = resolve_extractor(answer_extractor)
    judge = resolve_verifier(engine, verifier)
    messages = prompt if prompt is not None else few_shot_messages(question, shots)

    return ReasoningPlan(question, messages, n, params, extract, judge, cgee)


def finish_reasoning(plan: ReasoningPlan, completions: Sequence[Any], generate_s: float) -> ReasoningResult:
    """Extract, vote, verify (or skip by CGEE) and pick, for the generated branches of ``plan``."""
    branches = [BranchAnswer(c.text, plan.extract(c.text), c.confidence) for c in completions]
    answer, report, summary = verify_and_pick(plan.question, branches, plan.judge, plan.cgee)
    _, votes = majority_vote([b.answer for b in branches])
    return ReasoningResult(answer, votes, branches, report, summary, generate_s, list(completions))


def verify_and_pick(
    question: str, branches: Sequence[BranchAnswer], judge: Verifier | None, cgee: CGEEConfig
) -> tuple[str | None, VerificationReport, VoteSummary]:
    """The CGEE decision for already generated branches: skip or verify, then pick the answer.

    ``judge=None`` votes only: the confidence-weighted vote winner is the answer, and the report
    still says whether CGEE level 1 would have skipped verification.
    """
    summary = summarise_votes([b.answer for b in branches], [b.confidence for b in branches])
    skip, why = should_skip(summary, cgee)
    report = VerificationReport(skipped=skip, reason=why, p=summary.p, lead=summary.lead)
    if judge is None:
        return summary.winner, report, summary
    candidates = [answer for answer, _ in summary.shares]
    if skip:
        estimate = getattr(judge, "estimate_full_s", None)
        report.time_saved_s = estimate(len(candidates)) if callable(estimate) else None
    if skip or summary.winner is None:
        return summary.winner, report, summary
    start = time.perf_counter()
    if isinstance(judge, LLMJudgeVerifier):
        report.scores, trace = judge.score_with_trace(question, candidates, cgee)
        report.num_layers, report.check_s, report.time_saved_s = trace.num_layers, trace.check_s, trace.time_saved_s
    else:
        report.scores = judge.score(question, candidates, cgee)
    report.verify_s = time.perf_counter() - start
    report.exit_layers = [s.exit_layer for s in report.scores]
    if [s.answer for s in report.scores] != candidates:
        raise ValueError("the verifier must return one score per candidate, in the order given")
    return pick_answer(summary, [s.score for s in report.scores]), report, summary
