"""rksc_engine: multi-branch generation over a shared, cached prompt prefix on a local transformers model.

The engine knows nothing of LangChain, LlamaIndex or HTTP servers; ``rksc_integrations`` adapts it to
them and ``rksc_serve`` serves it. ``RemoteEngine`` is the same generation and reasoning API over an
OpenAI-compatible server.
"""

from .config import (
    ASKSConfig,
    CGEEConfig,
    EngineConfig,
    PrefixCacheConfig,
    RSBCMConfig,
    SamplingParams,
    SchedulerConfig,
)
from .engine import Prefilled, RKSCEngine
from .kvcache.memory import ForwardOutOfMemoryError
from .kvcache.radix import LRUPolicy, OmegaPolicy, PrefixMatch, RadixPrefixCache
from .protocol import Engine, LocalEngine, ServedEngine
from .reasoning.tree_search import SearchNode, SearchResult
from .remote import RemoteEngine, RemoteServerError
from .results import ASKSDecision, Completion, EngineStats, ServerCapabilities, StreamChunk
from .runtime.cancel import CancelToken
from .runtime.handle import RequestCancelled, RequestHandle
from .runtime.loading import DefaultModelNotInstalled

__all__ = [
    "ASKSConfig",
    "ASKSDecision",
    "CGEEConfig",
    "CancelToken",
    "Completion",
    "DefaultModelNotInstalled",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "ForwardOutOfMemoryError",
    "LRUPolicy",
    "LocalEngine",
    "OmegaPolicy",
    "Prefilled",
    "PrefixCacheConfig",
    "PrefixMatch",
    "RKSCEngine",
    "RSBCMConfig",
    "RadixPrefixCache",
    "RemoteEngine",
    "RemoteServerError",
    "RequestCancelled",
    "RequestHandle",
    "SamplingParams",
    "SchedulerConfig",
    "SearchNode",
    "SearchResult",
    "ServedEngine",
    "ServerCapabilities",
    "StreamChunk",
]
__version__ = "0.1.0"
