"""``MultiBranchReasoner``: the engine's verified self-consistency pipeline as a LangChain Runnable.

One call answers one question: ``n`` sibling branches decode over one prefill of the (cached)
few-shot prompt, each branch's answer is extracted, the answers are voted with confidence weights,
and the vote is verified (or the verification skipped by CGEE level 1) before one answer is picked.
All of that is ``RKSCEngine.reason``; this module translates LangChain input into its keywords and
its ``ReasoningResult`` into a typed, serialisable ``ReasonerOutput``, and reports the decisions as
LangChain custom events::

    reasoner = MultiBranchReasoner(n=8, few_shot=synthetic_problems(8, seed=1), seed=0)
    chain = {"question": RunnablePassthrough()} | reasoner | RunnableLambda(lambda out: out.answer)
    collector = RKSCEventCollector()
    chain.invoke("A baker makes 4 trays of 12 muffins and sells 30. How many are left?",
                 config={"callbacks": [collector]})
    collector.data(VOTE_EVENT)  # [{"votes": {...}, "shares": {...}, ...}]

Input (one of):
    * a question string;
    * ``{"question": str}`` or ``{"messages": [...]}`` (the prompt as chat messages, question last),
      optionally with ``"few_shot"`` (a list of ``Problem``) overriding the field for this input;
    * a ``PromptValue`` from an upstream prompt template: a string prompt is the question; a chat
      prompt's last human message is the question the verifier sees.

Chat messages (``"messages"`` or a chat prompt) may hold text content blocks, as ``ChatRKSC``
accepts. The ``few_shot`` field is honoured with them too: its worked problems are inserted as
user/assistant turns after the leading system messages, so a template's own system message and
question frame the same shared, cached prefix the string form builds.

Warnings: ``temperature=0`` with ``n > 1`` (every branch would be the same), and a call whose
branches all ran out of ``max_new_tokens`` before stating an answer (``answer`` is then None
for want of tokens; ``ReasonerOutput.num_truncated`` counts such branches on every call).

Output: a ``ReasonerOutput`` (answer, votes, branches, the CGEE decision, what early stopping did,
the call's cache accounting); ``ReasonerOutput.result`` is the engine's full ``ReasoningResult``.

Early stop: the ``early_stop`` field (or per call, ``invoke(q, early_stop=None)``) is
``RKSCEngine.reason``'s: ``"decided"`` (the default; exact, it never changes the vote's winner),
``"answered"``, ``"adaptive"``, ``"confidence"``, ``"length"``, an ``EarlyStopConfig``, or None to run
every branch to its end. A stopped branch stays in ``branches`` with ``finish_reason="cancelled"``; ``voted`` says
whether it was counted.

Events, sent on every call to the callbacks of the reasoner's run (and so in ``astream_events``):
``rksc_early_stop`` (only when an early-stop rule stopped branches or the request: the
``EarlyStopReport`` as a dict), ``rksc_vote`` (the vote), ``rksc_cgee`` (verification skipped or not,
why, scores, exit layers), ``rksc_early_exit`` (only when a verifier pass stopped before the last
layer) and ``rksc_cache_reuse`` (prompt tokens computed vs served from the prefix cache during the
call, and the one prefill the branches shared).
``RKSCEventCollector`` gathers them.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from langchain_core.callbacks import (
    BaseCallbackHandler,
    CallbackManagerForChainRun,
    adispatch_custom_event,
    dispatch_custom_event,
)
from langchain_core.messages import BaseMessage
from langchain_core.prompt_values import ChatPromptValue, PromptValue
from langchain_core.runnables import Runnable, RunnableConfig, RunnableSerializable
from langchain_core.runnables.config import patch_config
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from rksc_engine import EngineConfig, RemoteEngine, RKSCEngine, SamplingParams
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.early_stop import resolve_early_stop
from rksc_engine.reasoning.few_shot import SYSTEM_PROMPT, Problem, check_problems, few_shot_messages
from rksc_engine.reasoning.self_consistency import EXTRACTORS, ReasoningResult
from rksc_engine.reasoning.verifier import CallableVerifier, Verifier, as_verifier
from rksc_integrations._common import call_sampling_params, explicit_settings, normalise_stop
from rksc_integrations._engines import remote_engine_from_openai_llm, shared_engine
from rksc_integrations.langchain._base import CACHE_EVENT, all_at_once
from rksc_integrations.langchain.messages import content_text

VOTE_EVENT = "rksc_vote"
CGEE_EVENT = "rksc_cgee"
EARLY_EXIT_EVENT = "rksc_early_exit"
EARLY_STOP_EVENT = "rksc_early_stop"
REASONER_EVENTS = (EARLY_STOP_EVENT, VOTE_EVENT, CGEE_EVENT, EARLY_EXIT_EVENT, CACHE_EVENT)

# Per-call keyword arguments (``reasoner.invoke(q, n=4)`` or ``reasoner.bind(n=4)``).
CALL_KWARGS = ("n", "temperature", "top_p", "top_k", "max_new_tokens", "max_tokens", "seed", "stop", "cgee",
               "early_stop")
INPUT_KEYS = ("question", "few_shot", "messages")
_ROLES = {"system": "system", "human": "user", "ai": "assistant"}

ReasonerInput = str | dict[str, Any] | PromptValue


# -- output -----------------------------------------------------------------------------------------
class ReasonerBranch(BaseModel):
    """One branch: its text, the answer extracted from it, its confidence (exp mean token logprob)."""

    text: str
    answer: str | None
    confidence: float
    finish_reason: str | None = None
    """Why it ended: ``"eos"``, ``"stop"``, ``"length"`` (``max_new_tokens`` reached) or ``"cancelled"``
    (an early-stop rule stopped it)."""
    voted: bool = True
    """Whether it counted in the vote (False when an early-stop rule took it out; ``answer`` is then None)."""


class CGEEDecision(BaseModel):
    """What verification did: CGEE level 1 skipped it or not (and why), scores, exit layers."""

    skipped: bool
    """The verifier did not run: the vote was confident enough (or had no answer)."""
    reason: str
    """Why it skipped or not, e.g. ``"p=0.62 < tau_conf=0.75"``."""
    p: float
    """The winner's confidence-weighted vote share."""
    lead: float
    """The winner's share minus the runner-up's."""
    scores: dict[str, float] = Field(default_factory=dict)
    """Verifier score per candidate answer, in [0, 1] (empty when skipped)."""
    exit_layers: dict[str, int | None] = Field(default_factory=dict)
    """Per candidate, the 0-based layer its verifier pass stopped at (None: a verifier without layers)."""
    num_layers: int | None = None
    """Decoder layers of the judge model, when the judge is the engine's."""
    layers_saved: int = 0
    """Layer forwards CGEE level 2 skipped, summed over candidates."""
    verify_s: float = 0.0
    """Wall time spent verifying."""
    time_saved_s: float | None = None
    """The engine's estimate of the time CGEE saved against full verification (None: unknown)."""

    @property
    def exited_early(self) -> bool:
        return self.num_layers is not None and any(
            layer is not None and layer < self.num_layers - 1 for layer in self.exit_layers.values()
        )


class CacheReuse(BaseModel):
    """Prompt tokens of one reasoner call: computed vs served from the prefix cache.

    The counters cover the branches' generation (their single prefill and their decoded tokens),
    read from the call's own completions, so calls running at once never mix their counts. The
    judge's prompts are not in them (``engine.stats()`` counts everything).
    """

    model_name: str
    num_prompt_tokens: int
    """Tokens of the branches' prompt."""
    num_branches: int
    """Branches decoded over that prompt's single prefill."""
    prompt_tokens_computed: int
    """Prompt tokens whose KV was computed during the call."""
    prompt_tokens_reused: int
    """Prompt tokens whose KV came from the prefix cache during the call."""
    prefills: int
    """Prompt prefills run: 1 for all the branches, plus 1 when the judge prefills its shared question."""
    decode_tokens: int
    """Tokens the branches decoded, summed over branches."""


class ReasonerOutput(BaseModel):
    """What ``MultiBranchReasoner`` returns; ``str(output)`` is the answer (or "")."""

    model_config = ConfigDict(arbitrary_types_allowed=True)

    question: str
    answer: str | None
    """The picked answer: the vote winner, re-weighted by verifier scores when verification ran."""
    votes: dict[str, int]
    """Branches per extracted answer."""
    vote_shares: dict[str, float]
    """Confidence-weighted share per answer, best first."""
    branches: list[ReasonerBranch]
    cgee: CGEEDecision
    cache: CacheReuse
    early_stop: dict[str, Any] | None = None
    """What early stopping did (``EarlyStopReport.as_dict()``: branches launched and cancelled, decode
    tokens, the rule per stopped branch, the rule that ended the request); None when it was off."""
    generate_s: float
    """Wall time of the branches' generation."""
    result: ReasoningResult = Field(exclude=True, repr=False)
    """The engine's full result (``VerificationReport``, ``VoteSummary``...)."""

    @property
    def num_truncated(self) -> int:
        """Branches cut by ``max_new_tokens`` before stating an answer (see ``ReasoningResult``)."""
        return sum(b.answer is None and b.finish_reason == "length" for b in self.branches)

    def __str__(self) -> str:
        return self.answer or ""


# -- events -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RKSCEvent:
    """One custom event as a handler saw it."""

    name: str
    data: dict[str, Any]
    run_id: Any
    tags: tuple[str, ...] = ()


class RKSCEventCollector(BaseCallbackHandler):
    """Collects rksc custom events (the reasoner's and the models' ``rksc_cache_reuse``).

    Pass it as a callback: ``chain.invoke(x, config={"callbacks": [collector]})``; then read
    ``collector.events`` or ``collector.data(VOTE_EVENT)``. Safe to share across threads and async tasks.
    """

    run_inline = True  # keep events in order, in the thread that sent them

    def __init__(self, names: Sequence[str] | None = None) -> None:
        """Args:
            names: The event names to keep; default every name starting with ``rksc_``.
        """
        self.names = tuple(names) if names is not None else None
        self.events: list[RKSCEvent] = []
        self._lock = threading.Lock()

    def on_custom_event(self, name: str, data: Any, *, run_id: Any, tags: list[str] | None = None,
                        metadata: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if (self.names is None and name.startswith("rksc_")) or (self.names is not None and name in self.names):
            with self._lock:
                self.events.append(RKSCEvent(name, data, run_id, tuple(tags or ())))

    def data(self, name: str) -> list[dict[str, Any]]:
        """The data of every collected event called ``name``, in order."""
        with self._lock:
            return [e.data for e in self.events if e.name == name]

    def clear(self) -> None:
        with self._lock:
            self.events.clear()


# -- the runnable -----------------------------------------------------------------------------------
@dataclass
class _Request:
    question: str
    messages: list[dict[str, str]]
    params: SamplingParams
    n: int
    cgee: CGEEConfig | None
    early_stop: Any
    num_prompt_tokens: int = 0


class MultiBranchReasoner(RunnableSerializable[ReasonerInput, ReasonerOutput]):
    """Verified self-consistency over one cached prefix, as a Runnable (``prompt | reasoner | parser``).

    Args:
        llm: A ``ChatRKSC`` or ``RKSCLLM`` whose engine (and prefix cache) to share, or an OpenAI
            client model (``ChatOpenAI(base_url=..., model=..., api_key=...)``) whose server to
            reason over: a ``RemoteEngine`` on its base URL, model and key (one per server in the
            process). Exclusive with ``engine`` and ``model``; with none of them the embedded
            default engine is shared. The settings set on it (``max_tokens``, ``temperature``,
            ``top_p``, ``top_k``, ``stop``, ``seed``, and ``n`` or LlamaIndex's ``branches``) are the
            reasoner's defaults; the reasoner's own arguments win. A temperature of 0 taken this way
            is kept: with ``n > 1`` every branch is then the same, which the reasoner warns about
            (pass ``temperature=`` to the reasoner to sample its branches).
        engine: An ``RKSCEngine``, or a ``RemoteEngine`` (reasoning over its server; see
            ``docs/remote_reasoning.md`` for what a server changes).
        **fields: The fields below. ``n``, ``temperature``, ``top_p``, ``top_k``, ``max_new_tokens``
            (or ``max_tokens``), ``seed``, ``stop``, ``cgee`` and ``early_stop`` can also be passed per call
            (``invoke(q, n=4)``, ``.bind(n=4)``); other keyword arguments raise ``TypeError``.

    ``batch``/``abatch`` submit every input at once (unless ``max_concurrency`` says otherwise), so
    the engine's scheduler decodes all their branches together; the shared few-shot prefix is
    computed by the first admitted question and reused by the rest.
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    model: str | None = None
    """Local Hugging Face model directory to load when no llm/engine is given; None: the embedded default."""
    device: str = "auto"
    """Device the model is loaded on when built from ``model``."""
    dtype: str = "auto"
    """Weights dtype when built from ``model``."""
    engine_config: EngineConfig | None = Field(default=None, exclude=True)
    """Engine settings when the engine is built here; None shares one engine per process."""
    n: int = Field(default=8, ge=1)
    """Sibling branches, decoded as one batch over a single prefill of the prompt."""
    temperature: float = Field(default=0.7, ge=0)
    """Sampling temperature of the branches (0 would make every branch the same)."""
    top_p: float = Field(default=0.95, gt=0, le=1)
    """Nucleus mass in (0, 1]."""
    top_k: int = Field(default=0, ge=0)
    """Keep the k most likely tokens; 0 disables it."""
    max_new_tokens: int = Field(default=160, gt=0, alias="max_tokens")
    """Upper bound on tokens per branch (also accepted as ``max_tokens``)."""
    stop: list[str] | None = None
    """Strings that end a branch, one string or a list (the model's end-of-turn token ends it anyway)."""
    seed: int | None = Field(default=None, ge=0)
    """Seed of branch 0 (branch i uses seed + i); None draws a fresh seed per call."""
    few_shot: list[Problem] = Field(default_factory=list)
    """Worked examples rendered before the question as user/assistant turns: the shared, cached prefix."""
    system_prompt: str = SYSTEM_PROMPT
    """System instruction of the rendered prompt (default: solve step by step, end with '#### <number>')."""
    answer_extractor: Any = "gsm8k"
    """``"gsm8k"`` (``#### x``, else the last number), ``"choice"`` (A-E) or ``fn(text) -> answer | None``."""
    verifier: Any = None
    """None (the engine judges with Yes/No), a ``Verifier``, ``fn(question, candidates) -> scores``, or a
    Runnable taking ``{"question", "candidates"}`` and returning one score in [0, 1] per candidate."""
    cgee: CGEEConfig | None = None
    """CGEE thresholds; None uses the engine's default."""
    early_stop: Any = "decided"
    """When to stop branches early: ``"decided"`` (exact: once they cannot change the vote's winner),
    ``"answered"``, ``"adaptive"``, ``"confidence"``, ``"length"``, an ``EarlyStopConfig``, or None (every
    branch to its end)."""

    given_engine: RKSCEngine | RemoteEngine | None = Field(default=None, exclude=True, repr=False)
    """The engine passed as ``engine`` or taken from ``llm``. A field so that LangChain, which rebuilds a
    Runnable from its fields (``configurable_fields``), rebuilds this one on the same engine."""

    _engine: RKSCEngine | RemoteEngine = PrivateAttr()

    def __init__(self, llm: Any = None, *, engine: RKSCEngine | RemoteEngine | None = None, **fields: Any) -> None:
        if engine is None:
            engine = fields.pop("given_engine", None)
        sources = [name for name, value in (("llm", llm), ("engine", engine), ("model", fields.get("model")))
                   if value is not None]
        if len(sources) > 1:
            raise ValueError(f"pass at most one of llm, engine and model; got {' and '.join(sources)}")
        if llm is not None:
            engine, settings = getattr(llm, "engine", None), _llm_settings(llm)
            if not isinstance(engine, (RKSCEngine, RemoteEngine)):
                engine, settings = remote_engine_from_openai_llm(llm), _openai_settings(llm)
            if engine is None:
                raise TypeError(f"llm must be a ChatRKSC or RKSCLLM (anything with an RKSCEngine .engine) or an "
                                f"OpenAI client model (ChatOpenAI(base_url=...)), got {type(llm).__name__}")
            for name, value in settings.items():
                if name not in fields and not (name == "max_new_tokens" and "max_tokens" in fields):
                    fields[name] = value  # the reasoner's own arguments win
        if engine is not None and not isinstance(engine, (RKSCEngine, RemoteEngine)):
            raise TypeError(f"engine must be an RKSCEngine or a RemoteEngine, got {type(engine).__name__}")
        super().__init__(given_engine=engine, **fields)
        self._sampling_params({})  # a bad combination fails here, not at the first call
        self._engine = engine if engine is not None else shared_engine(
            self.model, self.device, self.dtype, self.engine_config
        )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        return normalise_stop(value)

    @field_validator("answer_extractor")
    @classmethod
    def _check_extractor(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in EXTRACTORS:
            raise ValueError(f"answer_extractor must be a callable or one of {sorted(EXTRACTORS)}, got {value!r}")
        if not isinstance(value, str) and not callable(value):
            raise ValueError(f"answer_extractor must be a callable or a name, got {type(value).__name__}")
        return value

    @field_validator("early_stop")
    @classmethod
    def _check_early_stop(cls, value: Any) -> Any:
        try:
            resolve_early_stop(value)
        except TypeError as error:  # pydantic reports only ValueErrors as a ValidationError
            raise ValueError(str(error)) from None
        return value

    @field_validator("verifier")
    @classmethod
    def _check_verifier(cls, value: Any) -> Any:
        if value is not None and not isinstance(value, (Verifier, Runnable)) and not callable(value):
            raise ValueError(f"verifier must be None, a Verifier, a callable or a Runnable, got {type(value).__name__}")
        return value

    @property
    def engine(self) -> RKSCEngine | RemoteEngine:
        """The engine; share it with a ``ChatRKSC`` (``ChatRKSC(engine=reasoner.engine)``) to share its cache."""
        return self._engine

    @property
    def InputType(self) -> Any:  # noqa: N802 (LangChain's name)
        return ReasonerInput

    @property
    def OutputType(self) -> type[ReasonerOutput]:  # noqa: N802
        return ReasonerOutput

    # -- Runnable -------------------------------------------------------------------------------
    def invoke(self, input: ReasonerInput, config: RunnableConfig | None = None, **kwargs: Any) -> ReasonerOutput:
        return self._call_with_config(self._reason, input, config, run_type="chain", **kwargs)

    async def ainvoke(self, input: ReasonerInput, config: RunnableConfig | None = None, **kwargs: Any) -> ReasonerOutput:
        return await self._acall_with_config(self._areason, input, config, run_type="chain", **kwargs)

    def batch(self, inputs: list[ReasonerInput], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[ReasonerOutput]:
        # One waiting thread per input (cheap: each only waits on its request), so every input is
        # submitted before any finishes; LangChain's default pool would cap that at a few workers.
        return super().batch(inputs, all_at_once(config, len(inputs)), return_exceptions=return_exceptions, **kwargs)

    def _reason(self, input: ReasonerInput, run_manager: CallbackManagerForChainRun, config: RunnableConfig,
                **kwargs: Any) -> ReasonerOutput:
        request = self._request(input, kwargs)
        child = patch_config(config, callbacks=run_manager.get_child())
        output = self._run(request, self._engine_verifier(child))
        for name, data in _events(output):
            dispatch_custom_event(name, data, config=child)
        return output

    async def _areason(self, input: ReasonerInput, run_manager: Any, config: RunnableConfig,
                       **kwargs: Any) -> ReasonerOutput:
        request = self._request(input, kwargs)
        # The branches are awaited from the engine's scheduler (no thread); a Runnable verifier is
        # invoked from the verification worker thread, under the run's sync callbacks.
        sync_child = patch_config(config, callbacks=run_manager.get_sync().get_child())
        output = await self._arun(request, self._engine_verifier(sync_child))
        child = patch_config(config, callbacks=run_manager.get_child())
        for name, data in _events(output):
            await adispatch_custom_event(name, data, config=child)
        return output

    # -- translation ----------------------------------------------------------------------------
    def _sampling_params(self, kwargs: dict[str, Any]) -> tuple[SamplingParams, int]:
        # The call's stops replace the field's (None: none).
        params, n = call_sampling_params(self, kwargs, CALL_KWARGS, kwargs.get("stop", self.stop) or ())
        if n > 1 and params.greedy:
            warnings.warn(f"MultiBranchReasoner with n={n} and temperature={params.temperature} (top_p={params.top_p}) "
                          f"decodes greedily, so all {n} branches will be the same; use temperature > 0 (e.g. 0.7) "
                          f"or n=1", UserWarning, stacklevel=3)
        return params, n

    def _request(self, input: ReasonerInput, kwargs: dict[str, Any]) -> _Request:
        """Validate one input and its call options; nothing in the engine has changed if this raises."""
        params, n = self._sampling_params(kwargs)
        cgee = kwargs.get("cgee", self.cgee)
        if cgee is not None and not isinstance(cgee, CGEEConfig):
            raise TypeError(f"cgee must be a CGEEConfig, got {type(cgee).__name__}")
        early_stop = kwargs.get("early_stop", self.early_stop)
        resolve_early_stop(early_stop)  # a bad per-call value raises here, naming early_stop
        question, messages = self._prompt(input)
        if isinstance(self._engine, RemoteEngine):  # the server tokenizes, and says how many tokens it read
            return _Request(question, messages, params, n, cgee, early_stop)
        num_prompt_tokens = len(self._engine.encode(messages))  # also rejects a bad prompt early
        if num_prompt_tokens >= self._engine.context_window:
            raise ValueError(f"the prompt has {num_prompt_tokens} tokens; the model's context window is "
                             f"{self._engine.context_window}")
        return _Request(question, messages, params, n, cgee, early_stop, num_prompt_tokens)

    def _prompt(self, input: ReasonerInput) -> tuple[str, list[dict[str, str]]]:
        """``(question, prompt messages)`` of one input (see the module docstring for the forms)."""
        few_shot = self.few_shot
        if isinstance(input, ChatPromptValue):
            messages = _engine_messages(input.messages)
            return _last_user_message(messages), _with_shots(messages, few_shot)
        if isinstance(input, PromptValue):
            input = input.to_string()
        if isinstance(input, dict):
            unknown = sorted(set(input) - set(INPUT_KEYS))
            if unknown:
                raise ValueError(f"input dict has unknown key(s) {unknown}; allowed keys are {list(INPUT_KEYS)}")
            few_shot = check_problems(input.get("few_shot", few_shot), "input['few_shot']")
            if "messages" in input:
                raw = input["messages"]
                if not isinstance(raw, list) or not raw:
                    raise TypeError("input['messages'] must be a non-empty list of chat messages")
                messages = _engine_messages(raw)
                question = input.get("question", _last_user_message(messages))
                return _check_question(question), _with_shots(messages, few_shot)
            if "question" not in input:
                raise ValueError(f"input dict needs a 'question' key (allowed keys: {list(INPUT_KEYS)})")
            input = input["question"]
        question = _check_question(input)
        return question, few_shot_messages(question, list(few_shot), self.system_prompt)

    def _engine_verifier(self, config: RunnableConfig) -> Verifier | None:
        """The configured verifier as a ``Verifier``; a Runnable runs as a child of this run."""
        if self.verifier is None:
            return None  # the engine's default judge
        if isinstance(self.verifier, Verifier) or not isinstance(self.verifier, Runnable):
            return as_verifier(self.verifier)  # the field's validator admitted only a Verifier or a callable
        runnable = self.verifier

        def score(question: str, candidates: Sequence[str]) -> list[float]:
            scores = runnable.invoke({"question": question, "candidates": list(candidates)}, config=config)
            if not isinstance(scores, (list, tuple)) or not all(
                isinstance(s, (int, float)) and not isinstance(s, bool) for s in scores
            ):
                raise TypeError(f"the verifier Runnable must return a list of numbers, got {scores!r}"[:200])
            return list(scores)

        return CallableVerifier(score)

    def _keywords(self, request: _Request, verifier: Verifier | None) -> dict[str, Any]:
        keywords: dict[str, Any] = {"n": request.n, "params": request.params, "prompt": request.messages,
                                    "answer_extractor": self.answer_extractor, "verifier": verifier,
                                    "early_stop": request.early_stop}
        if request.cgee is not None:
            keywords["cgee"] = request.cgee
        return keywords

    def _run(self, request: _Request, verifier: Verifier | None) -> ReasonerOutput:
        result = self._engine.reason(request.question, **self._keywords(request, verifier))
        return _warn_if_truncated(_output(request, result, _cache_reuse(self._engine.model_name, request, result)))

    async def _arun(self, request: _Request, verifier: Verifier | None) -> ReasonerOutput:
        result = await self._engine.areason(request.question, **self._keywords(request, verifier))
        return _warn_if_truncated(_output(request, result, _cache_reuse(self._engine.model_name, request, result)))


# -- helpers ----------------------------------------------------------------------------------------
def _llm_settings(llm: Any) -> dict[str, Any]:
    """The generation settings the user set on ``llm``, by the reasoner's names (LlamaIndex's
    ``RKSCLLM`` calls ``n`` ``branches``)."""
    fields = getattr(type(llm), "model_fields", {})
    names = {name: name for name in ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed")}
    names["n"] = "n" if "n" in fields else "branches"
    return explicit_settings(llm, names)


def _openai_settings(llm: Any) -> dict[str, Any]:
    """The generation settings the user set on an OpenAI client model, by the reasoner's names."""
    names = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "seed": "seed",
             "stop": "stop"}
    return {name: value for name, value in explicit_settings(llm, names).items() if value is not None}


def _check_question(question: Any) -> str:
    if not isinstance(question, str):
        raise TypeError(f"the question must be a string, got {type(question).__name__}")
    if not question.strip():
        raise ValueError("the question must be a non-empty string")
    return question


def _engine_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, BaseMessage):
            role, content = _ROLES.get(message.type), message.content
            if role is None:
                raise ValueError(f"messages[{i}] is a {type(message).__name__}; the reasoner takes system, "
                                 f"human and AI messages")
        elif isinstance(message, dict):
            role, content = message.get("role"), message.get("content")
        else:
            raise TypeError(f"messages[{i}] must be a BaseMessage or a {{'role', 'content'}} dict, "
                            f"got {type(message).__name__}")
        if not isinstance(content, (str, list)):
            raise TypeError(f"messages[{i}] content must be a string or a list of text blocks, "
                            f"got {type(content).__name__}")
        out.append({"role": role, "content": content_text(content, f"messages[{i}]")})
    return out


def _with_shots(messages: list[dict[str, str]], shots: Sequence[Problem]) -> list[dict[str, str]]:
    """``messages`` with the worked problems as user/assistant turns after the leading system
    messages, where ``few_shot_messages`` puts them."""
    if not shots:
        return messages
    lead = 0
    while lead < len(messages) and messages[lead]["role"] == "system":
        lead += 1
    turns = few_shot_messages("", list(shots))[1:-1]  # without its system message and question
    return [*messages[:lead], *turns, *messages[lead:]]


def _warn_if_truncated(output: ReasonerOutput) -> ReasonerOutput:
    if output.answer is None and output.num_truncated:
        warnings.warn(f"{output.num_truncated} of {len(output.branches)} branches hit max_new_tokens before "
                      f"stating an answer, so none was voted (answer=None); raise max_new_tokens (max_tokens)",
                      UserWarning, stacklevel=2)
    return output


def _last_user_message(messages: list[dict[str, str]]) -> str:
    for message in reversed(messages):
        if message["role"] == "user":
            return _check_question(message["content"])
    raise ValueError("the prompt has no human/user message to take the question from")


def _cache_reuse(model_name: str, request: _Request, result: ReasoningResult) -> CacheReuse:
    """The branches' generation, from their own ``Completion``s (so concurrent calls never mix their
    counts): one prefill of the prompt, its cached part reused, every generated token decoded."""
    completions = result.completions
    cached = completions[0].num_cached_tokens if completions else 0
    # Over a server the prompt's tokens are the server's count.
    num_prompt_tokens = request.num_prompt_tokens or max((c.num_prompt_tokens for c in completions), default=0)
    return CacheReuse(
        model_name=model_name,
        num_prompt_tokens=num_prompt_tokens,
        num_branches=request.n,
        prompt_tokens_computed=num_prompt_tokens - cached,
        prompt_tokens_reused=cached,
        prefills=1,
        decode_tokens=sum(c.num_generated_tokens for c in completions),
    )


def _output(request: _Request, result: ReasoningResult, cache: CacheReuse) -> ReasonerOutput:
    report = result.verification
    decision = CGEEDecision(
        skipped=report.skipped, reason=report.reason, p=report.p, lead=report.lead,
        scores={s.answer: s.score for s in report.scores},
        exit_layers={s.answer: s.exit_layer for s in report.scores},
        num_layers=report.num_layers, layers_saved=report.layers_saved, verify_s=report.verify_s,
        time_saved_s=getattr(report, "time_saved_s", None),
    )
    return ReasonerOutput(
        question=request.question,
        answer=result.answer,
        votes=dict(result.votes.most_common()),
        vote_shares=dict(result.vote_summary.shares),
        branches=[ReasonerBranch(text=b.text, answer=b.answer, confidence=b.confidence,
                                 finish_reason=getattr(c, "finish_reason", None), voted=b.voted)
                  for b, c in zip(result.branches, result.completions or [None] * len(result.branches))],
        cgee=decision,
        cache=cache,
        early_stop=result.early_stop.as_dict() if result.early_stop is not None else None,
        generate_s=result.generate_s,
        result=result,
    )


def _events(output: ReasonerOutput) -> list[tuple[str, dict[str, Any]]]:
    """The custom events of one call, JSON-serialisable."""
    vote = {
        "question": output.question, "answer": output.answer, "vote_winner": output.result.vote_summary.winner,
        "votes": output.votes, "shares": output.vote_shares, "num_branches": len(output.branches),
        "num_unanswered": sum(b.answer is None for b in output.branches),
        "num_truncated": output.num_truncated,
    }
    events = []
    stop = output.early_stop
    if stop is not None and (stop["branches_cancelled"] or stop["stopped_request_by"] is not None):
        events.append((EARLY_STOP_EVENT, {"question": output.question, **stop}))  # first: it acted before the vote
    events += [(VOTE_EVENT, vote), (CGEE_EVENT, output.cgee.model_dump())]
    if output.cgee.exited_early:
        events.append((EARLY_EXIT_EVENT, {
            "exit_layers": output.cgee.exit_layers, "num_layers": output.cgee.num_layers,
            "layers_saved": output.cgee.layers_saved,
        }))
    # Same name as the models' event; the counters are the whole call's (see CacheReuse).
    events.append((CACHE_EVENT, {**output.cache.model_dump(), "num_generations": output.cache.num_branches}))
    return events
