"""Schema-constrained decoding now lives in the engine (``rksc_engine.constrained``, with tool calls
built on it in ``rksc_engine.tools``), shared by both adapters; this module keeps the old import path
working."""

from rksc_engine.constrained import MAX_ITEMS, ConstrainedDecoder, decode_json
from rksc_engine.tools import decode_tool_call

__all__ = ["MAX_ITEMS", "ConstrainedDecoder", "decode_json", "decode_tool_call"]
