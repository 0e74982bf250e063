"""Structured output: which JSON schemas can be guaranteed (``json_schema``), the schema-constrained JSON decoder (``constrained``) and the tool-calling protocol built on it (``tools``)."""
