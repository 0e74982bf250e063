"""Prompts that several benchmark scripts send: essay chat turns, as independent requests or as the
sibling branches of one, and few-shot prompts grown to a length in tokens."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

from rksc_engine import RequestHandle, RKSCEngine, SamplingParams
from rksc_engine.reasoning.few_shot import Problem, few_shot_messages

TOPICS = ("rivers", "bread", "owls", "volcanoes", "chess", "tides", "bees", "glass", "comets", "maps",
          "tea", "bridges", "whales", "clocks", "salt", "kites")


def essay_chat(index: int) -> list[dict[str, str]]:
    """Chat turn ``index``: a request for a long essay, its topic cycling through ``TOPICS``, so that
    turns have about the same length and distinct prompts."""
    topic = TOPICS[index % len(TOPICS)]
    return [{"role": "user", "content": f"Write a long essay about {topic} (essay {index})."}]


def submit_independent(engine: RKSCEngine, rows: int, params: SamplingParams) -> list[RequestHandle]:
    """``rows`` single-branch requests, each its own essay chat turn (the workload of a chat server)."""
    return [engine.submit(essay_chat(i), 1, params) for i in range(rows)]


def submit_siblings(engine: RKSCEngine, rows: int, params: SamplingParams) -> list[RequestHandle]:
    """One request of ``rows`` branches of one essay chat turn (the multi-branch workload)."""
    return [engine.submit(essay_chat(0), rows, params)]


# The two shapes of a decode batch of ``rows`` rows; each submits its requests and returns their handles.
CHAT_ARMS: dict[str, Callable[[RKSCEngine, int, SamplingParams], list[RequestHandle]]] = {
    "independent": submit_independent,
    "siblings": submit_siblings,
}


def shots_to_length(engine: RKSCEngine, question: str, pool: Sequence[Problem], target_tokens: int, *,
                    start: int = 0, system_prompt: str | None = None) -> list[Problem]:
    """Worked examples for a few-shot prompt of at least ``target_tokens`` tokens: consecutive
    problems of ``pool`` from ``start`` (wrapping around), added until ``few_shot_messages(question,
    shots)`` encodes to that many tokens. With every problem of the pool used and the prompt still
    shorter, it warns on stderr and returns them all."""
    if not pool:
        raise ValueError("pool must hold at least one problem")
    extra = {} if system_prompt is None else {"system_prompt": system_prompt}
    shots: list[Problem] = []
    while len(engine.encode(few_shot_messages(question, shots, **extra))) < target_tokens:
        if len(shots) == len(pool):
            print(f"warning: the prompt stays under {target_tokens} tokens with all {len(pool)} shots",
                  file=sys.stderr)
            break
        shots.append(pool[(start + len(shots)) % len(pool)])
    return shots


def few_shot_prompt_ids(engine: RKSCEngine, problems: Sequence[Problem], target_tokens: int) -> tuple[list[int], int]:
    """A few-shot prompt's token ids: ``problems[0]`` is the question, and worked examples from the
    rest are added (``shots_to_length``) until the prompt reaches ``target_tokens``.

    Returns:
        ``(token_ids, number_of_shots)``.
    """
    question = problems[0].question
    shots = shots_to_length(engine, question, problems[1:], target_tokens)
    return engine.encode(few_shot_messages(question, shots)), len(shots)
