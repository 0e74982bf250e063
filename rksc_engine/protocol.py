"""What an engine offers, as protocols: ``Engine`` (generation, stats; ``RKSCEngine`` and
``RemoteEngine`` both satisfy it), ``LocalEngine`` (adds what needs the model in this process:
its tokenizer, its cache, its passes) and ``ServedEngine`` (an engine behind a server: what the
server provides, and the next-token log-probs the log-prob judge reads). Code built on engines (reasoning, structured output, the
adapters, the server) takes one of these, never a concrete engine class."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

from .config import EngineConfig, SamplingParams
from .kvcache.radix import RadixPrefixCache
from .results import Completion, EngineStats, ServerCapabilities, StreamChunk
from .runtime.handle import BranchMonitor, LogitsProcessor, RequestHandle

__all__ = ["Engine", "LocalEngine", "ServedEngine"]


@runtime_checkable
class Engine(Protocol):
    """Generation over one model, local or behind a server."""

    @property
    def model_name(self) -> str: ...

    def encode(self, prompt: Any) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]: ...

    def submit(self, prompt: Any, n: int = 1, params: SamplingParams | None = None, *, stream: bool = False,
               logits_processor: LogitsProcessor | None = None, monitor: BranchMonitor | None = None,
               max_branches: int | None = None) -> RequestHandle: ...

    def generate(self, prompt: Any, params: SamplingParams | None = None) -> Completion: ...

    def generate_branches(self, prompt: Any, n: int, params: SamplingParams | None = None) -> list[Completion]: ...

    def generate_many(self, prompts: Sequence[Any], params: SamplingParams | None = None) -> list[Completion]: ...

    def stream(self, prompt: Any, params: SamplingParams | None = None) -> Iterator[StreamChunk]: ...

    async def agenerate(self, prompt: Any, params: SamplingParams | None = None) -> Completion: ...

    async def agenerate_branches(self, prompt: Any, n: int, params: SamplingParams | None = None
                                 ) -> list[Completion]: ...

    async def agenerate_many(self, prompts: Sequence[Any], params: SamplingParams | None = None
                             ) -> list[Completion]: ...

    def astream(self, prompt: Any, params: SamplingParams | None = None) -> AsyncIterator[StreamChunk]: ...

    def stats(self) -> EngineStats: ...

    def reset_stats(self) -> None: ...

    def reason(self, question: str, **kwargs: Any) -> Any: ...

    async def areason(self, question: str, **kwargs: Any) -> Any: ...

    def tree_search(self, question: str, **kwargs: Any) -> Any: ...


@runtime_checkable
class LocalEngine(Engine, Protocol):
    """An engine whose model runs in this process (``RKSCEngine``): what the verifier, tree search
    and constrained decoding need beyond generation."""

    config: EngineConfig
    prefix_cache: RadixPrefixCache

    @property
    def model(self) -> Any: ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def context_window(self) -> int: ...

    @property
    def eos_token_ids(self) -> frozenset[int]: ...

    def render_chat(self, messages: list[dict[str, Any]], **template_kwargs: Any) -> str: ...

    def validate_request(self, prompt_ids: list[int], n: int, params: SamplingParams | None) -> SamplingParams: ...

    def exclusive(self) -> AbstractContextManager[Any]: ...

    def cached_prefix(self, prefix_ids: Sequence[int]) -> AbstractContextManager[Any]: ...

    def annotate_cache(self, token_ids: Sequence[int], *, start: int = 0, branch_score: float, depth: int) -> int: ...


@runtime_checkable
class ServedEngine(Engine, Protocol):
    """An engine whose model runs behind an OpenAI-compatible server (``RemoteEngine``): reasoning
    asks it what the server provides before it sends anything, and judges with its log-probs."""

    def capabilities(self, refresh: bool = False) -> ServerCapabilities: ...

    def top_next_tokens(self, prompts: Sequence[Any], num_top: int = 20) -> list[dict[str, float]]: ...
