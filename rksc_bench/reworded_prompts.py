"""The prompt-ensemble workload of the ASKS benchmarks (``benchmarks/asks.py``,
``benchmarks/asks_fidelity.py``): one question after differently worded system instructions, and
when a greedy decode of it has settled its answer."""

from __future__ import annotations

import re

from rksc_engine import RKSCEngine
from rksc_engine.reasoning.answers import extract_gsm8k_answer

# A greedy decode runs at least this many tokens, so that fidelity is compared over a window this long.
GREEDY_WINDOW = 32
# The workload whose answers are the first generated line, not a ``#### x`` line.
AGENT_WORKLOAD = "agent template"
GSM8K_DONE = re.compile(r"####\s*-?[\d,.]+\s*\n")

WORDINGS = [
    "You solve grade-school math word problems. Reason step by step in short sentences, then give the "
    "final answer on its own line as '#### <number>'.",
    "Solve the grade-school math word problem. Think step by step in brief sentences and put the final "
    "answer alone on the last line as '#### <number>'.",
    "You are a careful math tutor. Work through each problem step by step, briefly, and finish with the "
    "answer on its own line in the form '#### <number>'.",
    "Answer the arithmetic word problem. Show short step-by-step reasoning, then write the final number "
    "on a separate line as '#### <number>'.",
    "Reason through the math problem one short step at a time. End with a line containing only '#### ' "
    "followed by the answer.",
    "Work out the answer to this word problem with brief step-by-step reasoning; the last line must be "
    "'#### <number>'.",
    "Please solve the following math question. Explain your steps concisely and state the final answer "
    "as '#### <number>' on its own line.",
    "Compute the answer step by step using short sentences, and report it at the end as '#### <number>'.",
]


def answer_settled(engine: RKSCEngine, workload: str, tokens: list[int]) -> bool:
    """Whether a greedy decode can stop: at least ``GREEDY_WINDOW`` tokens are out and the final
    answer is settled (SC: a finished ``#### x`` line; agent: the first line is complete)."""
    if len(tokens) < GREEDY_WINDOW:
        return False
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    return "\n" in text.strip() if workload == AGENT_WORKLOAD else bool(GSM8K_DONE.search(text))


def answer_of(engine: RKSCEngine, workload: str, tokens: list[int]) -> str | None:
    """The final answer of a decode: the first line for the agent workload, else the GSM8K answer."""
    text = engine.tokenizer.decode(tokens, skip_special_tokens=True)
    if workload == AGENT_WORKLOAD:
        return " ".join(text.strip().splitlines()[0].split()) if text.strip() else ""
    return extract_gsm8k_answer(text)
