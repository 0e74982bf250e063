"""One engine per model in the process, shared by every adapter (LangChain and LlamaIndex).

Frameworks build models freely (every ``ChatRKSC()`` in a chain, every ``RKSCLLM()`` in a LlamaIndex
``Settings`` assignment, a test fixture per test); loading the weights each time would cost seconds
and memory, and separate engines would not share a prefix cache. So adapters built without an
explicit engine take the process's engine for their ``(model, device, dtype)``.

A model behind a server has one configuration, the ``RemoteEngine``'s ``(base_url, model, api_key)``:
``shared_remote_engine`` keeps one per server (one connection pool, one capability probe), and
``remote_engine_from_openai_llm`` reads those three settings off an OpenAI client model a user
already has (LangChain's ``ChatOpenAI``, LlamaIndex's ``OpenAI``/``OpenAILike``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from rksc_engine import EngineConfig, RemoteEngine, RKSCEngine

_shared_engines: dict[tuple[str, str, str], RKSCEngine] = {}
_shared_remote_engines: dict[tuple[str, str | None, str | None], RemoteEngine] = {}
_shared_lock = threading.Lock()


def shared_engine(
    model: str | Path | None = None, device: str = "auto", dtype: str = "auto", config: EngineConfig | None = None
) -> RKSCEngine:
    """The process's engine for ``(model, device, dtype)``, loaded on first use.

    Args:
        model: A local Hugging Face model directory; None for the embedded default. Different
            spellings of one directory share an engine (the path is resolved).
        device: As ``RKSCEngine.from_pretrained``.
        dtype: As ``RKSCEngine.from_pretrained``.
        config: An explicit ``EngineConfig`` gets an engine of its own, since the shared one may
            have been built with other settings.
    """
    if config is not None:
        return RKSCEngine.from_pretrained(model, device=device, dtype=dtype, config=config, progress=False)
    key = (str(Path(model).resolve()) if model is not None else "", device, dtype)
    with _shared_lock:
        if key not in _shared_engines:
            _shared_engines[key] = RKSCEngine.from_pretrained(model, device=device, dtype=dtype, progress=False)
        return _shared_engines[key]


def shared_remote_engine(base_url: str, model: str | None = None, api_key: str | None = None) -> RemoteEngine:
    """The process's ``RemoteEngine`` for ``(base_url, model, api_key)``, built on first use."""
    key = (base_url.rstrip("/"), model, api_key)
    with _shared_lock:
        if key not in _shared_remote_engines:
            _shared_remote_engines[key] = RemoteEngine(base_url, model=model, api_key=api_key)
        return _shared_remote_engines[key]


# Where each OpenAI client model keeps the server's URL, the model and the key, by its field names.
_OPENAI_FIELDS = (("openai_api_base", "model_name", "openai_api_key"),  # LangChain's ChatOpenAI
                  ("api_base", "model", "api_key"))  # LlamaIndex's OpenAI and OpenAILike
OPENAI_DEFAULT_BASE_URL = "https://api.openai.com/v1"


def remote_engine_from_openai_llm(llm: Any) -> RemoteEngine | None:
    """The shared ``RemoteEngine`` for the server an OpenAI client model talks to (its base URL,
    model and API key), or None when ``llm`` is no OpenAI client model."""
    module = type(llm).__module__
    if not module.startswith(("langchain_openai", "llama_index.llms.openai")):
        return None
    for url_field, model_field, key_field in _OPENAI_FIELDS:
        if hasattr(llm, model_field) and hasattr(llm, url_field):
            key = getattr(llm, key_field, None)
            if key is not None and hasattr(key, "get_secret_value"):
                key = key.get_secret_value()
            return shared_remote_engine(getattr(llm, url_field) or OPENAI_DEFAULT_BASE_URL,
                                        getattr(llm, model_field) or None, key or None)
    return None
