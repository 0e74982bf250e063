"""Tree search on the tiny seeded model: the cache budget holds in a deep search, the tree does not
depend on budget or policy, children equal plain seeded sampling, the beam keeps the best, and the
cache is told each step's score and depth."""

import pytest

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams, SearchResult
from rksc_engine.config import RSBCMConfig

TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4
PROMPT = "Q: 2+3?\nA:"
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=6, seed=0)


def make_engine(model, tokenizer, budget_tokens=None, policy="omega", enabled=True):
    budget_mb = 64.0 if budget_tokens is None else budget_tokens * TINY_BYTES_PER_TOKEN / 2**20
    config = EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=budget_mb, block_size=4, policy=policy, enabled=enabled))
    return RKSCEngine(model, tokenizer, config)


def search(engine, **kwargs):
    kwargs = {"breadth": 3, "depth": 6, "params": PARAMS, "prompt": PROMPT, **kwargs}
    return engine.tree_search("What is 2+3?", **kwargs)


def tree_signature(result: SearchResult):
    return [(n.parent, n.token_ids, round(n.branch_score, 6), n.status, n.is_final) for n in result.nodes]


def path_ids(engine, result, index):
    ids = engine.encode(PROMPT)
    for node in result.path(index)[1:]:
        ids += list(node.token_ids)
    return ids


@pytest.mark.parametrize("policy", ["omega", "lru"])
def test_peak_cache_bytes_never_exceed_the_budget_in_a_deep_search(tiny_model, tiny_tokenizer, policy):
    engine = make_engine(tiny_model, tiny_tokenizer, budget_tokens=40, policy=policy)
    cache = engine.prefix_cache
    insert, checked = cache.insert, []

    def checked_insert(*args, **kwargs):
        stored = insert(*args, **kwargs)
        assert cache.total_bytes <= cache.budget_bytes, f"{cache.total_bytes} B held, budget {cache.budget_bytes} B"
        checked.append(stored)
        return stored

    cache.insert = checked_insert
    result = search(engine, depth=6)
    assert max(n.depth for n in result.nodes) >= 6, "the search should go deep"
    assert len(checked) >= result.num_expansions, "every expansion allocates through insert"
    assert cache.peak_bytes <= cache.budget_bytes
    assert cache.evicted_tokens > 0, "a 40-token budget must force eviction in this search"
    cache.check_consistency()
    assert cache.evictable_bytes == cache.total_bytes, "a node stayed locked after the search"


def test_the_search_makes_the_same_tree_under_any_budget_or_policy(tiny_model, tiny_tokenizer):
    unbounded = make_engine(tiny_model, tiny_tokenizer)
    reference = search(unbounded)
    for policy in ("omega", "lru"):
        engine = make_engine(tiny_model, tiny_tokenizer, budget_tokens=30, policy=policy)
        result = search(engine)
        assert tree_signature(result) == tree_signature(reference), f"{policy}: eviction changed the tree"
        assert result.answer == reference.answer
        assert engine.stats().prompt_tokens_computed > unbounded.stats().prompt_tokens_computed, (
            f"{policy}: a 30-token budget should force recomputation")


def test_every_child_equals_plain_seeded_sampling_of_its_parent_path(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    result = search(engine, depth=3)
    cold = make_engine(tiny_model, tiny_tokenizer, enabled=False)
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop=("\n",))
    merged = 0
    for node in result.nodes[1:]:
        parent = result.nodes[node.parent]
        alone = cold.generate(path_ids(engine, result, parent.index),
                              SamplingParams(**{**vars(params), "seed": PARAMS.seed + parent.index * 3 + node.branch_index}))
        drawn = tuple(t for t in alone.token_ids if t != 1)
        if not alone.text.strip() and alone.finish_reason == "stop":
            # A blank step is no step: the child went on from its blank tokens (test_tree_search_blank_steps).
            assert node.token_ids[:len(drawn)] == drawn and node.text.strip(), f"node {node.index} differs"
            merged += 1
        else:
            assert drawn == node.token_ids, f"node {node.index} differs"
    assert merged < len(result.nodes) - 1, "most children should be plain seeded steps"


def test_a_seeded_search_is_reproducible_and_the_seed_matters(tiny_model, tiny_tokenizer):
    first = search(make_engine(tiny_model, tiny_tokenizer), depth=3)
    again = search(make_engine(tiny_model, tiny_tokenizer), depth=3)
    other = search(make_engine(tiny_model, tiny_tokenizer), depth=3,
                   params=SamplingParams(temperature=1.0, max_new_tokens=6, seed=1))
    assert tree_signature(first) == tree_signature(again)
    assert tree_signature(first) != tree_signature(other)


def test_each_level_keeps_exactly_its_best_beam_children(tiny_model, tiny_tokenizer):
    result = search(make_engine(tiny_model, tiny_tokenizer), beam=2)
    levels = {}
    for node in result.nodes[1:]:
        levels.setdefault(node.depth, []).append(node)
    for depth, nodes in levels.items():
        ranked = sorted(nodes, key=lambda n: (-n.branch_score, n.index))
        kept = {n.index for n in ranked[:2]}
        assert {n.index for n in nodes if n.status != "pruned"} == kept, f"level {depth} kept the wrong nodes"
        assert all(n.status in ("expanded", "kept") for n in ranked[:2])
        assert len([n for n in nodes if n.status == "expanded"]) <= 2
    best = result.best_path[-1]
    pool = [n for n in result.nodes if n.is_final and n.status == "kept"] or \
        [n for n in result.nodes if n.status == "kept"]
    assert best.branch_score == max(n.branch_score for n in pool)


def test_confidence_scores_are_the_path_geometric_mean_probability(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    result = search(engine, depth=2)
    cold = make_engine(tiny_model, tiny_tokenizer, enabled=False)
    node = next(n for n in result.nodes if n.depth == 2)
    ids = engine.encode(PROMPT)
    # Score the whole path's generated tokens by teacher forcing: exp(mean logprob).
    import torch

    full = ids + [t for n in result.path(node.index)[1:] for t in n.token_ids]
    with torch.no_grad():
        logits = cold.model(torch.tensor([full])).logits[0].log_softmax(-1)
    generated = range(len(ids), len(full))
    mean = sum(logits[p - 1, full[p]].item() for p in generated) / len(generated)
    assert node.branch_score == pytest.approx(torch.tensor(mean).exp().item(), rel=1e-4)


def test_a_callable_scorer_decides_the_ranking(tiny_model, tiny_tokenizer):
    calls = []

    def prefer_short(question, paths):
        calls.append(list(paths))
        return [1.0 / (1 + len(p)) for p in paths]

    result = search(make_engine(tiny_model, tiny_tokenizer), depth=3, scorer=prefer_short)
    assert calls and all(len(c) > 0 for c in calls)
    for node in result.nodes[1:]:
        assert node.branch_score == pytest.approx(1.0 / (1 + len(_path_text(tiny_tokenizer, result, node.index))))


def _path_text(tokenizer, result, index):
    return tokenizer.decode([t for n in result.path(index)[1:] for t in n.token_ids], skip_special_tokens=True)


def test_the_judge_scorer_gives_probabilities(tiny_model, tiny_tokenizer):
    result = search(make_engine(tiny_model, tiny_tokenizer), depth=2, breadth=2, scorer="judge")
    assert all(0.0 <= n.branch_score <= 1.0 for n in result.nodes[1:])
    assert len({round(n.branch_score, 9) for n in result.nodes[1:]}) > 1, "the judge should tell paths apart"


def _cache_nodes_for(cache, ids, start):
    """Cache nodes holding positions [start, len(ids)) of ``ids``."""
    node, pos, out = cache.root, 0, []
    while pos < len(ids):
        node = node.children.get(ids[pos])
        if node is None:
            break
        if node.start >= start:
            out.append(node)
        pos = node.end
    return out


@pytest.mark.parametrize("demote", [True, False])
def test_the_cache_holds_each_step_with_its_score_and_depth_and_dead_steps_at_zero(tiny_model, tiny_tokenizer, demote):
    engine = make_engine(tiny_model, tiny_tokenizer)
    result = search(engine, beam=2, demote_pruned=demote)
    cache = engine.prefix_cache
    alive = {n.index for i in (n.index for n in result.nodes if n.status == "kept") for n in result.path(i)}
    owners = {}
    for node in result.nodes[1:]:
        if node.status != "expanded":
            continue
        ids = path_ids(engine, result, node.index)
        start = len(ids) - len(node.token_ids)
        for cache_node in _cache_nodes_for(cache, ids, start):
            owners.setdefault(id(cache_node), (cache_node, []))[1].append(node)
    assert owners, "expanded steps should be in the cache"
    checked = 0
    for cache_node, search_nodes in owners.values():
        if len(search_nodes) != 1:
            continue  # KV shared by sibling steps (a split): the live sibling's score wins
        node = search_nodes[0]
        expected = node.branch_score if (node.index in alive or not demote) else 0.0
        assert cache_node.depth == node.depth, f"node {node.index}: depth {cache_node.depth} in the cache"
        assert cache_node.branch_score == pytest.approx(expected), f"node {node.index}: wrong score in the cache"
        checked += 1
    assert checked >= 3
    if demote:
        assert any(n.status == "expanded" and n.index not in alive for n in result.nodes), "no dead branch checked"


def test_a_step_with_the_final_marker_ends_its_path(tiny_model, tiny_tokenizer):
    first = search(make_engine(tiny_model, tiny_tokenizer), depth=2)
    marker = next(ch for ch in first.nodes[1].text if ch.isalnum())
    result = search(make_engine(tiny_model, tiny_tokenizer), depth=4, final_marker=marker, answer_extractor=lambda t: t)
    marked = [n for n in result.nodes[1:] if marker in n.text]
    assert marked and all(n.is_final and n.status != "expanded" for n in marked)
    assert result.best_path[-1].is_final
    assert result.answer == _path_text(tiny_tokenizer, result, result.best_path[-1].index)


@pytest.mark.parametrize(
    "kwargs,error,fragment",
    [
        ({"breadth": 0}, ValueError, "breadth must be >= 1"),
        ({"depth": 0}, ValueError, "depth must be >= 1"),
        ({"beam": 0}, ValueError, "beam must be >= 1"),
        ({"breadth": 2.0}, TypeError, "breadth must be an int"),
        ({"scorer": "nope"}, ValueError, "scorer must be"),
        ({"scorer": 3}, TypeError, "scorer must be"),
        ({"params": SamplingParams(max_new_tokens=4)}, ValueError, "temperature > 0"),
        ({"params": {"temperature": 1}}, TypeError, "params"),
        ({"step_delimiter": ""}, ValueError, "step_delimiter"),
        ({"answer_extractor": "roman"}, ValueError, "answer_extractor"),
    ],
)
def test_invalid_search_arguments_raise_before_touching_the_cache(tiny_model, tiny_tokenizer, kwargs, error, fragment):
    engine = make_engine(tiny_model, tiny_tokenizer)
    engine.generate(PROMPT, SamplingParams(max_new_tokens=4))
    before_bytes, before_nodes = engine.prefix_cache.total_bytes, engine.prefix_cache.num_nodes()
    before = engine.stats()
    with pytest.raises(error, match=fragment):
        search(engine, **kwargs)
    assert engine.prefix_cache.total_bytes == before_bytes
    assert engine.prefix_cache.num_nodes() == before_nodes
    assert engine.stats().requests == before.requests
    with pytest.raises(ValueError, match="question"):
        engine.tree_search("  ", params=PARAMS)


def test_the_cache_bytes_trace_has_one_entry_per_expansion_and_stays_inside_the_budget(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer, budget_tokens=40)
    result = search(engine, depth=4)
    assert len(result.cache_bytes_trace) == result.num_expansions
    assert all(0 < b <= engine.prefix_cache.budget_bytes for b in result.cache_bytes_trace)
