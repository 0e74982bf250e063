"""Tree search with early stop on the tiny seeded model: off by default (the tree unchanged); the
length and confidence rules really stop children, which are never kept, expanded, cached as live or
chosen; the totals match the tree; fewer tokens are decoded; batching does not change the tree; the
vote rules and bad values are refused before anything runs."""

import importlib

import pytest

from rksc_engine import EngineConfig, RKSCEngine, SamplingParams, SearchResult
from rksc_engine.config import RSBCMConfig
from rksc_engine.reasoning.early_stop import (
    AdaptiveConfig,
    AnsweredConfig,
    ConfidenceConfig,
    EarlyStopConfig,
    LengthConfig,
)

PROMPT = "Q: 2+3?\nA:"
# The tiny model rarely writes a newline, so its steps would all run to max_new_tokens and be the
# same length (nothing for the length rule to cut). "3" is one of its common characters: steps end
# at different lengths, as real reasoning steps do.
DELIMITER = "3"
PARAMS = SamplingParams(temperature=1.0, max_new_tokens=24, seed=0)
# The tail cut tuned to fire here: once a quarter of a node's children have finished, any sibling
# longer than that quartile length is stopped.
TIGHT_LENGTH = EarlyStopConfig(decided=False, length=LengthConfig(finished_fraction=0.25, factor=1.01))


def make_engine(model, tokenizer):
    config = EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=64.0, block_size=4))
    return RKSCEngine(model, tokenizer, config)


def search(engine, **kwargs):
    kwargs = {"breadth": 6, "depth": 3, "params": PARAMS, "prompt": PROMPT, "step_delimiter": DELIMITER, **kwargs}
    return engine.tree_search("What is 2+3?", **kwargs)


def tree_signature(result: SearchResult):
    # Scores are rounded: a batched forward's logprobs differ from a lone one's in the last bits.
    return [(n.parent, n.text, n.token_ids, round(n.branch_score, 6), n.status, n.is_final, n.finish_reason,
             tuple(n.children)) for n in result.nodes]


def path_ids(engine, result, index):
    ids = engine.encode(PROMPT)
    for node in result.path(index)[1:]:
        ids += list(node.token_ids)
    return ids


def test_early_stop_none_is_the_search_without_it(tiny_model, tiny_tokenizer):
    plain = search(make_engine(tiny_model, tiny_tokenizer))
    off = search(make_engine(tiny_model, tiny_tokenizer), early_stop=None)
    assert tree_signature(off) == tree_signature(plain)
    assert (off.answer, off.best_score, off.text) == (plain.answer, plain.best_score, plain.text)
    assert off.early_stop is None and plain.early_stop is None
    assert all(n.status != "stopped" for n in off.nodes)


def test_the_length_rule_stops_children_that_are_never_kept_expanded_or_chosen(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    result = search(engine, beam=3, early_stop=TIGHT_LENGTH)
    stopped = [n for n in result.nodes if n.status == "stopped"]
    assert stopped, "the tuned length rule should stop some children on the tiny model"
    assert any(n.status in ("expanded", "kept") for n in result.nodes[1:]), "some children should survive"
    on_best_path = {n.index for n in result.best_path}
    for node in stopped:
        assert node.children == [], f"stopped node {node.index} was expanded"
        assert node.index not in on_best_path, f"stopped node {node.index} is on the best path"
        assert node.finish_reason == "cancelled", "the length rule cuts children while they decode"
        assert node.token_ids, "a stopped child keeps the tokens it had generated"
        assert f"[{node.index}] {node.branch_score:.3f} stopped " in result.format_tree()
    # Each level's beam (its best 3) is taken from the children that were not stopped, whatever the
    # stopped ones scored.
    levels = {}
    for node in result.nodes[1:]:
        levels.setdefault(node.depth, []).append(node)
    for depth, nodes in levels.items():
        ranked = sorted((n for n in nodes if n.status != "stopped"), key=lambda n: (-n.branch_score, n.index))
        assert {n.index for n in ranked[:3]} == {n.index for n in nodes if n.status in ("expanded", "kept")}, (
            f"level {depth} kept the wrong nodes")
        assert all(n.status == "pruned" for n in ranked[3:])
    totals = result.early_stop
    assert totals["rules"] == ["length"]
    assert totals["expansions"] == result.num_expansions
    assert totals["children_launched"] == len(result.nodes) - 1
    assert totals["children_stopped"] == totals["children_cancelled"] == len(stopped)
    assert totals["stopped_by"] == {"length": len(stopped)}
    # Every launched token is counted: a child's tokens, plus an EOS the step text does not keep.
    assert totals["decode_tokens"] >= sum(len(n.token_ids) for n in result.nodes[1:])
    assert totals["decode_tokens"] == engine.stats().decode_tokens


def test_a_stopped_child_is_a_strict_prefix_of_the_same_seeded_child_run_to_its_end(tiny_model, tiny_tokenizer):
    """Seeds are unchanged: one level with and without early stop launches the same children, and
    the stopped ones are cut short of what they would have generated, so fewer tokens are decoded."""
    full_engine, early_engine = make_engine(tiny_model, tiny_tokenizer), make_engine(tiny_model, tiny_tokenizer)
    full = search(full_engine, depth=1, breadth=8)
    early = search(early_engine, depth=1, breadth=8, early_stop=TIGHT_LENGTH)
    assert len(early.nodes) == len(full.nodes) == 9
    stopped = 0
    for got, want in zip(early.nodes[1:], full.nodes[1:]):
        if got.status == "stopped":
            stopped += 1
            assert len(got.token_ids) < len(want.token_ids)
            assert want.token_ids[:len(got.token_ids)] == got.token_ids, f"node {got.index} drew other tokens"
        else:
            assert got.token_ids == want.token_ids and got.branch_score == want.branch_score
    assert stopped > 0
    assert early.early_stop["decode_tokens"] == early_engine.stats().decode_tokens
    assert early_engine.stats().decode_tokens < full_engine.stats().decode_tokens


def test_every_expansion_decodes_no_more_than_without_early_stop(tiny_model, tiny_tokenizer):
    """Deeper: each expanded node's children, regenerated without a monitor from the same path and
    seeds, are the stopped ones' supersets and the kept ones' equals."""
    engine = make_engine(tiny_model, tiny_tokenizer)
    result = search(engine, early_stop=TIGHT_LENGTH)
    plain = make_engine(tiny_model, tiny_tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop=(DELIMITER,))
    checked = 0
    for parent in (n for n in result.nodes if n.children):
        seed = PARAMS.seed + parent.index * 6
        alone = plain.generate_branches(path_ids(engine, result, parent.index), 6,
                                        SamplingParams(**{**vars(params), "seed": seed}))
        for i in parent.children:
            node = result.nodes[i]
            drawn = alone[node.branch_index]
            want = tuple(t for t in drawn.token_ids if t != 1)
            if node.status == "stopped":
                assert len(node.token_ids) < len(want) and want[:len(node.token_ids)] == node.token_ids
            elif not drawn.text.strip() and drawn.finish_reason == "stop":
                # A blank step is no step: the child went on from its blank tokens (test_tree_search_blank_steps).
                assert node.token_ids[:len(want)] == want and node.text.strip(), f"node {i} lost its blank tokens"
            else:
                assert node.token_ids == want, f"node {i} differs from plain seeded sampling"
            checked += 1
    assert checked == len(result.nodes) - 1


def test_a_stopped_childs_kv_is_never_annotated_as_a_live_path(tiny_model, tiny_tokenizer):
    engine = make_engine(tiny_model, tiny_tokenizer)
    calls = []
    annotate = engine.annotate_cache

    def spy(ids, *args, **kwargs):
        calls.append((tuple(ids), kwargs.get("branch_score")))
        return annotate(ids, *args, **kwargs)

    engine.annotate_cache = spy
    result = search(engine, early_stop=TIGHT_LENGTH)
    stopped = [n for n in result.nodes if n.status == "stopped"]
    assert stopped and calls
    for node in stopped:
        ids = tuple(path_ids(engine, result, node.index))
        assert not any(called[:len(ids)] == ids for called, _ in calls), f"stopped node {node.index} was annotated"


@pytest.mark.slow
def test_the_tree_is_the_same_expanded_together_or_one_by_one(tiny_model, tiny_tokenizer):
    for early_stop in (TIGHT_LENGTH, EarlyStopConfig(decided=False, confidence=ConfidenceConfig(warmup_branches=2,
                                                                                                 percentile=50.0))):
        together = search(make_engine(tiny_model, tiny_tokenizer), early_stop=early_stop, expand_together=True)
        alone = search(make_engine(tiny_model, tiny_tokenizer), early_stop=early_stop, expand_together=False)
        assert any(n.status == "stopped" for n in together.nodes), f"{early_stop}: nothing stopped"
        assert tree_signature(together) == tree_signature(alone)
        assert together.early_stop == alone.early_stop
        assert together.answer == alone.answer


def test_the_confidence_rule_leaves_out_children_below_the_threshold(tiny_model, tiny_tokenizer):
    result = search(make_engine(tiny_model, tiny_tokenizer), early_stop="confidence")
    stopped = [n for n in result.nodes if n.status == "stopped"]
    totals = result.early_stop
    assert stopped, "the confidence filter should leave some children out"
    assert totals["rules"] == ["confidence"]
    assert totals["stopped_by"] == {"confidence": len(stopped)} and totals["children_stopped"] == len(stopped)
    # A child that finished and was then left out by the filter is stopped, not cancelled.
    assert totals["children_cancelled"] == sum(n.finish_reason == "cancelled" for n in stopped)
    assert all(not n.children and n not in result.best_path for n in stopped)


@pytest.mark.slow
def test_a_passed_decided_flag_is_ignored(tiny_model, tiny_tokenizer, monkeypatch):
    """``EarlyStopConfig`` has ``decided=True`` by default; the monitors run without it (there is no
    vote to decide), and the tree is the one ``decided=False`` gives."""
    module = importlib.import_module("rksc_engine.reasoning.tree_search")

    configs = []

    class Recording(module.EarlyStopMonitor):
        def __init__(self, config, **kwargs):
            configs.append(config)
            super().__init__(config, **kwargs)

    monkeypatch.setattr(module, "EarlyStopMonitor", Recording)
    with_decided = search(make_engine(tiny_model, tiny_tokenizer), early_stop=EarlyStopConfig(
        length=TIGHT_LENGTH.length))
    assert configs and all(c == TIGHT_LENGTH for c in configs), "a monitor ran the decided rule"
    without = search(make_engine(tiny_model, tiny_tokenizer), early_stop=TIGHT_LENGTH)
    assert tree_signature(with_decided) == tree_signature(without)
    assert with_decided.early_stop == without.early_stop


def test_a_level_whose_children_are_all_stopped_ends_the_search_on_the_last_beam(tiny_model, tiny_tokenizer,
                                                                               monkeypatch):
    module = importlib.import_module("rksc_engine.reasoning.tree_search")

    level = {"expansions": 0}
    voting = module.EarlyStopMonitor.voting

    def nobody_at_depth_two(self, completions):  # the root's expansion votes; the next level's do not
        level["expansions"] += 1
        votes = voting(self, completions)
        return votes if level["expansions"] == 1 else [False] * len(completions)

    monkeypatch.setattr(module.EarlyStopMonitor, "voting", nobody_at_depth_two)
    result = search(make_engine(tiny_model, tiny_tokenizer), beam=2, final_marker=None, early_stop=TIGHT_LENGTH)
    assert max(n.depth for n in result.nodes) == 2
    assert all(n.status == "stopped" for n in result.nodes if n.depth == 2)
    best = result.best_path[-1]
    assert best.depth == 1 and best.status == "expanded"
    assert best.branch_score == max(n.branch_score for n in result.nodes if n.depth == 1 and n.status == "expanded")


@pytest.mark.parametrize(
    "early_stop,error,fragment",
    [
        ("decided", ValueError, "early_stop='decided' does not apply to tree search: .*not voted"),
        ("answered", ValueError, "early_stop='answered' does not apply"),
        ("adaptive", ValueError, "early_stop='adaptive' does not apply"),
        ("sometimes", ValueError, "early_stop must be"),
        (3, TypeError, "early_stop must be"),
        (LengthConfig(), TypeError, "early_stop must be"),
        (EarlyStopConfig(answered=AnsweredConfig(), length=LengthConfig()), ValueError,
         "early_stop.answered does not apply to tree search"),
        (EarlyStopConfig(decided=False, adaptive=AdaptiveConfig()), ValueError, "early_stop.adaptive does not apply"),
        (EarlyStopConfig(), ValueError, "early_stop has no rule that applies to tree search"),
    ],
)
def test_a_bad_early_stop_is_refused_before_anything_runs(tiny_model, tiny_tokenizer, early_stop, error, fragment):
    engine = make_engine(tiny_model, tiny_tokenizer)
    engine.generate(PROMPT, SamplingParams(max_new_tokens=4))
    before_bytes, before_nodes = engine.prefix_cache.total_bytes, engine.prefix_cache.num_nodes()
    before = engine.stats()
    touched = []
    encode, submit = engine.encode, engine.submit
    engine.encode = lambda *a, **k: touched.append("encode") or encode(*a, **k)
    engine.submit = lambda *a, **k: touched.append("submit") or submit(*a, **k)
    with pytest.raises(error, match=fragment):
        search(engine, early_stop=early_stop)
    assert touched == [], f"{touched} ran before early_stop was refused"
    assert engine.stats().requests == before.requests
    assert engine.stats().decode_tokens == before.decode_tokens
    assert (engine.prefix_cache.total_bytes, engine.prefix_cache.num_nodes()) == (before_bytes, before_nodes)
