"""What an OpenAI-compatible server provides, found out by asking it: ``probe_capabilities``.

``RemoteEngine.capabilities()`` runs it once and remembers the answer; reasoning reads it before it
sends anything, so that what a server lacks is named up front (an error, or a line of
``ReasoningResult.server_limits`` saying what was done instead), never a silent difference.

The probe sends at most six requests of at most 16 tokens:
    1. one greedy token with ``logprobs`` and ``top_logprobs=5`` (a server that refuses
       ``top_logprobs`` is asked again without it): are log-probs and top log-probs sent, is
       ``usage.prompt_tokens_details.cached_tokens`` reported, does the stream end with ``[DONE]``;
    2. ``n=2``: are two choices answered;
    3. three sampled requests sent together, two with one seed and one with the next: a server
       that honours ``seed`` per request answers the first two alike and the third differently. A
       server that ignores it, or seeds one generator that every request draws from in turn
       (``transformers serve`` sets torch's global seed), answers the first two differently; one
       that refuses the field (4xx) does not honour it either. When all three agree (a model too
       sure of itself to sample differently) the probe cannot tell.

The chat endpoint is asked first (reasoning sends chat messages); a server without a chat template
(4xx) is asked through ``/v1/completions``.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass
from typing import Any, Protocol

from .config import SamplingParams
from .results import ServerCapabilities

PROBE_MESSAGES = [{"role": "user", "content": "Write one short sentence about the sea."}]
PROBE_TEXT = "The sea is"
# A seed far from the small ones callers use, so the probe's samples are not theirs.
PROBE_SEED = 7_919


@dataclass(frozen=True)
class ProbeAnswer:
    """One small request's answer as the server sent it (``RemoteEngine.probe``).

    Attributes:
        text: The first choice's text.
        logprobs: Its tokens' log-probs (empty when the server sent none).
        top_logprobs: Per position, ``{token text: logprob}`` of the most likely tokens.
        num_choices: Choices the server answered.
        usage: The ``usage`` object ({} when none came).
        saw_done: The stream ended with ``data: [DONE]`` (a whole answer counts as ended).
    """

    text: str
    logprobs: tuple[float, ...]
    top_logprobs: tuple[dict[str, float], ...]
    num_choices: int
    usage: dict[str, Any]
    saw_done: bool


class ProbedEngine(Protocol):
    """What the probe needs of a ``RemoteEngine``."""

    def probe(self, prompt: Any, n: int = 1, params: SamplingParams | None = None, *,
              num_top: int = 0, count: bool = True) -> ProbeAnswer: ...


def probe_capabilities(engine: ProbedEngine) -> ServerCapabilities:
    """Ask the server behind ``engine`` what it provides (see the module docstring)."""
    prompt: Any = PROBE_MESSAGES
    try:
        first = _first_token(engine, prompt)
    except ValueError:  # a 4xx: no chat template, say; ask the completions endpoint
        prompt = PROBE_TEXT
        first = _first_token(engine, prompt)
    answer, top_refused = first
    try:
        n_answered = engine.probe(prompt, 2, SamplingParams(max_new_tokens=1), count=False).num_choices == 2
    except (ValueError, RuntimeError):
        n_answered = False
    details = answer.usage.get("prompt_tokens_details") or {}
    return ServerCapabilities(
        logprobs=bool(answer.logprobs),
        top_logprobs=not top_refused and any(answer.top_logprobs),
        n=n_answered,
        seed=_honours_seed(engine, prompt),
        cached_tokens="cached_tokens" in details,
        done_marker=answer.saw_done,
    )


def _first_token(engine: ProbedEngine, prompt: Any) -> tuple[ProbeAnswer, bool]:
    """One greedy token with its top log-probs, and whether ``top_logprobs`` was refused."""
    try:
        return engine.probe(prompt, num_top=5, count=False), False
    except ValueError:
        return engine.probe(prompt, count=False), True


def _honours_seed(engine: ProbedEngine, prompt: Any) -> bool | None:
    params = [SamplingParams(temperature=1.0, max_new_tokens=16, seed=seed)
              for seed in (PROBE_SEED, PROBE_SEED, PROBE_SEED + 1)]
    try:
        with concurrent.futures.ThreadPoolExecutor(len(params), thread_name_prefix="rksc-probe") as pool:  # together
            texts = list(pool.map(lambda p: engine.probe(prompt, 1, p, count=False).text, params))
    except ValueError:  # a 4xx: the server refuses ``seed``
        return False
    if texts[0] == texts[1] == texts[2]:
        return None
    return texts[0] == texts[1]

