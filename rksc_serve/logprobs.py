"""Log-probabilities in OpenAI's shapes, and the top-k of each position for ``top_logprobs``.

The engine gives, per generated token, the chosen token's log-probability under the model's
unmodified distribution (``Completion.logprobs``). The k most likely alternatives are not part of a
``Completion``; ``TopLogprobsRecorder`` is a per-request logits processor that records them from the
same unmodified logits and returns the logits untouched, so the answer does not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rksc_engine import Completion, StreamChunk

TopTokens = list[tuple[int, float]]  # (token id, logprob), most likely first


class TopLogprobsRecorder:
    """A logits processor that records the ``k`` most likely next tokens at every decode step.

    The scheduler calls it with each active branch's generated ids so far and their logits (B, V);
    finished branches leave the batch, so a row is not a branch. A step is therefore keyed by the
    ids generated before it (their length and hash): two branches with the same ids so far share
    one distribution, and ``top(token_ids)`` reads a finished branch's positions back by its ids.
    """

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = k
        self._steps: dict[tuple[int, int], TopTokens] = {}

    def __call__(self, token_ids_per_row: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # (B, V)
        values, indices = logprobs.topk(min(self.k, logprobs.shape[-1]), dim=-1)  # (B, k)
        for ids, row_ids, row_values in zip(token_ids_per_row, indices.tolist(), values.tolist()):
            self._steps[_key(ids)] = list(zip(row_ids, row_values))
        return logits

    def top(self, token_ids: Sequence[int]) -> list[TopTokens]:
        """The recorded top-k at each position of a branch that generated ``token_ids``."""
        ids = list(token_ids)
        return [self._steps.get(_key(ids[:i]), []) for i in range(len(ids))]


def _key(ids: Sequence[int]) -> tuple[int, int]:
    return len(ids), hash(tuple(ids))


class TokenText:
    """Each token's own text (as OpenAI's ``logprobs`` give it), decoded once per id."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._tokenizer.decode([token_id])
            self._texts[token_id] = text
        return text


def _entry(token_text: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    text = token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def chat_logprobs(completion: Completion | StreamChunk, token_text: TokenText, top: list[TopTokens] | None
                  ) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion: ``{"content": [{token, logprob, bytes, top_logprobs}]}``,
    for a whole completion or for the tokens of one streamed chunk.

    Every generated token is listed, the EOS or stop-completing token included, so
    ``exp(mean(logprob))`` is the engine's ``Completion.confidence``.
    """
    content = []
    for i, (token_id, logprob) in enumerate(zip(completion.token_ids, completion.logprobs)):
        entry = _entry(token_text, token_id, logprob)
        entry["top_logprobs"] = [_entry(token_text, t, lp) for t, lp in top[i]] if top else []
        content.append(entry)
    return {"content": content}


def completion_logprobs(completion: Completion | StreamChunk, token_text: TokenText, top: list[TopTokens] | None
                        ) -> dict[str, Any]:
    """``choices[i].logprobs`` of a legacy completion: ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (a ``{token: logprob}`` dict per position) and ``text_offset``."""
    tokens = [token_text(t) for t in completion.token_ids]
    offsets, offset = [], 0
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": list(completion.logprobs),
        "top_logprobs": [{token_text(t): lp for t, lp in top[i]} if top else {} for i in range(len(tokens))],
        "text_offset": offsets,
    }
