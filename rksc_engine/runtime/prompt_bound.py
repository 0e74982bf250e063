"""How many characters of text one token can stand for, so that a prompt certain to exceed the
context window is refused by its length in characters, before the tokenizer spends its time on it.

Tokenizing is linear in the text, but for a prompt of a megabyte it takes seconds; the context window
is known before any of it. If a token covers at most ``L`` characters, a text of ``c`` characters
has at least ``ceil(c / L)`` tokens, whatever it says. ``max_chars_per_token`` finds ``L`` from
the tokenizer itself, and says None wherever no such bound holds, so the check never refuses a
prompt that would fit:

    * ``L`` is the longest entry of the vocabulary (added tokens included). A byte-level vocabulary
      writes one symbol per byte, and a character is at least one byte, so its entries' lengths
      bound characters too; markers such as ``##`` or ``<0x0A>`` only make the bound looser.
    * Every character must come out as at least one token, or as part of one: a byte-level
      pre-tokenizer or ``byte_fallback`` covers any text, and so does an unknown token emitted per
      unknown character. A BPE model with no unknown token silently drops characters it lacks, and
      WordPiece, WordLevel and Unigram turn a whole unknown word into one token: no bound.
    * Normalization happens first. Decomposing (NFD, NFKD), lowercasing and prepending never make a
      text shorter; composing (NFC, NFKC) joins at most four code points into one (the longest
      canonical decomposition is four); a literal ``Replace`` shrinks by at most its pattern's
      length over its replacement's. Anything else (stripping, removing accents or control
      characters, regular expressions) could delete without limit: no bound.
    * Pre-tokenizers only split the text, except those that drop what they split on (whitespace
      splitters, ``Split`` with behaviour ``removed``): no bound with those.

A tokenizer without the ``tokenizers`` backend (a "slow" one) gets no bound.
"""

from __future__ import annotations

import json
from typing import Any

# The most code points Unicode composition joins into one (NFC, NFKC): the longest canonical
# decomposition of a code point is four.
MAX_CODE_POINTS_COMPOSED = 4
_NON_SHRINKING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
# Pre-tokenizers that keep every character (they split, or map a character to one or more symbols).
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "FixedLength"})
_SPLITTING_PRE_TOKENIZERS = frozenset({"Split", "Punctuation"})  # keep unless told to remove the delimiter


def max_chars_per_token(tokenizer: Any) -> float | None:
    """The most characters of input text one token of ``tokenizer`` can stand for, counting the
    normalizer's worst shrinking (a product, so it may be fractional); None where no bound holds
    (see the module docstring)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    shrink = _normalizer_shrink(_state(backend.normalizer))
    pre_tokenizer = _state(backend.pre_tokenizer)
    if shrink is None or not _keeps_every_character(pre_tokenizer):
        return None
    if not _covers_every_character(backend.model, pre_tokenizer):
        return None
    longest = max((len(entry) for entry in tokenizer.get_vocab()), default=0)
    return longest * shrink if longest else None


def _state(component: Any) -> dict[str, Any] | None:
    """A normalizer's or pre-tokenizer's settings as ``tokenizers`` serialises them; None for none."""
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_shrink(state: dict[str, Any] | None) -> float | None:
    """By how much at most the normalizer makes a text shorter (1: never); None when it could delete
    characters without limit."""
    if state is None:
        return 1.0
    kind = state.get("type")
    if kind == "Sequence":
        factor = 1.0
        for part in state.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind in _NON_SHRINKING_NORMALIZERS:
        return 1.0
    if kind in _COMPOSING_NORMALIZERS:
        return float(MAX_CODE_POINTS_COMPOSED)
    if kind == "Replace":
        pattern, content = state.get("pattern", {}).get("String"), state.get("content", "")
        if not pattern or not content:  # a regular expression, or a deletion
            return None
        return max(1.0, len(pattern) / len(content))
    return None


def _keeps_every_character(state: dict[str, Any] | None) -> bool:
    if state is None:
        return True
    kind = state.get("type")
    if kind == "Sequence":
        return all(_keeps_every_character(part) for part in state.get("pretokenizers", []))
    if kind in _KEEPING_PRE_TOKENIZERS:
        return True
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return str(state.get("behavior", "")).lower() != "removed"
    return False


def _uses_byte_level(state: dict[str, Any] | None) -> bool:
    if state is None:
        return False
    if state.get("type") == "Sequence":
        return any(_uses_byte_level(part) for part in state.get("pretokenizers", []))
    return state.get("type") == "ByteLevel"


def _covers_every_character(model: Any, pre_tokenizer: dict[str, Any] | None) -> bool:
    """Whether every character of the (normalized) text ends up in some token: a byte-level
    alphabet or byte fallback, or a BPE unknown token emitted per character (not fused)."""
    if getattr(model, "byte_fallback", False) or _uses_byte_level(pre_tokenizer):
        return True
    if type(model).__name__ != "BPE":
        return False
    return model.unk_token is not None and not model.fuse_unk
