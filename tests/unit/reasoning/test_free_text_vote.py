"""The vote over free-text answers: ``answer_key``, the clustered vote, its config, its place in
``reason`` and in LlamaIndex's ``RKSCBranchQueryEngine``; and numeric answers voting as they always did."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

from rksc_engine import Completion, RKSCEngine
from rksc_engine.reasoning.answers import (
    VoteConfig,
    answer_key,
    answer_similarity,
    cluster_answers,
    extract_gsm8k_answer,
    majority_vote,
    resolve_vote,
    vote_answers,
)
from rksc_engine.reasoning.cgee import CGEEConfig
from rksc_engine.reasoning.early_stop import (
    AdaptiveConfig,
    EarlyStopConfig,
    LengthConfig,
    for_clustered_vote,
)
from tests.conftest import make_char_tokenizer, make_tiny_model


def completion(text: str, logprob: float = -0.5, index: int = 0) -> Completion:
    return Completion(text=text, token_ids=(1,), logprobs=(logprob,), finish_reason="eos", num_prompt_tokens=3,
                      branch_index=index)


def members(result) -> list[list[int]]:
    return [list(c.members) for c in result.clusters]


# -- answer_key -----------------------------------------------------------------------------------
@pytest.mark.parametrize(("texts", "key"), [
    (["The Eiffel Tower.", "eiffel tower", "  EIFFEL   Tower!", "\u201cThe Eiffel Tower\u201d"], "eiffel tower"),
    (["Yes.", "yes", "YES!"], "yes"),
    (["1,000", "1000", "+1000.0", "1000.00", "1. 1000"], "1000"),
    (["-5", "\u22125"], "-5"),
    (["3.50", "3.5"], "3.5"),
    (["It isn't open.", "it is not open"], "it is not open"),
    (["an apple", "Apple"], "apple"),
])
def test_answer_key_gives_equivalent_short_answers_one_key(texts, key):
    assert [answer_key(t) for t in texts] == [key] * len(texts)
    assert answer_key(key) == key, "the key of a key should be itself"


def test_answer_key_keeps_what_tells_answers_apart():
    keys = [answer_key(t) for t in ("5", "-5", "50", "0.5", "5 apples", "no", "yes", "1990-2000")]
    assert len(set(keys)) == len(keys), keys
    assert answer_key("1990-2000") == "1990 2000"
    assert answer_key("") is None and answer_key(" ...!? ") is None and answer_key("The.") is None


# -- similarity and clusters ----------------------------------------------------------------------
LIGHTHOUSE = "Who keeps the lighthouse?"


def test_the_clustered_vote_groups_paraphrases_and_separates_different_answers():
    texts = [
        "Tomas Reyes keeps the lighthouse.",
        "The lighthouse is kept by Mara Quill.",
        "Mara Quill keeps the lighthouse.",
        "It is Mara Quill, the keeper.",
        "The bakery opens at six.",
        "tomas reyes",
    ]
    result = vote_answers(texts, config=VoteConfig(method="cluster"), question=LIGHTHOUSE)
    assert result.method == "cluster" and result.threshold == 0.5
    assert members(result) == [[1, 2, 3], [0, 5], [4]], "paraphrases should share a cluster, other answers not"
    assert result.sizes == (3, 2, 1) and result.top_size == 3
    # The representative is the member most like the rest of its cluster; every member votes with its key.
    assert result.clusters[0].representative == 2 and result.clusters[0].answer == answer_key(texts[2])
    assert result.answers == tuple(c.answer for i in range(6) for c in result.clusters if i in c.members)
    exact = vote_answers([answer_key(t) for t in texts])
    assert exact.sizes == (1,) * 6, "on whole sentences an exact vote never agrees"


def test_answers_stating_different_numbers_or_only_one_negated_never_share_a_cluster():
    assert answer_similarity("The telescope was funded in 1931.", "The telescope was funded in 1872.") == 0.0
    assert answer_similarity("The observatory is open on Fridays.", "The observatory isn't open on Fridays.") == 0.0
    assert answer_similarity("It is open on Fridays.", "It is open on clear Fridays.") > 0.5
    # A number only one answer mentions is an ordinary word: it counts against the F1, no more.
    assert answer_similarity("Mara Quill.", "Mara Quill, keeper since 1872.") == pytest.approx(2 * 2 / (2 + 5))
    texts = ["It was funded in 1931.", "Funded in 1931 by the town.", "It was funded in 1872.", "It was funded in 1872!"]
    assert members(vote_answers(texts, config=VoteConfig(method="cluster"))) == [[0, 1], [2, 3]]


def test_the_questions_words_do_not_count_as_agreement():
    question = "In which month is the festival of Wexpel held?"
    texts = ["The festival of Wexpel is held in October.", "The festival of Wexpel is held in December.",
             "The Wexpel festival is held in October."]
    assert answer_similarity(texts[0], texts[1]) >= 0.5, "restated question words alone make them look alike"
    assert members(vote_answers(texts, config=VoteConfig(method="cluster"))) == [[0, 1, 2]]
    assert members(vote_answers(texts, config=VoteConfig(method="cluster"), question=question)) == [[0, 2], [1]]


def test_the_threshold_decides_how_alike_answers_must_be():
    texts = ["Mara Quill", "Mara Quill of Harrow Point"]  # F1 of content words 2 * 2 / (2 + 4) = 0.67
    assert answer_similarity(*texts) == pytest.approx(2 / 3)
    assert vote_answers(texts, config=VoteConfig("cluster", threshold=0.6)).sizes == (2,)
    assert vote_answers(texts, config=VoteConfig("cluster", threshold=0.7)).sizes == (1, 1)


def test_clusters_do_not_depend_on_how_equal_answers_are_spelled_and_ties_go_to_the_earlier_branch():
    keys = ["mara quill", None, "mara quill", "tomas reyes", "tomas reyes"]
    clusters = cluster_answers(keys, [0.2, 0.9, 0.5, 0.5, 0.5])
    assert [list(c.members) for c in clusters] == [[0, 2], [3, 4]]
    assert clusters[0].representative == 2, "among equals the most confident represents the cluster"
    assert clusters[1].representative == 3, "equal confidence: the earlier branch"
    assert cluster_answers([None, None]) == ()


# -- numeric answers vote as they always did ------------------------------------------------------
GSM8K_TEXTS = [
    "She pays 3 * 4 = 12 dollars.\n#### 12", "#### 1,200", "The answer is 12.", "So 12 - 24 = -12\n#### -12",
    "#### 120", "He has 12.5 left", "#### 12", "#### 1200", "Total: 120 apples", "no number here", "#### -12",
]


def test_numeric_answers_vote_exactly_as_before_in_both_votes():
    answers = [extract_gsm8k_answer(t) for t in GSM8K_TEXTS]
    winner, counts = majority_vote(answers)
    exact = vote_answers(answers)
    assert exact.method == "exact" and exact.answers == tuple(answers)
    assert {c.answer: c.size for c in exact.clusters} == dict(counts)
    assert exact.clusters[0].answer == winner
    clustered = vote_answers(answers, config=VoteConfig(method="cluster", threshold=0.01))
    assert members(clustered) == members(exact), "a clustered vote merged different numbers"
    assert [c.answer for c in clustered.clusters] == [c.answer for c in exact.clusters]


class _Done:
    """A request handle whose completions are already there."""

    def __init__(self, completions):
        self.completions = completions

    def result(self):
        return self.completions


def test_reason_votes_gsm8k_answers_exactly_as_before_by_default(monkeypatch):
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer())
    scripted = [completion(t, -0.1 * (i + 1), i) for i, t in enumerate(GSM8K_TEXTS)]
    monkeypatch.setattr(engine, "submit", lambda prompt, n, params: _Done(scripted[:n]))
    result = engine.reason("How much?", n=len(GSM8K_TEXTS), prompt="Q:", early_stop=None,
                           verifier=lambda q, c: [0.5] * len(c), cgee=CGEEConfig.off())
    answers = [extract_gsm8k_answer(t) for t in GSM8K_TEXTS]
    assert result.vote.method == "exact" and result.vote.answers == tuple(answers)
    assert result.votes == majority_vote(answers)[1]
    assert [b.answer for b in result.branches] == answers
    assert result.answer == "12"


def test_reason_with_a_clustered_vote_counts_clusters_and_runs_no_decided_rule(monkeypatch):
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer())
    texts = ["Mara Quill keeps it.", "It is kept by Mara Quill.", "Tomas Reyes.", "Mara Quill."]
    calls = []

    def submit(prompt, n, params, **kwargs):
        calls.append(kwargs)
        return _Done([completion(t, -0.3, i) for i, t in enumerate(texts)])

    monkeypatch.setattr(engine, "submit", submit)
    monkeypatch.setattr(engine, "generate_branches", lambda prompt, n, params: submit(prompt, n, params).result())
    result = engine.reason(LIGHTHOUSE, n=4, prompt="Q:", answer_extractor=answer_key, vote="cluster",
                           verifier=None, cgee=CGEEConfig(tau_conf=0.0, margin=0.0))
    assert result.vote.method == "cluster" and result.vote.sizes == (3, 1)
    assert result.early_stop is None and calls == [{}], "the decided rule should not run on a clustered vote"
    assert result.answer == result.vote.clusters[0].answer and result.votes == Counter({result.answer: 3, "tomas reyes": 1})
    assert [b.answer for b in result.branches] == [answer_key(t) for t in texts], "branches keep their own answers"


class _Done:
    """A finished request handle: ``result()`` gives the scripted completions."""

    def __init__(self, completions: list[Completion]) -> None:
        self.completions = completions

    def result(self) -> list[Completion]:
        return self.completions


# -- config ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"method": "fuzzy"}, ValueError, "vote.method must be one of"),
    ({"method": 3}, TypeError, "vote.method must be one of"),
    ({"threshold": 0.0}, ValueError, r"vote.threshold must be in \(0, 1\]"),
    ({"threshold": 1.5}, ValueError, "vote.threshold"),
    ({"threshold": math.nan}, ValueError, "vote.threshold"),
    ({"threshold": "0.5"}, TypeError, "vote.threshold must be a number"),
    ({"threshold": True}, TypeError, "vote.threshold must be a number"),
])
def test_a_bad_vote_config_names_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        VoteConfig(**kwargs)


def test_a_vote_is_named_or_configured_and_anything_else_is_refused():
    assert resolve_vote("cluster") == VoteConfig(method="cluster")
    assert resolve_vote(VoteConfig("cluster", 0.8)).threshold == 0.8
    with pytest.raises(TypeError, match="vote must be a VoteConfig"):
        resolve_vote(None)
    with pytest.raises(ValueError, match="vote.method"):
        resolve_vote("majority")
    with pytest.raises(ValueError, match="vote.threshold"):
        cluster_answers(["mara quill"], threshold=0.0)
    with pytest.raises(ValueError, match="confidences"):
        vote_answers(["a", "b"], [1.0], "cluster")


def test_a_bad_vote_is_refused_by_reason_before_anything_runs():
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer())
    with pytest.raises(ValueError, match="vote.method must be one of"):
        engine.reason("q?", n=2, prompt="Q:", vote="fuzzy")
    with pytest.raises(ValueError, match="adaptive counts votes"):
        engine.reason("q?", n=2, prompt="Q:", vote="cluster", early_stop="adaptive")
    assert engine.stats().decode_tokens == 0


def test_a_clustered_vote_keeps_only_the_early_stop_rules_that_judge_a_branch_alone():
    assert for_clustered_vote(None) is None
    assert for_clustered_vote(EarlyStopConfig()) is None, "decided alone: nothing left to run"
    length = EarlyStopConfig(length=LengthConfig())
    assert for_clustered_vote(length) == EarlyStopConfig(decided=False, length=LengthConfig())
    with pytest.raises(ValueError, match="adaptive"):
        for_clustered_vote(EarlyStopConfig(adaptive=AdaptiveConfig()))


# -- LlamaIndex: the branch query engine votes clusters by default ---------------------------------
llama_index = pytest.importorskip("llama_index.core")


def _lighthouse_engine(monkeypatch, texts: list[str], logprobs: list[float]) -> tuple[RKSCEngine, list]:
    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer())
    calls: list[dict[str, Any]] = []

    def submit(prompt, n, params, **kwargs):
        calls.append(kwargs)
        return _Done([completion(t, lp, i) for i, (t, lp) in enumerate(zip(texts, logprobs))][:n])

    monkeypatch.setattr(engine, "submit", submit)
    return engine, calls


BRANCH_TEXTS = [
    "Tomas Reyes keeps the lighthouse.",  # the most confident branch, alone in its answer
    "The lighthouse is kept by Mara Quill.",
    "Mara Quill keeps the lighthouse.",
    "It is Mara Quill, the keeper.",
    "The bakery opens at six.",
]
BRANCH_LOGPROBS = [-0.05, -0.5, -0.5, -0.5, -0.3]


def test_the_branch_query_engine_returns_the_representative_of_the_majority_cluster(monkeypatch):
    from llama_index.core.query_engine import CustomQueryEngine

    from rksc_integrations.llama_index import RKSCLLM, RKSCBranchQueryEngine

    class AskLLM(CustomQueryEngine):
        llm: Any

        def custom_query(self, query_str: str) -> str:
            return str(self.llm.complete(query_str))

    engine, calls = _lighthouse_engine(monkeypatch, BRANCH_TEXTS, BRANCH_LOGPROBS)
    llm = RKSCLLM(engine=engine, branches=5, verifier=None)
    response = RKSCBranchQueryEngine(AskLLM(llm=llm)).query(LIGHTHOUSE)
    final = response.metadata["rksc"]["final"]
    assert final["vote"]["method"] == "cluster"
    assert [list(c["members"]) for c in final["vote"]["clusters"]] == [[1, 2, 3], [0], [4]]
    assert final["votes"] == {"mara quill keeps lighthouse": 3, "tomas reyes keeps lighthouse": 1, "bakery opens at six": 1}
    assert final["chosen_branch"] == 2 and response.response == "Mara Quill keeps the lighthouse.", \
        "the answer should be the majority cluster's representative, not the most confident branch"
    assert final["early_stop"] is None and calls == [{}], "the decided rule should not run on a clustered vote"

    exact = RKSCBranchQueryEngine(AskLLM(llm=RKSCLLM(engine=engine, branches=5, verifier=None, vote="exact")))
    final = exact.query(LIGHTHOUSE).metadata["rksc"]["final"]
    assert final["vote"]["method"] == "exact" and set(final["votes"].values()) == {1}
    assert final["chosen_branch"] == 0, "an exact vote of five singletons goes to the most confident branch"
    assert calls[-1].get("monitor") is not None, "an exact vote keeps the decided rule"


def test_rksc_llm_refuses_a_bad_vote_at_construction():
    from rksc_integrations.llama_index import RKSCLLM

    engine = RKSCEngine(make_tiny_model(0), make_char_tokenizer())
    with pytest.raises(ValueError, match="vote.method must be one of"):
        RKSCLLM(engine=engine, vote="fuzzy")
    with pytest.raises(TypeError, match="vote must be a VoteConfig"):
        RKSCLLM(engine=engine, vote=3)
    assert RKSCLLM(engine=engine, vote=VoteConfig("cluster", 0.7)).vote.threshold == 0.7
