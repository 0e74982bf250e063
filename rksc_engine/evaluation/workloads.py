"""Question workloads: seeded synthetic sets for offline runs, and readers for real JSONL files taken
by path (the few-shot prompts built from them are ``rksc_engine.reasoning.few_shot``).

* GSM8K style: multi-step arithmetic word problems with a worked solution ending in
  ``#### <answer>`` (``synthetic_problems``, ``load_gsm8k_jsonl``); answers are numbers.
* Difficulty ladder: arithmetic word problems of exactly 1 to 4 steps (``ladder_problems``), each
  a ``LadderProblem`` carrying its ``level``, with one-step worked examples (``ladder_shots``) worded
  unlike the questions; answers are positive integers.
* Multiple choice: a question with lettered choices rendered into its text and a solution ending
  in ``The answer is <letter>.`` (``synthetic_choice_problems``, ``load_choice_jsonl`` for rows
  with ``question``, ``choices`` and ``answerKey``, as ARC has them); answers are letters, read by
  the ``"choice"`` extractor.

``load_problems_jsonl`` tells the two formats apart by their fields.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..reasoning.few_shot import CHOICE_SYSTEM_PROMPT, SYSTEM_PROMPT, Problem  # noqa: F401  (workloads pair with them)

__all__ = [
    "ITEMS", "LADDER_LEVELS", "LADDER_NAMES", "NAMES", "LadderProblem", "format_choices", "jsonl_format",
    "ladder_problems", "ladder_shots", "load_choice_jsonl", "load_gsm8k_jsonl", "load_problems_jsonl",
    "solution_steps", "synthetic_choice_problems", "synthetic_problems",
]

NAMES = ["Ava", "Ben", "Chloe", "Diego", "Elena", "Farid", "Grace", "Hiro", "Isla", "Jonah", "Keira", "Liam"]
ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells"]


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


# -- the difficulty ladder ------------------------------------------------------------------------
# Arithmetic word problems of 1 to 4 steps, worded unlike ``synthetic_problems`` and unlike their own
# worked examples (``ladder_shots``), so a model is asked to transfer the method, not to copy a
# wording. Each step of a solution is one line holding one ``a <op> b = c`` equation; the generator
# checks every step exactly (integers, no remainder, a positive result) as it builds it.

LADDER_LEVELS = (1, 2, 3, 4)
LADDER_NAMES = ["Maya", "Omar", "Priya", "Tomas", "Nadia", "Kofi", "Lena", "Ravi"]


@dataclass(frozen=True)
class LadderProblem(Problem):
    """A ``Problem`` of the difficulty ladder.

    Attributes:
        level: Arithmetic steps the question needs; the solution has exactly one equation line per step.
        template: Name of the wording it was generated from (at least four per level).
    """

    level: int = 1
    template: str = ""


class _Steps:
    """Builds a solution one checked equation at a time: ``steps(a, "*", b, "text {eq}")`` returns
    ``a * b`` and records the line with ``{eq}`` replaced by ``"a * b = c"``."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.results: list[int] = []

    def __call__(self, a: int, op: str, b: int, text: str) -> int:
        if op == "/":
            if b <= 0 or a % b:
                raise AssertionError(f"ladder step {a} / {b} leaves a remainder")
            result = a // b
        else:
            result = {"+": a + b, "-": a - b, "*": a * b}[op]
        if result <= 0:
            raise AssertionError(f"ladder step {a} {op} {b} = {result} is not positive")
        self.lines.append(text.format(eq=f"{a} {op} {b} = {result}"))
        self.results.append(result)
        return result


_LadderTemplate = Callable[[random.Random, _Steps], str]


# Level 1: one step each, one of each operation.
def _aquarium(rng: random.Random, s: _Steps) -> str:
    fish, added = rng.randint(12, 80), rng.randint(5, 40)
    s(fish, "+", added, "The new fish join the ones already there: {eq}.")
    return (f"An aquarium holds {fish} fish. The keeper adds another {added} fish from a delivery. "
            f"How many fish are in the aquarium now?")


def _stadium(rng: random.Random, s: _Steps) -> str:
    rows, seats = rng.randint(6, 25), rng.randint(8, 30)
    s(rows, "*", seats, "Rows times seats in a row: {eq}.")
    return f"A stadium section has {rows} rows, and every row has {seats} seats. How many seats does the section have?"


def _tank(rng: random.Random, s: _Steps) -> str:
    name, liters = rng.choice(LADDER_NAMES), rng.randint(60, 300)
    used = rng.randint(10, liters - 10)
    s(liters, "-", used, "Taking away what was drained: {eq}.")
    return (f"A water tank contains {liters} liters. {name} drains {used} liters to water a garden. "
            f"How many liters remain in the tank?")


def _teams(rng: random.Random, s: _Steps) -> str:
    size, teams = rng.randint(2, 9), rng.randint(3, 15)
    players = size * teams
    s(players, "/", size, "Players divided by the team size: {eq}.")
    return f"A coach splits {players} players into teams of {size}. How many teams are there?"


# Level 2.
def _bus(rng: random.Random, s: _Steps) -> str:
    start = rng.randint(20, 60)
    off, on = rng.randint(3, min(25, start - 5)), rng.randint(2, 20)
    left = s(start, "-", off, "After some riders get off, {eq} are still aboard.")
    s(left, "+", on, "Adding the riders who got on: {eq}.")
    return (f"A bus starts its route with {start} riders. At the station {off} riders get off and {on} new "
            f"riders get on. How many riders are on the bus when it leaves the station?")


def _orchard(rng: random.Random, s: _Steps) -> str:
    rows, per_row = rng.randint(4, 12), rng.randint(6, 20)
    fallen = rng.randint(2, min(30, rows * per_row - 1))
    trees = s(rows, "*", per_row, "The orchard starts with {eq} trees.")
    s(trees, "-", fallen, "Removing the fallen trees: {eq}.")
    return (f"An orchard has {rows} rows with {per_row} trees in every row. A storm knocks down {fallen} trees. "
            f"How many trees are still standing?")


def _tickets(rng: random.Random, s: _Steps) -> str:
    friday, saturday, price = rng.randint(20, 150), rng.randint(20, 150), rng.randint(5, 25)
    sold = s(friday, "+", saturday, "Tickets sold over both days: {eq}.")
    s(sold, "*", price, "At the ticket price that brings in {eq} dollars.")
    return (f"A concert hall sells {friday} tickets on Friday and {saturday} tickets on Saturday. Every ticket "
            f"costs {price} dollars. How much money, in dollars, do the tickets bring in?")


def _bottles(rng: random.Random, s: _Steps) -> str:
    size, crates = rng.randint(4, 12), rng.randint(3, 20)
    total = size * crates
    monday = rng.randint(1, total - 1)
    collected = s(monday, "+", total - monday, "Bottles collected on both days: {eq}.")
    s(collected, "/", size, "Full crates: {eq}.")
    return (f"A club collects {monday} bottles on Monday and {total - monday} bottles on Tuesday, then packs all "
            f"of them into crates of {size}, with every crate full. How many crates does the club fill?")


# Level 3.
def _eggs(rng: random.Random, s: _Steps) -> str:
    hens, per_hen, size = rng.randint(6, 30), rng.randint(3, 7), rng.choice([6, 10, 12])
    laid = hens * per_hen
    cartons = rng.randint(max(1, laid // size // 2), (laid - 1) // size)
    kept = laid - size * cartons
    laid = s(hens, "*", per_hen, "The hens lay {eq} eggs a week.")
    left = s(laid, "-", kept, "After the family's share, {eq} eggs are for sale.")
    s(left, "/", size, "Full cartons: {eq}.")
    return (f"A farm has {hens} hens, and each hen lays {per_hen} eggs a week. The farmer keeps {kept} eggs for "
            f"the family and sells the rest in cartons of {size}, every carton full. How many cartons are sold "
            f"each week?")


def _savings(rng: random.Random, s: _Steps) -> str:
    name, weekly, weeks = rng.choice(LADDER_NAMES), rng.randint(5, 30), rng.randint(3, 12)
    spent, gift = rng.randint(10, weekly * weeks - 1), rng.randint(5, 50)
    saved = s(weekly, "*", weeks, "The jar collects {eq} dollars.")
    left = s(saved, "-", spent, "After the bike, {eq} dollars are left.")
    s(left, "+", gift, "With the gift, {eq} dollars.")
    return (f"{name} puts {weekly} dollars into a jar every week for {weeks} weeks, spends {spent} dollars of it "
            f"on a bike, and then adds a gift of {gift} dollars to the jar. How much money, in dollars, is in the "
            f"jar at the end?")


def _hotel(rng: random.Random, s: _Steps) -> str:
    floors, rooms = rng.randint(3, 12), rng.randint(8, 25)
    booked = rng.randint(2, floors * rooms - 1)
    monday = rng.randint(1, booked - 1)
    total = s(floors, "*", rooms, "The hotel has {eq} rooms.")
    taken = s(monday, "+", booked - monday, "Rooms booked on the two days: {eq}.")
    s(total, "-", taken, "Rooms still free: {eq}.")
    return (f"A hotel has {floors} floors with {rooms} rooms on each floor. Guests book {monday} rooms on Monday "
            f"and {booked - monday} more rooms on Tuesday. How many rooms are still free after Tuesday?")


def _pencils(rng: random.Random, s: _Steps) -> str:
    classrooms, boxes, extra = rng.randint(2, 6), rng.randint(2, 9), rng.randint(2, 15)
    per_box = classrooms * rng.randint(2, 8)
    pencils = s(boxes, "*", per_box, "The school buys {eq} pencils.")
    share = s(pencils, "/", classrooms, "Shared equally, each classroom gets {eq}.")
    s(share, "+", extra, "With the pencils from the office: {eq}.")
    return (f"A school buys {boxes} boxes of pencils with {per_box} pencils in each box. The pencils are shared "
            f"equally among {classrooms} classrooms, and each classroom also gets {extra} pencils from the office. "
            f"How many pencils does each classroom end up with?")


# Level 4.
def _muffins(rng: random.Random, s: _Steps) -> str:
    trays, per_tray, size = rng.randint(3, 10), rng.randint(6, 24), rng.randint(4, 8)
    baked = s(trays, "*", per_tray, "The bakery bakes {eq} muffins.")
    leftover = size * rng.randint(1, (baked - 2) // size)
    morning = rng.randint(1, baked - leftover - 1)
    afternoon = baked - leftover - morning
    sold = s(morning, "+", afternoon, "It sells {eq} muffins.")
    left = s(baked, "-", sold, "Leftover muffins: {eq}.")
    s(left, "/", size, "Full boxes: {eq}.")
    return (f"A bakery bakes {trays} trays of muffins with {per_tray} muffins on each tray. It sells {morning} "
            f"muffins in the morning and {afternoon} in the afternoon, then packs the leftovers into boxes of {size}, "
            f"every box full. How many boxes does it pack?")


def _road_trip(rng: random.Random, s: _Steps) -> str:
    daily, days, per_liter, price = rng.randint(80, 300), rng.randint(2, 5), rng.randint(8, 15), rng.randint(2, 4)
    liters = daily * days // per_liter + rng.randint(1, 30)
    last = per_liter * liters - daily * days
    driven = s(daily, "*", days, "Before the final day the family drives {eq} kilometers.")
    total = s(driven, "+", last, "With the final day: {eq} kilometers.")
    fuel = s(total, "/", per_liter, "Fuel burned: {eq} liters.")
    s(fuel, "*", price, "The fuel costs {eq} dollars.")
    return (f"A family drives {daily} kilometers a day for {days} days and {last} kilometers on the final day. "
            f"The car burns one liter of fuel for every {per_liter} kilometers, and fuel costs {price} dollars a "
            f"liter. How many dollars does the fuel for the trip cost?")


def _warehouse(rng: random.Random, s: _Steps) -> str:
    start, crates, per_crate, stores = rng.randint(50, 400), rng.randint(3, 15), rng.randint(6, 24), rng.randint(2, 8)
    per_store = rng.randint(5, min(60, (start + crates * per_crate - 1) // stores))
    delivered = s(crates, "*", per_crate, "The truck brings {eq} boxes.")
    stock = s(start, "+", delivered, "The warehouse then holds {eq} boxes.")
    shipped = s(per_store, "*", stores, "The stores receive {eq} boxes.")
    s(stock, "-", shipped, "Boxes left: {eq}.")
    return (f"A warehouse holds {start} boxes. A truck brings {crates} crates with {per_crate} boxes in each, and "
            f"later {per_store} boxes are shipped to each of {stores} stores. How many boxes are left in the "
            f"warehouse?")


def _theater(rng: random.Random, s: _Steps) -> str:
    rows, seats, broken, price = rng.randint(8, 25), rng.randint(10, 30), rng.randint(1, 20), rng.randint(5, 20)
    donation = rng.randint(10, (rows * seats - broken) * price // 3)
    total = s(rows, "*", seats, "The theater has {eq} seats.")
    sold = s(total, "-", broken, "Seats sold: {eq}.")
    takings = s(sold, "*", price, "Ticket money: {eq} dollars.")
    s(takings, "-", donation, "After the donation it keeps {eq} dollars.")
    return (f"A theater has {rows} rows of {seats} seats. For one show, {broken} seats are broken and the rest "
            f"are all sold at {price} dollars each. The theater gives {donation} dollars of that money to charity. "
            f"How many dollars does it keep?")


_LADDER_TEMPLATES: dict[int, tuple[_LadderTemplate, ...]] = {
    1: (_aquarium, _stadium, _tank, _teams),
    2: (_bus, _orchard, _tickets, _bottles),
    3: (_eggs, _savings, _hotel, _pencils),
    4: (_muffins, _road_trip, _warehouse, _theater),
}


# The worked examples: one step each, in wordings none of the questions use.
def _tulips(rng: random.Random, s: _Steps) -> str:
    rows, per_row = rng.randint(3, 12), rng.randint(4, 15)
    s(rows, "*", per_row, f"Each of the {rows} rows has {per_row} tulips, so {{eq}} tulips are planted.")
    return f"A gardener plants {rows} rows of tulips with {per_row} tulips in each row. How many tulips are planted?"


def _train(rng: random.Random, s: _Steps) -> str:
    aboard, boarding = rng.randint(20, 90), rng.randint(3, 40)
    s(aboard, "+", boarding, f"The train had {aboard} passengers and {boarding} more boarded, so {{eq}}.")
    return (f"A train leaves the station with {aboard} passengers, and {boarding} more passengers board at the next "
            f"stop. How many passengers are on the train?")


def _baker(rng: random.Random, s: _Steps) -> str:
    eggs = rng.randint(12, 48)
    used = rng.randint(2, eggs - 2)
    s(eggs, "-", used, f"The baker started with {eggs} eggs and used {used}, so {{eq}} eggs are left.")
    return f"A baker has {eggs} eggs and uses {used} of them in a cake. How many eggs does the baker have left?"


def _crayons(rng: random.Random, s: _Steps) -> str:
    boxes, per_box = rng.randint(2, 8), rng.randint(4, 12)
    s(boxes * per_box, "/", boxes, f"{boxes * per_box} crayons shared by {boxes} boxes gives {{eq}} crayons per box.")
    return f"{boxes * per_box} crayons are packed equally into {boxes} boxes. How many crayons are in each box?"


_LADDER_SHOT_TEMPLATES: tuple[_LadderTemplate, ...] = (_tulips, _train, _baker, _crayons)


def _ladder_problem(template: _LadderTemplate, rng: random.Random, level: int) -> LadderProblem:
    steps = _Steps()
    question = template(rng, steps)
    if len(steps.lines) != level:
        raise AssertionError(f"ladder template {template.__name__} took {len(steps.lines)} steps, not {level}")
    answer = str(steps.results[-1])
    return LadderProblem(question, "\n".join(steps.lines) + f"\n#### {answer}", answer, level, template.__name__[1:])


def _check_count(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= {minimum}, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_seed(seed: object) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")


def ladder_problems(num_per_level: int, levels: Sequence[int] = LADDER_LEVELS, seed: int = 0) -> list[LadderProblem]:
    """``num_per_level`` arithmetic word problems of each level (steps), interleaved level by level.

    Each level draws from its own generator, seeded by ``seed`` and the level, and cycles through its
    templates (four per level), so a level's problems do not depend on which other levels are asked
    for, and asking for more problems only appends. Answers are exact positive integers, as is every
    intermediate value.

    Args:
        num_per_level: Problems per level, >= 1.
        levels: Distinct levels from 1 to 4. Default all four.
        seed: Same seed, same problems.

    Example:
        >>> problems = ladder_problems(2, levels=(1, 3))
        >>> [p.level for p in problems]
        [1, 3, 1, 3]
    """
    _check_count("num_per_level", num_per_level, 1)
    if isinstance(levels, (str, bytes)) or not isinstance(levels, Sequence) or not levels:
        raise TypeError(f"levels must be a non-empty sequence of ints from 1 to 4, got {levels!r:.60}")
    valid = [isinstance(level, int) and not isinstance(level, bool) and level in _LADDER_TEMPLATES for level in levels]
    if not all(valid) or len(set(levels)) != len(levels):
        raise ValueError(f"levels must be distinct ints from 1 to 4, got {list(levels)}")
    _check_seed(seed)
    rngs = {level: random.Random(f"ladder:{seed}:{level}") for level in levels}
    problems = []
    for i in range(num_per_level):
        for level in levels:
            templates = _LADDER_TEMPLATES[level]
            problems.append(_ladder_problem(templates[i % len(templates)], rngs[level], level))
    return problems


def ladder_shots(num: int, seed: int = 1) -> list[LadderProblem]:
    """``num`` (>= 0) one-step worked examples for the ladder, ending in ``#### <number>`` like
    ``synthetic_problems``' solutions, in wordings no ladder question uses."""
    _check_count("num", num, 0)
    _check_seed(seed)
    rng = random.Random(f"ladder-shots:{seed}")
    return [_ladder_problem(_LADDER_SHOT_TEMPLATES[i % len(_LADDER_SHOT_TEMPLATES)], rng, 1) for i in range(num)]


def solution_steps(problem: Problem) -> int:
    """Reasoning steps in ``problem``'s worked solution: its non-empty lines before the ``####``
    answer line, at least 1. A ``LadderProblem`` has exactly ``level`` of them."""
    return max(1, sum(1 for line in problem.solution.splitlines() if line.strip() and not line.startswith("####")))


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
