"""Adapters from rksc_engine to agent frameworks (LangChain, LlamaIndex).

They are thin translators: messages in, ``Completion``s out, events forwarded. The engine imports
nothing from here.
"""
