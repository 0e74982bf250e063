"""What a branch's sampled tokens become for its caller: text with stop strings cut, stream chunks
that never show part of a stop string or half a character, and the final ``Completion``.

The scheduler calls these once per sampled token; they change only the branch and the request's
channel, never the batch or the cache.
"""

from __future__ import annotations

from collections.abc import Collection

from ..config import SamplingParams
from ..results import Completion, StreamChunk
from .detokenize import Detokenizer
from .request import Branch, Request


def append_token(branch: Branch, token: int, logprob: float, params: SamplingParams, max_new: int,
                 eos_token_ids: Collection[int], detokenizer: Detokenizer, watched: bool = True) -> None:
    """Record ``token`` on ``branch`` and set its ``finish_reason`` when it ends the branch: an end
    of sequence token, a stop string in the text (the text is cut before it), or ``max_new`` tokens.
    The text is the decode of the tokens before an end of sequence token.

    ``watched`` False (a request whose text nobody reads while it runs: no stream, no stop string,
    no monitor) leaves the text to be decoded once, when the branch ends."""
    branch.token_ids.append(token)
    branch.logprobs.append(logprob)
    if len(branch.token_ids) > branch.skip_tokens:
        branch.pending_ids.append(token)
    if token not in eos_token_ids:
        if watched:
            branch.text = detokenizer.extend(branch.text, branch.token_ids, branch.text_state)
        if params.stop:
            cut = first_stop(branch.text, params.stop, branch.stop_checked_chars)
            branch.stop_checked_chars = len(branch.text)
            if cut is not None:
                branch.text = branch.text[:cut]
                branch.finish_reason = "stop"
                return
    end_if_done(branch, max_new, eos_token_ids, detokenizer)


def end_if_done(branch: Branch, max_new: int, eos_token_ids: Collection[int], detokenizer: Detokenizer) -> None:
    """End ``branch`` if its latest token ends it: an end of sequence token (``"eos"``, its text the
    decode of the tokens before it), else ``max_new`` tokens (``"length"``). ``append_token`` ends a
    branch this way after its stop strings; the scheduler, for a row recorded without it."""
    token_ids = branch.token_ids
    if token_ids[-1] in eos_token_ids:
        branch.finish_reason = "eos"
        branch.text = detokenizer.whole(branch.text, token_ids[:-1], branch.text_state)
    elif len(token_ids) >= max_new:
        branch.finish_reason = "length"
        branch.text = detokenizer.whole(branch.text, token_ids, branch.text_state)


def finish_text(branch: Branch, detokenizer: Detokenizer) -> None:
    """Give ``branch``, stopped before its tokens' text was made (an unwatched branch cancelled by
    its caller), the text of all its tokens."""
    branch.text = detokenizer.whole(branch.text, branch.token_ids, branch.text_state)


def emit(request: Request, branch: Branch) -> None:
    """Stream what ``branch`` may show now: never a possible start of a stop string, never half a
    character. Its final chunk (when it has finished) carries the ``Completion``."""
    if branch.finish_reason is None:
        safe = safe_stream_end(branch.text, request.params.stop)
        if safe > branch.emitted_chars:
            request.channel.push(StreamChunk(branch.text[branch.emitted_chars:safe], tuple(branch.pending_ids),
                                             branch_index=branch.index, logprobs=pending_logprobs(branch)))
            branch.emitted_chars, branch.pending_ids = safe, []
        return
    done = completion(request, branch)
    request.channel.push(StreamChunk(done.text[branch.emitted_chars:], tuple(branch.pending_ids), done,
                                     branch_index=branch.index, logprobs=pending_logprobs(branch)))
    branch.emitted_chars, branch.pending_ids = len(done.text), []


def pending_logprobs(branch: Branch) -> tuple[float, ...]:
    """The log-probabilities of ``branch.pending_ids``: its latest tokens, since pending ids are
    appended as tokens are and cleared when streamed."""
    count = len(branch.pending_ids)
    return tuple(branch.logprobs[len(branch.logprobs) - count:]) if count else ()


def completion(request: Request, branch: Branch) -> Completion:
    """``branch``'s result as its caller receives it."""
    return Completion(
        text=branch.text,
        token_ids=tuple(branch.token_ids),
        logprobs=tuple(branch.logprobs),
        finish_reason=branch.finish_reason or "length",
        num_prompt_tokens=len(request.prompt_ids),
        num_cached_tokens=request.num_cached_tokens,
        branch_index=branch.index,
        seed=request.seed,
        asks=request.reuse_decision,
        drafted_tokens=branch.drafted_tokens,
        accepted_draft_tokens=branch.accepted_draft_tokens,
    )


def first_stop(text: str, stops: tuple[str, ...], checked: int = 0) -> int | None:
    """Index of the earliest stop string in ``text``, or None. ``text[:checked]`` is known to hold
    none, so only a stop string ending after it is looked for: a step's check costs what the step
    added to the text, not the whole text."""
    hits = [i for i in (text.find(s, max(0, checked - len(s) + 1)) for s in stops) if i >= 0]
    return min(hits) if hits else None


def safe_stream_end(text: str, stops: tuple[str, ...]) -> int:
    """How much of ``text`` can be streamed: not a trailing partial character, nor a tail that
    could be the beginning of a stop string."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":  # an incomplete multi-byte character
        end -= 1
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text[end - k:end] == stop[:k]:
                end -= k
                break
    return end
