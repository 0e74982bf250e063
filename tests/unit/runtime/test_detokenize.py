"""A branch's text grows a token at a time, equal to decoding the whole branch at every token it
commits, and the decoding a step does stays bounded however long the branch gets."""

from __future__ import annotations

import random

import pytest
from transformers import PreTrainedTokenizerFast

from rksc_bench.step_overhead import no_end_of_text
from rksc_engine import EngineConfig, RKSCEngine, SamplingParams
from rksc_engine.runtime.detokenize import Detokenizer, TextState
from rksc_engine.runtime.loading import default_model_dir
from tests.conftest import make_byte_tokenizer, make_char_tokenizer, make_tiny_model


class RespellingTokenizer(PreTrainedTokenizerFast):
    """Drops a space before a full stop, as WordPiece's clean-up does: the text of a window of
    tokens is then not a piece of the whole text."""

    def decode(self, token_ids, *args, **kwargs):
        return super().decode(token_ids, *args, **kwargs).replace(" .", ".")


def default_tokenizer():
    from transformers import AutoTokenizer

    path = default_model_dir()
    if not (path / "tokenizer.json").exists():
        pytest.skip("the default model is not converted on this machine")
    return AutoTokenizer.from_pretrained(path)


def grow(detokenizer: Detokenizer, ids: list[int]) -> None:
    """Grow a text over ``ids`` a token at a time: each committed text equals the whole decode,
    and the text at the end does too."""
    text, state = "", TextState()
    for end in range(1, len(ids) + 1):
        text = detokenizer.extend(text, ids[:end], state)
        if state.read == end:
            assert text == detokenizer.tokenizer.decode(ids[:end], skip_special_tokens=True), end
    assert detokenizer.whole(text, ids, state) == detokenizer.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("make", [make_byte_tokenizer, make_char_tokenizer, default_tokenizer],
                         ids=["byte-level", "characters", "default-model"])
def test_random_token_streams_grow_into_the_whole_decode(make):
    tokenizer = make()
    detokenizer = Detokenizer(tokenizer)
    assert detokenizer.incremental
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(20):  # random ids split multi-byte characters across tokens and mix in specials
        grow(detokenizer, [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))])
    grow(detokenizer, list(tokenizer("Café — 東京 🙂, 3 * 4 = 12.", add_special_tokens=False)["input_ids"]))


def test_a_tokenizer_that_respells_across_tokens_decodes_whole_every_step():
    tokenizer = make_byte_tokenizer(RespellingTokenizer)
    detokenizer = Detokenizer(tokenizer)
    assert not detokenizer.incremental
    grow(detokenizer, list(tokenizer("Hello , world . It 's ok . Yes .", add_special_tokens=False)["input_ids"]))


@pytest.mark.parametrize("cleanup", [False, True], ids=["incremental", "whole-decode"])
def test_engine_texts_are_the_decode_of_their_tokens(cleanup):
    tokenizer = make_byte_tokenizer(RespellingTokenizer if cleanup else None)
    engine = RKSCEngine(make_tiny_model(vocab_size=258), tokenizer, EngineConfig())
    assert engine.scheduler.detokenizer.incremental is not cleanup
    params = SamplingParams(max_new_tokens=40, temperature=1.0, seed=3)
    for completion in engine.generate_branches("Q: 2+3? A:", 6, params):
        assert completion.text == tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
    stopped = engine.generate_branches("Q: 2+3? A:", 6, SamplingParams(max_new_tokens=40, temperature=1.0,
                                                                       seed=3, stop=("e",)))
    for completion in stopped:
        whole = tokenizer.decode(list(completion.token_ids), skip_special_tokens=True)
        assert completion.text == whole.split("e")[0]


def test_a_step_decodes_a_bounded_window_of_a_long_branch():
    model = make_tiny_model(vocab_size=258, max_positions=1024)
    with no_end_of_text(model, make_byte_tokenizer()) as tokenizer:
        engine = RKSCEngine(model, tokenizer, EngineConfig())
        detokenizer = engine.scheduler.detokenizer
        decode, decoded = detokenizer._decode, []
        detokenizer._decode = lambda ids: decoded.append(len(ids)) or decode(ids)
        tokens = 300
        completion = engine.generate("x", SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=1))
    assert len(completion.token_ids) == tokens, "the branch ended early: pick another seed"
    # Whole decodes every step would read tokens * (tokens + 1) / 2 = 45,150 tokens.
    assert sum(decoded) < 12 * tokens
