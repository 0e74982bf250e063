"""A text prompt that certainly overflows the context window is refused by its length in characters,
before the tokenizer spends its time on it; the bound comes from the tokenizer (the most characters
one token covers) and is never so tight that a prompt which fits is refused."""

from __future__ import annotations

import pytest
from conftest import make_byte_tokenizer, make_char_tokenizer, make_tiny_model
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.runtime.loading import default_model_dir
from rksc_engine.runtime.prompt_bound import MAX_CODE_POINTS_COMPOSED, max_chars_per_token

WINDOW = 512
LONGEST_BYTE_TOKEN = len("<eos>")  # the byte tokenizer's longest entries are its special tokens


class RecordingTokenizer(PreTrainedTokenizerFast):
    """Records the length of every text it encodes."""

    encoded_lengths: list[int]

    def _encode_plus(self, text, *args, **kwargs):
        if isinstance(text, str):
            self.encoded_lengths.append(len(text))
        return super()._encode_plus(text, *args, **kwargs)


@pytest.fixture
def engine():
    tokenizer = make_byte_tokenizer(RecordingTokenizer)
    tokenizer.encoded_lengths = []
    return RKSCEngine(make_tiny_model(vocab_size=len(tokenizer), max_positions=WINDOW), tokenizer)


def bpe_tokenizer(vocab, *, normalizer=None, pre_tokenizer=None, unk_token=None, fuse_unk=False):
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk_token, fuse_unk=fuse_unk))
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


VOCAB = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abab": 4}


def test_a_byte_level_vocabulary_bounds_characters_by_its_longest_entry():
    assert max_chars_per_token(make_byte_tokenizer()) == LONGEST_BYTE_TOKEN


@pytest.mark.parametrize("make, want", [
    # One unknown token per character: each still costs a token.
    (lambda: bpe_tokenizer(VOCAB, unk_token="<unk>"), 5),
    # Composition joins up to four code points into one, so a token stands for four times as many.
    (lambda: bpe_tokenizer(VOCAB, unk_token="<unk>", normalizer=normalizers.NFC()), 5 * MAX_CODE_POINTS_COMPOSED),
    # Replacing a 3-character pattern by 1 character shrinks the text threefold at most.
    (lambda: bpe_tokenizer(VOCAB, unk_token="<unk>", normalizer=normalizers.Replace("abc", "x")), 15),
    (lambda: bpe_tokenizer(VOCAB, unk_token="<unk>", normalizer=normalizers.Sequence(
        [normalizers.NFD(), normalizers.Lowercase()])), 5),
])
def test_the_bound_counts_unknown_tokens_and_the_normalizers_worst_shrinking(make, want):
    assert max_chars_per_token(make()) == want


@pytest.mark.parametrize("make", [
    make_char_tokenizer,  # BPE without an unknown token drops the characters it lacks
    lambda: bpe_tokenizer(VOCAB, unk_token="<unk>", fuse_unk=True),  # a run of unknowns is one token
    lambda: bpe_tokenizer(VOCAB, unk_token="<unk>", normalizer=normalizers.Strip()),
    lambda: bpe_tokenizer(VOCAB, unk_token="<unk>", normalizer=normalizers.StripAccents()),
    lambda: bpe_tokenizer(VOCAB, unk_token="<unk>", pre_tokenizer=pre_tokenizers.Whitespace()),
    lambda: bpe_tokenizer(VOCAB, unk_token="<unk>", pre_tokenizer=pre_tokenizers.Split(" ", "removed")),
    lambda: PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1},
                                                                               unk_token="[UNK]"))),
])
def test_no_bound_where_characters_can_vanish_or_merge_without_limit(make):
    assert max_chars_per_token(make()) is None


def test_the_default_models_tokenizer_covers_at_most_81_characters_a_token():
    path = default_model_dir()
    if not (path / "tokenizer.json").exists():
        pytest.skip("the default model is not installed")
    from transformers import AutoTokenizer

    # Its longest entry is a newline and 80 spaces; byte-level, with no normalizer.
    assert max_chars_per_token(AutoTokenizer.from_pretrained(path)) == 81


def test_a_text_over_the_bound_is_refused_before_the_tokenizer_sees_it(engine):
    tokenizer = engine.tokenizer
    text = "a" * (WINDOW * LONGEST_BYTE_TOKEN)  # at least WINDOW tokens: no room for one generated token
    with pytest.raises(ValueError, match=r"^prompt has at least 512 tokens .* context window is 512") as refused:
        engine.submit(text, 1, SamplingParams(max_new_tokens=4))
    assert "2,560 characters" in str(refused.value)
    with pytest.raises(ValueError, match=r"^prompt has at least"):
        engine.submit([{"role": "user", "content": text}], 1, SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match=r"^prompt has at least"):
        engine.generate_many(["fine", text], SamplingParams(max_new_tokens=4))
    assert max(tokenizer.encoded_lengths, default=0) < len(text), "a text the bound refuses was tokenized"
    assert engine.stats().requests == 0 and engine.stats().waiting_requests == 0


def test_a_prompt_at_the_bounds_edge_is_accepted_and_one_over_the_window_is_refused_by_its_tokens(engine):
    # The densest text there is: every token its longest entry, WINDOW - 1 of them: it must fit.
    densest = "<eos>" * (WINDOW - 1)
    assert len(engine.encode(densest)) == WINDOW - 1
    completion = engine.generate(densest, SamplingParams(max_new_tokens=1))
    assert completion.num_prompt_tokens == WINDOW - 1 and len(completion.token_ids) == 1
    # Within the character bound but over the window in tokens: tokenized, then refused exactly.
    over = "a" * (WINDOW + 10)
    with pytest.raises(ValueError, match=r"^prompt has 522 tokens; the model's context window is 512"):
        engine.submit(over, 1, SamplingParams(max_new_tokens=4))
    assert len(over) in engine.tokenizer.encoded_lengths


def test_engine_encode_itself_is_not_bounded(engine):
    # ``encode`` is the tokenizer's view of any text (counting tokens, say); only requests are bounded.
    text = "a" * (WINDOW * LONGEST_BYTE_TOKEN + 1)
    assert len(engine.encode(text)) == len(text)


def test_the_chat_template_is_what_is_bounded(engine):
    # A rendered chat adds the template's text around the messages; content just under the bound
    # renders over it, so the rendered text is what the check must read.
    content = "a" * (WINDOW * LONGEST_BYTE_TOKEN - 5)
    rendered = engine.render_chat([{"role": "user", "content": content}])
    assert len(rendered) >= WINDOW * LONGEST_BYTE_TOKEN
    with pytest.raises(ValueError, match=r"^prompt has at least"):
        engine.submit([{"role": "user", "content": content}], 1, SamplingParams(max_new_tokens=4))
    assert max(engine.tokenizer.encoded_lengths, default=0) < len(rendered)
