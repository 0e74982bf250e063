"""One engine per model in the process, shared by every adapter (LangChain and LlamaIndex).

Frameworks build models freely (every ``ChatRKSC()`` in a chain, every ``RKSCLLM()`` in a LlamaIndex
``Settings`` assignment, a test fixture per test); loading the weights each time would cost seconds
and memory, and separate engines would not share a prefix cache. So adapters built without an
explicit engine take the process's engine for their ``(model, device, dtype)``.
"""

from __future__ import annotations

import threading
from pathlib import Path

from rksc_engine import EngineConfig, RKSCEngine

_shared_engines: dict[tuple[str, str, str], RKSCEngine] = {}
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
