"""What one ``rksc bench`` run is asked to do: ``BenchConfig``, with the arms, workloads and
instruction wordings it chooses from."""

from __future__ import annotations

from dataclasses import dataclass

from rksc_engine.config import check_type
from rksc_engine.evaluation.workloads import LADDER_LEVELS
from rksc_engine.reasoning.few_shot import CHOICE_SYSTEM_PROMPT, SYSTEM_PROMPT

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
        check_type("levels", self.levels, (tuple, list))
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
            check_type(name, value, int)
            if value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        check_type("ensemble", self.ensemble, int)
        if not 1 <= self.ensemble <= MAX_ENSEMBLE or self.branches % self.ensemble:
            raise ValueError(f"ensemble must be in [1, {MAX_ENSEMBLE}] and divide branches "
                             f"({self.branches}), got {self.ensemble}")
        check_type("tree_budget_mb", self.tree_budget_mb, (int, float))
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

