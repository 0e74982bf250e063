"""Questions and few-shot prompts: seeded synthetic sets for offline runs, and readers for real
JSONL files taken by path.

* GSM8K style: multi-step arithmetic word problems with a worked solution ending in
  ``#### <answer>`` (``synthetic_problems``, ``load_gsm8k_jsonl``); answers are numbers.
* Multiple choice: a question with lettered choices rendered into its text and a solution ending
  in ``The answer is <letter>.`` (``synthetic_choice_problems``, ``load_choice_jsonl`` for rows
  with ``question``, ``choices`` and ``answerKey``, as ARC has them); answers are letters, read by
  the ``"choice"`` extractor.

``load_problems_jsonl`` tells the two formats apart by their fields.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Elena", "Farid", "Grace", "Hiro", "Isla", "Jonah", "Keira", "Liam"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells"]

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


def _jsonl_rows(path: str | Path) -> Iterator[tuple[str, dict]]:
    """``(path:line, row)`` for every non-blank line of a JSONL file, so errors can say where."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if line.strip():
                yield f"{path}:{line_no}", json.loads(line)


def load_gsm8k_jsonl(path: str | Path, limit: int | None = None) -> list[Problem]:
    """Read GSM8K-format JSONL (``question``, ``answer`` ending in ``#### x``)."""
    problems = []
    for where, row in _jsonl_rows(path):
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{where}: a GSM8K row needs 'question' and 'answer' fields")
        solution = row["answer"]
        final = solution.rsplit("####", 1)[-1].strip().replace(",", "")
        problems.append(Problem(row["question"], solution, final))
        if limit is not None and len(problems) >= limit:
            break
    return problems


def format_choices(question: str, labels: Sequence[str], texts: Sequence[str]) -> str:
    """The question followed by one ``"A) text"`` line per choice."""
    return question.strip() + "\n" + "\n".join(f"{label}) {text}" for label, text in zip(labels, texts))


def _choice_problem(question: str, labels: list[str], texts: list[str], key: str, reasoning: str) -> Problem:
    return Problem(format_choices(question, labels, texts), f"{reasoning} The answer is {key}.".strip(), key)


def _mc_product(rng: random.Random) -> tuple[str, int, list[int], str]:
    a, b = rng.randint(3, 12), rng.randint(3, 12)
    right = a * b
    wrong = {right + a, right - b, right + 10, (a + 1) * b, a + b} - {right}
    return f"What is {a} * {b}?", right, rng.sample(sorted(wrong), 3), f"{a} * {b} = {right}."


def _mc_left(rng: random.Random) -> tuple[str, int, list[int], str]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    have, used = rng.randint(20, 60), rng.randint(3, 19)
    right = have - used
    wrong = {have + used, right - 1, right + 2, used} - {right}
    return (f"{name} has {have} {item} and gives away {used}. How many {item} are left?", right,
            rng.sample(sorted(wrong), 3), f"{have} - {used} = {right} {item} are left.")


def _mc_largest(rng: random.Random) -> tuple[str, int, list[int], str]:
    values = rng.sample(range(10, 100), 4)
    right = max(values)
    return ("Which number is the largest?", right, [v for v in values if v != right],
            f"Comparing the numbers, {right} is the largest.")


_CHOICE_TEMPLATES = (_mc_product, _mc_left, _mc_largest)


def synthetic_choice_problems(num: int, seed: int = 0, num_choices: int = 4) -> list[Problem]:
    """``num`` deterministic multiple-choice problems with ``num_choices`` (2-4) lettered choices;
    the right choice's position is drawn at random, so letter frequencies are balanced."""
    if not 2 <= num_choices <= 4:
        raise ValueError(f"num_choices must be in [2, 4], got {num_choices}")
    rng = random.Random(seed)
    labels = [chr(ord("A") + i) for i in range(num_choices)]
    problems = []
    for i in range(num):
        question, right, wrong, reasoning = _CHOICE_TEMPLATES[i % len(_CHOICE_TEMPLATES)](rng)
        values = wrong[: num_choices - 1] + [right]
        rng.shuffle(values)
        key = labels[values.index(right)]
        problems.append(_choice_problem(question, labels, [str(v) for v in values], key,
                                        f"{reasoning} That is choice {key}."))
    return problems


def _parse_choices(raw: object, where: str) -> tuple[list[str], list[str]]:
    if isinstance(raw, dict) and isinstance(raw.get("text"), list):
        texts = [str(t) for t in raw["text"]]
        labels = [str(x) for x in raw.get("label") or [chr(ord("A") + i) for i in range(len(texts))]]
    elif isinstance(raw, list):
        texts = [str(t) for t in raw]
        labels = [chr(ord("A") + i) for i in range(len(texts))]
    else:
        raise ValueError(f"{where}: 'choices' must be a list or {{'text': [...], 'label': [...]}}, got {raw!r:.80}")
    if len(labels) != len(texts) or len(texts) < 2:
        raise ValueError(f"{where}: need at least 2 choices with one label each")
    return labels, texts


def load_choice_jsonl(path: str | Path, limit: int | None = None) -> list[Problem]:
    """Read multiple-choice JSONL: ``question``, ``choices`` (a list, or ARC's ``{"text": [...],
    "label": [...]}``) and ``answerKey`` (a label, or a 0-based index / numeric label "1".."n" that
    maps onto the choices). Labels are rewritten as letters A, B, ... so the ``"choice"`` extractor
    reads them; the answer is the letter of the right choice."""
    problems = []
    for where, row in _jsonl_rows(path):
        if not all(k in row for k in ("question", "choices", "answerKey")):
            raise ValueError(f"{where}: a multiple-choice row needs 'question', 'choices' and 'answerKey'")
        question = row["question"]["stem"] if isinstance(row["question"], dict) else str(row["question"])
        labels, texts = _parse_choices(row["choices"], where)
        key = str(row["answerKey"]).strip()
        if key in labels:
            index = labels.index(key)
        elif isinstance(row["answerKey"], int) and 0 <= row["answerKey"] < len(texts):
            index = row["answerKey"]
        else:
            raise ValueError(f"{where}: answerKey {row['answerKey']!r} is not one of the labels {labels}")
        letters = [chr(ord("A") + i) for i in range(len(texts))]
        problems.append(_choice_problem(question, letters, texts, letters[index], ""))
        if limit is not None and len(problems) >= limit:
            break
    return problems


def jsonl_format(path: str | Path) -> str:
    """``"choice"`` when the first row has ``choices`` and ``answerKey``, ``"gsm8k"`` when it has
    ``question`` and ``answer``."""
    for _, row in _jsonl_rows(path):
        if "choices" in row and "answerKey" in row:
            return "choice"
        if "question" in row and "answer" in row:
            return "gsm8k"
        raise ValueError(f"{path}: rows are neither GSM8K ('question', 'answer') nor multiple choice "
                         f"('question', 'choices', 'answerKey'); first row has {sorted(row)}")
    raise ValueError(f"{path}: no rows")


def load_problems_jsonl(path: str | Path, limit: int | None = None) -> tuple[str, list[Problem]]:
    """``(format, problems)`` of a GSM8K or multiple-choice JSONL file (see ``jsonl_format``)."""
    kind = jsonl_format(path)
    return kind, (load_choice_jsonl(path, limit) if kind == "choice" else load_gsm8k_jsonl(path, limit))


def check_problems(value: object, name: str = "few_shot") -> list[Problem]:
    """``value`` as a list of ``Problem``s, or a ``TypeError`` naming ``name``.

    A string is refused although it is a sequence: ``few_shot="..."`` would otherwise be read one
    character at a time.
    """
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of rksc_engine.datasets.Problem (e.g. synthetic_problems(8)), "
                        f"got {type(value).__name__}")
    bad = [i for i, item in enumerate(value) if not isinstance(item, Problem)]
    if bad:
        raise TypeError(f"{name} must be a list of rksc_engine.datasets.Problem; {name}[{bad[0]}] is a "
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
