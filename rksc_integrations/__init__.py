"""Adapters from rksc_engine to agent frameworks (LangChain, LlamaIndex).

They are thin translators: messages in, ``Completion``s out, events forwarded. The engine imports
nothing from here. Import the adapter you need, e.g. ``from rksc_integrations.llama_index import
RKSCLLM``; the subpackages import their framework only when loaded.
"""
