"""``RKSCLLM``: the rksc engine as a LlamaIndex ``FunctionCallingLLM``.

Drop-in for ``llama-index-llms-huggingface``'s ``HuggingFaceLLM``::

    Settings.llm = RKSCLLM()                      # embedded default model
    index.as_query_engine(llm=RKSCLLM(engine=e))  # an engine you already have

What differs, on purpose:
    * One prompt formatting for every path: ``complete`` and ``stream_complete`` (and their async
      forms) format the prompt the same way (``HuggingFaceLLM.stream_complete`` skips
      ``completion_to_prompt``).
    * The engine's prefix cache makes repeated context (refine steps, chat history, re-asked
      questions) cheap; each call reports its reuse as an ``RKSCCacheReuseEvent`` and in the
      response's ``additional_kwargs``.
    * Async methods run the engine in a worker thread, so the event loop is never blocked.
    * Tools (``chat(tools=...)``, ``chat_with_tools``, agents) go through ``rksc_engine.structured.tools``: the
      template's ``tools=`` when it takes them, the ``<tool_call>`` system-prompt protocol otherwise.
      A call the model starts, or one that is required (``tool_required=True``), is decoded under
      the tool's schema, so its arguments are valid JSON of the right types even on a 135M model.
    * ``structured_predict`` decodes the answer under the output class's JSON schema (the same
      constrained decoder), whatever ``is_function_calling_model`` says.
    * ``branches=n`` answers by verified self-consistency, see ``rksc_integrations.llama_index.branches``.

``is_function_calling_model`` defaults to True: rksc offers tools and decodes every call under its
schema itself, whatever the chat template, so LlamaIndex's ``FunctionAgent``, ``FunctionCallingProgram``
and ``predict_and_call`` work with any model (``FunctionAgent`` otherwise refuses it with "LLM must be
a FunctionCallingLLM"). Set it False to route agents to ReAct, or None to advertise it only when the
chat template takes tools (the sign a model was trained to choose them; SmolLM2's does not). A
tool-call turn's content follows ``rksc_integrations._common``: no echo of the tool protocol.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_index.core.base.llms.generic_utils import messages_to_prompt as generic_messages_to_prompt
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW
from llama_index.core.instrumentation.events.llm import LLMStructuredPredictEndEvent, LLMStructuredPredictStartEvent
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt
from llama_index.core.types import PydanticProgramMode

from rksc_engine import Completion, RemoteEngine, RKSCEngine, SamplingParams
from rksc_engine.config import ASKSConfig, EngineConfig
from rksc_engine.reasoning.answers import VoteConfig, answer_key, resolve_vote
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.early_stop import EarlyStopMonitor
from rksc_engine.reasoning.self_consistency import submit_branches
from rksc_engine.structured import tools as tool_protocol
from rksc_engine.structured.constrained import ConstrainedResult, ToolCall, value_params
from rksc_engine.structured.tools import ToolRequest
from rksc_integrations._async import iterate_in_thread, run_in_thread
from rksc_integrations._common import (
    call_sampling_params,
    check_prompt_text,
    device_from_device_map,
    loading_from_model_kwargs,
    local_model_dir,
    normalise_stop,
    put_settings,
    sampling_from_generate_kwargs,
    unknown_argument,
)
from rksc_integrations._engines import shared_engine
from rksc_integrations.llama_index.branches import (
    AnswerKey,
    BranchCollector,
    BranchDecision,
    branch_monitor,
    current_collector,
    decide,
    make_verifier,
)
from rksc_integrations.llama_index.events import (
    RKSCASKSReuseEvent,
    RKSCBranchVoteEvent,
    RKSCCacheReuseEvent,
    RKSCCGEESkipEvent,
    RKSCEarlyExitEvent,
    RKSCEarlyStopEvent,
    RKSCVerificationEvent,
    dispatcher,
    emit,
)
from rksc_integrations.llama_index.messages import to_engine_messages, to_tool_call_blocks

if TYPE_CHECKING:
    from llama_index.core.prompts.base import BasePromptTemplate
    from llama_index.core.tools.types import BaseTool

# Per-call keyword arguments that override the fields of the same name.
GENERATION_KWARGS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed", "branches")
# ``HuggingFaceLLM`` constructor arguments translated to rksc settings (see ``RKSCLLM``).
HUGGINGFACE_LLM_ARGUMENTS = ("model_name", "tokenizer_name", "generate_kwargs", "device_map", "model_kwargs")
_REFUSED_HUGGINGFACE_LLM_ARGUMENTS = {
    "tokenizer": "rksc loads the tokenizer saved with the model; for a model and tokenizer already loaded, pass "
                 "engine=RKSCEngine(model, tokenizer)",
    "stopping_ids": "generation ends at the model's end-of-turn token; for more, pass stop strings (stop=[...])",
    "tokenizer_kwargs": "rksc uses the model directory's tokenizer as saved; to change it, build "
                        "RKSCEngine(model, tokenizer) and pass engine=",
    "tokenizer_outputs_to_remove": "rksc builds the model's inputs itself; drop it",
}

EnginePrompt = str | list[dict[str, Any]] | list[int]


@dataclass(frozen=True)
class _Prompt:
    """One call's engine prompt and what its answer must be: free text, maybe a tool call, or JSON."""

    prompt: EnginePrompt
    tools: ToolRequest | None = None
    output_schema: dict[str, Any] | None = None


@dataclass
class _Piece:
    """A streamed piece; the last one of a call carries the completion (its accounting) and calls."""

    delta: str
    text: str
    completion: Completion | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    tool_calls: tuple[ToolCall, ...] = ()


class RKSCLLM(FunctionCallingLLM):
    """A LlamaIndex LLM backed by an ``RKSCEngine``, or by a ``RemoteEngine`` (a model a server runs).

    Args:
        engine: An engine to share (its prefix cache is shared too). Exclusive with ``model``. A
            ``RemoteEngine`` gives the multi-branch answers, early stop (``RKSCBranchQueryEngine``)
            and the judge over its server (the log-prob judge; none where the server sends no top
            log-probs); tools, JSON answers and ``reuse_retrieved_context`` need a local engine
            and raise ``NotImplementedError``/``ValueError``; ``context_window`` is the server's to
            know: pass it, else LlamaIndex's default is reported.
        model: A local Hugging Face model directory, loaded with ``RKSCEngine.from_pretrained``
            (weights are never downloaded). With neither, the embedded default model
            (SmolLM2-135M-Instruct) is loaded.
        device: Where ``model`` is loaded: ``"auto"`` (CUDA if present), ``"cpu"``, ``"cuda:1"``...
        dtype: The weights' dtype when ``model`` is loaded: ``"auto"`` (float32 on CPU, bfloat16 on
            CUDA), ``"fast"`` or a dtype name.
        **fields: Any of the fields below, or ``HuggingFaceLLM``'s arguments:

            * ``model_name``: the same as ``model`` (a local directory; a Hub id raises ``ValueError``).
            * ``tokenizer_name``: accepted when it is the model's directory (rksc loads the tokenizer
              saved with the model); another raises ``ValueError``.
            * ``generate_kwargs``: ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``,
              ``top_k`` and ``stop_strings`` set the fields of those names (``do_sample=True`` samples
              at transformers' defaults, temperature 1.0 and top_k 50, unless they are given; a
              temperature without ``do_sample`` samples too); other keys raise ``TypeError``.
            * ``device_map``: one device, as ``device``; a map over several devices raises ``ValueError``.
            * ``model_kwargs``: ``torch_dtype``/``dtype`` and ``device_map``, as ``dtype`` and ``device``.
            * ``max_new_tokens``, ``context_window``, ``is_chat_model``, ``system_prompt``,
              ``messages_to_prompt``, ``completion_to_prompt``: fields of the same name (a
              ``context_window`` larger than the model's raises ``ValueError``).
            * ``stopping_ids``, ``tokenizer_kwargs``, ``tokenizer_outputs_to_remove`` and ``tokenizer``
              raise ``TypeError`` saying what to write instead.

    Any generation field can also be passed per call (``llm.complete(p, max_new_tokens=8)``). An
    unknown argument, to the constructor or a call, raises ``TypeError`` naming it.
    """

    max_new_tokens: int = Field(default=256, description="Upper bound on generated tokens (metadata.num_output).", gt=0)
    temperature: float = Field(default=0.0, description="0 = greedy (exact against transformers); > 0 samples.", ge=0)
    top_p: float = Field(default=1.0, description="Nucleus mass in (0, 1]; 1 disables it.", gt=0, le=1)
    top_k: int = Field(default=0, description="Keep the k most likely tokens; 0 disables it.", ge=0)
    stop: list[str] = Field(
        default_factory=list,
        description="Strings that end generation (one string or a list), matched on decoded text, so a stop "
        "spanning several tokens works; the text is cut before it and it never appears in a stream.",
    )
    seed: int | None = Field(default=None, description="Seed of branch 0 (branch i uses seed + i); None = fresh per call.")
    branches: int = Field(
        default=1, description="Branches per call; > 1 answers by verified self-consistency (tool calls use one).", ge=1
    )
    branch_temperature: float = Field(
        default=0.7, description="Temperature used when branches > 1 and temperature is 0 (greedy branches would be identical).", gt=0
    )
    answer_key: AnswerKey = Field(
        default=answer_key, exclude=True,
        description="Maps a branch's text to the answer it votes for (None: no vote). Default "
        "rksc_engine.reasoning.answer_key (case, punctuation, articles and number formatting normalised).",
    )
    vote: Any = Field(
        default="cluster", exclude=True,
        description="How branches vote: 'cluster' (default: equivalent free-text answers are grouped before "
        "counting), 'exact' (equal answer keys only; every early-stop rule applies), or a rksc VoteConfig.",
    )
    verifier: Any = Field(
        default="judge", exclude=True,
        description="Scores the voted answers when CGEE does not skip: 'judge' (the engine as a Yes/No judge over the "
        "call's prompt), a rksc Verifier, a callable fn(question, candidates) -> scores, or None (vote only).",
    )
    cgee: CGEEConfig | None = Field(
        default=None, exclude=True, description="CGEE thresholds (skip and layer exit); None: the engine's EngineConfig.cgee."
    )
    context_window: int | None = Field(default=None, description="Override of the model's context window.")
    is_chat_model: bool | None = Field(
        default=None, description="Route query-engine prompts through chat(); default: the tokenizer has a chat template."
    )
    is_function_calling_model: bool | None = Field(
        default=True,
        description="Advertise tool calling to LlamaIndex (FunctionAgent, FunctionCallingProgram, predict_and_call). "
        "Default True: rksc decodes calls under the tool's schema with any model. False routes agents to ReAct; "
        "None advertises it only when the chat template takes tools.",
    )

    reuse_retrieved_context: bool = Field(
        default=False,
        description="Reuse each retrieved chunk's KV wherever it appears in a later prompt (approximate; see "
        "ASKSConfig.reuse_chunks): query-engine context is set off by blank lines so each node is a chunk of its "
        "own. Needs an engine built with ASKSConfig(reuse_chunks=True); with none given, one is built.",
    )

    _engine: RKSCEngine | RemoteEngine = PrivateAttr()
    _verifier: Any = PrivateAttr(default=None)
    _vote: VoteConfig = PrivateAttr(default_factory=VoteConfig)

    def __init__(
        self, engine: RKSCEngine | RemoteEngine | None = None, model: str | None = None, *, device: str = "auto",
        dtype: str = "auto",
        **fields: Any,
    ) -> None:
        model, device, dtype = _huggingface_llm_arguments(fields, model, device, dtype)
        for name in fields:
            if name not in type(self).model_fields:
                raise unknown_argument(name, [*type(self).model_fields, "engine", "model", "device", "dtype",
                                              *HUGGINGFACE_LLM_ARGUMENTS], "RKSCLLM")
        if engine is not None and model is not None:
            raise ValueError("pass either engine or model, not both")
        if engine is not None and not isinstance(engine, (RKSCEngine, RemoteEngine)):
            raise TypeError(f"engine must be an RKSCEngine or a RemoteEngine, got {type(engine).__name__}")
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise TypeError(f"model must be a local model directory, got {type(model).__name__}; for a model "
                            f"already loaded, pass engine=RKSCEngine(model, tokenizer)")
        super().__init__(**fields)
        self._params({})  # a bad field combination fails here, not at the first call
        if self.cgee is not None and not isinstance(self.cgee, CGEEConfig):
            raise TypeError(f"cgee must be a CGEEConfig or None, got {type(self.cgee).__name__}")
        self._vote = resolve_vote(self.vote)
        if isinstance(engine, RemoteEngine):
            if self.reuse_retrieved_context:
                raise ValueError("reuse_retrieved_context=True reuses KV in a local engine's cache; a RemoteEngine's "
                                 "cache is its server's")
            self._engine = engine
            self._verifier = make_verifier(engine, self.verifier)
            return
        # Like LangChain's ChatRKSC: one engine (and prefix cache) per model in the process.
        if self.reuse_retrieved_context and engine is None:
            engine = shared_engine(model, device, dtype, config=EngineConfig(asks=ASKSConfig.for_retrieved_context()))
        if self.reuse_retrieved_context and not engine.config.asks.reuse_chunks:
            raise ValueError("reuse_retrieved_context=True needs an engine built with "
                             "EngineConfig(asks=ASKSConfig.for_retrieved_context()) (asks.reuse_chunks is off)")
        self._engine = engine if engine is not None else shared_engine(model, device, dtype)
        if self.context_window is not None and self.context_window > self._engine.context_window:
            raise ValueError(f"context_window={self.context_window} exceeds the model's context window of "
                             f"{self._engine.context_window} tokens; pass at most that (or leave it out)")
        self._verifier = make_verifier(self._engine, self.verifier)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        # One stop string is accepted as per call (and as LangChain does), not only a list of them.
        return [] if value is None else normalise_stop(value)

    @classmethod
    def class_name(cls) -> str:
        return "RKSCLLM"

    @property
    def engine(self) -> RKSCEngine | RemoteEngine:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        if isinstance(self._engine, RemoteEngine):  # the server applies its chat template; no tools here
            return LLMMetadata(context_window=self.context_window or DEFAULT_CONTEXT_WINDOW,
                               num_output=self.max_new_tokens,
                               is_chat_model=True if self.is_chat_model is None else self.is_chat_model,
                               is_function_calling_model=False, model_name=self._engine.model_name)
        function_calling = self.is_function_calling_model
        if function_calling is None:
            function_calling = tool_protocol.template_takes_tools(self._engine.tokenizer)
        return LLMMetadata(
            context_window=self.context_window or self._engine.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=self._has_chat_template() if self.is_chat_model is None else self.is_chat_model,
            is_function_calling_model=function_calling,
            model_name=self._engine.model_name,
        )

    # -- prompt formatting ----------------------------------------------------------------------
    def _retrieved_context(self, prompt_args: dict[str, Any]) -> dict[str, Any]:
        # Response synthesizers join the retrieved nodes with a blank line, but their templates put the
        # context between dashed lines, which would glue the first node to the header and the last to
        # the question; blank lines around it make every node a chunk of its own.
        context = prompt_args.get("context_str")
        if not (self.reuse_retrieved_context and isinstance(context, str)):
            return prompt_args
        separator = self._engine.config.asks.chunk_separator
        return {**prompt_args, "context_str": f"{separator}{context.strip()}{separator}"}

    def _get_prompt(self, prompt: Any, **prompt_args: Any) -> str:
        return super()._get_prompt(prompt, **self._retrieved_context(prompt_args))

    def _get_messages(self, prompt: Any, **prompt_args: Any) -> list[ChatMessage]:
        return super()._get_messages(prompt, **self._retrieved_context(prompt_args))

    def _has_chat_template(self) -> bool:
        if isinstance(self._engine, RemoteEngine):
            return True  # chat messages go to the server, which renders them
        return bool(getattr(self._engine.tokenizer, "chat_template", None))

    def _completion_prompt(self, prompt: str, formatted: bool) -> _Prompt:
        """The one formatting of a completion prompt, shared by every complete path."""
        check_prompt_text(prompt)
        if formatted:
            return _Prompt(prompt)
        if self.completion_to_prompt is not default_completion_to_prompt:
            return _Prompt(self.completion_to_prompt(prompt))
        if self._has_chat_template():
            # An instruct model answers a bare prompt best as a user turn of its own template.
            return _Prompt(to_engine_messages([ChatMessage(role=MessageRole.USER, content=prompt)], self.system_prompt))
        return _Prompt(f"{self.system_prompt}\n\n{prompt}" if self.system_prompt else prompt)

    def _chat_prompt(
        self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None = None, tool_required: bool = False,
        tool_choice: Any = None, output_schema: dict[str, Any] | None = None,
    ) -> _Prompt:
        if isinstance(self._engine, RemoteEngine):
            return self._remote_chat_prompt(messages, tools, output_schema)
        request = ToolRequest.build([_tool_schema(t) for t in tools or ()], "any" if tool_required else tool_choice)
        engine_messages, template_kwargs = tool_protocol.offer_tools(
            to_engine_messages(messages, self.system_prompt), request, self._engine.tokenizer,
            json_answer=output_schema is not None, schema=output_schema,
        )
        if self.messages_to_prompt is not generic_messages_to_prompt:
            # A user-supplied formatter wins; it sees LlamaIndex messages, as it expects.
            prompt: EnginePrompt = self.messages_to_prompt(_llama_messages(engine_messages))
        elif not self._has_chat_template():
            prompt = generic_messages_to_prompt(_llama_messages(engine_messages))
        elif template_kwargs:  # the template renders the tools itself
            prompt = self._engine.encode_chat(engine_messages, **template_kwargs)
        else:
            prompt = engine_messages
        return _Prompt(prompt, request, output_schema)

    def _remote_chat_prompt(self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None,
                            output_schema: dict[str, Any] | None) -> _Prompt:
        """A chat prompt for a server: its messages as they are (the server renders them)."""
        if tools or output_schema is not None:
            raise NotImplementedError("tools and JSON answers are decoded under their schema in the decode loop, "
                                      "which needs a local RKSCEngine; a RemoteEngine sends free text only")
        engine_messages = to_engine_messages(messages, self.system_prompt)
        if self.messages_to_prompt is not generic_messages_to_prompt:
            return _Prompt(self.messages_to_prompt(_llama_messages(engine_messages)))
        return _Prompt(engine_messages)

    # -- generation core ------------------------------------------------------------------------
    def _params(self, kwargs: dict[str, Any]) -> tuple[SamplingParams, int]:
        # The call's stops replace the field's; greedy branches would be identical, so several
        # branches at temperature 0 sample at branch_temperature.
        return call_sampling_params(self, kwargs, GENERATION_KWARGS, kwargs.get("stop", self.stop),
                                    n_name="branches", branch_temperature=self.branch_temperature)

    def _cgee(self) -> CGEEConfig:
        if self.cgee is not None:
            return self.cgee
        return getattr(getattr(self._engine, "config", None), "cgee", None) or CGEEConfig()

    def _report(self, completion: Completion, n: int, num_generated_tokens: int | None = None) -> dict[str, Any]:
        stats = self._engine.stats()
        emit(RKSCCacheReuseEvent(
            model_name=self._engine.model_name, num_prompt_tokens=completion.num_prompt_tokens,
            num_cached_tokens=completion.num_cached_tokens, num_branches=n,
            cache_tokens=stats.cache_tokens, cache_bytes=stats.cache_bytes,
        ))
        extra = {
            "prompt_tokens": completion.num_prompt_tokens,
            "cached_tokens": completion.num_cached_tokens,
            "completion_tokens": completion.num_generated_tokens if num_generated_tokens is None else num_generated_tokens,
            "finish_reason": completion.finish_reason,
        }
        asks = getattr(completion, "asks", None)  # the engine's ASKS decision for this prompt, if it acted
        if asks is not None:
            event = RKSCASKSReuseEvent.from_decision(asks)
            emit(event)
            extra["rksc_asks"] = event.detail
        return extra

    def _report_decision(self, decision: BranchDecision) -> None:
        if decision.early_stop is not None:
            emit(RKSCEarlyStopEvent(**decision.early_stop))
        emit(RKSCBranchVoteEvent(
            num_branches=decision.num_branches, answer=decision.answer, votes=decision.votes,
            chosen_branch=decision.chosen_branch, vote_method=decision.vote.method if decision.vote else "exact",
        ))
        emit(RKSCCGEESkipEvent(skipped=decision.cgee_skipped, reason=decision.cgee_reason, p=decision.p, lead=decision.lead))
        if decision.verified:
            emit(RKSCVerificationEvent(answer=decision.answer, scores=decision.scores, verify_s=decision.verify_s))
        if decision.exited_early:
            emit(RKSCEarlyExitEvent(
                exit_layers=decision.exit_layers, num_layers=decision.num_layers, layers_saved=decision.layers_saved
            ))

    def _generate(self, prompt: _Prompt, kwargs: dict[str, Any], collector: BranchCollector | None = None) -> _Piece:
        """One call, as its final piece; a multi-branch decision is appended to ``collector`` (the
        running ``RKSCBranchQueryEngine``'s, captured by the caller in the caller's context), whose
        early stop the branches run under."""
        params, n = self._params(kwargs)
        if prompt.tools is not None or prompt.output_schema is not None:
            params, _ = self._params({**kwargs, "branches": 1})  # one branch, at the call's own temperature
            if prompt.output_schema is not None or prompt.tools.forced:
                return self._constrained(prompt, params)
            completion = self._engine.generate(prompt.prompt, tool_protocol.with_tool_call_stop(params))
            return self._free_tool_turn(prompt, params, completion)
        if n == 1:
            return self._branches_piece(prompt, [self._engine.generate(prompt.prompt, params)], 1, collector)
        monitor = branch_monitor(collector, n, self.answer_key, params, self._vote)
        completions = submit_branches(self._engine, prompt.prompt, n, params, monitor).result()
        return self._branches_piece(prompt, completions, n, collector, monitor)

    async def _agenerate(self, prompt: _Prompt, kwargs: dict[str, Any],
                         collector: BranchCollector | None = None) -> _Piece:
        """``_generate`` for asyncio: the branches are awaited from the engine's scheduler (batched with
        every other request, no thread); tool turns and the verifier's pass run in a worker thread."""
        params, n = self._params(kwargs)
        if prompt.tools is not None or prompt.output_schema is not None:
            return await run_in_thread(self._generate, prompt, kwargs, collector)
        monitor = branch_monitor(collector, n, self.answer_key, params, self._vote)
        completions = await submit_branches(self._engine, prompt.prompt, n, params, monitor)
        if n == 1:
            return self._branches_piece(prompt, completions, n, collector)
        return await run_in_thread(self._branches_piece, prompt, completions, n, collector, monitor)

    def _branches_piece(self, prompt: _Prompt, completions: list[Completion], n: int, collector: BranchCollector | None,
                        monitor: EarlyStopMonitor | None = None) -> _Piece:
        """The piece of a free generation of ``n`` branches: the branch itself, or the one the vote and
        CGEE chose."""
        if n == 1:
            completion = completions[0]
            return _Piece(completion.text, completion.text, completion, self._report(completion, 1))
        decision = decide(completions, self.answer_key, self._cgee(), question=self._question(prompt.prompt),
                          verifier=self._verifier, monitor=monitor, vote=self._vote,
                          query=collector.query if collector is not None else None)
        completion = completions[decision.chosen_branch]
        extra = self._report(completion, n)
        self._report_decision(decision)
        extra["rksc_branches"] = decision.as_dict()
        if collector is not None:
            collector.decisions.append(decision.as_dict())
        return _Piece(completion.text, completion.text, completion, extra)

    def _constrained(self, prompt: _Prompt, params: SamplingParams) -> _Piece:
        """A JSON answer or a forced tool call, decoded under its schema by ``rksc_engine.structured.tools``
        from the first token."""
        # An output schema wins over tools (a structured answer is asked for); else the forced call.
        tools = None if prompt.output_schema is not None else prompt.tools
        result, text = tool_protocol.decode_constrained(
            self._engine, self._engine.encode(prompt.prompt), value_params(params, params.seed),
            tools, prompt.output_schema,
        )
        return self._constrained_piece(result, text, delta=text)

    def _constrained_piece(self, result: ConstrainedResult, text: str, delta: str) -> _Piece:
        extra = self._report(result.completion, 1, result.num_generated_tokens)
        extra["finish_reason"] = result.finish_reason
        extra["constrained"] = True
        return _Piece(delta, text, result.completion, extra, result.tool_calls)

    def _free_tool_turn(self, prompt: _Prompt, params: SamplingParams, completion: Completion) -> _Piece:
        """A free generation with tools offered, finished by ``rksc_engine.structured.tools.finish_tool_turn``
        (a call it started is decoded under the schema; its text was streamed already)."""
        turn = tool_protocol.finish_tool_turn(
            self._engine, prompt.prompt, prompt.tools, completion, value_params(params, params.seed)
        )
        if turn.constrained is not None:
            return self._constrained_piece(turn.constrained, turn.text, delta="")
        return _Piece(completion.text, turn.text, completion, self._report(completion, 1), turn.tool_calls)

    def _question(self, prompt: EnginePrompt) -> str:
        """What the judge is asked about: the prompt's text without its system turn."""
        if isinstance(prompt, str):
            return prompt
        if prompt and isinstance(prompt[0], dict):
            return "\n\n".join(m["content"] for m in prompt if m["role"] != "system")
        return self._engine.tokenizer.decode(list(prompt), skip_special_tokens=True)

    def _stream(self, prompt: _Prompt, kwargs: dict[str, Any]) -> Iterator[_Piece]:
        """Pieces of one call; the last carries the completion.

        Everything, including the events and any constrained tool call, runs in the iterating
        thread, so an async consumer that drains this in a worker never touches the engine from the
        event loop.
        """
        params, n = self._params(kwargs)  # checked before the first next(), like the engine does
        if prompt.tools is not None:
            params, _ = self._params({**kwargs, "branches": 1})  # tool turns decode one branch
        collector = current_collector()
        constrained = prompt.output_schema is not None or (prompt.tools is not None and prompt.tools.forced)
        if constrained or (n > 1 and prompt.tools is None):
            # A vote needs every branch finished, and a constrained answer is written by the decoder,
            # so either arrives as one piece.
            def whole() -> Iterator[_Piece]:
                yield self._generate(prompt, kwargs, collector)

            return whole()
        chunks = self._engine.stream(prompt.prompt, tool_protocol.with_tool_call_stop(params) if prompt.tools else params)

        def pieces() -> Iterator[_Piece]:
            text = ""
            for chunk in chunks:
                text += chunk.text
                if chunk.completion is None:
                    if chunk.text:
                        yield _Piece(chunk.text, text)
                    continue
                if prompt.tools is not None:
                    last = self._free_tool_turn(prompt, params, chunk.completion)
                    yield dataclasses.replace(last, delta=chunk.text, text=text if not last.tool_calls else last.text)
                else:
                    yield _Piece(chunk.text, text, chunk.completion, self._report(chunk.completion, 1))

        return pieces()

    async def _astream(self, prompt: _Prompt, kwargs: dict[str, Any]) -> AsyncIterator[_Piece]:
        """``_stream`` for asyncio: a plain one-branch stream is read from the engine's scheduler as it
        decodes (no thread); votes, tool turns and constrained answers go through a worker thread."""
        params, n = self._params(kwargs)
        if prompt.tools is not None or prompt.output_schema is not None or n > 1:
            async for piece in iterate_in_thread(lambda: self._stream(prompt, kwargs)):
                yield piece
            return
        text = ""
        async for chunk in self._engine.astream(prompt.prompt, params):
            text += chunk.text
            if chunk.completion is None:
                if chunk.text:
                    yield _Piece(chunk.text, text)
            else:
                yield _Piece(chunk.text, text, chunk.completion, self._report(chunk.completion, 1))

    # -- completion endpoints -------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _completion_response(self._generate(self._completion_prompt(prompt, formatted), kwargs, current_collector()))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        pieces = self._stream(self._completion_prompt(prompt, formatted), kwargs)
        return (_completion_response(piece) for piece in pieces)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        engine_prompt = self._completion_prompt(prompt, formatted)
        return _completion_response(await self._agenerate(engine_prompt, kwargs, current_collector()))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        engine_prompt = self._completion_prompt(prompt, formatted)
        self._params(kwargs)  # bad options raise here, at the await, not inside the stream

        async def gen() -> AsyncIterator[CompletionResponse]:
            async for piece in self._astream(engine_prompt, kwargs):
                yield _completion_response(piece)

        return gen()

    # -- chat endpoints -------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None = None, tool_required: bool = False,
        tool_choice: Any = None, output_schema: dict[str, Any] | None = None, **kwargs: Any,
    ) -> ChatResponse:
        """Chat through the model's chat template.

        Args:
            messages: The conversation; tool calls in it are rendered back for the model.
            tools: LlamaIndex tools or JSON schema dicts to offer; the reply's calls become ``ToolCallBlock``s.
            tool_required: A tool call must be made (decoded under the schema from the first token).
            tool_choice: A tool name to force, ``"auto"``, ``"any"`` or ``"none"``.
            output_schema: A JSON schema the reply must follow; the content is then its JSON.
            **kwargs: Generation fields for this call.
        """
        engine_prompt = self._chat_prompt(messages, tools, tool_required, tool_choice, output_schema)
        return _chat_response(self._generate(engine_prompt, kwargs, current_collector()))

    @llm_chat_callback()
    def stream_chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None = None, tool_required: bool = False,
        tool_choice: Any = None, output_schema: dict[str, Any] | None = None, **kwargs: Any,
    ) -> ChatResponseGen:
        pieces = self._stream(self._chat_prompt(messages, tools, tool_required, tool_choice, output_schema), kwargs)
        return (_chat_response(piece) for piece in pieces)

    @llm_chat_callback()
    async def achat(
        self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None = None, tool_required: bool = False,
        tool_choice: Any = None, output_schema: dict[str, Any] | None = None, **kwargs: Any,
    ) -> ChatResponse:
        engine_prompt = self._chat_prompt(messages, tools, tool_required, tool_choice, output_schema)
        return _chat_response(await self._agenerate(engine_prompt, kwargs, current_collector()))

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None = None, tool_required: bool = False,
        tool_choice: Any = None, output_schema: dict[str, Any] | None = None, **kwargs: Any,
    ) -> ChatResponseAsyncGen:
        engine_prompt = self._chat_prompt(messages, tools, tool_required, tool_choice, output_schema)
        self._params(kwargs)

        async def gen() -> AsyncIterator[ChatResponse]:
            async for piece in self._astream(engine_prompt, kwargs):
                yield _chat_response(piece)

        return gen()

    # -- structured output ----------------------------------------------------------------------
    @dispatcher.span
    def structured_predict(
        self, output_cls: type, prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> Any:
        """An ``output_cls`` instance decoded under its JSON schema (``rksc_engine.structured.constrained.decode_json``).

        With ``pydantic_program_mode`` other than DEFAULT, LlamaIndex's own program for that mode runs.

        Raises:
            pydantic.ValidationError: A constraint the decoder does not enforce (a string pattern,
                a length bound) rejects the decoded value.
        """
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super().structured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args))
        messages = prompt.format_messages(llm=self, **prompt_args)
        response = self.chat(messages, output_schema=output_cls.model_json_schema(), **(llm_kwargs or {}))
        result = output_cls.model_validate(json.loads(response.message.content))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    @dispatcher.span
    async def astructured_predict(
        self, output_cls: type, prompt: BasePromptTemplate, llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
    ) -> Any:
        """``structured_predict`` in a worker thread."""
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super().astructured_predict(output_cls, prompt, llm_kwargs, **prompt_args)
        dispatcher.event(LLMStructuredPredictStartEvent(output_cls=output_cls, template=prompt, template_args=prompt_args))
        messages = prompt.format_messages(llm=self, **prompt_args)
        response = await self.achat(messages, output_schema=output_cls.model_json_schema(), **(llm_kwargs or {}))
        result = output_cls.model_validate(json.loads(response.message.content))
        dispatcher.event(LLMStructuredPredictEndEvent(output=result))
        return result

    # -- function calling -----------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str) else user_msg)
        # OpenAI-style options have no meaning for a local template; generation options pass through.
        options = {k: v for k, v in kwargs.items() if k in (*GENERATION_KWARGS, "tool_choice")}
        return {"messages": messages, "tools": list(tools), "tool_required": tool_required, **options}

    def _validate_chat_with_tools_response(
        self, response: ChatResponse, tools: Sequence[BaseTool], allow_parallel_tool_calls: bool = False, **kwargs: Any
    ) -> ChatResponse:
        if not allow_parallel_tool_calls:
            calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
            if len(calls) > 1:
                response.message.blocks = [b for b in response.message.blocks if not isinstance(b, ToolCallBlock)] + calls[:1]
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if not calls and error_on_no_tool_call:
            raise ValueError(f"expected at least one tool call in the response, got none: {response.message.content!r}")
        return [
            ToolSelection(tool_id=c.tool_call_id or f"call_{i}", tool_name=c.tool_name,
                          tool_kwargs=c.tool_kwargs if isinstance(c.tool_kwargs, dict) else {"input": c.tool_kwargs})
            for i, c in enumerate(calls)
        ]


def _tool_schema(tool: Any) -> dict[str, Any]:
    """A LlamaIndex tool (or a schema dict) as the function dict ``rksc_engine.structured.tools`` takes."""
    if isinstance(tool, dict):
        return tool_protocol.function_spec(tool)
    metadata = getattr(tool, "metadata", None)
    if metadata is None or not hasattr(metadata, "get_parameters_dict"):
        raise TypeError(f"tools must be LlamaIndex tools or JSON schema dicts, got {type(tool).__name__}")
    return {"name": metadata.get_name(), "description": metadata.description, "parameters": metadata.get_parameters_dict()}


def _llama_messages(messages: Sequence[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage(role=m["role"], content=m["content"]) for m in messages]


def _completion_response(piece: _Piece) -> CompletionResponse:
    raw = {"completion": piece.completion} if piece.completion else None
    return CompletionResponse(text=piece.text, delta=piece.delta, raw=raw, additional_kwargs=piece.extra)


def _chat_response(piece: _Piece) -> ChatResponse:
    blocks: list[Any] = [TextBlock(text=piece.text)]
    if piece.tool_calls:
        blocks = ([TextBlock(text=piece.text)] if piece.text else []) + to_tool_call_blocks(piece.tool_calls)
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks),
        delta=piece.delta, raw={"completion": piece.completion} if piece.completion else None,
        additional_kwargs=piece.extra,
    )


def _huggingface_llm_arguments(
    fields: dict[str, Any], model: Any, device: str, dtype: str
) -> tuple[Any, str, str]:
    """Translate (popping them from ``fields``) the arguments a ``HuggingFaceLLM`` user writes;
    returns ``(model, device, dtype)``. See ``RKSCLLM``'s docstring for each one."""
    for name, instead in _REFUSED_HUGGINGFACE_LLM_ARGUMENTS.items():
        if name in fields:
            raise TypeError(f"RKSCLLM does not take {name}: {instead}")
    if "model_name" in fields:
        if model is not None:
            raise ValueError("pass either model or model_name (the same thing), not both")
        model = local_model_dir(fields.pop("model_name"), "model_name")
    if "tokenizer_name" in fields:
        tokenizer_dir = fields.pop("tokenizer_name")
        if model is None or Path(str(tokenizer_dir)).resolve() != Path(str(model)).resolve():
            raise ValueError(f"tokenizer_name={str(tokenizer_dir)!r} is not the model's directory; rksc loads the "
                             f"tokenizer saved with the model: drop tokenizer_name, or save that tokenizer into the "
                             f"model directory")
    loading: dict[str, Any] = {}
    if "model_kwargs" in fields:
        loading.update(loading_from_model_kwargs(fields.pop("model_kwargs"), "model_kwargs"))
    if "device_map" in fields:
        put_settings(loading, {"device": device_from_device_map(fields.pop("device_map"), "device_map")}, "device_map")
    if "device" in loading and device != "auto":
        raise ValueError("pass either device or device_map, not both")
    if "generate_kwargs" in fields:
        put_settings(fields, sampling_from_generate_kwargs(fields.pop("generate_kwargs"), "generate_kwargs"),
                     "generate_kwargs")
    return model, loading.get("device", device), loading.get("dtype", dtype)
