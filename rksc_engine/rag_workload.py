"""Kept so that ``rksc_engine.rag_workload`` keeps importing: the code lives in ``rksc_engine.evaluation.rag_facts``."""

from .evaluation.rag_facts import FactParagraph, RagQuery, fact_corpus, load_rag_jsonl, rag_messages, rag_queries  # noqa: F401
