"""Questions and few-shot prompts: a seeded synthetic GSM8K-style set for offline runs, and a
reader for real GSM8K-format JSONL files taken by path.

Synthetic problems are multi-step arithmetic word problems with a worked solution ending in
``#### <answer>``, the GSM8K convention, so the same prompts and answer extractors serve both.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Elena", "Farid", "Grace", "Hiro", "Isla", "Jonah", "Keira", "Liam"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells"]

SYSTEM_PROMPT = (
    "You solve grade-school math word problems. Reason step by step in short sentences, "
    "then give the final answer on its own line as '#### <number>'."
)


@dataclass(frozen=True)
class Problem:
    """A question with its worked solution and numeric answer (as a string, GSM8K style)."""

    question: str
    solution: str
    answer: str


def _shop(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    packs, per_pack, price, given = rng.randint(2, 9), rng.randint(3, 12), rng.randint(2, 9), rng.randint(1, 5)
    total = packs * per_pack
    kept = total - given
    cost = packs * price
    q = (f"{name} buys {packs} packs of {item}. Each pack holds {per_pack} {item} and costs ${price}. "
         f"{name} gives {given} {item} to a friend. How many {item} does {name} have left, "
         f"and how much did the packs cost in total? Give the number of {item} left.")
    s = (f"{name} buys {packs} packs with {per_pack} {item} each, so {packs} * {per_pack} = {total} {item}.\n"
         f"The packs cost {packs} * ${price} = ${cost} in total, which does not change the count.\n"
         f"After giving away {given}, {name} has {total} - {given} = {kept} {item} left.\n#### {kept}")
    return Problem(q, s, str(kept))


def _speed(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    speed, hours, extra = rng.randint(3, 12) * 5, rng.randint(2, 6), rng.randint(5, 40)
    dist = speed * hours + extra
    q = (f"{name} drives at {speed} miles per hour for {hours} hours, then walks the last {extra} miles "
         f"to a cabin. How many miles does {name} travel in all?")
    s = (f"Driving covers {speed} * {hours} = {speed * hours} miles.\n"
         f"Walking adds {extra} miles, so the total is {speed * hours} + {extra} = {dist} miles.\n#### {dist}")
    return Problem(q, s, str(dist))


def _share(rng: random.Random) -> Problem:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    friends = rng.randint(2, 6)
    each = rng.randint(3, 15)
    left = rng.randint(0, friends - 1)
    total = friends * each + left
    q = (f"{name} has {total} {item} and shares them equally among {friends} friends, keeping whatever "
         f"cannot be shared equally. How many {item} does each friend get?")
    s = (f"{total} divided by {friends} is {each} with {left} left over, since {friends} * {each} = {friends * each} "
         f"and {total} - {friends * each} = {left}.\nEach friend gets {each} {item}.\n#### {each}")
    return Problem(q, s, str(each))


def _wage(rng: random.Random) -> Problem:
    name = rng.choice(NAMES)
    rate, days, hours, bonus = rng.randint(8, 25), rng.randint(2, 6), rng.randint(3, 8), rng.randint(10, 60)
    base = rate * hours * days
    q = (f"{name} earns ${rate} an hour and works {hours} hours a day for {days} days. "
         f"At the end of the week {name} also gets a ${bonus} bonus. How many dollars does {name} earn?")
    s = (f"Each day {name} earns {rate} * {hours} = ${rate * hours}.\n"
         f"Over {days} days that is {rate * hours} * {days} = ${base}.\n"
         f"With the bonus, {base} + {bonus} = ${base + bonus}.\n#### {base + bonus}")
    return Problem(q, s, str(base + bonus))


def _age(rng: random.Random) -> Problem:
    a, b = rng.sample(NAMES, 2)
    age_b, diff, years = rng.randint(4, 20), rng.randint(2, 15), rng.randint(2, 10)
    age_a = age_b + diff
    q = f"{a} is {diff} years older than {b}. {b} is {age_b} years old. How old will {a} be in {years} years?"
    s = (f"{a} is {age_b} + {diff} = {age_a} years old now.\n"
         f"In {years} years {a} will be {age_a} + {years} = {age_a + years}.\n#### {age_a + years}")
    return Problem(q, s, str(age_a + years))


_TEMPLATES = (_shop, _speed, _share, _wage, _age)


def synthetic_problems(num: int, seed: int = 0) -> list[Problem]:
    """``num`` deterministic GSM8K-style problems (same seed, same problems)."""
    rng = random.Random(seed)
    return [_TEMPLATES[i % len(_TEMPLATES)](rng) for i in range(num)]


def load_gsm8k_jsonl(path: str | Path, limit: int | None = None) -> list[Problem]:
    """Read GSM8K-format JSONL (``question``, ``answer`` ending in ``#### x``)."""
    problems = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "question" not in row or "answer" not in row:
                raise ValueError(f"{path}:{line_no}: a GSM8K row needs 'question' and 'answer' fields")
            solution = row["answer"]
            final = solution.rsplit("####", 1)[-1].strip().replace(",", "")
            problems.append(Problem(row["question"], solution, final))
            if limit is not None and len(problems) >= limit:
                break
    return problems


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
