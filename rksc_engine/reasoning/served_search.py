"""Tree search over an engine behind a server (``RemoteEngine.tree_search``): the beam search of
``rksc_engine.reasoning.tree_search`` with paths kept as text, since a server takes text and sends
no token ids.

What is the same as a local search: the tree's shape and statuses (``SearchNode``, ``SearchResult``),
the seeds (node ``i``'s children are seeded ``seed + i * breadth + k``), every level's expansions
submitted together (``expand_together``), children run under their own ``EarlyStopMonitor`` (the
``length`` and ``confidence`` rules, ``resolve_search_early_stop``), scores from path confidence or
a verifier (the log-prob judge by default for ``"judge"``), the beam, the answer.

What differs:
    * A path is text: the prompt (a string, sent to ``/v1/completions``) followed by each step's
      text and the delimiter that ended it; the server tokenizes it again for every expansion, so
      on a tokenizer whose tokens do not split at the delimiter the continuation's tokens can
      differ from a local search's. Chat messages cannot be continued as text without the model's
      chat template, which only the server holds: pass ``prompt`` as text (the template applied:
      ``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``).
      Without ``prompt``, the few-shot examples are written as plain ``Question:``/``Answer:`` text.
    * RSBCM is not done: the server's cache is its own, so no ``annotate_cache``, no demotion of
      pruned branches (``demote_pruned`` has no effect) and no ``cache_bytes_trace``; a server's
      prefix cache still shares a parent's path among its children and their descendants.
    * A step that ended on ``"stop"`` is read as ending at the delimiter, and its path goes on: a
      ``Completion`` does not say which stop string ended it (and ``transformers serve`` does not
      say it at all), so a stop string of ``params.stop`` besides the delimiter ends a step here,
      where locally it ends the path.
    * ``scorer="confidence"`` needs the server's log-probs, ``"judge"`` its top log-probs: a server
      without them refuses the scorer before anything is generated (pass a callable scorer).
    * A path longer than the server's context is the server's 400 (``ValueError``), not a final node.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from tqdm.auto import tqdm

from ..config import MAX_SEED, MIN_SAMPLING_TEMPERATURE, MIN_TOP_P, SamplingParams
from ..protocol import ServedEngine
from ..results import Completion
from .cgee import CGEEConfig
from .early_stop import EarlyStopConfig, EarlyStopMonitor
from .few_shot import SYSTEM_PROMPT, Problem, check_problems
from .logprob_judge import LogprobJudgeVerifier
from .self_consistency import check_branch_count, resolve_extractor
from .tree_search import (
    DEFAULT_SEARCH_PARAMS,
    SCORER_NAMES,
    SEARCH_EARLY_STOP_RULES,
    PathScorer,
    SearchNode,
    SearchResult,
    resolve_search_early_stop,
)
from .verifier import Verifier, as_verifier

RSBCM_NOT_DONE = ("RSBCM is the server's business: its cache is not annotated with branch scores, pruned branches "
                  "are not demoted (demote_pruned has no effect) and cache_bytes_trace stays empty")


def few_shot_text(question: str, shots: Sequence[Problem], system_prompt: str = SYSTEM_PROMPT) -> str:
    """The few-shot prompt as plain text, for a server's ``/v1/completions``: the instruction, each
    worked example as ``Question:``/``Answer:``, then the question and ``Answer:``."""
    parts = [system_prompt, ""]
    for shot in shots:
        parts += [f"Question: {shot.question}", f"Answer: {shot.solution}", ""]
    parts += [f"Question: {question}", "Answer:"]
    return "\n".join(parts)


def tree_search_over_server(
    engine: ServedEngine,
    question: str,
    *,
    breadth: int = 3,
    depth: int = 6,
    beam: int | None = None,
    step_delimiter: str = "\n",
    scorer: str | Verifier | PathScorer = "confidence",
    params: SamplingParams | None = None,
    few_shot: Sequence[Problem] = (),
    prompt: str | None = None,
    answer_extractor: str | Callable[[str], str | None] = "gsm8k",
    final_marker: str | None = "####",
    demote_pruned: bool = True,
    cgee: CGEEConfig | None = None,
    progress: bool = False,
    expand_together: bool = True,
    early_stop: None | str | EarlyStopConfig = None,
) -> SearchResult:
    """Beam search over reasoning steps on a server; the arguments of ``tree_search`` (see the
    module docstring for what differs). ``SearchResult.server_limits`` names what was not done.

    Raises:
        TypeError, ValueError: a bad argument (named), a chat-message ``prompt``, a scorer the
            server cannot feed, ``cgee.exit_enabled`` with the judge; before anything is sent.
    """
    if not isinstance(question, str):
        raise TypeError(f"question must be a non-empty string, got {type(question).__name__}")
    if not question.strip():
        raise ValueError("question must be a non-empty string")
    for name, value in (("breadth", breadth), ("depth", depth), ("beam", breadth if beam is None else beam)):
        check_branch_count(name, value)
    beam = breadth if beam is None else beam
    if not isinstance(step_delimiter, str) or not step_delimiter:
        raise ValueError("step_delimiter must be a non-empty string")
    params = DEFAULT_SEARCH_PARAMS if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if breadth > 1 and params.greedy:
        raise ValueError(f"breadth > 1 needs sampling (params.temperature > 0, at least {MIN_SAMPLING_TEMPERATURE}, "
                         f"and params.top_p >= {MIN_TOP_P}): greedy siblings would all be the same step")
    if params.seed is not None and params.seed + depth * beam * breadth * breadth > MAX_SEED:
        raise ValueError(f"params.seed + depth * beam * breadth**2 must be <= {MAX_SEED} (MAX_SEED; node i's "
                         f"children are seeded seed + i * breadth), got seed={params.seed}")
    shots = check_problems(few_shot, "few_shot")
    if shots and prompt is not None:
        raise ValueError("pass few_shot or prompt, not both (prompt replaces the few-shot prompt)")
    if prompt is not None and not isinstance(prompt, str):
        raise TypeError("prompt must be text over a server: a path is continued as text on /v1/completions, and "
                        "chat messages cannot be without the model's chat template; pass the template applied, "
                        "tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)")
    extract = resolve_extractor(answer_extractor)
    if final_marker is not None and (not isinstance(final_marker, str) or not final_marker):
        raise ValueError("final_marker must be a non-empty string or None")
    for name, flag in (("demote_pruned", demote_pruned), ("progress", progress), ("expand_together", expand_together)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    cgee = CGEEConfig() if cgee is None else cgee
    if not isinstance(cgee, CGEEConfig):
        raise TypeError(f"cgee must be a CGEEConfig or None, got {type(cgee).__name__}")
    stop_config = resolve_search_early_stop(early_stop)
    judge, limits = _served_scorer(engine, scorer, cgee, stop_config)
    root = prompt if prompt is not None else few_shot_text(question, shots)

    search = _TextSearch(engine, question, root, breadth, beam, step_delimiter, judge, params, final_marker, cgee,
                         stop_config, extract, expand_together)
    start = time.perf_counter()
    search.run(depth, progress)
    best = search.best()
    text = search.path_texts[best.index]
    return SearchResult(extract(text), search.path(best.index), best.branch_score, text, search.nodes,
                        search.num_expansions, time.perf_counter() - start, [], search.early_stop_totals,
                        server_limits=(RSBCM_NOT_DONE, *limits))


def _served_scorer(engine: ServedEngine, scorer: Any, cgee: CGEEConfig, stop: EarlyStopConfig | None
                   ) -> tuple[Verifier | None, tuple[str, ...]]:
    """The scorer (None: path confidence) and what the server's capabilities change, checked up front."""
    if isinstance(scorer, str) and scorer not in SCORER_NAMES:
        raise ValueError(f"scorer must be a Verifier, a callable or one of {list(SCORER_NAMES)}, got {scorer!r}")
    judge = None
    if not isinstance(scorer, str):
        judge = as_verifier(scorer)
        if judge is None:
            raise TypeError(f"scorer must be a Verifier, a callable or one of {list(SCORER_NAMES)}, "
                            f"got {type(scorer).__name__}")
    if scorer == "judge" and cgee.exit_enabled:
        LogprobJudgeVerifier(engine).score("", [], cgee)  # raises the layer-exit refusal
    capabilities = engine.capabilities()
    if scorer == "confidence" and not capabilities.logprobs:
        raise ValueError("scorer='confidence' scores a path by its tokens' log-probs, and the server sends none "
                         "(capabilities().logprobs is False); pass scorer='judge' or fn(question, paths) -> scores")
    if scorer == "judge":
        if not capabilities.top_logprobs:
            raise ValueError("scorer='judge' reads the judge prompt's top log-probs, and the server sends none "
                             "(capabilities().top_logprobs is False); pass fn(question, paths) -> scores")
        judge = LogprobJudgeVerifier(engine)
    if stop is not None and stop.confidence is not None and not capabilities.logprobs:
        raise ValueError("early_stop.confidence filters children on their tokens' log-probs, and the server sends "
                         "none (capabilities().logprobs is False); use early_stop='length'")
    return judge, tuple(line for line in capabilities.limits() if "top_logprobs" not in line or scorer == "judge")


class _TextSearch:
    """One search's tree, each node's path text, and the beam."""

    def __init__(self, engine: ServedEngine, question: str, root: str, breadth: int, beam: int, delimiter: str,
                 judge: Verifier | None, params: SamplingParams, final_marker: str | None, cgee: CGEEConfig,
                 stop: EarlyStopConfig | None, extract: Callable[[str], str | None], together: bool) -> None:
        self.engine, self.question, self.root, self.breadth, self.beam = engine, question, root, breadth, beam
        self.delimiter, self.judge, self.final_marker, self.cgee = delimiter, judge, final_marker, cgee
        self.stop, self.extract, self.together = stop, extract, together
        self.base_seed = params.seed if params.seed is not None else secrets.randbelow(2**31)
        self.params = replace(params, stop=tuple(dict.fromkeys((delimiter, *params.stop))))
        self.nodes = [SearchNode(0, None, 0, "", (), 1.0, None, status="root")]
        self.path_texts = [""]  # per node, the generated text root..node (the prompt excluded)
        self.frontier, self.finished = [0], []
        self.num_expansions = 0
        rules = [name for name in SEARCH_EARLY_STOP_RULES if stop is not None and getattr(stop, name) is not None]
        self.early_stop_totals: dict[str, Any] | None = None if stop is None else {
            "rules": rules, "expansions": 0, "children_launched": 0, "children_stopped": 0, "children_cancelled": 0,
            "decode_tokens": 0, "stopped_by": {rule: 0 for rule in rules}}

    def run(self, depth: int, progress: bool) -> None:
        for _ in tqdm(range(depth), desc="tree search", unit="level", disable=not progress):
            children = self._expand_level()
            self._score(children)
            ranked = sorted((i for i in children if self.nodes[i].status != "stopped"),
                            key=lambda i: (-self.nodes[i].branch_score, i))
            if not ranked:
                break
            for i in ranked[self.beam:]:
                self.nodes[i].status = "pruned"
            kept = ranked[: self.beam]
            self.frontier = [i for i in kept if not self.nodes[i].is_final]
            self.finished += [i for i in kept if self.nodes[i].is_final]
            if not self.frontier:
                break

    def _expand_level(self) -> list[int]:
        """Submit every frontier node's children (before waiting on any, unless not ``together``)."""
        pending = []
        for index in self.frontier:
            params = replace(self.params, seed=self.base_seed + index * self.breadth)
            monitor = None if self.stop is None else EarlyStopMonitor(
                self.stop, n=self.breadth, extract=self.extract, max_new_tokens=params.max_new_tokens)
            handle = self.engine.submit(self.root + self.path_texts[index], self.breadth, params, monitor=monitor)
            pending.append((index, handle.result() if not self.together else handle, monitor))
        children = []
        for index, done, monitor in pending:
            completions = done if isinstance(done, list) else done.result()
            children += self._add_children(index, completions, monitor)
        return children

    def _add_children(self, index: int, completions: list[Completion], monitor: EarlyStopMonitor | None) -> list[int]:
        node = self.nodes[index]
        node.status = "expanded"
        self.num_expansions += 1
        stopped = self._stopped(completions, monitor)
        out = []
        for completion in completions:
            # "stop" is read as the delimiter (see the module docstring).
            at_delimiter = completion.finish_reason == "stop"
            is_final = (completion.finish_reason == "eos"
                        or (self.final_marker is not None and self.final_marker in completion.text))
            child = SearchNode(len(self.nodes), index, node.depth + 1, completion.text, (), 0.0,
                               completion.finish_reason, is_final=is_final,
                               path_logprob_sum=node.path_logprob_sum + sum(completion.logprobs),
                               path_num_tokens=node.path_num_tokens + len(completion.logprobs))
            if completion.branch_index in stopped:
                child.status = "stopped"
            self.nodes.append(child)
            self.path_texts.append(self.path_texts[index] + completion.text + (self.delimiter if at_delimiter else ""))
            node.children.append(child.index)
            out.append(child.index)
        return out

    def _stopped(self, completions: list[Completion], monitor: EarlyStopMonitor | None) -> dict[int, str]:
        """Per branch index of a child an early-stop rule took out, the rule; counted in the totals."""
        if monitor is None or self.early_stop_totals is None:
            return {}
        report = monitor.report()
        stopped_by = dict(report.stopped_by)
        stopped = {c.branch_index: stopped_by.get(c.branch_index, "confidence")
                   for c, votes in zip(completions, monitor.voting(completions)) if not votes}
        totals = self.early_stop_totals
        totals["expansions"] += 1
        totals["children_launched"] += report.branches_launched
        totals["children_stopped"] += len(stopped)
        totals["children_cancelled"] += sum(c.finish_reason == "cancelled" and c.branch_index in stopped
                                            for c in completions)
        totals["decode_tokens"] += report.decode_tokens
        for rule in stopped.values():
            totals["stopped_by"][rule] = totals["stopped_by"].get(rule, 0) + 1
        return stopped

    def _score(self, children: list[int]) -> None:
        if self.judge is None:
            for i in children:
                node = self.nodes[i]
                node.branch_score = math.exp(node.path_logprob_sum / node.path_num_tokens) if node.path_num_tokens else 0.0
            return
        scores = self.judge.score(self.question, [self.path_texts[i] for i in children], self.cgee)
        if len(scores) != len(children):
            raise ValueError(f"scorer returned {len(scores)} scores for {len(children)} paths")
        for i, s in zip(children, scores):
            value = float(s.score)
            if not math.isfinite(value):
                raise ValueError(f"scorer returned a non-finite score {value} for node {i}")
            self.nodes[i].branch_score = value

    def best(self) -> SearchNode:
        """The best finished path; when none finished, the best of the last beam."""
        pool = self.finished or self.frontier or [0]
        return max((self.nodes[i] for i in pool), key=lambda n: (n.branch_score, -n.index))

    def path(self, index: int) -> list[SearchNode]:
        out = []
        i: int | None = index
        while i is not None:
            out.append(self.nodes[i])
            i = self.nodes[i].parent
        return out[::-1]
