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
    * Tool calls (``chat_with_tools``, agents) use the ``<tool_call>`` JSON convention, see
      ``rksc_integrations.llama_index.messages``.
    * ``branches=n`` answers by self-consistency, see ``rksc_integrations.llama_index.branches``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
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
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection, default_completion_to_prompt

from rksc_engine import Completion, RKSCEngine, SamplingParams
from rksc_engine.cgee import CGEEConfig

from .._async import iterate_in_thread, run_in_thread
from .branches import AnswerKey, BranchDecision, current_collector, decide, normalise_answer
from .events import RKSCBranchVoteEvent, RKSCCacheReuseEvent, RKSCCGEESkipEvent, emit
from .messages import parse_tool_calls, to_engine_messages, tool_system_prompt

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

# Per-call keyword arguments that override the fields of the same name.
GENERATION_KWARGS = ("max_new_tokens", "temperature", "top_p", "top_k", "stop", "seed", "branches")

EnginePrompt = str | list[dict[str, str]]


class RKSCLLM(FunctionCallingLLM):
    """A LlamaIndex LLM backed by an ``RKSCEngine``.

    Args:
        engine: An engine to share (its prefix cache is shared too). Exclusive with ``model``.
        model: A local Hugging Face model directory, loaded with ``RKSCEngine.from_pretrained``.
            With neither, the embedded default model (SmolLM2-135M-Instruct) is loaded.
        **fields: Any of the fields below.

    Any generation field can also be passed per call (``llm.complete(p, max_new_tokens=8)``);
    other keyword arguments raise ``TypeError``.
    """

    max_new_tokens: int = Field(default=256, description="Upper bound on generated tokens (metadata.num_output).", gt=0)
    temperature: float = Field(default=0.0, description="0 = greedy (exact against transformers); > 0 samples.", ge=0)
    top_p: float = Field(default=1.0, description="Nucleus mass in (0, 1]; 1 disables it.", gt=0, le=1)
    top_k: int = Field(default=0, description="Keep the k most likely tokens; 0 disables it.", ge=0)
    stop: list[str] = Field(
        default_factory=list,
        description="Strings that end generation, matched on decoded text, so a stop spanning several tokens works; "
        "the text is cut before it and it never appears in a stream.",
    )
    seed: int | None = Field(default=None, description="Seed of branch 0 (branch i uses seed + i); None = fresh per call.")
    branches: int = Field(default=1, description="Branches per call; > 1 answers by self-consistency.", ge=1)
    branch_temperature: float = Field(
        default=0.7, description="Temperature used when branches > 1 and temperature is 0 (greedy branches would be identical).", gt=0
    )
    answer_key: AnswerKey = Field(
        default=normalise_answer, exclude=True,
        description="Maps a branch's text to the answer it votes for (None: no vote). Default normalise_answer.",
    )
    cgee: CGEEConfig = Field(default_factory=CGEEConfig, exclude=True, description="Thresholds of the CGEE skip decision.")
    context_window: int | None = Field(default=None, description="Override of the model's context window.")
    is_chat_model: bool | None = Field(
        default=None, description="Route query-engine prompts through chat(); default: the tokenizer has a chat template."
    )
    is_function_calling_model: bool = Field(default=True, description="Advertise tool calling to LlamaIndex agents.")

    _engine: RKSCEngine = PrivateAttr()

    def __init__(self, engine: RKSCEngine | None = None, model: str | None = None, **fields: Any) -> None:
        if engine is not None and model is not None:
            raise ValueError("pass either engine or model, not both")
        if engine is not None and not isinstance(engine, RKSCEngine):
            raise TypeError(f"engine must be an RKSCEngine, got {type(engine).__name__}")
        super().__init__(**fields)
        self._params({})  # a bad field combination fails here, not at the first call
        self._engine = engine if engine is not None else RKSCEngine.from_pretrained(model, progress=False)

    @classmethod
    def class_name(cls) -> str:
        return "RKSCLLM"

    @property
    def engine(self) -> RKSCEngine:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        return LLMMetadata(
            context_window=self.context_window or self._engine.context_window,
            num_output=self.max_new_tokens,
            is_chat_model=self._has_chat_template() if self.is_chat_model is None else self.is_chat_model,
            is_function_calling_model=self.is_function_calling_model,
            model_name=self._engine.model_name,
        )

    # -- prompt formatting ----------------------------------------------------------------------
    def _has_chat_template(self) -> bool:
        return bool(getattr(self._engine.tokenizer, "chat_template", None))

    def _completion_prompt(self, prompt: str, formatted: bool) -> EnginePrompt:
        """The one formatting of a completion prompt, shared by every complete path."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt.strip():
            raise ValueError("prompt must be a non-empty string")
        if formatted:
            return prompt
        if self.completion_to_prompt is not default_completion_to_prompt:
            return self.completion_to_prompt(prompt)
        if self._has_chat_template():
            # An instruct model answers a bare prompt best as a user turn of its own template.
            return to_engine_messages([ChatMessage(role=MessageRole.USER, content=prompt)], self.system_prompt)
        return f"{self.system_prompt}\n\n{prompt}" if self.system_prompt else prompt

    def _chat_prompt(self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None) -> EnginePrompt:
        engine_messages = to_engine_messages(messages, self.system_prompt)
        if tools:
            offer = tool_system_prompt([_tool_schema(t) for t in tools])
            if engine_messages[0]["role"] == "system":
                engine_messages[0] = {"role": "system", "content": engine_messages[0]["content"] + "\n\n" + offer}
            else:
                engine_messages.insert(0, {"role": "system", "content": offer})
        if self.messages_to_prompt is not generic_messages_to_prompt:
            # A user-supplied formatter wins; it sees LlamaIndex messages, as it expects.
            return self.messages_to_prompt([ChatMessage(role=m["role"], content=m["content"]) for m in engine_messages])
        if self._has_chat_template():
            return engine_messages
        return generic_messages_to_prompt([ChatMessage(role=m["role"], content=m["content"]) for m in engine_messages])

    # -- generation core ------------------------------------------------------------------------
    def _params(self, kwargs: dict[str, Any]) -> tuple[SamplingParams, int]:
        unknown = sorted(set(kwargs) - set(GENERATION_KWARGS))
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; per-call options are {list(GENERATION_KWARGS)}")
        merged = {name: kwargs.get(name, getattr(self, name)) for name in GENERATION_KWARGS}
        n = merged.pop("branches")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"branches must be an int >= 1, got {n!r}")
        if n > 1 and merged["temperature"] == 0:
            merged["temperature"] = self.branch_temperature
        stop = merged["stop"]
        merged["stop"] = (stop,) if isinstance(stop, str) else tuple(stop)
        return SamplingParams(**merged), n

    def _report(self, completion: Completion, n: int) -> dict[str, Any]:
        stats = self._engine.stats()
        emit(RKSCCacheReuseEvent(
            model_name=self._engine.model_name, num_prompt_tokens=completion.num_prompt_tokens,
            num_cached_tokens=completion.num_cached_tokens, num_branches=n,
            cache_tokens=stats.cache_tokens, cache_bytes=stats.cache_bytes,
        ))
        return {
            "prompt_tokens": completion.num_prompt_tokens,
            "cached_tokens": completion.num_cached_tokens,
            "completion_tokens": completion.num_generated_tokens,
            "finish_reason": completion.finish_reason,
        }

    def _report_decision(self, decision: BranchDecision) -> None:
        emit(RKSCBranchVoteEvent(
            num_branches=decision.num_branches, answer=decision.answer, votes=decision.votes,
            chosen_branch=decision.chosen_branch,
        ))
        emit(RKSCCGEESkipEvent(skipped=decision.cgee_skipped, reason=decision.cgee_reason, p=decision.p, lead=decision.lead))

    def _generate(
        self, prompt: EnginePrompt, kwargs: dict[str, Any], collector: list | None = None
    ) -> tuple[Completion, dict[str, Any]]:
        """One call; a multi-branch decision is appended to ``collector`` (the running
        ``RKSCBranchQueryEngine``'s list, captured by the caller in the caller's context)."""
        params, n = self._params(kwargs)
        if n == 1:
            completion = self._engine.generate(prompt, params)
            return completion, self._report(completion, 1)
        completions = self._engine.generate_branches(prompt, n, params)
        decision = decide(completions, self.answer_key, self.cgee)
        completion = completions[decision.chosen_branch]
        extra = self._report(completion, n)
        self._report_decision(decision)
        extra["rksc_branches"] = decision.as_dict()
        if collector is not None:
            collector.append(decision.as_dict())
        return completion, extra

    def _stream(self, prompt: EnginePrompt, kwargs: dict[str, Any]) -> Iterator[tuple[str, str, Completion | None, dict]]:
        """Yields ``(delta, text so far, completion or None, extra)``; the last item has the completion.

        Everything, including the events, runs in the iterating thread, so an async consumer that
        drains this in a worker never touches the engine from the event loop.
        """
        params, n = self._params(kwargs)  # checked before the first next(), like the engine does
        collector = current_collector()
        if n > 1:
            # A vote needs every branch finished, so a multi-branch answer arrives as one piece.
            def voted() -> Iterator[tuple[str, str, Completion | None, dict]]:
                completion, extra = self._generate(prompt, kwargs, collector)
                yield completion.text, completion.text, completion, extra

            return voted()
        chunks = self._engine.stream(prompt, params)

        def pieces() -> Iterator[tuple[str, str, Completion | None, dict]]:
            text = ""
            for chunk in chunks:
                text += chunk.text
                if chunk.completion is not None:
                    yield chunk.text, text, chunk.completion, self._report(chunk.completion, 1)
                elif chunk.text:
                    yield chunk.text, text, None, {}

        return pieces()

    # -- completion endpoints -------------------------------------------------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        completion, extra = self._generate(self._completion_prompt(prompt, formatted), kwargs, current_collector())
        return CompletionResponse(text=completion.text, raw={"completion": completion}, additional_kwargs=extra)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        pieces = self._stream(self._completion_prompt(prompt, formatted), kwargs)
        return (_completion_response(*piece) for piece in pieces)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        engine_prompt = self._completion_prompt(prompt, formatted)
        completion, extra = await run_in_thread(self._generate, engine_prompt, kwargs, current_collector())
        return CompletionResponse(text=completion.text, raw={"completion": completion}, additional_kwargs=extra)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseAsyncGen:
        engine_prompt = self._completion_prompt(prompt, formatted)
        self._params(kwargs)  # bad options raise here, at the await, not inside the stream

        async def gen() -> AsyncIterator[CompletionResponse]:
            async for piece in iterate_in_thread(lambda: self._stream(engine_prompt, kwargs)):
                yield _completion_response(*piece)

        return gen()

    # -- chat endpoints -------------------------------------------------------------------------
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None = None, **kwargs: Any) -> ChatResponse:
        """Chat through the model's chat template. ``tools`` (LlamaIndex tools or JSON schemas) are
        offered in the system message, and ``<tool_call>`` blocks in the reply become ``ToolCallBlock``s."""
        completion, extra = self._generate(self._chat_prompt(messages, tools), kwargs, current_collector())
        return _chat_response(completion.text, completion.text, completion, extra, bool(tools))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None = None, **kwargs: Any) -> ChatResponseGen:
        pieces = self._stream(self._chat_prompt(messages, tools), kwargs)
        return (_chat_response(*piece, parse_tools=bool(tools)) for piece in pieces)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None = None, **kwargs: Any) -> ChatResponse:
        engine_prompt = self._chat_prompt(messages, tools)
        completion, extra = await run_in_thread(self._generate, engine_prompt, kwargs, current_collector())
        return _chat_response(completion.text, completion.text, completion, extra, bool(tools))

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], tools: Sequence[Any] | None = None, **kwargs: Any
    ) -> ChatResponseAsyncGen:
        engine_prompt = self._chat_prompt(messages, tools)
        self._params(kwargs)

        async def gen() -> AsyncIterator[ChatResponse]:
            async for piece in iterate_in_thread(lambda: self._stream(engine_prompt, kwargs)):
                yield _chat_response(*piece, parse_tools=bool(tools))

        return gen()

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
        options = {k: v for k, v in kwargs.items() if k in GENERATION_KWARGS}
        return {"messages": messages, "tools": list(tools), **options}

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
    if isinstance(tool, dict):
        if not isinstance(tool.get("name"), str):
            raise ValueError(f"a tool schema dict needs a string 'name', got {tool!r}")
        return tool
    metadata = getattr(tool, "metadata", None)
    if metadata is None or not hasattr(metadata, "get_parameters_dict"):
        raise TypeError(f"tools must be LlamaIndex tools or JSON schema dicts, got {type(tool).__name__}")
    return {"name": metadata.get_name(), "description": metadata.description, "parameters": metadata.get_parameters_dict()}


def _completion_response(delta: str, text: str, completion: Completion | None, extra: dict) -> CompletionResponse:
    return CompletionResponse(text=text, delta=delta, raw={"completion": completion} if completion else None,
                              additional_kwargs=extra)


def _chat_response(
    delta: str, text: str, completion: Completion | None, extra: dict, parse_tools: bool = False
) -> ChatResponse:
    blocks: list[Any] = [TextBlock(text=text)]
    if parse_tools and completion is not None:
        # Calls are parsed once the text is complete; partial JSON mid-stream is not a call yet.
        prose, calls = parse_tool_calls(text)
        blocks = ([TextBlock(text=prose)] if prose else []) + calls
    return ChatResponse(
        message=ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks),
        delta=delta, raw={"completion": completion} if completion else None, additional_kwargs=extra,
    )
