"""Verifiers score candidate answers for a question; the default is the engine judging itself.

``LLMJudgeVerifier`` asks the model whether a proposed answer is correct and reads
``P(Yes) / (P(Yes) + P(No))`` at the answer position. The question part of the verification
prompt is identical across candidates, so it is computed once and served from the prefix cache;
each candidate computes only its own tail. With CGEE level 2 the tail's pass may stop at an earlier
layer (see ``cgee``); a stopped pass's KV is never written to the prefix cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from .cgee import CGEEConfig

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


class CallableVerifier:
    """Wrap ``fn(question, candidates) -> list[float]`` (e.g. a process reward model) as a Verifier."""

    def __init__(self, fn: Callable[[str, Sequence[str]], Sequence[float]]) -> None:
        if not callable(fn):
            raise TypeError(f"verifier must be callable, got {type(fn).__name__}")
        self.fn = fn

    def score(self, question: str, candidates: Sequence[str], cgee: CGEEConfig) -> list[CandidateScore]:
        scores = list(self.fn(question, list(candidates)))
        if len(scores) != len(candidates):
            raise ValueError(f"verifier returned {len(scores)} scores for {len(candidates)} candidates")
        return [CandidateScore(a, float(s)) for a, s in zip(candidates, scores)]


class _StopForward(Exception):
    """Raised from a layer hook to end a forward pass early."""


def decoder_parts(model: Any) -> tuple[Sequence[torch.nn.Module], torch.nn.Module, torch.nn.Module]:
    """``(decoder layers, final norm, LM head)`` of a transformers causal LM (Llama-style layout)."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    norm = getattr(base, "norm", None)
    if layers is None or norm is None:
        raise TypeError(f"layer exit needs a Llama-style model with .model.layers and .model.norm; "
                        f"got {type(model).__name__}")
    return layers, norm, model.get_output_embeddings()


@dataclass
class PassTrace:
    """What one verifier pass did: how many layer forwards ran and where it stopped."""

    layers_run: int = 0
    exit_layer: int | None = None
    check_s: float = 0.0


class LLMJudgeVerifier:
    """The engine's model as a Yes/No judge.

    Args:
        engine: The ``RKSCEngine`` whose model judges (the same engine that reasoned, or another).
        system_prompt / template: The verification prompt; ``template`` takes ``{question}`` and
            ``{answer}``, and the question must come first so candidates share it as a prefix.
        labels: The positive and negative label strings; each is scored by its first token.
    """

    def __init__(self, engine: Any, system_prompt: str = JUDGE_SYSTEM_PROMPT, template: str = JUDGE_TEMPLATE,
                 labels: tuple[str, str] = ("Yes", "No")) -> None:
        if template.find("{question}") < 0 or template.find("{answer}") < template.find("{question}"):
            raise ValueError("template must contain {question} before {answer}")
        self.engine, self.system_prompt, self.template = engine, system_prompt, template
        tok = engine.tokenizer
        self.label_ids = [tok(label, add_special_tokens=False)["input_ids"][0] for label in labels]
        if self.label_ids[0] == self.label_ids[1]:
            raise ValueError(f"labels {labels} start with the same token; pick labels that differ in their first token")
        self.last_traces: list[PassTrace] = []

    def prompt_ids(self, question: str, answer: str) -> list[int]:
        messages = [{"role": "system", "content": self.system_prompt},
                    {"role": "user", "content": self.template.format(question=question, answer=answer)}]
        return self.engine.encode(messages)

    def score(self, question: str, candidates: Sequence[str], cgee: CGEEConfig) -> list[CandidateScore]:
        engine = self.engine
        all_ids = [self.prompt_ids(question, c) for c in candidates]
        shared = _common_prefix(all_ids)
        with engine._lock:
            if len(candidates) > 1 and len(shared) > 1 and not self._is_cached(shared):
                engine._prefill(shared)  # a full pass: its KV goes into the prefix cache for every candidate
            label_logits, trace = self._judge_batch(all_ids, shared, cgee)
        self.last_traces = [trace]
        probs = label_logits.float().softmax(-1)[:, 0].tolist()
        return [CandidateScore(a, p, trace.exit_layer) for a, p in zip(candidates, probs)]

    def _is_cached(self, ids: list[int]) -> bool:
        cache = self.engine.prefix_cache
        return self.engine._cacheable and cache.match_prefix(ids).num_tokens >= len(ids) - 1

    @torch.inference_mode()
    def _judge_batch(self, all_ids: list[list[int]], shared: list[int], cgee: CGEEConfig) -> tuple[torch.Tensor, PassTrace]:
        """Label logits ``(B, 2)`` at each candidate's last position, all candidates in one batch.

        The shared prefix's KV comes from the prefix cache (fanned out to the B rows); each row then
        computes only its own tail. Rows are right-padded: attention is causal, so padding after a
        row's last real token cannot change that token's hidden state, and scores stay exact. With
        layer exit on, the batch stops at the first layer where every row's label entropy is below
        ``theta`` and stable.
        """
        engine = self.engine
        layers, norm, head = decoder_parts(engine.model)
        label_rows = head.weight[self.label_ids]  # (2, hidden): the only LM-head rows the judge needs
        trace = PassTrace()
        state: dict[str, Any] = {"prev": None, "logits": None}
        # Every row must keep at least one token of its own to compute.
        limit = min(len(shared), min(len(ids) for ids in all_ids) - 1)
        cache, matched, node = engine._cache_for_prefix(shared[: limit + 1])
        tails = [ids[matched:] for ids in all_ids]
        width = max(len(t) for t in tails)
        pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
        input_ids = torch.tensor([t + [pad] * (width - len(t)) for t in tails], device=engine.device)  # (B, T)
        rows = torch.arange(len(tails), device=engine.device)
        last = torch.tensor([len(t) - 1 for t in tails], device=engine.device)  # (B,)

        def on_layer(layer_idx: int):
            def hook(_module, _args, output):
                trace.layers_run += 1
                if not cgee.exit_enabled or layer_idx < cgee.min_layer or layer_idx == len(layers) - 1:
                    return
                start = time.perf_counter()
                hidden = output[0] if isinstance(output, tuple) else output  # (B, T, hidden)
                logits = norm(hidden[rows, last]) @ label_rows.T  # (B, 2)
                logp = logits.float().log_softmax(-1)
                entropy = -(logp.exp() * logp).sum(-1)  # (B,) label entropy in nats, one op for the batch
                stable = state["prev"] is not None and bool(((entropy - state["prev"]).abs() < cgee.epsilon).all())
                state["prev"] = entropy
                trace.check_s += time.perf_counter() - start
                if stable and bool((entropy < cgee.theta).all()):
                    trace.exit_layer, state["logits"] = layer_idx, logits
                    raise _StopForward
            return hook

        handles = [layer.register_forward_hook(on_layer(i)) for i, layer in enumerate(layers)]
        try:
            if len(tails) > 1:
                cache.batch_repeat_interleave(len(tails))
            try:
                # Run the decoder body only and project just the label rows at the scored positions:
                # the full-vocabulary head over every padded position would cost ~30% of the pass.
                body = engine.model.get_decoder()
                hidden = body(input_ids=input_ids, use_cache=True, **{engine._cache_kwarg: cache}).last_hidden_state
                trace.exit_layer = len(layers) - 1
                return hidden[rows, last] @ label_rows.T, trace  # (B, 2); the body already applied the final norm
            except _StopForward:
                return state["logits"], trace
        finally:
            # The candidates' cache is a private copy dropped here, stopped or not: the radix cache
            # only ever holds KV from complete passes.
            for handle in handles:
                handle.remove()
            if node is not None:
                engine.prefix_cache.unlock(node)
            engine._stats.prompt_tokens_computed += sum(len(t) for t in tails)
            engine._stats.prompt_tokens_reused += matched * len(tails)


def _common_prefix(sequences: list[list[int]]) -> list[int]:
    if not sequences:
        return []
    first = sequences[0]
    n = min(len(s) for s in sequences)
    i = 0
    while i < n and all(s[i] == first[i] for s in sequences):
        i += 1
    return first[:i]
