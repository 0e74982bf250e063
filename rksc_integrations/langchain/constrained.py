"""Schema-constrained decoding now lives in the engine (``rksc_engine.structured.constrained``, with
tool calls built on it in ``rksc_engine.structured.tools``), shared by both adapters; this module keeps
the old import path working."""

from rksc_engine.structured.constrained import ConstrainedDecoder, decode_json
from rksc_engine.structured.json_schema import MAX_ITEMS
from rksc_engine.structured.tools import decode_tool_call

__all__ = ["MAX_ITEMS", "ConstrainedDecoder", "decode_json", "decode_tool_call"]
