"""A step that is only whitespace is not a step: on the tiny seeded model, whose children often meet
the newline delimiter before writing anything, a tree search never returns or scores a blank step;
a child that met the delimiter first goes on to its next step; one that ended blank by another stop
string ends its parent's path."""

from __future__ import annotations

import pytest

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.config import EngineConfig, RSBCMConfig

PROMPT = "Q: 2+3?\nA:"
# With these seeds, plain seeded sampling of some child is a lone newline (the search used to keep it
# as a node with empty text and a score).
SEEDS = (0, 1, 2, 3)


def make_engine(model, tokenizer):
    return RKSCEngine(model, tokenizer, EngineConfig(rsbcm=RSBCMConfig(cache_budget_mb=64.0, block_size=4)))


def search(engine, seed, scorer="confidence", stop=(), breadth=3, depth=4):
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed, stop=stop)
    return engine.tree_search("What is 2+3?", breadth=breadth, depth=depth, params=params, prompt=PROMPT,
                              scorer=scorer)


def path_ids(engine, result, index):
    ids = engine.encode(PROMPT)
    for node in result.path(index)[1:]:
        ids += list(node.token_ids)
    return ids


def plain_children(engine, result, parent, seed, breadth=3, stop=()):
    """The parent's children as plain seeded sampling draws them, one step each (stopping at the newline)."""
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed + parent.index * breadth,
                            stop=("\n", *stop))
    return engine.generate_branches(path_ids(engine, result, parent.index), breadth, params)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_search_never_returns_or_scores_a_blank_step(tiny_model, tiny_tokenizer, seed):
    scored: list[str] = []

    def by_length(question, paths):
        scored.extend(paths)
        return [1.0 / (1 + len(p)) for p in paths]

    result = search(make_engine(tiny_model, tiny_tokenizer), seed, scorer=by_length)
    blank = [n.index for n in result.nodes[1:] if not n.text.strip()]
    assert blank == [], f"seed {seed}: nodes {blank} are blank steps:\n{result.format_tree()}"
    assert len(scored) == len(result.nodes) - 1, "every node is scored once, and nothing else is"
    for node in result.nodes[1:]:
        added = tiny_tokenizer.decode(node.token_ids, skip_special_tokens=True)
        assert added.strip(), f"node {node.index} adds nothing but whitespace to its parent's path"
    assert result.best_path[-1].index == 0 or result.best_path[-1].text.strip()


def test_a_child_that_meets_the_delimiter_first_goes_on_to_its_next_step(tiny_model, tiny_tokenizer):
    merged = 0
    for seed in SEEDS:
        engine = make_engine(tiny_model, tiny_tokenizer)
        result = search(engine, seed)
        plain = make_engine(tiny_model, tiny_tokenizer)
        for parent in (n for n in result.nodes if n.children):
            drawn = plain_children(plain, result, parent, seed)
            by_branch = {result.nodes[i].branch_index: result.nodes[i] for i in parent.children}
            for k, alone in enumerate(drawn):
                if alone.text.strip() or alone.finish_reason != "stop":
                    continue  # not blank, or not ended by the delimiter
                node = by_branch.get(k)
                assert node is not None, f"seed {seed}: branch {k} of node {parent.index} met the newline first and vanished"
                assert node.token_ids[:len(alone.token_ids)] == alone.token_ids, "the blank tokens stay on the path"
                assert len(node.token_ids) > len(alone.token_ids) and node.text.strip()
                rest = tiny_tokenizer.decode(node.token_ids[len(alone.token_ids):], skip_special_tokens=True)
                assert rest.lstrip().startswith(node.text.lstrip()), "the node's text is the step written after the blanks"
                merged += 1
    assert merged >= 4, f"the tiny model should meet the newline first in several children, merged {merged}"


def test_a_child_that_ends_blank_by_another_stop_string_ends_its_parents_path(tiny_model, tiny_tokenizer):
    ended = 0
    for seed in SEEDS:
        engine = make_engine(tiny_model, tiny_tokenizer)
        result = search(engine, seed, stop=(" ",), depth=3)
        plain = make_engine(tiny_model, tiny_tokenizer)
        for parent in (n for n in result.nodes[1:] if n.children or n.status == "expanded"):
            drawn = plain_children(plain, result, parent, seed, stop=(" ",))
            for k, alone in enumerate(drawn):
                raw = tiny_tokenizer.decode(alone.token_ids, skip_special_tokens=True)
                if alone.text.strip() or alone.finish_reason != "stop" or "\n" in raw:
                    continue  # only a child that a space ended before it wrote anything
                assert k not in {result.nodes[i].branch_index for i in parent.children}, "a blank child made a node"
                assert parent.is_final, f"seed {seed}: node {parent.index}'s path ended, yet it is not final"
                ended += 1
    assert ended >= 1, "the tiny model should end some child with a space before anything else"
    assert all(n.text.strip() for n in result.nodes[1:])
