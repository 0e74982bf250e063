"""rksc_engine.structured: tools, constrained decoding and JSON schemas."""
