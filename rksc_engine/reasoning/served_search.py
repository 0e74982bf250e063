"""Tree search over an engine behind a server (``RemoteEngine.tree_search``): the beam search of
``rksc_engine.reasoning.tree_search`` with paths kept as text, since a server takes text and sends
no token ids.

What is the same as a local search: the tree's shape and statuses (``SearchNode``, ``SearchResult``),
the seeds (node ``i``'s children are seeded ``seed + i * breadth + k``), every level's expansions
submitted together (``expand_together``), children run under their own ``EarlyStopMonitor`` (the
``length`` and ``confidence`` rules, ``resolve_search_early_stop``), scores from path confidence or
a verifier (the log-prob judge by default for ``"judge"``), the beam, the answer; a blank step is not
a step (a child that met the delimiter first goes on from there, seeded as locally, until it writes
one or spends its budget); a ``cancel`` token is checked before each level and each scoring pass,
and cancelling it closes the level's requests at once.

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
    * A path longer than the server's context is the server's 400 (``ValueError``), not a final node,
      and a blank child goes on while it has budget left (the server's context is its own).
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from typing import Any

from tqdm.auto import tqdm

from ..config import MAX_SEED, MIN_SAMPLING_TEMPERATURE, MIN_TOP_P, SamplingParams
from ..protocol import ServedEngine
from ..results import Completion
from ..runtime.cancel import CancelToken, check_cancel_token
from ..runtime.handle import RequestCancelled, RequestHandle
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
    cancel: CancelToken | None = None,
) -> SearchResult:
    """Beam search over reasoning steps on a server; the arguments of ``tree_search`` (see the
    module docstring for what differs). ``SearchResult.server_limits`` names what was not done.

    Raises:
        TypeError, ValueError: a bad argument (named), a chat-message ``prompt``, a scorer the
            server cannot feed, ``cgee.exit_enabled`` with the judge; before anything is sent.
        RequestCancelled: ``cancel`` was cancelled before the search ended (its requests in flight
            are closed at once).
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
    cancel = check_cancel_token(cancel)
    judge, limits = _served_scorer(engine, scorer, cgee, stop_config)
    root = prompt if prompt is not None else few_shot_text(question, shots)

    search = _TextSearch(engine, question, root, breadth, beam, step_delimiter, judge, params, final_marker, cgee,
                         stop_config, extract, expand_together, cancel)
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


@dataclass(frozen=True)
class _TextStep:
    """One child's generated step as text, before it becomes a node (or, blank, is merged or dropped).

    Attributes:
        branch_index: The child's index among its siblings (its seed is the expansion's plus this).
        generated: What it adds to its path: every part's text, each followed by the delimiter that
            ended it (blank lines before the step included).
        text: The step's text, cut before the delimiter (after the blank lines once merged).
        logprobs: Its tokens' log-probabilities, as the server sent them.
        num_tokens: Tokens it generated (the server's count).
        finish_reason: How its last part ended (``Completion.finish_reason``).
        ends_path: EOS or the final marker ended it.
    """

    branch_index: int
    generated: str
    text: str
    logprobs: tuple[float, ...]
    num_tokens: int
    finish_reason: str
    ends_path: bool

    @property
    def is_blank(self) -> bool:
        return not self.text.strip()

    def followed_by(self, part: _TextStep) -> _TextStep:
        """This blank step and ``part``, generated after it, as one step: ``part``'s text and ending."""
        return _TextStep(self.branch_index, self.generated + part.generated, part.text, self.logprobs + part.logprobs,
                         self.num_tokens + part.num_tokens, part.finish_reason, part.ends_path)


class _TextSearch:
    """One search's tree, each node's path text, and the beam."""

    def __init__(self, engine: ServedEngine, question: str, root: str, breadth: int, beam: int, delimiter: str,
                 judge: Verifier | None, params: SamplingParams, final_marker: str | None, cgee: CGEEConfig,
                 stop: EarlyStopConfig | None, extract: Callable[[str], str | None], together: bool,
                 cancel: CancelToken | None) -> None:
        self.engine, self.question, self.root, self.breadth, self.beam = engine, question, root, breadth, beam
        self.delimiter, self.judge, self.final_marker, self.cgee = delimiter, judge, final_marker, cgee
        self.stop, self.extract, self.together, self.cancel = stop, extract, together, cancel
        self.base_seed = params.seed if params.seed is not None else secrets.randbelow(2**31)
        self.params = replace(params, stop=tuple(dict.fromkeys((delimiter, *params.stop))))
        self.nodes = [SearchNode(0, None, 0, "", (), 1.0, None, status="root")]
        self.path_texts = [""]  # per node, the generated text root..node (the prompt excluded)
        self.frontier, self.finished = [0], []
        self.num_expansions = 0
        self.num_levels = 0  # levels expanded and scored
        rules = [name for name in SEARCH_EARLY_STOP_RULES if stop is not None and getattr(stop, name) is not None]
        self.early_stop_totals: dict[str, Any] | None = None if stop is None else {
            "rules": rules, "expansions": 0, "children_launched": 0, "children_stopped": 0, "children_cancelled": 0,
            "decode_tokens": 0, "stopped_by": {rule: 0 for rule in rules}}

    def run(self, depth: int, progress: bool) -> None:
        """Expand, score and prune level after level; ``RequestCancelled`` once ``cancel`` is set."""
        try:
            self._run(depth, progress)
        except RequestCancelled:
            if self.cancel is None or not self.cancel.cancelled:
                raise  # a request cancelled by someone else: not this search's own cancellation
            raise RequestCancelled(f"tree search cancelled by its CancelToken after {self.num_levels} finished "
                                   f"levels ({self.num_expansions} expansions)") from None

    def _check_cancel(self) -> None:
        if self.cancel is not None:
            self.cancel.raise_if_cancelled("tree search")

    def _run(self, depth: int, progress: bool) -> None:
        for _ in tqdm(range(depth), desc="tree search", unit="level", disable=not progress):
            self._check_cancel()
            with self._level_requests() as submitted:
                children = self._expand_level(submitted)
            if not children:
                break
            self._check_cancel()
            self._score(children)
            self.num_levels += 1
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

    @contextmanager
    def _level_requests(self) -> Iterator[list[RequestHandle]]:
        """A list for the level's submitted handles: cancelling the search closes them at once, and so
        does any error that ends the level (nobody would read them)."""
        submitted: list[RequestHandle] = []
        with self.cancel.cancelling(submitted) if self.cancel is not None else nullcontext():
            try:
                yield submitted
            except BaseException:
                for handle in submitted:
                    handle.cancel()
                raise

    def _expand_level(self, submitted: list[RequestHandle]) -> list[int]:
        """Submit every frontier node's children (before waiting on any, unless not ``together``);
        each handle goes into ``submitted`` as soon as it is made."""
        pending = []
        for index in self.frontier:
            params = replace(self.params, seed=self.base_seed + index * self.breadth)
            monitor = None if self.stop is None else EarlyStopMonitor(
                self.stop, n=self.breadth, extract=self.extract, max_new_tokens=params.max_new_tokens)
            handle = self.engine.submit(self.root + self.path_texts[index], self.breadth, params, monitor=monitor)
            submitted.append(handle)
            self._check_cancel()  # a cancel that ran before the append did not see this handle
            pending.append((index, handle.result() if not self.together else handle, monitor))
        steps: dict[int, list[_TextStep]] = {}
        stopped: dict[int, dict[int, str]] = {}
        for index, done, monitor in pending:
            completions = done if isinstance(done, list) else done.result()
            stopped[index] = self._stopped(completions, monitor)
            steps[index] = [self._step(c) for c in completions]
        self._continue_blank_steps(steps, stopped, submitted)
        children = []
        for index, level_steps in steps.items():
            children += self._add_children(index, level_steps, stopped[index])
        return children

    def _step(self, completion: Completion) -> _TextStep:
        # "stop" is read as the delimiter (see the module docstring).
        at_delimiter = completion.finish_reason == "stop"
        ends_path = (completion.finish_reason == "eos"
                     or (self.final_marker is not None and self.final_marker in completion.text))
        return _TextStep(completion.branch_index, completion.text + (self.delimiter if at_delimiter else ""),
                         completion.text, tuple(completion.logprobs), completion.num_generated_tokens,
                         completion.finish_reason, ends_path)

    def _continues(self, step: _TextStep) -> bool:
        """Whether ``step`` is blank only because it met the delimiter first, with budget left to go on."""
        return (step.is_blank and step.finish_reason == "stop" and not step.ends_path
                and step.num_tokens < self.params.max_new_tokens)

    def _continue_blank_steps(self, steps: dict[int, list[_TextStep]], stopped: dict[int, dict[int, str]],
                              submitted: list[RequestHandle]) -> None:
        """Let each child that met the delimiter before writing anything go on from its blank text,
        round by round, until it writes a step or cannot go on (``_continues``); a round's requests
        are sent together, as a level's are, and go into ``submitted``. Only children the early-stop
        rules kept go on. The seed of each part is the local search's."""
        pending = [(index, k) for index, level_steps in steps.items() for k, step in enumerate(level_steps)
                   if step.branch_index not in stopped[index] and self._continues(step)]
        while pending:
            handles: dict[tuple[int, int], Any] = {}
            for index, k in pending:
                step = steps[index][k]
                params = replace(self.params, seed=self._continuation_seed(index, step),
                                 max_new_tokens=self.params.max_new_tokens - step.num_tokens)
                handle = self.engine.submit(self.root + self.path_texts[index] + step.generated, 1, params)
                submitted.append(handle)
                self._check_cancel()
                handles[index, k] = handle if self.together else handle.result()
            for (index, k), done in handles.items():
                [part] = done if isinstance(done, list) else done.result()
                steps[index][k] = steps[index][k].followed_by(self._step(part))
                if self.early_stop_totals is not None:
                    self.early_stop_totals["decode_tokens"] += part.num_generated_tokens
            pending = [(index, k) for index, k in pending if self._continues(steps[index][k])]

    def _continuation_seed(self, index: int, step: _TextStep) -> int:
        """The seed of the next part of blank ``step`` (a child of node ``index``), as the local search
        draws it: its own seed mixed with the tokens generated so far, at most ``MAX_SEED``."""
        child_seed = self.base_seed + index * self.breadth + step.branch_index
        return (child_seed * 0x9E3779B1 + step.num_tokens) % (MAX_SEED + 1)

    def _add_children(self, index: int, steps: list[_TextStep], stopped: dict[int, str]) -> list[int]:
        """Node ``index``'s children from its steps (``stopped``: branch index -> the early-stop rule
        that took it out); a blank step makes no node, and one that ended its path marks the parent
        final (as in the local search)."""
        node = self.nodes[index]
        node.status = "expanded"
        self.num_expansions += 1
        out = []
        for step in steps:
            if step.is_blank:
                if step.ends_path and index != 0 and step.branch_index not in stopped and index not in self.finished:
                    node.is_final = True  # the model ended the path right after this node's step
                    self.finished.append(index)
                continue
            child = SearchNode(len(self.nodes), index, node.depth + 1, step.text, (), 0.0,
                               step.finish_reason, is_final=step.ends_path, branch_index=step.branch_index,
                               path_logprob_sum=node.path_logprob_sum + sum(step.logprobs),
                               path_num_tokens=node.path_num_tokens + len(step.logprobs))
            if step.branch_index in stopped:
                child.status = "stopped"
            self._count_child(child, stopped.get(step.branch_index))
            self.nodes.append(child)
            self.path_texts.append(self.path_texts[index] + step.generated)
            node.children.append(child.index)
            out.append(child.index)
        return out

    def _stopped(self, completions: list[Completion], monitor: EarlyStopMonitor | None) -> dict[int, str]:
        """Per branch index of a child an early-stop rule took out, the rule (the expansion and its
        decoded tokens are counted in the totals; each child when it becomes a node)."""
        if monitor is None or self.early_stop_totals is None:
            return {}
        report = monitor.report()
        stopped_by = dict(report.stopped_by)
        stopped = {c.branch_index: stopped_by.get(c.branch_index, "confidence")
                   for c, votes in zip(completions, monitor.voting(completions)) if not votes}
        self.early_stop_totals["expansions"] += 1
        self.early_stop_totals["decode_tokens"] += report.decode_tokens
        return stopped

    def _count_child(self, child: SearchNode, rule: str | None) -> None:
        """Count a new node in the early-stop totals (when early stop is on); ``rule`` took it out, if one did."""
        totals = self.early_stop_totals
        if totals is None:
            return
        totals["children_launched"] += 1
        if rule is not None:
            totals["children_stopped"] += 1
            totals["children_cancelled"] += child.finish_reason == "cancelled"
            totals["stopped_by"][rule] = totals["stopped_by"].get(rule, 0) + 1

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
