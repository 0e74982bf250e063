"""``RKSCLLM``: the rksc engine as a LangChain text-completion LLM.

Drop-in for ``HuggingFacePipeline``: the prompt string goes to the model as is (no chat template),
and only new text comes back, never the prompt echoed. ``batch`` sends its prompts through the engine
in one call, so a prefix they share is prefilled once; ``n > 1`` keeps every branch as its own
``Generation``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult
from pydantic import ConfigDict

from rksc_engine import Completion, SamplingParams, StreamChunk
from rksc_integrations._common import check_prompt_text
from rksc_integrations.langchain._base import RKSCFields


class RKSCLLM(RKSCFields, BaseLLM):
    """A LangChain LLM backed by an ``RKSCEngine``.

    Args:
        engine: An engine to use (exclusive with ``model``). With neither, the embedded default is
            loaded once per process and shared.
        **fields: The fields below. ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``
            and ``n`` can also be passed per call; other call keyword arguments raise ``TypeError``.
    """

    model_config = ConfigDict(populate_by_name=True, extra="forbid", arbitrary_types_allowed=True, protected_namespaces=())

    @property
    def _llm_type(self) -> str:
        return "rksc"

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> dict[str, Any]:
        return {**self.ls_params(stop, kwargs), "ls_model_type": "llm"}

    def _generate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        for i, prompt in enumerate(prompts):
            check_prompt_text(prompt, f"prompts[{i}]")
        params, n = self.sampling_params(kwargs, stop)
        if self.streaming and len(prompts) == 1 and n == 1:
            return self._generate_by_streaming(prompts[0], stop, run_manager, **kwargs)
        if n == 1:
            # One engine call for the whole batch: a prefix the prompts share is computed once.
            per_prompt = [[c] for c in self.engine.generate_many(prompts, params)]
        else:  # every prompt submitted before any is waited on: the scheduler decodes them together
            handles = [self.engine.submit(p, n, params) for p in prompts]
            per_prompt = [h.result() for h in handles]
        return self._llm_result(per_prompt, n, run_manager)

    def _llm_result(self, per_prompt: list[list[Completion]], n: int,
                    run_manager: CallbackManagerForLLMRun | None) -> LLMResult:
        generations = []
        for completions in per_prompt:
            report = self.report(completions[0], n, run_manager)
            generations.append([self._generation(c, report) for c in completions])
        return LLMResult(generations=generations, llm_output=_llm_output(per_prompt, self.model_name))

    def _generate_by_streaming(
        self, prompt: str, stop: list[str] | None, run_manager: CallbackManagerForLLMRun | None, **kwargs: Any
    ) -> LLMResult:
        final: GenerationChunk | None = None
        for chunk in self._stream(prompt, stop, run_manager, **kwargs):
            final = chunk if final is None else final + chunk
        assert final is not None
        return LLMResult(generations=[[final]], llm_output={"model_name": self.model_name})

    async def _agenerate(
        self,
        prompts: list[str],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> LLMResult:
        # Awaited from the engine's scheduler (no thread): all prompts are submitted at once.
        sync_manager = run_manager.get_sync() if run_manager else None
        for i, prompt in enumerate(prompts):
            check_prompt_text(prompt, f"prompts[{i}]")
        params, n = self.sampling_params(kwargs, stop)
        if self.streaming and len(prompts) == 1 and n == 1:
            return await asyncio.to_thread(self._generate, prompts, stop, sync_manager, **kwargs)
        handles = [self.engine.submit(p, n, params) for p in prompts]
        return self._llm_result([await h for h in handles], n, sync_manager)

    def _stream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[GenerationChunk]:
        params = self._stream_params(prompt, stop, kwargs)
        for piece in self.engine.stream(prompt, params):
            chunk = self._chunk(piece, run_manager)
            if chunk is None:
                continue
            # BaseLLM.stream leaves token callbacks to the model.
            if run_manager is not None:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(
        self,
        prompt: str,
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[GenerationChunk]:
        params = self._stream_params(prompt, stop, kwargs)
        async for piece in self.engine.astream(prompt, params):  # from the scheduler, no thread
            chunk = self._chunk(piece, run_manager.get_sync() if run_manager else None)
            if chunk is None:
                continue
            if run_manager is not None:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _stream_params(self, prompt: str, stop: list[str] | None, kwargs: dict[str, Any]) -> SamplingParams:
        """The checked parameters of a stream, which produces one generation."""
        check_prompt_text(prompt)
        params, n = self.sampling_params(kwargs, stop)
        if n != 1:
            raise ValueError(f"streaming produces one generation; n must be 1, got {n}")
        return params

    def _chunk(self, piece: StreamChunk, run_manager: CallbackManagerForLLMRun | None) -> GenerationChunk | None:
        """The chunk of a streamed piece (None for an empty one); the last carries the generation's
        info, and its events are reported on ``run_manager``."""
        if piece.completion is not None:
            report = self.report(piece.completion, 1, run_manager)
            info = self._generation(piece.completion, report).generation_info
            return GenerationChunk(text=piece.text, generation_info=info)
        return GenerationChunk(text=piece.text) if piece.text else None

    def _generation(self, completion: Completion, report: dict[str, Any]) -> Generation:
        info = {**self.generation_info(completion), "usage": self.usage(completion), "rksc_cache_reuse": report}
        return Generation(text=completion.text, generation_info=info)


def _llm_output(per_prompt: list[list[Completion]], model_name: str) -> dict[str, Any]:
    return {
        "model_name": model_name,
        "token_usage": {
            "prompt_tokens": sum(c[0].num_prompt_tokens for c in per_prompt),
            "completion_tokens": sum(x.num_generated_tokens for c in per_prompt for x in c),
            "cached_tokens": sum(c[0].num_cached_tokens for c in per_prompt),
        },
    }
