"""rksc_engine: multi-branch generation over a shared, cached prompt prefix on a local transformers model.

The engine knows nothing of LangChain or LlamaIndex; ``rksc_integrations`` adapts it to them.
"""

from .config import EngineConfig, PrefixCacheConfig, SamplingParams
from .engine import RKSCEngine
from .loading import DefaultModelNotInstalled
from .prefix_cache import LRUPolicy, PrefixMatch, RadixPrefixCache
from .types import Completion, EngineStats, StreamChunk

__all__ = [
    "Completion",
    "DefaultModelNotInstalled",
    "EngineConfig",
    "EngineStats",
    "LRUPolicy",
    "PrefixCacheConfig",
    "PrefixMatch",
    "RKSCEngine",
    "RadixPrefixCache",
    "SamplingParams",
    "StreamChunk",
]
__version__ = "0.1.0"
