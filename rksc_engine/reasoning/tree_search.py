"""Tree search over reasoning steps (beam search, tree-of-thought style) inside the RSBCM cache budget.

Each frontier node is expanded into ``breadth`` children, one reasoning step each (generation stops
at ``step_delimiter``), decoded as one batch over the parent's cached KV. Children are scored (their
path's confidence, a ``Verifier``, or any ``fn(question, paths) -> scores``), the best ``beam`` are
kept, and the search stops at ``depth`` steps or when no unfinished node is left.

What the cache is told:
    A node's ``branch_score`` is its path's score and its ``depth`` the number of steps from the
    root; after every expansion the expanded path is annotated with both (``engine.annotate_cache``)
    so ``omega = branch_score / (depth + 1)`` eviction reads them. A branch the beam dropped is never
    expanded again, so with ``demote_pruned`` (default) its cached KV is annotated with score 0 and
    RSBCM evicts it first. The prompt (the root) keeps score 1.0 at depth 0.

Determinism:
    Expanding node ``i`` samples its children with seeds ``seed + i * breadth + k`` (``k`` < breadth),
    so a search with a given ``params.seed`` makes the same tree whatever the cache budget or policy:
    evicted KV is recomputed exactly.

Which KV gets cached: a node's step enters the prefix cache when the node is expanded (its prompt is
the parent's path plus the step; only the step is computed, the rest is a cache hit). Children the
beam drops are never prefilled, so they cost no cache memory.

Blank steps: a step that is only whitespace is not a step. A child that reached the delimiter before
writing anything else (a model that leaves a blank line between steps) goes on from there, seeded as
it was, until it writes a step or spends its ``max_new_tokens``: its node holds the blank tokens and
the step after them, and its text is that step. A child left blank when its budget runs out is
dropped; one that ended blank by EOS or a user stop string ends its parent's path instead (the parent
joins the finished paths). So no node but the root has blank text, and none is scored.

Early stop (``early_stop="length"``, ``"confidence"`` or an ``EarlyStopConfig``): each expansion's
``breadth`` children run under their own ``EarlyStopMonitor``, so a child that rambles past the tail
cut, or whose token confidence falls below its siblings' threshold, is stopped as a self-consistency
branch would be. A stopped child (status ``"stopped"``) stays in the tree with the text it had, but
the beam never keeps it, so it is never expanded and its KV is never cached. Children are scored, not
voted, so the vote rules (``decided``, ``answered``, ``adaptive``) do not apply. The monitor reads only
each child's own tokens, so the tree still does not depend on batching (``expand_together``).

Cancellation (``cancel=CancelToken()``): the search checks the token before each level and before
each scoring pass, and cancelling it cancels the level's requests in flight at once (they end at
the scheduler's next step). A cancelled search raises ``RequestCancelled`` saying how many levels it
had finished; the steps it had cached stay in the prefix cache with the scores they were given.
"""

from __future__ import annotations

import math
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any

from tqdm.auto import tqdm

from ..config import MAX_SEED, MIN_SAMPLING_TEMPERATURE, MIN_TOP_P, SamplingParams
from ..protocol import LocalEngine
from ..results import Completion
from ..runtime.cancel import CancelToken, check_cancel_token
from ..runtime.handle import RequestCancelled, RequestHandle
from .cgee import CGEEConfig
from .early_stop import (
    EARLY_STOP_RULES,
    ConfidenceConfig,
    EarlyStopConfig,
    EarlyStopMonitor,
    EarlyStopReport,
    LengthConfig,
)
from .few_shot import Problem, check_problems, few_shot_messages
from .self_consistency import resolve_extractor, resolve_verifier
from .verifier import Verifier, as_verifier

PathScorer = Callable[[str, Sequence[str]], Sequence[float]]
SCORER_NAMES = ("confidence", "judge")
# The early-stop rules that apply to a node's children: they judge each child by its own tokens. The
# others (decided, answered, adaptive) reason about a vote, and a beam scores its children instead.
SEARCH_EARLY_STOP_RULES = ("confidence", "length")
# Sampling of each step when ``tree_search`` is given no ``params`` (seeded, so the tree is reproducible).
DEFAULT_SEARCH_PARAMS = SamplingParams(temperature=0.7, top_p=0.95, max_new_tokens=48, seed=0)


@dataclass
class SearchNode:
    """One reasoning step in the search tree.

    Attributes:
        index: Position in ``SearchResult.nodes`` (the root is 0); creation order.
        parent: Index of the parent, None for the root.
        depth: Steps from the root (root 0).
        text: This step's text, cut before the step delimiter (empty for the root, never blank for
            another node: a step that began with blank lines is the text after them).
        token_ids: This step's generated tokens, as fed to the next step (blank lines before the
            step included).
        branch_score: Score of the path root..this node (the root: 1.0).
        finish_reason: The step's ``Completion.finish_reason`` (None for the root).
        is_final: The path ended here: an answer (``final_marker``), EOS, a user stop string, or
            the context window (also on an expanded node whose child ended blank by EOS or a user
            stop string).
        status: ``"root"``, ``"expanded"`` (its children were generated), ``"kept"`` (in the beam,
            not expanded: a final node or the last level), ``"pruned"`` (dropped by the beam), or
            ``"stopped"`` (an early-stop rule stopped it or left it out: never ranked by the beam, never
            expanded; its text and tokens are what it had generated, ``is_final`` as that step reads).
        children: Indices of its children.
        branch_index: Which of its parent's ``breadth`` children it was: it drew from the parent's
            seed plus this (``seed + parent * breadth + branch_index``). None for the root. A blank
            child makes no node, so a parent's children may skip an index.
    """

    index: int
    parent: int | None
    depth: int
    text: str
    token_ids: tuple[int, ...]
    branch_score: float
    finish_reason: str | None
    is_final: bool = False
    status: str = "kept"
    children: list[int] = field(default_factory=list)
    # Sum of logprobs and count of generated tokens along the path root..this node (path confidence).
    path_logprob_sum: float = 0.0
    path_num_tokens: int = 0
    branch_index: int | None = None


@dataclass
class SearchResult:
    """The outcome of a tree search.

    Attributes:
        answer: The answer extracted from the best path's text (None when it states none).
        best_path: Nodes from the root to the chosen leaf.
        best_score: The chosen leaf's ``branch_score``.
        text: The chosen path's generated text (every step, as the model wrote it).
        nodes: The whole tree with scores; ``nodes[0]`` is the root.
        num_expansions: Nodes expanded (generation calls).
        wall_s: Wall time of the search.
        cache_bytes_trace: Bytes held by the prefix cache after each expansion, in order, to see
            the search grow against the RSBCM budget.
        early_stop: None when early stop was off; else totals over every expansion: ``rules`` (those
            that ran), ``expansions``, ``children_launched``, ``children_stopped`` (nodes with status
            ``"stopped"``), ``children_cancelled`` (those of them cut while decoding, the ones that saved
            tokens; the rest finished and were left out by the confidence filter), ``decode_tokens``
            (tokens the children decoded, blank ones and their continuations included), and
            ``stopped_by`` (per rule, children it stopped). Children are nodes: a blank child, which
            makes none, is not counted.
        server_limits: Empty for a local search; over a server (``RemoteEngine.tree_search``), one
            line per thing not done there (RSBCM's cache annotation) or the server does not provide.
    """

    answer: str | None
    best_path: list[SearchNode]
    best_score: float
    text: str
    nodes: list[SearchNode]
    num_expansions: int
    wall_s: float
    cache_bytes_trace: list[int] = field(default_factory=list)
    early_stop: dict[str, Any] | None = None
    server_limits: tuple[str, ...] = ()

    def path(self, index: int) -> list[SearchNode]:
        """Nodes from the root to ``nodes[index]``."""
        out = []
        node: SearchNode | None = self.nodes[index]
        while node is not None:
            out.append(node)
            node = None if node.parent is None else self.nodes[node.parent]
        return out[::-1]

    def format_tree(self) -> str:
        """The tree as indented lines: ``[index] score status | step text`` (status as in
        ``SearchNode``, ``stopped`` included); ``*`` marks the best path."""
        lines: list[str] = []
        on_best_path = {n.index for n in self.best_path}

        def visit(i: int, indent: int) -> None:
            node = self.nodes[i]
            text = node.text.replace("\n", " ")[:70] if node.parent is not None else "(prompt)"
            mark = "*" if i in on_best_path else " "
            lines.append(f"{'  ' * indent}{mark}[{i}] {node.branch_score:.3f} {node.status:<8} | {text}")
            for child in node.children:
                visit(child, indent + 1)

        visit(0, 0)
        return "\n".join(lines)


def _check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _resolve_scorer(engine: LocalEngine, scorer: str | Verifier | PathScorer) -> Verifier | None:
    """None means path confidence; anything else scores path texts."""
    if isinstance(scorer, str):
        if scorer not in SCORER_NAMES:
            raise ValueError(f"scorer must be a Verifier, a callable or one of {list(SCORER_NAMES)}, got {scorer!r}")
        return None if scorer == "confidence" else resolve_verifier(engine, None)
    verifier = as_verifier(scorer)
    if verifier is not None:
        return verifier
    raise TypeError(f"scorer must be a Verifier, a callable or one of {list(SCORER_NAMES)}, got {type(scorer).__name__}")


def resolve_search_early_stop(value: None | str | EarlyStopConfig) -> EarlyStopConfig | None:
    """The early-stop configuration a tree search runs for each expansion's children, or None (off).

    A rule name (``"length"``, ``"confidence"``) means that rule alone with its defaults. An
    ``EarlyStopConfig`` runs its ``length`` and ``confidence`` rules; its ``decided`` flag is ignored
    (``decided`` is on by default in ``EarlyStopConfig``, so it says nothing about what the caller
    wants here, and the beam has no vote for it to decide); ``answered`` or ``adaptive`` set, or
    neither ``length`` nor ``confidence``, is refused.

    Raises:
        ValueError: a vote rule (by name or set in the config), an unknown name, or a config with no
            rule that applies to a tree's children.
        TypeError: anything but None, a name or an ``EarlyStopConfig``.
    """
    expected = f"None, an EarlyStopConfig or one of {list(SEARCH_EARLY_STOP_RULES)}"
    why = "a node's children are scored and ranked by the beam, not voted"
    if value is None:
        return None
    if isinstance(value, str):
        if value == "length":
            return EarlyStopConfig(decided=False, length=LengthConfig())
        if value == "confidence":
            return EarlyStopConfig(decided=False, confidence=ConfidenceConfig())
        if value in EARLY_STOP_RULES:
            raise ValueError(f"early_stop={value!r} does not apply to tree search: {why}; use {expected}")
        raise ValueError(f"early_stop must be {expected}, got {value!r}")
    if not isinstance(value, EarlyStopConfig):
        raise TypeError(f"early_stop must be {expected}, got {type(value).__name__}")
    vote_rules = [name for name in ("answered", "adaptive") if getattr(value, name) is not None]
    if vote_rules:
        raise ValueError(f"early_stop.{vote_rules[0]} does not apply to tree search: {why}; "
                         f"set only early_stop.length or early_stop.confidence")
    if value.length is None and value.confidence is None:
        raise ValueError("early_stop has no rule that applies to tree search: set early_stop.length or "
                         f"early_stop.confidence (decided is ignored: {why})")
    return replace(value, decided=False)


def tree_search(
    engine: LocalEngine,
    question: str,
    *,
    breadth: int = 3,
    depth: int = 6,
    beam: int | None = None,
    step_delimiter: str = "\n",
    scorer: str | Verifier | PathScorer = "confidence",
    params: SamplingParams | None = None,
    few_shot: Sequence[Problem] = (),
    prompt: Any = None,
    answer_extractor: str | Callable[[str], str | None] = "gsm8k",
    final_marker: str | None = "####",
    demote_pruned: bool = True,
    cgee: CGEEConfig | None = None,
    progress: bool = False,
    expand_together: bool = True,
    early_stop: None | str | EarlyStopConfig = None,
    cancel: CancelToken | None = None,
) -> SearchResult:
    """Beam search over reasoning steps; see ``RKSCEngine.tree_search``.

    Args:
        engine: The ``RKSCEngine``.
        question: The question (put into a few-shot chat prompt unless ``prompt`` is given).
        breadth: Children per expanded node, >= 1.
        depth: Most steps from the root, >= 1.
        beam: Nodes kept per level, >= 1. Default ``breadth``.
        step_delimiter: Ends a step (added to ``params.stop``). Default a newline.
        scorer: ``"confidence"`` (default: the path's geometric-mean token probability), ``"judge"``
            (``LLMJudgeVerifier`` on this engine), a ``Verifier``, or ``fn(question, path_texts) -> scores``.
            Scores must be finite; ``omega`` eviction expects them in [0, 1].
        params: Sampling per step. Default temperature 0.7, top_p 0.95, 48 new tokens per step, seed 0.
            ``breadth > 1`` needs ``temperature > 0`` (greedy siblings would be identical).
        few_shot: Worked problems for the default prompt.
        prompt: Your own prompt (string, chat messages or token ids) instead of the few-shot one.
        answer_extractor: ``"gsm8k"``, ``"choice"`` or ``fn(text) -> answer``.
        final_marker: A step containing it ends its path (GSM8K's ``"####"``); None: only EOS,
            user stop strings and the context window end a path.
        demote_pruned: Annotate the cached KV of branches the beam dropped with score 0. Default True.
        cgee: Passed to a ``Verifier`` scorer. Default ``CGEEConfig()``.
        progress: Show a progress bar over levels.
        expand_together: Submit all expansions of a level at once, so the scheduler decodes them in
            one batch (default). False expands one node per call; the tree is the same either way.
        early_stop: None (default: every child runs to its step's end), ``"length"``, ``"confidence"``
            or an ``EarlyStopConfig``: each expansion's children run under their own
            ``EarlyStopMonitor`` and those it stops or leaves out get status ``"stopped"`` and are never
            kept or expanded. Only ``length`` and ``confidence`` apply (children are scored, not
            voted): ``answered``/``adaptive`` raise ``ValueError``; ``decided`` is ignored.
        cancel: A ``CancelToken`` another thread may cancel: the search stops before its next level
            or scoring pass, and its requests in flight are cancelled at once.

    Returns:
        A ``SearchResult``.

    Raises:
        RequestCancelled: ``cancel`` was cancelled before the search ended.

    Example:
        >>> result = engine.tree_search("Tom has 3 bags of 4 apples. How many apples?", breadth=3, depth=6,
        ...                             params=SamplingParams(temperature=0.8, max_new_tokens=40, seed=0))
        >>> result.answer, result.best_score
        >>> print(result.format_tree())
    """
    if not isinstance(question, str):
        raise TypeError(f"question must be a non-empty string, got {type(question).__name__}")
    if not question.strip():
        raise ValueError("question must be a non-empty string")
    _check_positive_int("breadth", breadth)
    _check_positive_int("depth", depth)
    beam = breadth if beam is None else beam
    _check_positive_int("beam", beam)
    if not isinstance(step_delimiter, str) or not step_delimiter:
        raise ValueError("step_delimiter must be a non-empty string")
    params = DEFAULT_SEARCH_PARAMS if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if breadth > 1 and params.greedy:
        raise ValueError(f"breadth > 1 needs sampling (params.temperature > 0, at least {MIN_SAMPLING_TEMPERATURE}, "
                         f"and params.top_p >= {MIN_TOP_P}): greedy siblings would all be the same step")
    # Node i's children are seeded from seed + i * breadth, and fewer than depth * beam * breadth
    # nodes are ever expanded: every such seed must still be a valid SamplingParams.seed.
    if params.seed is not None and params.seed + depth * beam * breadth * breadth > MAX_SEED:
        raise ValueError(f"params.seed + depth * beam * breadth**2 must be <= {MAX_SEED} (MAX_SEED; node i's "
                         f"children are seeded seed + i * breadth), got seed={params.seed}")
    shots = check_problems(few_shot, "few_shot")
    if shots and prompt is not None:
        raise ValueError("pass few_shot or prompt, not both (prompt replaces the few-shot prompt)")
    extract = resolve_extractor(answer_extractor)
    if final_marker is not None and (not isinstance(final_marker, str) or not final_marker):
        raise ValueError("final_marker must be a non-empty string or None")
    for name, flag in (("demote_pruned", demote_pruned), ("progress", progress)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    cgee = CGEEConfig() if cgee is None else cgee
    if not isinstance(cgee, CGEEConfig):
        raise TypeError(f"cgee must be a CGEEConfig or None, got {type(cgee).__name__}")
    stop_config = resolve_search_early_stop(early_stop)
    cancel = check_cancel_token(cancel)
    judge = _resolve_scorer(engine, scorer)
    messages = prompt if prompt is not None else few_shot_messages(question, shots)
    root_ids = engine.encode(messages)
    engine.validate_request(root_ids, breadth, params)

    if not isinstance(expand_together, bool):
        raise TypeError(f"expand_together must be a bool, got {type(expand_together).__name__}")
    search = _Search(engine, question, root_ids, breadth, beam, step_delimiter, judge, params, final_marker,
                     demote_pruned, cgee)
    search.concurrent = expand_together
    search.cancel = cancel
    if stop_config is not None:
        search.enable_early_stop(stop_config, extract)
    start = time.perf_counter()
    search.run(depth, progress)
    wall_s = time.perf_counter() - start
    best = search.best()
    best_path = search.path(best.index)
    text = search.path_text(best.index)
    return SearchResult(extract(text), best_path, best.branch_score, text, search.nodes, search.num_expansions, wall_s,
                        search.cache_bytes_trace, search.early_stop_totals)


@dataclass(frozen=True)
class _Step:
    """One child's generated step, before it becomes a node (or, blank, is merged or dropped).

    Attributes:
        branch_index: The child's index among its siblings (its seed is the expansion's plus this).
        token_ids: Every token it generated, blank lines before the step included.
        logprobs: Their log-probabilities.
        text: The step's text, cut before the delimiter (after the blank lines once merged).
        finish_reason: How its last part ended (``Completion.finish_reason``).
        ends_path: EOS, a user stop string other than the delimiter, or the final marker ended it.
    """

    branch_index: int
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str
    ends_path: bool

    @property
    def is_blank(self) -> bool:
        return not self.text.strip()

    def followed_by(self, part: _Step) -> _Step:
        """This blank step and ``part``, generated after it, as one step: ``part``'s text and ending."""
        return _Step(self.branch_index, self.token_ids + part.token_ids, self.logprobs + part.logprobs,
                     part.text, part.finish_reason, part.ends_path)


class _Search:
    """State of one search: the tree, each node's full token path, the beam."""

    def __init__(self, engine: LocalEngine, question: str, root_ids: list[int], breadth: int, beam: int, delimiter: str,
                 judge: Verifier | None, params: SamplingParams, final_marker: str | None, demote_pruned: bool,
                 cgee: CGEEConfig) -> None:
        self.engine, self.question, self.breadth, self.beam = engine, question, breadth, beam
        self.delimiter, self.judge, self.final_marker = delimiter, judge, final_marker
        self.demote_pruned, self.cgee = demote_pruned, cgee
        self.concurrent = True
        self.base_seed = params.seed if params.seed is not None else secrets.randbelow(2**31)
        self.params = replace(params, stop=tuple(dict.fromkeys((delimiter, *params.stop))))
        self.root_len = len(root_ids)
        self.nodes = [SearchNode(0, None, 0, "", (), 1.0, None, status="root")]
        self.path_ids: list[list[int]] = [list(root_ids)]
        self.frontier: list[int] = [0]
        self.finished: list[int] = []
        self.expanded: list[int] = []
        self.demoted: set[int] = set()
        self.num_expansions = 0
        self.cache_bytes_trace: list[int] = []
        self.early_stop: EarlyStopConfig | None = None
        self.extract: Callable[[str], str | None] | None = None
        self.early_stop_totals: dict[str, Any] | None = None
        self.cancel: CancelToken | None = None
        self.num_levels = 0  # levels expanded and scored

    def enable_early_stop(self, config: EarlyStopConfig, extract: Callable[[str], str | None]) -> None:
        """Run every expansion's children under an ``EarlyStopMonitor`` of ``config`` (already
        checked by ``resolve_search_early_stop``); ``extract`` is the search's answer extractor."""
        self.early_stop, self.extract = config, extract
        rules = [name for name in SEARCH_EARLY_STOP_RULES if getattr(config, name) is not None]
        self.early_stop_totals = {"rules": rules, "expansions": 0, "children_launched": 0, "children_stopped": 0,
                                  "children_cancelled": 0, "decode_tokens": 0,
                                  "stopped_by": {rule: 0 for rule in rules}}

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
                children = self._expand_level(self.frontier, submitted)
            if not children:
                break
            self._check_cancel()
            self._score(children)
            self.num_levels += 1
            # Stopped children keep their score for inspection but never compete for the beam.
            ranked = sorted((i for i in children if self.nodes[i].status != "stopped"),
                            key=lambda i: (-self.nodes[i].branch_score, i))
            if not ranked:
                # Early stop left no child of this level: nothing to keep or expand. The search ends
                # with this level's parents as the last beam (``best``); their paths were annotated
                # live when expanded.
                break
            kept = ranked[: self.beam]
            for i in ranked[self.beam:]:
                self.nodes[i].status = "pruned"
            self.frontier = [i for i in kept if not self.nodes[i].is_final]
            self.finished += [i for i in kept if self.nodes[i].is_final]
            self._tell_cache()
            if not self.frontier:
                break

    def _expand_level(self, frontier: list[int], submitted: list[RequestHandle]) -> list[int]:
        """Expand every frontier node; all their requests are submitted before any is waited on, so
        the scheduler decodes the whole level in one batch. Node ``i``'s children draw from seeds
        ``base_seed + i * breadth + j`` either way, so the tree does not depend on the batching.
        Each request's handle goes into ``submitted`` as soon as it is made (``_level_requests``)."""
        handles = {}
        monitors: dict[int, EarlyStopMonitor] = {}
        for index in frontier:
            ids = self.path_ids[index]
            if len(ids) >= self.engine.context_window - 1:
                continue
            params = replace(self.params, seed=self.base_seed + index * self.breadth)
            if self.early_stop is None:
                handles[index] = self.engine.submit(ids, self.breadth, params)
            else:
                # One monitor per expansion: the rules compare a node's children with each other only
                # (and read only their tokens, never the clock), so batching cannot change the tree.
                monitor = monitors[index] = EarlyStopMonitor(self.early_stop, n=self.breadth, extract=self.extract,
                                                             max_new_tokens=params.max_new_tokens)
                handles[index] = self.engine.submit(ids, self.breadth, params, monitor=monitor,
                                                    max_branches=self.breadth)
            submitted.append(handles[index])
            self._check_cancel()  # a cancel that ran before the append did not see this handle
            if not self.concurrent:
                handles[index] = handles[index].result()
        steps: dict[int, list[_Step]] = {}
        stopped: dict[int, dict[int, str]] = {}
        for index in frontier:
            if index not in handles:
                node = self.nodes[index]
                node.is_final, node.finish_reason = True, "length"
                self.finished.append(index)
                continue
            done = handles[index]
            completions = done if isinstance(done, list) else done.result()
            stopped[index] = self._stopped_children(completions, monitors.get(index))
            steps[index] = [self._step(c) for c in completions]
        self._continue_blank_steps(steps, stopped, submitted)
        children = []
        for index, level_steps in steps.items():
            children += self._add_children(index, level_steps, stopped[index])
        return children

    @contextmanager
    def _level_requests(self) -> Iterator[list[RequestHandle]]:
        """A list for the level's submitted handles: cancelling the search cancels them at once, and so
        does any error that ends the level (nobody would read them)."""
        submitted: list[RequestHandle] = []
        with self.cancel.cancelling(submitted) if self.cancel is not None else nullcontext():
            try:
                yield submitted
            except BaseException:
                for handle in submitted:
                    handle.cancel()
                raise

    def _step(self, completion: Completion) -> _Step:
        raw = self.engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        ended_by_other_stop = completion.finish_reason == "stop" and self.delimiter not in raw
        ends_path = (completion.finish_reason == "eos" or ended_by_other_stop
                     or (self.final_marker is not None and self.final_marker in completion.text))
        return _Step(completion.branch_index, completion.token_ids, completion.logprobs, completion.text,
                     completion.finish_reason, ends_path)

    def _continues(self, index: int, step: _Step) -> bool:
        """Whether ``step`` (a child of node ``index``) is blank only because it met the delimiter
        first, and may go on: tokens left of its budget and room in the context window."""
        return (step.is_blank and step.finish_reason == "stop" and not step.ends_path
                and len(step.token_ids) < self.params.max_new_tokens
                and len(self.path_ids[index]) + len(step.token_ids) < self.engine.context_window - 1)

    def _continue_blank_steps(self, steps: dict[int, list[_Step]], stopped: dict[int, dict[int, str]],
                              submitted: list[RequestHandle]) -> None:
        """Let each child that met the delimiter before writing anything go on from its blank tokens,
        round by round, until it writes a step or cannot go on (``_continues``); a round's children are
        submitted together, as a level's are, and like them go into ``submitted`` (a cancel of the
        search cancels them). Only children the early-stop rules kept go on."""
        pending = [(index, k) for index, level_steps in steps.items() for k, step in enumerate(level_steps)
                   if step.branch_index not in stopped[index] and self._continues(index, step)]
        while pending:
            handles = {}
            for index, k in pending:
                step = steps[index][k]
                params = replace(self.params, seed=self._continuation_seed(index, step),
                                 max_new_tokens=self.params.max_new_tokens - len(step.token_ids))
                handles[index, k] = self.engine.submit(self.path_ids[index] + list(step.token_ids), 1, params)
                submitted.append(handles[index, k])
                self._check_cancel()
                if not self.concurrent:
                    handles[index, k] = handles[index, k].result()
            for (index, k), done in handles.items():
                [part] = done if isinstance(done, list) else done.result()
                steps[index][k] = steps[index][k].followed_by(self._step(part))
                if self.early_stop_totals is not None:
                    self.early_stop_totals["decode_tokens"] += len(part.token_ids)
            pending = [(index, k) for index, k in pending if self._continues(index, steps[index][k])]

    def _continuation_seed(self, index: int, step: _Step) -> int:
        """The seed of the next part of blank ``step`` (a child of node ``index``): its own seed
        would redraw the numbers that just picked the delimiter, and tend to pick it again, so it is
        mixed with the tokens generated so far; still fixed by ``params.seed``, and at most ``MAX_SEED``."""
        child_seed = self.base_seed + index * self.breadth + step.branch_index
        return (child_seed * 0x9E3779B1 + len(step.token_ids)) % (MAX_SEED + 1)

    def _stopped_children(self, completions: list[Completion], monitor: EarlyStopMonitor | None) -> dict[int, str]:
        """Per branch index of a child an early-stop rule took out, the rule (the expansion and its
        decoded tokens are counted in the totals; each child when it becomes a node)."""
        if monitor is None:
            return {}
        report: EarlyStopReport = monitor.report()
        stopped_by = dict(report.stopped_by)
        stopped = {}
        for completion, votes in zip(completions, monitor.voting(completions)):
            if not votes:
                # Not stopped while decoding: it finished and the confidence filter left it out (the
                # only rule here that judges a finished branch).
                stopped[completion.branch_index] = stopped_by.get(completion.branch_index, "confidence")
        totals = self.early_stop_totals
        totals["expansions"] += 1
        totals["decode_tokens"] += report.decode_tokens
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

    def _add_children(self, index: int, steps: list[_Step], stopped: dict[int, str]) -> list[int]:
        """Node ``index``'s children from its steps (``stopped``: branch index -> the early-stop rule
        that took it out); a blank step makes no node (see the module docstring)."""
        node, ids = self.nodes[index], self.path_ids[index]
        self.num_expansions += 1
        self.cache_bytes_trace.append(self.engine.prefix_cache.total_bytes)
        node.status = "expanded"
        self.expanded.append(index)
        self._annotate_path(index)  # the prefill just cached this node's step with default scores
        out = []
        for step in steps:
            if step.is_blank:
                if step.ends_path and index != 0 and step.branch_index not in stopped and index not in self.finished:
                    node.is_final = True  # the model ended the path right after this node's step
                    self.finished.append(index)
                continue
            step_ids = [t for t in step.token_ids if t not in self.engine.eos_token_ids]
            child = SearchNode(
                len(self.nodes), index, node.depth + 1, step.text, tuple(step_ids), 0.0,
                step.finish_reason, is_final=step.ends_path, branch_index=step.branch_index,
                path_logprob_sum=node.path_logprob_sum + sum(step.logprobs),
                path_num_tokens=node.path_num_tokens + len(step.logprobs),
            )
            if step.branch_index in stopped:
                child.status = "stopped"
            self._count_child(child, stopped.get(step.branch_index))
            self.nodes.append(child)
            self.path_ids.append(ids + step_ids)
            node.children.append(child.index)
            out.append(child.index)
        return out

    def _score(self, children: list[int]) -> None:
        if self.judge is None:
            for i in children:
                node = self.nodes[i]
                node.branch_score = math.exp(node.path_logprob_sum / node.path_num_tokens) if node.path_num_tokens else 0.0
            return
        texts = [self.path_text(i) for i in children]
        scores = self.judge.score(self.question, texts, self.cgee)
        if len(scores) != len(children):
            raise ValueError(f"scorer returned {len(scores)} scores for {len(children)} paths")
        for i, s in zip(children, scores):
            value = float(s.score)
            if not math.isfinite(value):
                raise ValueError(f"scorer returned a non-finite score {value} for node {i}")
            self.nodes[i].branch_score = value

    def _annotate_path(self, index: int) -> None:
        """Give every step on the path root..index its score and depth in the prefix cache."""
        for node in self.path(index)[1:]:
            self._annotate(node.index, node.branch_score)

    def _annotate(self, index: int, branch_score: float) -> None:
        node = self.nodes[index]
        self.engine.annotate_cache(self.path_ids[index], start=len(self.path_ids[node.parent]),
                                   branch_score=branch_score, depth=node.depth)

    def _tell_cache(self) -> None:
        """After a level: expanded nodes no kept branch descends from are dead (score 0); then the
        live paths are re-annotated, so KV shared between a dead and a live step keeps the live score."""
        if not self.demote_pruned:
            return
        alive: set[int] = set()
        for i in self.frontier:
            alive.update(n.index for n in self.path(i))
        for i in self.expanded:
            if i and i not in alive and i not in self.demoted:  # the root (the prompt) is never demoted
                self._annotate(i, 0.0)
                self.demoted.add(i)
        for i in self.frontier:
            self._annotate_path(self.nodes[i].parent)

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

    def path_text(self, index: int) -> str:
        return self.engine.tokenizer.decode(self.path_ids[index][self.root_len:], skip_special_tokens=True)
