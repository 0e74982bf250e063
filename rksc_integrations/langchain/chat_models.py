"""``ChatRKSC``: the rksc engine as a LangChain chat model.

Drop-in for ``ChatHuggingFace(llm=HuggingFacePipeline(...))``::

    chat = ChatRKSC()                              # embedded default model
    chat = ChatRKSC(engine=engine, max_tokens=64)  # an engine you already have (its cache is shared)
    chat = ChatRKSC(llm=RKSCLLM.from_model_id(...))  # ChatHuggingFace(llm=HuggingFacePipeline...)'s form

What differs, on purpose:
    * Any history renders (AI or tool message last, as an agent loop sends).
    * Each call's prompt goes through the engine's prefix cache; the reuse shows in
      ``usage_metadata["input_token_details"]["cache_read"]``, ``response_metadata["num_cached_tokens"]``
      and an ``rksc_cache_reuse`` custom event.
    * ``n > 1`` decodes sibling generations over one prefill; each is its own ``ChatGeneration``.
    * Tool calls and structured output are decoded under the schema (``rksc_engine.structured.tools``), so even
      the 135M default model returns well-formed calls.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Literal
from uuid import UUID

from langchain_core.callbacks import (
    AsyncCallbackManager,
    AsyncCallbackManagerForLLMRun,
    CallbackManager,
    CallbackManagerForLLMRun,
    adispatch_custom_event,
    dispatch_custom_event,
)
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableMap, RunnablePassthrough, ensure_config
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from langchain_core.utils.utils import LC_ID_PREFIX
from pydantic import BaseModel, ConfigDict

from rksc_engine import Completion, RKSCEngine, SamplingParams
from rksc_engine.structured import tools as tool_protocol
from rksc_engine.structured.constrained import ConstrainedResult, ToolCall, inline_refs, value_params
from rksc_engine.structured.tools import TOOL_CALL_OPEN, ToolRequest
from rksc_integrations._async import iterate_in_thread
from rksc_integrations._common import explicit_settings
from rksc_integrations.langchain._base import RKSCFields, all_at_once, custom_events
from rksc_integrations.langchain.llms import RKSCLLM
from rksc_integrations.langchain.messages import to_engine_messages

# Bound by bind_tools / with_structured_output, consumed here (never passed to the engine).
_BOUND_KWARGS = ("tools", "tool_choice", "response_format")
# The settings ``ChatRKSC(llm=...)`` takes from the LLM when the user set them there.
_LLM_SETTINGS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "streaming")


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    n: int
    tools: ToolRequest | None = None
    response_format: dict[str, Any] | None = None

    @property
    def constrained_from_start(self) -> bool:
        """A forced tool call or a JSON answer: decoded under the schema from the first token."""
        return (self.tools is not None and self.tools.forced) or self.response_format is not None


class ChatRKSC(RKSCFields, BaseChatModel):
    """A LangChain chat model backed by an ``RKSCEngine``.

    Args:
        engine: An engine to use (exclusive with ``model`` and ``llm``). With none of them, the
            embedded default is loaded once per process and shared.
        llm: An rksc ``RKSCLLM``, as ``ChatHuggingFace(llm=HuggingFacePipeline(...))`` takes one: its
            engine is used, and the generation settings set on it (``max_tokens``, ``temperature``,
            ``top_p``, ``top_k``, ``stop``, ``seed``, ``n``, ``streaming``) are the defaults of the
            fields given here.
        **fields: The fields below. ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``
            and ``n`` can also be passed per call; other call keyword arguments raise ``TypeError``.
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    def __init__(self, engine: RKSCEngine | None = None, *, llm: Any = None, **fields: Any) -> None:
        if llm is not None:
            if not isinstance(llm, RKSCLLM):
                raise TypeError(f"llm must be an rksc RKSCLLM (rksc_integrations.langchain.RKSCLLM), got "
                                f"{type(llm).__name__}; for ChatHuggingFace(llm=HuggingFacePipeline.from_model_id(...)) "
                                f"write ChatRKSC(llm=RKSCLLM.from_model_id(...))")
            if engine is not None or fields.get("model") is not None:
                raise ValueError("pass at most one of llm, engine and model")
            engine = llm.engine
            for name, value in explicit_settings(llm, {name: name for name in _LLM_SETTINGS}).items():
                if name not in fields and not (name == "max_new_tokens" and "max_tokens" in fields):
                    fields[name] = value  # the chat's own arguments win
        super().__init__(engine, **fields)

    @property
    def _llm_type(self) -> str:
        return "rksc-chat"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        return {**self.ls_params(stop, kwargs), "ls_model_type": "chat"}

    # -- tools and structured output ------------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | bool | dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Offer ``tools`` to the model.

        Args:
            tools: Anything ``convert_to_openai_tool`` accepts (pydantic classes, functions, tools, dicts).
            tool_choice: ``None``/``"auto"`` lets the model decide; ``"any"``/``"required"``/``True``
                forces a call to one of the tools; a tool name or ``{"function": {"name": ...}}``
                forces that tool; ``"none"`` offers no tools.
        """
        formatted = [convert_to_openai_tool(t) for t in tools]
        names = [t["function"]["name"] for t in formatted]
        choice = tool_protocol.normalise_tool_choice(tool_choice, names)
        if choice == "none":
            formatted, choice = [], None
        return super().bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "function_calling",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | BaseModel]:
        """Answers as ``schema`` (a pydantic class, TypedDict or JSON schema).

        Args:
            method: ``"function_calling"``: a forced call of a tool named after the schema;
                ``"json_schema"``: the message content is JSON decoded under the schema;
                ``"json_mode"``: a JSON object; without ``schema`` the model chooses its keys, with one
                it is decoded like ``"json_schema"``.
            include_raw: Return ``{"raw", "parsed", "parsing_error"}`` instead of the parsed value.
            strict: Accepted for API parity: decoding always follows the schema (see ``rksc_engine.structured.tools``).
        """
        if kwargs:
            raise TypeError(f"unexpected keyword argument(s) {sorted(kwargs)}")
        if method == "function_calling":
            if schema is None:
                raise ValueError("schema is required for method='function_calling'")
            return super().with_structured_output(schema, include_raw=include_raw)
        if method not in ("json_schema", "json_mode"):
            raise ValueError(f"method must be 'function_calling', 'json_schema' or 'json_mode', got {method!r}")
        if method == "json_schema" and schema is None:
            raise ValueError("schema is required for method='json_schema'")
        json_schema = convert_to_json_schema(schema) if schema is not None else None
        # JSON mode has the model choose the keys; a schema given to it is still used to decode, since
        # the answer is parsed as that schema and a small model rarely guesses its shape unaided.
        response_format = (
            {"type": "json_schema" if method == "json_schema" else "json_object",
             "schema": inline_refs(json_schema)}
            if json_schema is not None else {"type": "json_object"}
        )
        llm = self.bind(
            response_format=response_format,
            ls_structured_output_format={"kwargs": {"method": method}, "schema": json_schema},
        )
        parser = PydanticOutputParser(pydantic_object=schema) if isinstance(schema, type) and is_basemodel_subclass(schema) else JsonOutputParser()
        if not include_raw:
            return llm | parser
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        fallback = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([fallback], exception_key="parsing_error")

    # -- request --------------------------------------------------------------------------------
    def _request(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> _Request:
        bound = {k: kwargs.pop(k) for k in _BOUND_KWARGS if k in kwargs}
        tools = ToolRequest.build(bound.get("tools") or [], bound.get("tool_choice"))
        response_format = bound.get("response_format")
        # The tool-call opener ends free text, so a call the model starts is finished under the schema.
        params, n = self.sampling_params(kwargs, stop, (TOOL_CALL_OPEN,) if tools else ())
        tokenizer = self.engine.tokenizer
        # Calls in the history stay structured; rksc_engine.structured.tools renders them for the template.
        engine_messages, template_kwargs = tool_protocol.offer_tools(
            to_engine_messages(messages, native_tools=True), tools, tokenizer,
            json_answer=response_format is not None, schema=(response_format or {}).get("schema"),
        )
        if getattr(tokenizer, "chat_template", None):
            prompt_ids = self.engine.encode_chat(engine_messages, **template_kwargs)
        else:  # a base model: a plain transcript ending where the assistant speaks
            text = "".join(f"{m['role'].capitalize()}: {m['content']}\n" for m in engine_messages) + "Assistant:"
            prompt_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return _Request(prompt_ids, params, n, tools, response_format)

    # -- generation -----------------------------------------------------------------------------
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        if self.streaming:
            from langchain_core.language_models.chat_models import generate_from_stream

            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        request = self._request(messages, stop, kwargs)
        if request.constrained_from_start:
            results = [self._constrained(request, _branch_seed(request.params, i)) for i in range(request.n)]
            report = self.report(results[0][1], request.n, run_manager)
            messages_out = [m for m, _ in results]
            for m in messages_out:
                m.response_metadata["rksc_cache_reuse"] = report
            generations = [ChatGeneration(message=m, generation_info=dict(m.response_metadata)) for m in messages_out]
            return ChatResult(generations=generations, llm_output=_llm_output(messages_out, self.model_name))
        completions = self.engine.generate_branches(request.prompt_ids, request.n, request.params)
        return self._chat_result(completions, request, run_manager)

    def _chat_result(self, completions: list[Completion], request: _Request,
                     run_manager: CallbackManagerForLLMRun | None) -> ChatResult:
        report = self.report(completions[0], request.n, run_manager)
        generations = []
        for completion in completions:
            message = self._message(completion, request)
            message.response_metadata["rksc_cache_reuse"] = report
            generations.append(ChatGeneration(message=message, generation_info=dict(message.response_metadata)))
        return ChatResult(generations=generations, llm_output=_llm_output([g.message for g in generations], self.model_name))

    def batch(self, inputs: list[Any], config: RunnableConfig | list[RunnableConfig] | None = None, *,
              return_exceptions: bool = False, **kwargs: Any) -> list[BaseMessage]:
        # Every input submitted at once, so the scheduler decodes them together.
        return super().batch(inputs, all_at_once(config, len(inputs)), return_exceptions=return_exceptions, **kwargs)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        # The branches are awaited from the engine's scheduler, batched with every other request (no
        # thread). Calls whose result needs more engine calls (tool calls finished under their schema,
        # constrained answers) run in a worker thread, so the event loop never waits on the engine.
        sync_manager = run_manager.get_sync() if run_manager else None
        request = self._request(messages, stop, dict(kwargs))  # it pops the bound options
        if self.streaming or request.constrained_from_start:
            return await asyncio.to_thread(self._generate, messages, stop, sync_manager, **kwargs)
        completions = await self.engine.submit(request.prompt_ids, request.n, request.params)
        if request.tools is not None:
            return await asyncio.to_thread(self._chat_result, completions, request, sync_manager)
        return self._chat_result(completions, request, sync_manager)

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        # LangChain's stream() reports each yielded chunk to on_llm_new_token itself.
        request = self._request(messages, stop, dict(kwargs))  # it pops the bound options
        if request.n != 1:
            raise ValueError(f"streaming produces one generation; n must be 1, got {request.n}")
        # Without the run's manager (LangChain's stream()/astream()), stream()/astream() below send
        # the events once the run id is known; report() only computes the data then.
        dispatch = run_manager is not None
        if request.constrained_from_start:
            message, first = self._constrained(request, request.params.seed)
            message.response_metadata["rksc_cache_reuse"] = self.report(first, 1, run_manager, dispatch=dispatch)
            yield _last_chunk(message)
            return
        completion: Completion | None = None
        tail = ""
        for piece in self.engine.stream(request.prompt_ids, request.params):
            if piece.completion is not None:
                completion, tail = piece.completion, piece.text
            elif piece.text:
                yield ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
        assert completion is not None  # the engine's last chunk always carries it
        yield self._last_stream_chunk(completion, tail, request, run_manager, dispatch)

    def _last_stream_chunk(self, completion: Completion, tail: str, request: _Request,
                           run_manager: CallbackManagerForLLMRun | None, dispatch: bool) -> ChatGenerationChunk:
        """The final chunk of a stream: the text not yet streamed and the whole message's metadata (a
        tool call the model started is finished under its schema here)."""
        report = self.report(completion, 1, run_manager, dispatch=dispatch)
        message = self._message(completion, request)
        message.response_metadata["rksc_cache_reuse"] = report
        streamed = completion.text[: len(completion.text) - len(tail)]
        message.content = message.content[len(streamed):] if isinstance(message.content, str) else message.content
        return _last_chunk(message)

    def stream(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, *, stop: list[str] | None = None,
        **kwargs: Any,
    ) -> Iterator[AIMessageChunk]:
        """LangChain's ``stream``, plus the ``rksc_cache_reuse`` (and ``rksc_asks``) custom events
        ``invoke`` sends, on the same run."""
        config = ensure_config(config)
        for chunk in super().stream(input, config, stop=stop, **kwargs):
            events = _stream_events(chunk)
            if events:
                manager = self._stream_run_manager(config, chunk, CallbackManager)
                for name, data in events:
                    dispatch_custom_event(name, data, config={"callbacks": manager})
            yield chunk

    async def astream(
        self, input: LanguageModelInput, config: RunnableConfig | None = None, *, stop: list[str] | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[AIMessageChunk]:
        """LangChain's ``astream`` (so also ``astream_events``), plus the events ``stream`` adds."""
        config = ensure_config(config)
        async for chunk in super().astream(input, config, stop=stop, **kwargs):
            events = _stream_events(chunk)
            if events:
                manager = self._stream_run_manager(config, chunk, AsyncCallbackManager)
                for name, data in events:
                    await adispatch_custom_event(name, data, config={"callbacks": manager})
            yield chunk

    def _stream_run_manager(self, config: RunnableConfig, chunk: AIMessageChunk, manager_class: type) -> Any:
        """Callbacks of the chat-model run that streamed ``chunk``, as a parent for custom events:
        the handlers ``stream()`` configured for it, and its run id, which it wrote into the chunk's id."""
        manager = manager_class.configure(
            config.get("callbacks"), self.callbacks, self.verbose, config.get("tags"), self.tags,
            config.get("metadata"), self.metadata,
        )
        manager.parent_run_id = UUID(chunk.id.removeprefix(f"{LC_ID_PREFIX}-"))
        return manager

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        sync_manager = run_manager.get_sync() if run_manager else None
        request = self._request(messages, stop, dict(kwargs))  # it pops the bound options
        if request.n != 1 or request.constrained_from_start:
            async for chunk in iterate_in_thread(lambda: self._stream(messages, stop, sync_manager, **kwargs)):
                yield chunk
            return
        # Read from the engine's scheduler as it decodes (no thread per stream); only the last chunk,
        # which may finish a tool call with more engine calls, is built in a worker thread.
        completion: Completion | None = None
        tail = ""
        async for piece in self.engine.astream(request.prompt_ids, request.params):
            if piece.completion is not None:
                completion, tail = piece.completion, piece.text
            elif piece.text:
                yield ChatGenerationChunk(message=AIMessageChunk(content=piece.text))
        assert completion is not None
        dispatch = run_manager is not None
        if request.tools is not None:
            yield await asyncio.to_thread(self._last_stream_chunk, completion, tail, request, sync_manager, dispatch)
        else:
            yield self._last_stream_chunk(completion, tail, request, sync_manager, dispatch)

    # -- results --------------------------------------------------------------------------------
    def _message(self, completion: Completion, request: _Request) -> AIMessage:
        """The AIMessage of a free generation; with tools offered, its turn is finished by
        ``rksc_engine.structured.tools.finish_tool_turn`` (a call the model started is decoded constrained)."""
        if request.tools is None:
            return AIMessage(
                content=completion.text,
                usage_metadata=self.usage(completion),
                response_metadata=self.generation_info(completion),
            )
        params = value_params(request.params, completion.seed)
        turn = tool_protocol.finish_tool_turn(self.engine, request.prompt_ids, request.tools, completion, params)
        if turn.constrained is not None:
            return self._constrained_message(turn.constrained, turn.text)
        return AIMessage(
            content=turn.text,
            tool_calls=_tool_calls(turn.tool_calls),
            usage_metadata=self.usage(completion),
            response_metadata=self.generation_info(completion),
        )

    def _constrained(self, request: _Request, seed: int | None) -> tuple[AIMessage, Completion]:
        """A forced tool call or a JSON answer, decoded under the bound schemas from the first token,
        and the completion whose prompt accounting it reports."""
        result, content = tool_protocol.decode_constrained(
            self.engine, request.prompt_ids, value_params(request.params, seed), request.tools,
            (request.response_format or {}).get("schema"),
        )
        return self._constrained_message(result, content), result.completion

    def _constrained_message(self, result: ConstrainedResult, content: str) -> AIMessage:
        metadata = {**self.generation_info(result.completion), "finish_reason": result.finish_reason, "constrained": True}
        return AIMessage(
            content=content, tool_calls=_tool_calls(result.tool_calls),
            usage_metadata=self.usage(result.completion, result.num_generated_tokens), response_metadata=metadata,
        )


def _stream_events(chunk: Any) -> list[tuple[str, dict[str, Any]]]:
    """The custom events a streamed run still owes: those of its last chunk, when ``_stream`` made
    it (a fallback to ``invoke`` yields an ``AIMessage``, whose events ``_generate`` already sent)."""
    if not isinstance(chunk, AIMessageChunk) or chunk.chunk_position != "last":
        return []
    metadata = chunk.response_metadata
    if "rksc_cache_reuse" not in metadata or not (chunk.id or "").startswith(LC_ID_PREFIX):
        return []
    return custom_events(metadata["rksc_cache_reuse"], metadata.get("asks"))


def _tool_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    return [{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"} for c in calls]


def _branch_seed(params: SamplingParams, i: int) -> int | None:
    return None if params.seed is None else params.seed + i


def _last_chunk(message: AIMessage) -> ChatGenerationChunk:
    tool_call_chunks = [
        {"name": c["name"], "args": json.dumps(c["args"], ensure_ascii=False), "id": c["id"], "index": i, "type": "tool_call_chunk"}
        for i, c in enumerate(message.tool_calls)
    ]
    chunk = AIMessageChunk(
        content=message.content, tool_call_chunks=tool_call_chunks, usage_metadata=message.usage_metadata,
        response_metadata=message.response_metadata, chunk_position="last",
    )
    return ChatGenerationChunk(message=chunk, generation_info=dict(message.response_metadata))


def _llm_output(messages: list[BaseMessage], model_name: str) -> dict[str, Any]:
    usage = [m.usage_metadata for m in messages if getattr(m, "usage_metadata", None)]
    return {
        "model_name": model_name,
        "token_usage": {
            "prompt_tokens": usage[0]["input_tokens"] if usage else 0,
            "completion_tokens": sum(u["output_tokens"] for u in usage),
            "cached_tokens": usage[0]["input_token_details"]["cache_read"] if usage else 0,
        },
    }
