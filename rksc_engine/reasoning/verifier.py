"""Verifiers score candidate answers for a question; the default is the engine judging itself.

``LLMJudgeVerifier`` asks the model whether a proposed answer is correct and reads
``P(Yes) / (P(Yes) + P(No))`` at the answer position. The question part of the verification
prompt is identical across candidates, so it is computed once and served from the prefix cache;
each candidate computes only its own tail. With CGEE level 2 the tail's pass may stop at an earlier
layer (by ``cgee.exits_after_layer``, the rule calibration replays offline); a stopped pass's KV is
never written to the prefix cache.

Each pass is timed (``PassTrace``), which gives two per-call estimates of the time CGEE saved
against full-depth verification: for a pass that stopped early, the measured seconds per layer of
that pass times the layers it did not run, minus the exit checks' own cost (negative when the
checks cost more than they saved); for a skipped call, the full-depth cost per candidate measured
on this verifier's earlier passes times the number of candidates (None before any pass). These are
estimates, not measurements of the work that did not happen; ``benchmarks/cgee.py`` measures the
real difference side by side.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from ..decoder_parts import decoder_parts  # re-exported: ``verifier.decoder_parts`` stays importable
from ..kvcache.cache_layers import repeat_rows
from ..kvcache.prefix_match import common_prefix
from ..protocol import LocalEngine
from .cgee import CGEEConfig, exit_check_layers, exits_after_layer, lens_entropy

JUDGE_SYSTEM_PROMPT = "You check answers to math word problems. Reply with Yes or No only."
JUDGE_TEMPLATE = "Question: {question}\nProposed answer: {answer}\nIs the proposed answer correct?"


@dataclass(frozen=True)
class CandidateScore:
    """A verifier's judgement of one candidate answer.

    Attributes:
        answer: The candidate.
        score: In [0, 1]; higher means more likely correct.
        exit_layer: 0-based decoder layer whose output produced the score (``num_layers - 1`` for a
            full pass), or None for verifiers that have no layers.
    """

    answer: str
    score: float
    exit_layer: int | None = None


@runtime_checkable
class Verifier(Protocol):
    """Anything that scores candidate answers for a question."""

    def score(self, question: str, candidates: Sequence[str], cgee: CGEEConfig) -> list[CandidateScore]: ...


class _CostMeter:
    """Running mean of the measured full-verification seconds per candidate."""

    def __init__(self) -> None:
        self.total_s, self.num_candidates = 0.0, 0

    def add(self, seconds: float, num_candidates: int) -> None:
        if num_candidates > 0:
            self.total_s += seconds
            self.num_candidates += num_candidates

    def estimate(self, num_candidates: int) -> float | None:
        if self.num_candidates == 0:
            return None
        return self.total_s / self.num_candidates * num_candidates


class CallableVerifier:
    """Wrap ``fn(question, candidates) -> list[float]`` (e.g. a process reward model) as a Verifier."""

    def __init__(self, fn: Callable[[str, Sequence[str]], Sequence[float]]) -> None:
        if not callable(fn):
            raise TypeError(f"verifier must be callable, got {type(fn).__name__}")
        self.fn = fn
        self._cost = _CostMeter()

    def score(self, question: str, candidates: Sequence[str], cgee: CGEEConfig) -> list[CandidateScore]:
        start = time.perf_counter()
        scores = list(self.fn(question, list(candidates)))
        if len(scores) != len(candidates):
            raise ValueError(f"verifier returned {len(scores)} scores for {len(candidates)} candidates")
        self._cost.add(time.perf_counter() - start, len(candidates))
        return [CandidateScore(a, float(s)) for a, s in zip(candidates, scores)]

    def estimate_full_s(self, num_candidates: int) -> float | None:
        """Estimated seconds to score ``num_candidates`` (mean of this verifier's calls; None before any)."""
        return self._cost.estimate(num_candidates)


def as_verifier(verifier: Any) -> Verifier | None:
    """``verifier`` as a ``Verifier``: itself when it is one, a ``CallableVerifier`` around a callable
    ``fn(question, candidates) -> scores``, None for anything else (the caller's error names what it
    accepts there: a default judge for None, a name like ``"judge"``...)."""
    if isinstance(verifier, Verifier):
        return verifier
    if callable(verifier):
        return CallableVerifier(verifier)
    return None


class _StopForward(Exception):
    """Raised from a layer hook to end a forward pass early."""


@dataclass
class PassTrace:
    """What one batched verifier pass did and what it cost.

    Attributes:
        num_layers: Decoder layers of the judge model.
        layers_run: Decoder layers the batch ran (``num_layers`` for a full pass).
        exit_layer: 0-based layer whose output produced the scores.
        prefill_s: Seconds spent prefilling the shared question prefix (0 when it was cached).
        pass_s: Seconds of the candidates' batched pass, exit checks included.
        check_s: Part of ``pass_s`` spent on the exit checks.
        lens_logits: ``(num_layers, B, 2)`` label logits of the logit lens at every layer, when the
            verifier was built with ``record_lens=True`` and the pass ran to full depth.
    """

    num_layers: int = 0
    layers_run: int = 0
    exit_layer: int | None = None
    prefill_s: float = 0.0
    pass_s: float = 0.0
    check_s: float = 0.0
    lens_logits: torch.Tensor | None = None

    @property
    def full_depth_s(self) -> float:
        """Estimated seconds of this call at full depth without checks: the prefix prefill plus the
        pass's measured seconds per layer (checks excluded) times every layer."""
        if self.layers_run == 0:
            return self.prefill_s
        return self.prefill_s + (self.pass_s - self.check_s) / self.layers_run * self.num_layers

    @property
    def time_saved_s(self) -> float:
        """Estimated seconds saved against a full-depth pass: the layers not run, at this pass's
        measured seconds per layer, minus the cost of the checks. 0 for a full pass without checks."""
        if self.layers_run == 0:
            return 0.0
        seconds_per_layer = (self.pass_s - self.check_s) / self.layers_run
        return seconds_per_layer * (self.num_layers - self.layers_run) - self.check_s


class LLMJudgeVerifier:
    """The engine's model as a Yes/No judge.

    Args:
        engine: The ``RKSCEngine`` whose model judges (the same engine that reasoned, or another).
        system_prompt / template: The verification prompt; ``template`` takes ``{question}`` and
            ``{answer}``, and the question must come first so candidates share it as a prefix.
        labels: The positive and negative label strings; each is scored by its first token.
        record_lens: Keep the label logits of the logit lens at every layer of full-depth passes in
            ``PassTrace.lens_logits``, the data ``calibration.calibrate`` needs for level 2. Default False.
    """

    def __init__(self, engine: LocalEngine, system_prompt: str = JUDGE_SYSTEM_PROMPT, template: str = JUDGE_TEMPLATE,
                 labels: tuple[str, str] = ("Yes", "No"), record_lens: bool = False) -> None:
        if template.find("{question}") < 0 or template.find("{answer}") < template.find("{question}"):
            raise ValueError("template must contain {question} before {answer}")
        self.engine, self.system_prompt, self.template = engine, system_prompt, template
        tok = engine.tokenizer
        self.label_ids = [tok(label, add_special_tokens=False)["input_ids"][0] for label in labels]
        if self.label_ids[0] == self.label_ids[1]:
            raise ValueError(f"labels {labels} start with the same token; pick labels that differ in their first token")
        self.record_lens = record_lens
        self.last_traces: list[PassTrace] = []
        self._cost = _CostMeter()

    def prompt_ids(self, question: str, answer: str) -> list[int]:
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": self.template.format(question=question, answer=answer)}]
        return self.engine.encode(messages)

    def score(self, question: str, candidates: Sequence[str], cgee: CGEEConfig) -> list[CandidateScore]:
        return self.score_with_trace(question, candidates, cgee)[0]

    def score_with_trace(self, question: str, candidates: Sequence[str], cgee: CGEEConfig
                         ) -> tuple[list[CandidateScore], PassTrace]:
        """``score``, plus the ``PassTrace`` of the batched pass (layers run, timings, lens logits)."""
        engine = self.engine
        all_ids = [self.prompt_ids(question, c) for c in candidates]
        shared = common_prefix(all_ids)
        with engine.exclusive():  # the warm-up and the judge pass run between two scheduler steps
            prefill_start = time.perf_counter()
            prefilled = len(candidates) > 1 and len(shared) > 1 and not self._is_cached(shared)
            if prefilled:
                engine.warm_cache(shared)  # a full pass: its KV goes into the prefix cache for every candidate
            prefill_s = time.perf_counter() - prefill_start if prefilled else 0.0
            label_logits, trace = self._judge_batch(all_ids, shared, cgee)
        trace.prefill_s = prefill_s
        self.last_traces = [trace]
        self._cost.add(trace.full_depth_s, len(candidates))
        probs = label_logits.float().softmax(-1)[:, 0].tolist()
        return [CandidateScore(a, p, trace.exit_layer) for a, p in zip(candidates, probs)], trace

    def estimate_full_s(self, num_candidates: int) -> float | None:
        """Estimated seconds to verify ``num_candidates`` at full depth: the mean full-depth cost per
        candidate over this verifier's passes so far (``PassTrace.full_depth_s``); None before any."""
        return self._cost.estimate(num_candidates)

    def _is_cached(self, ids: list[int]) -> bool:
        return self.engine.cached_prefix_length(ids) >= len(ids) - 1

    @torch.inference_mode()
    def _judge_batch(self, all_ids: list[list[int]], shared: list[int], cgee: CGEEConfig) -> tuple[torch.Tensor, PassTrace]:
        """Label logits ``(B, 2)`` at each candidate's last position, all candidates in one batch.

        The shared prefix's KV comes from the prefix cache (fanned out to the B rows); each row then
        computes only its own tail. Rows are right-padded: attention is causal, so padding after a
        row's last real token cannot change that token's hidden state, and scores stay exact. With
        layer exit on, the batch stops at the first layer where ``cgee.exits_after_layer`` says so (every
        row's label entropy below ``theta`` and stable).
        """
        engine = self.engine
        layers, norm, head = decoder_parts(engine.model)
        label_rows = head.weight[self.label_ids]  # (2, hidden): the only LM-head rows the judge needs
        trace = PassTrace(num_layers=len(layers))
        state: dict[str, Any] = {"prev": None, "logits": None}
        lens: list[torch.Tensor] = []
        # Every row must keep at least one token of its own to compute.
        limit = min(len(shared), min(len(ids) for ids in all_ids) - 1)
        with engine.cached_prefix(shared[: limit + 1]) as prefix:
            return self._judge_rows(prefix, all_ids, cgee, layers, norm, label_rows, trace, state, lens)

    def _judge_rows(self, prefix: Any, all_ids: list[list[int]], cgee: CGEEConfig, layers: Any, norm: Any,
                    label_rows: torch.Tensor, trace: PassTrace, state: dict[str, Any], lens: list[torch.Tensor]
                    ) -> tuple[torch.Tensor, PassTrace]:
        engine = self.engine
        cache, matched = prefix.cache, prefix.num_tokens
        tails = [ids[matched:] for ids in all_ids]
        width = max(len(t) for t in tails)
        pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([t + [pad] * (width - len(t)) for t in tails], device=engine.device)  # (B, T)
        rows = torch.arange(len(tails), device=engine.device)
        last = torch.tensor([len(t) - 1 for t in tails], device=engine.device)  # (B,)
        num_layers = len(layers)
        checked_layers = exit_check_layers(num_layers, cgee)

        def on_layer(layer_idx: int):
            def hook(_module, _args, output):
                trace.layers_run += 1
                checked = layer_idx in checked_layers
                if not checked and not self.record_lens:
                    return
                start = time.perf_counter()
                hidden = output[0] if isinstance(output, tuple) else output  # (B, T, hidden)
                logits = norm(hidden[rows, last]) @ label_rows.T  # (B, 2)
                if self.record_lens:
                    lens.append(logits.float())
                if not checked:
                    return
                entropy = lens_entropy(logits)  # (B,) label entropy in nats, one op for the batch
                previous = state["prev"]
                moved = torch.full_like(entropy, math.inf) if previous is None else (entropy - previous).abs()
                state["prev"] = entropy
                stop = bool(exits_after_layer(layer_idx, num_layers, entropy, moved, cgee))
                trace.check_s += time.perf_counter() - start
                if stop:
                    trace.exit_layer, state["logits"] = layer_idx, logits
                    raise _StopForward
            return hook

        handles = [layer.register_forward_hook(on_layer(i)) for i, layer in enumerate(layers)]
        pass_start = time.perf_counter()
        try:
            repeat_rows(cache, len(tails))
            try:
                # Run the decoder body only and project just the label rows at the scored positions:
                # the full-vocabulary head over every padded position would cost ~30% of the pass.
                hidden = prefix.run_decoder(input_ids)
                trace.exit_layer = num_layers - 1
                if self.record_lens:
                    trace.lens_logits = torch.stack(lens)  # (L, B, 2)
                return hidden[rows, last] @ label_rows.T, trace  # (B, 2); the body already applied the final norm
            except _StopForward:
                return state["logits"], trace
        finally:
            trace.pass_s = time.perf_counter() - pass_start
            # The candidates' cache is a private copy dropped here, stopped or not: the radix cache
            # only ever holds KV from complete passes.
            for handle in handles:
                handle.remove()
            prefix.computed_tokens += sum(len(t) for t in tails)
            prefix.reused_tokens += matched * len(tails)
