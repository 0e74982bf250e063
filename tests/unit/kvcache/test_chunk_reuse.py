"""Retrieved-context reuse on tiny seeded models: segmentation that never changes tokenisation, chunk
KV reused at new positions, only exact KV in the radix cache, the exact fallbacks, and the adapters."""

import json

import pytest
import torch
from conftest import make_char_tokenizer, make_tiny_model

from rksc_engine import ASKSConfig, EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.config import RSBCMConfig
from rksc_engine.evaluation.rag_facts import fact_corpus, load_rag_jsonl, rag_messages, rag_queries
from rksc_engine.kvcache.chunk_reuse import segment_spans
from rksc_engine.results import ChunkReuseDecision

CHUNKS = [
    "Alpha facts: the river is long and wide and cold in the winter.",
    "Beta facts: the mountain is tall and steep and snowy all year.",
    "Gamma facts: the city is old and busy and loud at every hour.",
    "Delta facts: the forest is dark and deep and quiet at night.",
]


def rag_prompt(order, question="what is long?"):
    return "Use the context.\n\n" + "\n\n".join(CHUNKS[i] for i in order) + "\n\nQuestion: " + question


def chunk_engine(model, tokenizer, **asks):
    settings = dict(min_reuse_tokens=16, recompute_fraction=0.25) | asks
    return RKSCEngine(model, tokenizer, EngineConfig(asks=ASKSConfig.for_retrieved_context(**settings)))


def hf_greedy(model, tokenizer, prompt, max_new_tokens):
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return tuple(out[0, ids.shape[1]:].tolist())


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(num_layers=4)  # deep enough for the two-layer deviation probe


@pytest.fixture(scope="module")
def tokenizer():
    return make_char_tokenizer()


def assert_cache_holds_only_exact_kv(engine, model):
    """Every root-to-leaf path of the radix cache holds what a fresh prefill of its tokens gives."""
    from transformers import DynamicCache

    cache = engine.prefix_cache
    leaves = [node for node in cache._iter_nodes() if not node.children]
    assert leaves
    for leaf in leaves:
        tokens, node = [], leaf
        while node is not cache.root:
            tokens[:0] = list(node.token_ids)
            node = node.parent
        stored = cache.match_prefix(tokens).kv
        fresh = DynamicCache(config=model.config)
        with torch.no_grad():
            model(torch.tensor([tokens]), past_key_values=fresh, use_cache=True)
        want = torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in fresh.layers])
        torch.testing.assert_close(stored, want, atol=1e-4, rtol=1e-4)


# -- segmentation ---------------------------------------------------------------------------------
def test_segments_tile_the_prompt_and_cut_after_each_separator(tokenizer):
    text = rag_prompt([0, 1, 2])
    encoded = tokenizer(text, return_offsets_mapping=True)
    spans = segment_spans(text, encoded["offset_mapping"], "\n\n")
    assert spans[0][0] == 0 and spans[-1][1] == len(encoded["input_ids"])
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    pieces = [tokenizer.decode(encoded["input_ids"][a:b]) for a, b in spans]
    assert pieces == ["Use the context.\n\n", *(CHUNKS[i] + "\n\n" for i in (0, 1, 2)), "Question: what is long?"]


def test_a_cut_inside_a_token_moves_to_the_next_token_boundary():
    # One token spans "x\n\ny" (chars 3-7): the cut after its separator goes after that token.
    text = "ab x\n\ny cd\n\nef"
    offsets = [(0, 2), (2, 3), (3, 7), (7, 10), (10, 12), (12, 14)]
    assert segment_spans(text, offsets, "\n\n") == [(0, 3), (3, 5), (5, 6)]


def test_prompt_segments_come_from_the_prompts_own_tokenisation(model, tokenizer):
    engine = chunk_engine(model, tokenizer)
    for prompt in (rag_prompt([2, 0, 1]), [{"role": "user", "content": rag_prompt([1, 2])}]):
        ids = engine.encode(prompt)
        spans = engine.prompt_segments(prompt, ids)
        assert spans is not None and len(spans) >= 4
        assert [t for a, b in spans for t in ids[a:b]] == ids
    assert engine.prompt_segments(ids, ids) is None  # token ids: no text to cut
    plain = RKSCEngine(model, tokenizer)
    assert plain.prompt_segments(rag_prompt([0, 1]), plain.encode(rag_prompt([0, 1]))) is None


# -- reuse ----------------------------------------------------------------------------------------
def test_shuffled_chunks_are_reused_and_cost_far_fewer_prompt_tokens(model, tokenizer):
    reuse, exact = chunk_engine(model, tokenizer), RKSCEngine(model, tokenizer)
    params = SamplingParams(max_new_tokens=4)
    for engine in (reuse, exact):
        engine.generate(rag_prompt([0, 1, 2]), params)
        engine.reset_stats()
    completion = reuse.generate(rag_prompt([2, 0, 1], "what is tall?"), params)
    exact.generate(rag_prompt([2, 0, 1], "what is tall?"), params)
    decision = completion.asks
    assert isinstance(decision, ChunkReuseDecision) and decision.reused
    assert decision.chunks_reused == 2 and decision.chunks_cached == 0  # chunk 2 follows the header exactly
    assert decision.probe_tokens == decision.reused_tokens + decision.recomputed_tokens
    assert decision.recomputed_tokens == round(0.25 * decision.probe_tokens)
    stats = reuse.stats()
    assert stats.chunk_reuse_prompts == 1 and stats.chunks_reused == 2
    assert stats.prompt_tokens_computed * 2 < exact.stats().prompt_tokens_computed
    assert completion.num_cached_tokens == decision.prefix_tokens + decision.reused_tokens


@pytest.mark.slow
def test_only_exact_kv_enters_the_radix_cache(model, tokenizer):
    engine = chunk_engine(model, tokenizer)
    params = SamplingParams(max_new_tokens=3)
    for order in ([0, 1, 2], [2, 0, 1], [1, 3, 0], [3, 2, 1]):
        assert engine.generate(rag_prompt(order), params).asks is not None
    assert engine.stats().chunk_reuse_prompts >= 3
    engine.prefix_cache.check_consistency()
    assert_cache_holds_only_exact_kv(engine, model)
    # And so a later token-exact hit is still exact: a prompt seen before, with reuse off for it.
    again = RKSCEngine(model, tokenizer)
    prompt = "Use the context.\n\n" + CHUNKS[3] + "\n\n" + CHUNKS[2] + " and more"
    assert engine.generate(prompt, params).token_ids == again.generate(prompt, params).token_ids


@pytest.mark.parametrize("setting", [{"recompute_fraction": 1.0}, {"max_mean_deviation": 0.0}])
def test_full_recompute_and_a_closed_gate_are_token_identical_to_transformers(model, tokenizer, setting):
    engine = chunk_engine(model, tokenizer, **setting)
    params = SamplingParams(max_new_tokens=6)
    engine.generate(rag_prompt([0, 1, 2]), params)
    prompt = rag_prompt([1, 2, 0], "what is old?")
    completion = engine.generate(prompt, params)
    assert completion.token_ids == hf_greedy(model, tokenizer, prompt, 6)
    assert completion.asks is None or not completion.asks.reused
    assert_cache_holds_only_exact_kv(engine, model)


def test_reuse_stays_within_the_cache_budget(model, tokenizer):
    budget_mb = 0.5
    engine = RKSCEngine(model, tokenizer, EngineConfig(
        asks=ASKSConfig.for_retrieved_context(min_reuse_tokens=16), rsbcm=RSBCMConfig(cache_budget_mb=budget_mb)))
    params = SamplingParams(max_new_tokens=2)
    for seed in range(6):
        order = torch.randperm(4, generator=torch.Generator().manual_seed(seed)).tolist()
        engine.generate(rag_prompt(order, f"question {seed}?"), params)
        assert engine.prefix_cache.total_bytes <= budget_mb * 2**20
        engine.prefix_cache.check_consistency()
    assert engine.prefix_cache.locked_bytes == 0, "a radix node was left locked"


def test_reuse_needs_asks_enabled_and_a_separator():
    with pytest.raises(ValueError, match=r"asks\.reuse_chunks needs asks\.enabled"):
        ASKSConfig(reuse_chunks=True)
    with pytest.raises(ValueError, match=r"asks\.chunk_separator"):
        ASKSConfig(enabled=True, reuse_chunks=True, chunk_separator="")
    with pytest.raises(TypeError, match=r"asks\.reuse_chunks"):
        ASKSConfig(enabled=True, reuse_chunks="yes")


# -- workload -------------------------------------------------------------------------------------
def test_the_rag_workload_is_seeded_and_each_query_holds_its_answer():
    corpus = fact_corpus(20, seed=3)
    assert corpus == fact_corpus(20, seed=3) and len({p.name for p in corpus}) == 20
    queries = rag_queries(corpus, 10, chunks_per_query=4, seed=1)
    assert queries == rag_queries(corpus, 10, chunks_per_query=4, seed=1)
    for query in queries:
        assert len(query.chunks) == 4 == len(set(query.chunks))
        asked = [p for p in corpus if f" {p.name} " in f" {query.question.rstrip('?')} "]
        assert len(asked) == 1 and asked[0].text in query.chunks and query.answer in asked[0].text
        content = rag_messages(query)[-1]["content"]
        assert all(f"\n\n{c}\n\n" in content for c in query.chunks)
    with pytest.raises(ValueError, match="chunks_per_query"):
        rag_queries(corpus, 2, chunks_per_query=21)


def test_rag_jsonl_loads_and_names_the_bad_row(tmp_path):
    path = tmp_path / "rag.jsonl"
    path.write_text(json.dumps({"chunks": ["a", "b"], "question": "q?", "answer": "a"}) + "\n"
                    + json.dumps({"context": ["c"], "question": "r?"}) + "\n")
    loaded = load_rag_jsonl(path)
    assert [q.chunks for q in loaded] == [("a", "b"), ("c",)] and loaded[1].answer == ""
    path.write_text(json.dumps({"chunks": "not a list", "question": "q"}) + "\n")
    with pytest.raises(ValueError, match=r"rag\.jsonl:1: 'chunks'"):
        load_rag_jsonl(path)


# -- adapters -------------------------------------------------------------------------------------
def test_llama_index_llm_sets_retrieved_context_apart_and_reports_the_reuse(model, tokenizer):
    from llama_index.core import PromptTemplate

    from rksc_integrations.llama_index import RKSCLLM

    with pytest.raises(ValueError, match="reuse_retrieved_context"):
        RKSCLLM(engine=RKSCEngine(model, tokenizer), reuse_retrieved_context=True, is_chat_model=False)
    engine = chunk_engine(model, tokenizer)
    llm = RKSCLLM(engine=engine, reuse_retrieved_context=True, is_chat_model=False, max_new_tokens=3)
    # The dashed lines of LlamaIndex's QA template would glue the first and last node to their neighbours.
    template = PromptTemplate("Context:\n-----\n{context_str}\n-----\nQuery: {query_str}\nAnswer: ")
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        llm.predict(template, context_str="\n\n".join(CHUNKS[i] for i in order), query_str="what is long?")
    assert engine.stats().chunks_reused >= 3  # every node of the second call but the first was reused


def test_no_chunk_is_reused_over_kv_freed_out_of_a_sliding_window(model, tokenizer, monkeypatch):
    from rksc_engine.kvcache.radix import PrefixMatch

    reuse = chunk_engine(model, tokenizer)
    params = SamplingParams(max_new_tokens=4)
    reuse.generate(rag_prompt([0, 1, 2]), params)
    reuse.reset_stats()
    # As if every match had lost its sliding layers' KV before its last window: chunks are read at
    # other positions, where that KV would be seen, so none may be reused.
    monkeypatch.setattr(PrefixMatch, "window_freed", property(lambda match: bool(match.segments)))
    completion = reuse.generate(rag_prompt([2, 0, 1], "what is tall?"), params)
    assert completion.asks is None and reuse.stats().chunks_reused == 0
    assert completion.token_ids == hf_greedy(model, tokenizer, rag_prompt([2, 0, 1], "what is tall?"), 4)
