"""rksc_engine: multi-branch generation over a shared, cached prompt prefix on a local transformers model.

The engine knows nothing of LangChain, LlamaIndex or HTTP servers; ``rksc_integrations`` adapts it to
them and ``rksc_serve`` serves it. ``RemoteEngine`` is the same generation API over an OpenAI-compatible
server.
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
from .loading import DefaultModelNotInstalled
from .memory import ForwardOutOfMemoryError
from .prefix_cache import LRUPolicy, OmegaPolicy, PrefixMatch, RadixPrefixCache
from .remote import RemoteEngine, RemoteServerError
from .requests import RequestCancelled, RequestHandle
from .tree_search import SearchNode, SearchResult
from .types import ASKSDecision, Completion, EngineStats, StreamChunk

__all__ = [
    "ASKSConfig",
    "ASKSDecision",
    "CGEEConfig",
    "Completion",
    "DefaultModelNotInstalled",
    "EngineConfig",
    "EngineStats",
    "ForwardOutOfMemoryError",
    "LRUPolicy",
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
    "StreamChunk",
]
__version__ = "0.1.0"
