"""The rksc endpoints, for what OpenAI's API cannot say: the bodies of ``POST /v1/rksc/reason``
(self-consistency over ``n`` branches, voted, then verified or skipped by CGEE) and
``POST /v1/rksc/tree_search`` (beam search over reasoning steps), and their answers.

Promises:
    * Bodies are validated as strictly as the OpenAI ones (``rksc_serve.protocol``): strict types,
      ``n`` and ``breadth * beam`` bounded by the server's ``--max-n``, ``max_tokens`` by its
      ``--max-tokens-limit``, ``depth`` by ``MAX_SEARCH_DEPTH``. Unlike OpenAI's bodies, unknown
      fields are refused: these endpoints are rksc's own, so an unknown field is a typo that would
      otherwise be ignored in silence. Every refusal names the field (``pydantic.ValidationError`` or
      ``InvalidRequest``) and the app answers it with HTTP 400.
    * ``engine_kwargs`` turns a body into the keyword arguments of ``engine.areason`` /
      ``engine.tree_search`` and decides nothing else, so the served answer is the engine's answer to
      those arguments. Sampling fields left out keep the engine's defaults for the call
      (``DEFAULT_REASON_PARAMS``, ``DEFAULT_SEARCH_PARAMS``); ``cgee`` fields left out keep the
      engine's own ``EngineConfig.cgee``; ``early_stop`` left out is the engine's default, ``"decided"``
      (exact: it never changes the vote's winner), and null runs every branch to its end. A tree
      search's ``early_stop`` is parsed the same way (``early_stop_name_as_object``, ``EarlyStopOverrides``)
      but, as in ``engine.tree_search``, is off when left out and takes only ``length`` and
      ``confidence``: the vote rules are refused before anything runs.
    * Answers are the engine's result dataclasses as JSON (``reasoning_body``, ``search_body``);
      ``finish_reason`` is the engine's (``"eos"``, ``"stop"``, ``"length"``, ``"cancelled"`` for a
      branch an early-stop rule stopped), not OpenAI's; a tree-search node an early-stop rule stopped
      has status ``"stopped"``. ``early_stop`` is in both answers, null when early stopping was off.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from rksc_engine import CGEEConfig, SamplingParams, SearchResult
from rksc_engine.config import MAX_SEED
from rksc_engine.reasoning.early_stop import (
    EARLY_STOP_RULES,
    AdaptiveConfig,
    AnsweredConfig,
    ConfidenceConfig,
    EarlyStopConfig,
    LengthConfig,
)
from rksc_engine.reasoning.few_shot import Problem
from rksc_engine.reasoning.self_consistency import DEFAULT_REASON_PARAMS, EXTRACTORS, ReasoningResult
from rksc_engine.reasoning.tree_search import (
    DEFAULT_SEARCH_PARAMS,
    SCORER_NAMES,
    SEARCH_EARLY_STOP_RULES,
    resolve_search_early_stop,
)
from rksc_serve.protocol import (
    ChatMessage,
    InvalidRequest,
    ServeLimits,
    engine_error_param,
    within_max_n,
    within_max_tokens,
)
from rksc_serve.responses import usage

# Most reasoning steps one tree search may take (each is a level of beam * breadth generations).
MAX_SEARCH_DEPTH = 16

_RKSC = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class FewShotExample(BaseModel):
    """A worked example put before the question: its question as a user turn, its reasoning as the
    assistant's answer."""

    model_config = _RKSC

    question: str = Field(min_length=1)
    """The example's question."""
    reasoning: str = Field(min_length=1)
    """Its worked solution, ending the way the answer extractor reads it (``... #### 5`` for gsm8k)."""
    answer: str
    """Its final answer."""

    def to_problem(self) -> Problem:
        return Problem(self.question, self.reasoning, self.answer)


class CGEEOverrides(BaseModel):
    """CGEE thresholds for one call; a field left out keeps the engine's ``EngineConfig.cgee`` value.
    Ranges are ``CGEEConfig``'s own (checked by ``over``)."""

    model_config = _RKSC

    skip_enabled: bool | None = None
    """Level 1: skip verification when the vote is confident."""
    tau_conf: float | None = None
    """Smallest confidence-weighted winner share that may skip, in [0, 1]."""
    margin: float | None = None
    """Smallest lead over the runner-up that may skip, in [0, 1]."""
    exit_enabled: bool | None = None
    """Level 2: stop verifier passes early on low label entropy."""
    theta: float | None = None
    """Label-entropy threshold in nats, > 0."""
    epsilon: float | None = None
    """Largest entropy change between consecutive layers that counts as stable, > 0."""
    min_layer: int | None = None
    """First layer (0-based) whose entropy is checked, >= 0."""

    def over(self, base: CGEEConfig) -> CGEEConfig:
        """``base`` with the fields given here; ``InvalidRequest`` naming ``cgee.<field>`` when one is out of range."""
        try:
            return dataclasses.replace(base, **self.model_dump(exclude_none=True))
        except (TypeError, ValueError) as error:
            head = str(error).split(" ", 1)[0]  # CGEEConfig names the field first: "cgee.tau_conf must be ..."
            raise InvalidRequest(str(error), head if head.startswith("cgee.") else "cgee") from None


class AnsweredOverrides(BaseModel):
    """The ``answered`` rule (``AnsweredConfig``): end a branch once its answer is settled."""

    model_config = _RKSC

    pattern: str | None = None
    """Regular expression a completed line must match to settle the answer; default ``#### <digit>``."""


class AdaptiveOverrides(BaseModel):
    """The ``adaptive`` rule (``AdaptiveConfig``): launch in waves, stop launching once the vote looks settled."""

    model_config = _RKSC

    wave_size: int | None = None
    """Branches per wave, >= 1."""
    threshold: float | None = None
    """The posterior the leader must reach, in (0, 1]."""
    method: str | None = None
    """``"beta"``, ``"dirichlet"`` or ``"esc"``."""
    min_branches: int | None = None
    """Branches to launch before the rule may stop, >= 1."""


class ConfidenceOverrides(BaseModel):
    """The ``confidence`` rule (``ConfidenceConfig``): drop branches below the warm-up branches' threshold."""

    model_config = _RKSC

    window_tokens: int | None = None
    """Tokens per sliding window, >= 1."""
    warmup_branches: int | None = None
    """Branches, run to their end, that set the threshold, >= 1."""
    percentile: float | None = None
    """The threshold's percentile of the warm-up branches' lowest window means, in [0, 100]."""


class LengthOverrides(BaseModel):
    """The ``length`` rule (``LengthConfig``): stop branches that run far longer than the first to finish."""

    model_config = _RKSC

    finished_fraction: float | None = None
    """The share of launched branches that must have finished before the cut applies, in (0, 1]."""
    factor: float | None = None
    """A running branch longer than this times the reference length is stopped, > 1."""


_RULES = (("answered", AnsweredConfig), ("adaptive", AdaptiveConfig), ("confidence", ConfidenceConfig),
          ("length", LengthConfig))


class EarlyStopOverrides(BaseModel):
    """``early_stop`` as an object: the rules to run. A rule given (``{}`` for its defaults) runs; a
    field left out keeps ``EarlyStopConfig``'s default (``decided`` on, the other rules off). Ranges
    are the engine's own (checked by ``config``)."""

    model_config = _RKSC

    decided: bool | None = None
    """Stop the running branches once they cannot change the vote's winner (default true)."""
    answered: AnsweredOverrides | None = None
    """End each branch once its answer is settled."""
    adaptive: AdaptiveOverrides | None = None
    """Launch branches in waves, and no more once the vote looks settled."""
    confidence: ConfidenceOverrides | None = None
    """Drop branches whose sliding-window confidence falls below the warm-up threshold."""
    length: LengthOverrides | None = None
    """Drop branches that run past the tail cut."""

    def config(self) -> EarlyStopConfig:
        """The engine's ``EarlyStopConfig``; ``InvalidRequest`` naming ``early_stop.<rule>.<field>`` when
        a value is out of range."""
        try:
            rules = {name: kind(**getattr(self, name).model_dump(exclude_none=True))
                     for name, kind in _RULES if getattr(self, name) is not None}
            decided = {} if self.decided is None else {"decided": self.decided}
            return EarlyStopConfig(**decided, **rules)
        except (TypeError, ValueError) as error:
            # The configs name the field first: "adaptive.wave_size must be >= 1, got 0".
            message = str(error).removeprefix("early_stop.")
            raise InvalidRequest(f"early_stop.{message}", f"early_stop.{message.split(' ', 1)[0]}") from None


def early_stop_name_as_object(value: Any, names: tuple[str, ...], refused: str = "") -> Any:
    """``early_stop`` as a body gives it, before validation: a rule name among ``names`` as the
    ``EarlyStopOverrides`` the engine reads it as (``"decided"``: ``decided`` alone; any other: that rule
    with its defaults, beside ``decided``, which a tree search ignores); anything else unchanged, for
    the model to validate. Both rksc endpoints parse ``early_stop`` with this. ``ValueError`` for a
    name not in ``names``, ending with ``refused`` (why) when it is a rule of another endpoint."""
    if not isinstance(value, str):
        return value
    if value not in names:
        why = f" ({refused})" if refused and value in EARLY_STOP_RULES else ""
        raise ValueError(f"must be null, an object or one of {list(names)}, got {value!r}{why}")
    return EarlyStopOverrides() if value == "decided" else EarlyStopOverrides.model_validate({value: {}})


class _RkscRequest(BaseModel):
    """The fields both rksc endpoints share."""

    model_config = _RKSC

    model: str | None = None
    """Echoed back; the server has one model, so any name is accepted."""
    question: str
    """The question. With ``messages`` it is still what answers are judged against."""
    few_shot: list[FewShotExample] | None = None
    """Worked examples for the engine's few-shot chat prompt (system instruction, examples, question)."""
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    """Your own chat prompt instead of the few-shot one (so not with ``few_shot``)."""
    answer_extractor: str = "gsm8k"
    """How an answer is read from a branch: ``"gsm8k"`` (the number after ``####``) or ``"choice"`` (a letter A-E)."""
    temperature: float | None = Field(None, ge=0, le=2)
    """Sampling temperature; default the engine's for the call (0.7)."""
    top_p: float | None = Field(None, gt=0, le=1)
    """Nucleus mass; default the engine's for the call (0.95)."""
    max_tokens: int | None = Field(None, ge=1)
    """Most generated tokens per branch (per step for a tree search)."""
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    """Seed of branch 0; branch i is seeded ``seed + i``, so a seeded request is reproducible."""

    @field_validator("question")
    @classmethod
    def _non_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must be a non-empty string")
        return value

    @field_validator("answer_extractor")
    @classmethod
    def _known_extractor(cls, value: str) -> str:
        if value not in EXTRACTORS:
            raise ValueError(f"must be one of {sorted(EXTRACTORS)}, got {value!r}")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _max_tokens_within_limit(cls, value: int | None, info: ValidationInfo) -> int | None:
        return within_max_tokens(value, info)

    def check(self, limits: ServeLimits) -> None:
        if self.few_shot is not None and self.messages is not None:
            raise InvalidRequest("few_shot and messages cannot both be given (messages replace the few-shot prompt)",
                                 "messages")

    @property
    def prompt_field(self) -> str:
        """The field an engine complaint about the prompt (too long for the context window) is about."""
        return "messages" if self.messages is not None else "question"

    def _prompt_kwargs(self) -> dict[str, Any]:
        if self.messages is not None:
            return {"prompt": [m.to_engine() for m in self.messages]}
        return {"few_shot": [example.to_problem() for example in self.few_shot or ()]}

    def _sampling_params(self, defaults: SamplingParams) -> SamplingParams:
        given = {"temperature": self.temperature, "top_p": self.top_p, "max_new_tokens": self.max_tokens,
                 "seed": self.seed}
        return dataclasses.replace(defaults, **{name: value for name, value in given.items() if value is not None})


class ReasonRequest(_RkscRequest):
    """``POST /v1/rksc/reason``: ``engine.areason(question, **engine_kwargs(...))``."""

    n: int = Field(8, ge=1, validate_default=True)
    """Branches over one shared prefill, voted (at most the server's ``--max-n``)."""
    cgee: CGEEOverrides | None = None
    """CGEE thresholds for this call; None keeps the engine's."""
    early_stop: EarlyStopOverrides | None = Field(default_factory=EarlyStopOverrides)
    """When to stop branches early: a rule name (``"decided"``, the default; ``"answered"``,
    ``"adaptive"``, ``"confidence"``, ``"length"``: ``decided`` plus that rule with its defaults), an
    object naming the rules and their settings, or null to run every branch to its end."""

    @field_validator("n")
    @classmethod
    def _n_within_limit(cls, value: int, info: ValidationInfo) -> int:
        return within_max_n(value, info)

    @field_validator("early_stop", mode="before")
    @classmethod
    def _rule_name_as_object(cls, value: Any) -> Any:
        return early_stop_name_as_object(value, EARLY_STOP_RULES)

    def engine_kwargs(self, engine_cgee: CGEEConfig) -> dict[str, Any]:
        """The keyword arguments of ``engine.areason``; ``engine_cgee`` is what ``cgee`` overrides."""
        return {"n": self.n, "params": self._sampling_params(DEFAULT_REASON_PARAMS), **self._prompt_kwargs(),
                "answer_extractor": self.answer_extractor,
                "cgee": None if self.cgee is None else self.cgee.over(engine_cgee),
                "early_stop": None if self.early_stop is None else self.early_stop.config()}


class TreeSearchRequest(_RkscRequest):
    """``POST /v1/rksc/tree_search``: ``engine.tree_search(question, **engine_kwargs())``."""

    breadth: int = Field(3, ge=1)
    """Children per expanded node."""
    depth: int = Field(6, ge=1, le=MAX_SEARCH_DEPTH)
    """Most reasoning steps from the root."""
    beam: int | None = Field(None, ge=1)
    """Nodes kept per level; default ``breadth``. ``breadth * beam`` is at most the server's ``--max-n``."""
    step_delimiter: str = Field("\n", min_length=1)
    """Ends a step."""
    scorer: str = "confidence"
    """``"confidence"`` (the path's geometric-mean token probability) or ``"judge"`` (the engine as a Yes/No judge)."""
    early_stop: EarlyStopOverrides | None = None
    """Stop each expansion's children early: null (the default: every child runs to its step's end),
    ``"length"`` or ``"confidence"`` (that rule with its defaults), or an object setting ``length`` and/or
    ``confidence`` (``decided`` is ignored). Children are scored by the beam, not voted, so the vote
    rules (``answered``, ``adaptive``) are refused. A child a rule stops has status ``"stopped"``."""

    @field_validator("early_stop", mode="before")
    @classmethod
    def _rule_name_as_object(cls, value: Any) -> Any:
        return early_stop_name_as_object(value, SEARCH_EARLY_STOP_RULES,
                                         "a tree search's children are scored by the beam, not voted")

    @field_validator("scorer")
    @classmethod
    def _known_scorer(cls, value: str) -> str:
        if value not in SCORER_NAMES:
            raise ValueError(f"must be one of {list(SCORER_NAMES)}, got {value!r}")
        return value

    def check(self, limits: ServeLimits) -> None:
        super().check(limits)
        rows = self.breadth * (self.beam or self.breadth)  # generations in flight per level
        if rows > limits.max_n:
            too_wide = self.breadth > limits.max_n or self.beam is None
            raise InvalidRequest(f"breadth * beam is {rows}, more than the server's --max-n ({limits.max_n})",
                                 "breadth" if too_wide else "beam")

    def engine_kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``engine.tree_search``; ``InvalidRequest`` naming ``early_stop`` (or
        ``early_stop.<rule>[.<field>]``) for an ``early_stop`` the engine would refuse."""
        return {"breadth": self.breadth, "depth": self.depth, "beam": self.beam, "step_delimiter": self.step_delimiter,
                "scorer": self.scorer, "params": self._sampling_params(DEFAULT_SEARCH_PARAMS), **self._prompt_kwargs(),
                "answer_extractor": self.answer_extractor, "early_stop": self._early_stop()}

    def _early_stop(self) -> EarlyStopConfig | None:
        if self.early_stop is None:
            return None
        config = self.early_stop.config()
        try:
            return resolve_search_early_stop(config)
        except (TypeError, ValueError) as error:
            # "early_stop.answered does not apply ..." / "early_stop has no rule that applies ...".
            raise InvalidRequest(str(error), str(error).split(" ", 1)[0]) from None


# The engine argument an engine ValueError/TypeError message starts with -> the body field.
_ENGINE_ARGUMENTS = {"question": "question", "few_shot": "few_shot", "answer_extractor": "answer_extractor",
                     "breadth": "breadth", "depth": "depth", "beam": "beam", "step_delimiter": "step_delimiter",
                     "scorer": "scorer", "params.seed": "seed", "cgee": "cgee", "early_stop": "early_stop"}


def engine_error_field(message: str, prompt_field: str, n_field: str) -> str:
    """The body field an engine ``ValueError``/``TypeError`` from ``areason``/``tree_search`` is about;
    ``n_field`` is the field that sets the engine's per-request ``n`` (``breadth`` for a search)."""
    head = message.split(" ", 1)[0]
    if head.startswith("cgee."):
        return head
    if head in _ENGINE_ARGUMENTS:
        return _ENGINE_ARGUMENTS[head]
    field = engine_error_param(message, prompt_field)
    return n_field if field == "n" else field


def _envelope(kind: str, model: str) -> dict[str, Any]:
    return {"id": f"rksc-{kind}-{secrets.token_hex(12)}", "object": f"rksc.{kind}", "created": int(time.time()),
            "model": model}


def reasoning_body(result: ReasoningResult, model: str) -> dict[str, Any]:
    """The answer of ``/v1/rksc/reason``: the pick, the vote, every branch (and whether it voted), the
    CGEE report, what early stopping did (null when it was off), the usage."""
    report = result.verification
    return {
        **_envelope("reason", model),
        "answer": result.answer,
        "votes": dict(result.votes),
        "vote_shares": dict(result.vote_summary.shares),
        "branches": [{"text": b.text, "answer": b.answer, "confidence": b.confidence, "finish_reason": c.finish_reason,
                      "voted": b.voted}
                     for b, c in zip(result.branches, result.completions)],
        "verification": {
            "skipped": report.skipped, "reason": report.reason, "p": report.p, "lead": report.lead,
            "scores": {s.answer: s.score for s in report.scores},
            "exit_layers": {s.answer: s.exit_layer for s in report.scores},
            "num_layers": report.num_layers, "verify_s": report.verify_s, "time_saved_s": report.time_saved_s,
        },
        "early_stop": result.early_stop.as_dict() if result.early_stop is not None else None,
        "usage": usage([result.completions]),
    }


def search_body(result: SearchResult, model: str) -> dict[str, Any]:
    """The answer of ``/v1/rksc/tree_search``: the best path's answer and steps, the scored tree (each
    node's ``status``: ``"root"``, ``"expanded"``, ``"kept"``, ``"pruned"``, or ``"stopped"`` for a child an
    early-stop rule stopped or left out, never kept or expanded), and what early stopping did
    (``SearchResult.early_stop``'s totals; null when it was off)."""
    return {
        **_envelope("tree_search", model),
        "answer": result.answer,
        "best_score": result.best_score,
        "best_path": [node.text for node in result.best_path[1:]],  # the root (the prompt) has no text
        "best_node": result.best_path[-1].index,
        "text": result.text,
        "nodes": [{"index": n.index, "parent": n.parent, "depth": n.depth, "text": n.text,
                   "branch_score": n.branch_score, "status": n.status, "is_final": n.is_final} for n in result.nodes],
        "num_expansions": result.num_expansions,
        "early_stop": result.early_stop,
        "wall_s": result.wall_s,
    }
