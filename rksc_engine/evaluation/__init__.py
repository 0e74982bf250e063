"""Workloads and offline measurement, not serving: seeded question generators (GSM8K style, the
difficulty ladder, multiple choice), JSONL readers for real datasets taken by path, the synthetic RAG
fact corpus, and the offline calibration of CGEE thresholds. Benchmarks, tests and the cookbook use
them; the engine and the reasoning layer never import them.
"""
