"""The verifier over a server: the model judges each candidate, Yes or No, from the judge prompt's
next-token log-probs (``top_logprobs`` on the chat endpoint), the judge a ``RemoteEngine`` runs.

It asks what ``LLMJudgeVerifier`` asks, with the same prompt, and scores what it scores,
``P(Yes) / (P(Yes) + P(No))`` at the answer's first position. Where the local judge reads the logits
of each label's first token, a server only lists its most likely tokens as text, so a label's
probability here is the sum over the listed tokens whose text, stripped of whitespace, begins the
label (``"Y"``, ``"Yes"``) and does not begin the other one. When the labels' first tokens are
listed, that is the local judge's score; a label missing from the list counts 0, and a candidate
whose list holds neither label scores 0.5 (no preference).

Only CGEE level 1 (skip a confident vote's verification) applies: level 2 stops the judge's pass
at an early layer, which needs the hidden states a server does not expose. A ``cgee`` with
``exit_enabled`` is refused with a ``ValueError`` saying so.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from ..config import CGEEConfig
from ..protocol import ServedEngine
from .verifier import JUDGE_SYSTEM_PROMPT, JUDGE_TEMPLATE, CandidateScore

LAYER_EXIT_REFUSAL = ("cgee.exit_enabled: CGEE level 2 stops the judge's pass at an early layer, which reads the "
                      "model's hidden states; a server does not expose them. Over a server only level 1 (skipping "
                      "a confident vote's verification) runs: pass CGEEConfig(exit_enabled=False)")


class LogprobJudgeVerifier:
    """The served model as a Yes/No judge, read from its next-token log-probs.

    Args:
        engine: The engine behind the server (``RemoteEngine``).
        system_prompt / template: The verification prompt (``template`` takes ``{question}`` and
            ``{answer}``); the local judge's by default.
        labels: The positive and negative labels; their first characters must differ.
        num_top: Most likely tokens to ask for (the server's ``top_logprobs``), in [1, 20]. Default 20.
    """

    def __init__(self, engine: ServedEngine, system_prompt: str = JUDGE_SYSTEM_PROMPT,
                 template: str = JUDGE_TEMPLATE, labels: tuple[str, str] = ("Yes", "No"), num_top: int = 20) -> None:
        if template.find("{question}") < 0 or template.find("{answer}") < template.find("{question}"):
            raise ValueError("template must contain {question} before {answer}")
        if len(labels) != 2 or not all(isinstance(label, str) and label.strip() for label in labels):
            raise ValueError(f"labels must be two non-empty strings, got {labels!r}")
        if labels[0].strip()[0] == labels[1].strip()[0]:
            raise ValueError(f"labels {labels} begin alike; pick labels whose first characters differ")
        if isinstance(num_top, bool) or not isinstance(num_top, int) or not 1 <= num_top <= 20:
            raise ValueError(f"num_top must be an int in [1, 20], got {num_top!r}")
        self.engine, self.system_prompt, self.template = engine, system_prompt, template
        self.labels = (labels[0].strip(), labels[1].strip())
        self.num_top = num_top
        self._seconds, self._candidates = 0.0, 0

    def messages(self, question: str, answer: str) -> list[dict[str, str]]:
        """The judge prompt for one candidate, as chat messages."""
        return [{"role": "system", "content": self.system_prompt},
                {"role": "user", "content": self.template.format(question=question, answer=answer)}]

    def score(self, question: str, candidates: Sequence[str], cgee: CGEEConfig) -> list[CandidateScore]:
        """Each candidate's ``P(Yes) / (P(Yes) + P(No))``, all candidates' requests in flight at once.

        Raises:
            ValueError: ``cgee.exit_enabled`` (level 2 needs hidden states), or the server sent no
                ``top_logprobs`` at all.
        """
        if cgee.exit_enabled:
            raise ValueError(LAYER_EXIT_REFUSAL)
        start = time.perf_counter()
        tops = self.engine.top_next_tokens([self.messages(question, c) for c in candidates], self.num_top)
        if candidates and not any(tops):
            raise ValueError("the server sent no top_logprobs for the judge prompt, so the log-prob judge cannot "
                             "read Yes from No; pass a verifier of your own (or verifier=None votes only)")
        self._seconds += time.perf_counter() - start
        self._candidates += len(candidates)
        return [CandidateScore(answer, self.label_score(top)) for answer, top in zip(candidates, tops)]

    def label_score(self, top: dict[str, float]) -> float:
        """``P(yes) / (P(yes) + P(no))`` from one position's listed tokens (0.5 when neither is listed)."""
        yes, no = self.labels
        mass = [0.0, 0.0]
        for token, logprob in top.items():
            text = token.strip()
            if not text or not math.isfinite(logprob):
                continue
            if yes.startswith(text) and not no.startswith(text):
                mass[0] += math.exp(logprob)
            elif no.startswith(text) and not yes.startswith(text):
                mass[1] += math.exp(logprob)
        total = mass[0] + mass[1]
        return mass[0] / total if total > 0 else 0.5

    def estimate_full_s(self, num_candidates: int) -> float | None:
        """Estimated seconds to judge ``num_candidates``: the mean per candidate so far (None before any)."""
        if self._candidates == 0:
            return None
        return self._seconds / self._candidates * num_candidates
