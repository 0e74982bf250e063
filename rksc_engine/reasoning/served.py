"""Reasoning over an engine behind a server (``ServedEngine``): what the server's capabilities allow.

The reasoning code is the same for every engine; what differs is what a server provides. This
module reads ``engine.capabilities()`` once per call, before anything is generated, and turns each
gap into an error (a rule that cannot run) or a line of ``ReasoningResult.server_limits`` (a
documented fallback):

    * no log-probs: every branch weighs 1 in the vote (``Completion.confidence`` is 1.0 without
      them), so the vote and CGEE's ``p`` and ``lead`` are counts, and every early-stop rule but
      ``confidence`` runs on them; ``confidence`` (it filters on token log-probs) is refused;
    * no ``top_logprobs``: no log-prob judge, so a vote CGEE does not skip is answered by its winner;
    * ``seed`` not honoured per request: branches are samples a rerun does not reproduce;
    * ``n`` ignored: every branch is a request of its own (early stop does that anyway).

CGEE level 2 (layer exit) reads hidden states and is refused over any server
(``logprob_judge.LAYER_EXIT_REFUSAL``).
"""

from __future__ import annotations

from typing import Any

from ..config import CGEEConfig
from ..protocol import ServedEngine
from .early_stop import EarlyStopConfig
from .logprob_judge import LAYER_EXIT_REFUSAL, LogprobJudgeVerifier


def served_limits(engine: Any, early_stop: EarlyStopConfig | None, cgee: CGEEConfig,
                  judge_given: bool) -> tuple[str, ...]:
    """What the server behind ``engine`` changes about this call, one line each; () for an engine
    not behind a server.

    Raises:
        ValueError: a rule the server cannot run: CGEE level 2 for the default judge, or the
            ``confidence`` early-stop rule on a server that sends no log-probs.
    """
    if not isinstance(engine, ServedEngine):
        return ()
    if cgee.exit_enabled and not judge_given:
        raise ValueError(LAYER_EXIT_REFUSAL)
    capabilities = engine.capabilities()
    if early_stop is not None and early_stop.confidence is not None and not capabilities.logprobs:
        raise ValueError("early_stop.confidence filters branches on their tokens' log-probs, and the server sends "
                         "none (capabilities().logprobs is False); use 'decided', 'answered', 'adaptive' or 'length'")
    limits = list(capabilities.limits())
    if judge_given:  # the caller's verifier judges: the server's top log-probs are not needed
        limits = [line for line in limits if "top_logprobs" not in line]
    return tuple(limits)


def served_judge(engine: Any) -> LogprobJudgeVerifier | None:
    """The default judge over a server: the log-prob judge where the server sends top log-probs,
    else None (the vote only; ``served_limits`` says so)."""
    return LogprobJudgeVerifier(engine) if engine.capabilities().top_logprobs else None
