"""A branch's text, grown a token at a time without decoding the whole branch again each step.

Decoding every generated token list in full costs a step time that grows with the branch's length,
for every row. Instead each branch keeps two offsets into its tokens, as streaming detokenizers do:
the text of ``tokens[prefix:read]`` is already in the branch's text, and the tokens after ``read``
are not yet. A step decodes only ``tokens[prefix:]`` (a few tokens of context, so a tokenizer that
spells a token differently after another, SentencePiece's leading space say, gets the context it
needs) and appends what it adds beyond ``tokens[prefix:read]``. A tail that decodes to a replacement
character (a multi-byte character split across tokens) waits for the token that completes it.

Not every tokenizer decodes a window the way it decodes the whole (one that cleans up spaces across
token boundaries, say). ``Detokenizer`` checks its tokenizer once on sample texts and falls back to
decoding the whole branch each step when the two ways disagree, so a branch's text is always what
``tokenizer.decode(token_ids, skip_special_tokens=True)`` gives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Texts the check decodes both ways, a token at a time: words, digits and arithmetic, punctuation
# after spaces, newlines and indentation, multi-byte characters (accents, CJK, an emoji).
_SAMPLES = (
    "Tom has 3 bags of 4 apples, so 3 * 4 = 12. The answer is 12.",
    "Hello , world ! It 's a test ... isn't it ? (yes) [no] {maybe}",
    "def f(x):\n    return x  # twice\n\n\tdone; 1,234.56 - 7/8 = -0.3%",
    "Café naïve résumé — 東京 に 行く 🙂 ok",
)


@dataclass
class TextState:
    """How much of a branch's tokens its text covers.

    Attributes:
        prefix: Where the decoded window starts (the context kept before ``read``).
        read: Tokens ``[0, read)`` are in the text.
    """

    prefix: int = 0
    read: int = 0


class Detokenizer:
    """Keeps branches' texts equal to ``tokenizer.decode(token_ids, skip_special_tokens=True)``.

    Args:
        tokenizer: The model's ``transformers`` tokenizer.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        samples = _sample_ids(tokenizer)  # None: a tokenizer that cannot encode them is not checked
        self._decode = _fastest_decode(tokenizer, samples)
        self.incremental = samples is not None and _windows_decode_as_whole(samples, self._decode)

    def extend(self, text: str, token_ids: list[int], state: TextState) -> str:
        """The text of ``token_ids`` given ``text``, the text of the tokens ``state`` says it
        covers; advances ``state``."""
        if not self.incremental:
            return self._decode(token_ids)
        return _extend(self._decode, text, token_ids, state)

    def whole(self, text: str, token_ids: list[int], state: TextState) -> str:
        """The text of all of ``token_ids``, for a branch that ends here: ``text`` when it covers
        them all, else decoded in full (a last character left incomplete shows as the tokenizer
        decodes it)."""
        if state.read == len(token_ids) and self.incremental:
            return text
        state.prefix, state.read = 0, len(token_ids)
        return self._decode(token_ids)


def _extend(decode: Any, text: str, token_ids: list[int], state: TextState) -> str:
    before = decode(token_ids[state.prefix:state.read])
    after = decode(token_ids[state.prefix:])
    if len(after) <= len(before) or after.endswith("\ufffd") or not after.startswith(before):
        # Nothing printable yet (half a character, a special token), or the new token respells its
        # context: wait for more tokens before committing.
        return text
    state.prefix, state.read = state.read, len(token_ids)
    return text + after[len(before):]


def _sample_ids(tokenizer: Any) -> list[list[int]] | None:
    """The sample texts' token ids, or None when the tokenizer cannot encode them."""
    try:
        return [list(tokenizer(sample, add_special_tokens=False)["input_ids"]) for sample in _SAMPLES]
    except Exception:  # noqa: BLE001 - the checks that need them then choose the plain way
        return None


def _fastest_decode(tokenizer: Any, samples: list[list[int]] | None) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, or the Rust tokenizer's own decode when
    it gives the same text on every prefix of the sample texts: it skips the Python wrapper's
    per-token conversions, which cost more than the decode itself for a few tokens."""
    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer of a fast tokenizer
    if backend is None or not hasattr(backend, "decode") or samples is None:
        return decode
    try:
        vocab = len(tokenizer)
        checked = [*samples, list(range(min(vocab, 512))), [vocab - 1, 0, vocab // 2]]
        if all(backend.decode(ids[:end], skip_special_tokens=True) == decode(ids[:end])
               for ids in checked for end in range(len(ids) + 1)):
            return lambda ids: backend.decode(ids, skip_special_tokens=True)
    except Exception:  # noqa: BLE001 - a backend we cannot check is not used
        pass
    return decode


def _windows_decode_as_whole(samples: list[list[int]], decode: Callable[[list[int]], str]) -> bool:
    """Whether growing a text a token at a time (``_extend``) gives the whole decode at every token
    of the sample texts (``samples``, their ids), except while a character is still incomplete."""
    try:
        for ids in samples:
            text, state = "", TextState()
            for end in range(1, len(ids) + 1):
                text = _extend(decode, text, ids[:end], state)
                whole = decode(ids[:end])
                if state.read == end and text != whole:
                    return False
            if text != decode(ids):
                return False
    except Exception:  # noqa: BLE001 - a tokenizer we cannot check decodes whole every step
        return False
    return True
