"""Few-shot chat prompts for reasoning: the worked-example ``Problem`` and the messages that put
worked examples before a question, so that every question sharing the shots shares one prompt prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

SYSTEM_PROMPT = (
    "You solve grade-school math word problems. Reason step by step in short sentences, "
    "then give the final answer on its own line as '#### <number>'."
)
CHOICE_SYSTEM_PROMPT = (
    "You answer multiple-choice questions. Reason briefly in short sentences, "
    "then end with 'The answer is <letter>.'"
)


@dataclass(frozen=True)
class Problem:
    """A question with its worked solution and numeric answer (as a string, GSM8K style)."""

    question: str
    solution: str
    answer: str


def check_problems(value: object, name: str = "few_shot") -> list[Problem]:
    """``value`` as a list of ``Problem``s, or a ``TypeError`` naming ``name``.

    A string is refused although it is a sequence: ``few_shot="..."`` would otherwise be read one
    character at a time.
    """
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of rksc_engine.reasoning.Problem (e.g. synthetic_problems(8)), "
                        f"got {type(value).__name__}")
    bad = [i for i, item in enumerate(value) if not isinstance(item, Problem)]
    if bad:
        raise TypeError(f"{name} must be a list of rksc_engine.reasoning.Problem; {name}[{bad[0]}] is a "
                        f"{type(value[bad[0]]).__name__}")
    return list(value)


def few_shot_messages(question: str, shots: list[Problem], system_prompt: str = SYSTEM_PROMPT) -> list[dict]:
    """Chat messages: a system instruction, the worked examples as user/assistant turns, the question.

    Everything before the final question is identical across questions that use the same shots,
    which is the prefix the engine computes once and caches.
    """
    messages = [{"role": "system", "content": system_prompt}]
    for shot in shots:
        messages.append({"role": "user", "content": shot.question})
        messages.append({"role": "assistant", "content": shot.solution})
    messages.append({"role": "user", "content": question})
    return messages
