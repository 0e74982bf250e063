"""LangChain adapters: ``ChatRKSC`` (chat model) and ``RKSCLLM`` (text-completion LLM)."""

from ._base import CACHE_EVENT
from .chat_models import ChatRKSC
from .llms import RKSCLLM

__all__ = ["CACHE_EVENT", "ChatRKSC", "RKSCLLM"]
