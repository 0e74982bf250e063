"""The engine: the only owner of the model, the tokenizer and the prefix cache.

Contract:
    * ``generate`` / ``generate_branches`` / ``generate_many`` / ``stream`` take a prompt (a string,
      a list of chat messages, or token ids) and ``SamplingParams``, and return ``Completion``s that hold
      generated text only.
    * One prefill per prompt: the prompt's longest cached prefix comes from the radix cache, only the
      rest is computed, and its KV is fanned out to the ``n`` sibling branches, which decode as one batch.
      A branch that finishes leaves the batch, so it stops costing compute.
    * Exactness: with the prefix cache on or off, greedy output equals ``model.generate(do_sample=False)``
      token for token, and branch i (seeded ``seed + i``) is the same alone or among siblings.
    * Bad input raises ``ValueError``/``TypeError`` before any cache or counter changes.
    * Calls are serialised by a re-entrant lock, so threads can share one engine without cross-talk.
"""

from __future__ import annotations

import inspect
import secrets
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import asks
from .config import EngineConfig, SamplingParams
from .loading import ensure_default_model, load_model_dir, resolve_device, resolve_dtype
from .memory import run_with_oom_retry
from .prefix_cache import RadixPrefixCache
from .sampling import choose_next_tokens, make_generators
from .shared_prefix import (
    ATTENTION_NAME,
    ProbeResult,
    SharedPrefixCache,
    attention_implementation,
    initial_suffix_capacity,
    probe,
)
from .types import ASKSDecision, Completion, EngineStats, StreamChunk

ChatMessage = dict[str, Any]
Prompt = str | Sequence[ChatMessage] | Sequence[int]
CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass
class _Branch:
    """Mutable decoding state of one branch."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    emitted_chars: int = 0  # for streaming: how much of `text` has been handed out


@dataclass
class _Prefilled:
    """A prompt whose KV is computed: the batch-1 cache and the logits of its last position."""

    prompt_ids: list[int]
    cache: Any  # transformers DynamicCache, batch 1
    last_logits: torch.Tensor  # (1, V)
    num_cached_tokens: int
    # False when ASKS reused approximate KV: then nothing past the prompt's exact part, and nothing
    # decoded on top of it, may go into the token-exact prefix cache.
    exact: bool = True
    asks: ASKSDecision | None = None  # what ASKS did, None when it did not act


class RKSCEngine:
    """Multi-branch generation over one shared prompt prefill, with a radix prefix cache across calls.

    Example:
        >>> engine = RKSCEngine.from_pretrained()  # embedded SmolLM2-135M-Instruct
        >>> branches = engine.generate_branches("Q: 2+3=?\\nA:", n=4,
        ...     params=SamplingParams(temperature=0.7, max_new_tokens=16, seed=0))
        >>> engine.stats().prompt_tokens_computed  # the prompt was prefilled once, not 4 times
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None) -> None:
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        self._model = model.eval()
        self._tokenizer = tokenizer
        self._lock = threading.RLock()
        self._stats = EngineStats()
        first_param = next(model.parameters())
        self.device, self.dtype = first_param.device, first_param.dtype
        self.prefix_cache = RadixPrefixCache(
            config.rsbcm.budget_bytes, policy=config.rsbcm.policy, block_size=config.rsbcm.block_size
        )
        self._cacheable = config.prefix_cache.enabled and self._model_supports_prefix_cache()
        self._eos_ids = self._collect_eos_ids()
        # transformers 5.x renamed the forward's `past_key_values` to `cache`; support both.
        forward_params = inspect.signature(self._model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._shared_prefix_probe: ProbeResult | None = None  # probed on first decode, see _use_shared_prefix

    # -- construction ---------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model: str | Path | tuple[Any, Any] | None = None,
        *,
        device: str | torch.device = "auto",
        dtype: str | torch.dtype = "auto",
        config: EngineConfig | None = None,
        progress: bool = True,
    ) -> RKSCEngine:
        """Build an engine.

        Args:
            model: ``None`` for the embedded default (SmolLM2-135M-Instruct, converted once into the
                user cache), a local Hugging Face model directory, or a loaded ``(model, tokenizer)`` pair.
            device: ``"auto"`` (CUDA if present, else CPU), a device string or ``torch.device``.
            dtype: ``"auto"`` (float32 on CPU, bfloat16 on CUDA), ``"fast"`` (bfloat16 on CUDA and on
                CPUs with native bf16, else float32) or a dtype / its name.
            config: Engine settings.
            progress: Show a progress bar while converting the default model the first time.
        """
        config = EngineConfig() if config is None else config
        if isinstance(model, tuple):
            if len(model) != 2:
                raise TypeError("model as a tuple must be (model, tokenizer)")
            return cls(model[0], model[1], config)
        if model is not None and not isinstance(model, (str, Path)):
            raise TypeError(f"model must be None, a path or a (model, tokenizer) pair, got {type(model).__name__}")
        torch_device = resolve_device(device)
        torch_dtype = resolve_dtype(dtype, torch_device)
        path = ensure_default_model(progress=progress) if model is None else Path(model)
        hf_model, tokenizer = load_model_dir(path, torch_device, torch_dtype, config.trust_remote_code)
        return cls(hf_model, tokenizer, config)

    @property
    def model(self) -> Any:
        """The underlying ``transformers`` model."""
        return self._model

    @property
    def tokenizer(self) -> Any:
        """The underlying ``transformers`` tokenizer."""
        return self._tokenizer

    @property
    def context_window(self) -> int:
        cfg = self._model.config.get_text_config() if hasattr(self._model.config, "get_text_config") else self._model.config
        return int(getattr(cfg, "max_position_embeddings", None) or self._tokenizer.model_max_length)

    @property
    def model_name(self) -> str:
        # A local directory's name ("SmolLM2-135M-Instruct"), not its full cache path.
        name = str(getattr(self._model.config, "_name_or_path", "") or "")
        return Path(name).name if name else type(self._model).__name__

    def _model_supports_prefix_cache(self) -> bool:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        # Sliding-window and other exotic layers do not keep the whole prefix, so slicing them into
        # the radix tree would not be exact; such models run without the cross-call cache.
        layers = DynamicCache(config=self._model.config).layers
        return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)

    def _collect_eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen_eos = getattr(getattr(self._model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, self._tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return frozenset(ids)

    # -- prompts --------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string (tokenised as ``tokenizer(prompt)`` does), a list of chat
        messages (rendered with the model's chat template, generation prompt appended), or token ids.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string, list of chat messages or token ids")
            ids = list(self._tokenizer(prompt)["input_ids"])
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = len(self._tokenizer)
            bad = [t for t in prompt if not 0 <= t < max(vocab, self._model.config.vocab_size)]
            if bad:
                raise ValueError(f"prompt token ids must be in [0, {vocab}), got {bad[:3]}")
            ids = list(prompt)
        elif isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._encode_chat(list(prompt))
        elif isinstance(prompt, Sequence) and not prompt:
            raise ValueError("prompt must not be empty")
        else:
            raise TypeError(
                f"prompt must be a string, a list of chat messages ({{'role', 'content'}} dicts) or a list of "
                f"token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("prompt encodes to zero tokens")
        return ids

    def _encode_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> list[int]:
        for i, message in enumerate(messages):
            role = message.get("role")
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}]['role'] must be one of {list(CHAT_ROLES)}, got {role!r}")
            content = message.get("content")
            if not isinstance(content, str):
                raise TypeError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
        if not getattr(self._tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass the prompt as a string")
        text = self.render_chat(messages, **template_kwargs)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def render_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> str:
        """The chat template applied to ``messages`` with the assistant's generation prompt appended."""
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **template_kwargs
        )

    def _check_request(self, prompt_ids: list[int], n: int, params: SamplingParams | None) -> SamplingParams:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"n must be an int, got {type(n).__name__}")
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if len(prompt_ids) >= self.context_window:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the model's context window is {self.context_window}, "
                f"so the prompt must have at most {self.context_window - 1}"
            )
        return params

    # -- public generation ----------------------------------------------------------------------
    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> Completion:
        """One completion of ``prompt``."""
        return self.generate_branches(prompt, 1, params)[0]

    def generate_branches(self, prompt: Prompt, n: int, params: SamplingParams | None = None) -> list[Completion]:
        """``n`` sibling completions of one prompt, prefilled once and decoded as one batch."""
        prompt_ids = self.encode(prompt)
        params = self._check_request(prompt_ids, n, params)
        with self._lock:
            info: dict = {}
            *_, (branches, _) = self._run(prompt_ids, n, params, info)  # drain; the last step holds every branch
            return [self._to_completion(b, info) for b in branches]

    def generate_many(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[Completion]:
        """One completion per prompt; a token prefix shared by several prompts is prefilled once.

        Prompts run in order through the radix cache, so the first computes a shared prefix and the
        rest reuse it.
        """
        if isinstance(prompts, str) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts")
        encoded = [self.encode(p) for p in prompts]
        params = SamplingParams() if params is None else params
        for ids in encoded:
            self._check_request(ids, 1, params)
        with self._lock:
            return [self.generate_branches(ids, 1, params)[0] for ids in encoded]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield the text of one completion as it is generated.

        Text that could still turn out to be the start of a stop string is held back until it is
        known not to be, so a stop string never leaks into the stream. The last chunk carries the
        finished ``Completion``. The engine lock is held until the stream is exhausted or closed.
        """
        prompt_ids = self.encode(prompt)
        params = self._check_request(prompt_ids, 1, params)
        return self._stream(prompt_ids, params)

    def _stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StreamChunk]:
        with self._lock:
            info: dict = {}
            pending: list[int] = []
            for branches, step_tokens in self._run(prompt_ids, 1, params, info):
                branch = branches[0]
                pending.extend(step_tokens)
                if branch.finish_reason is None:
                    safe = _safe_stream_end(branch.text, params.stop)
                    if safe > branch.emitted_chars:
                        yield StreamChunk(branch.text[branch.emitted_chars:safe], tuple(pending))
                        branch.emitted_chars, pending = safe, []
            completion = self._to_completion(branch, info)
            yield StreamChunk(completion.text[branch.emitted_chars:], tuple(pending), completion)

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (prompt tokens computed/reused, decode tokens, cache)."""
        with self._lock:
            snapshot = EngineStats(**{k: v for k, v in vars(self._stats).items() if k != "extra"})
            snapshot.extra = dict(self._stats.extra)
            snapshot.cache_bytes = self.prefix_cache.total_bytes
            snapshot.cache_tokens = self.prefix_cache.total_tokens
            snapshot.cache_evicted_tokens = self.prefix_cache.evicted_tokens
            snapshot.cache_peak_bytes = self.prefix_cache.peak_bytes
            snapshot.cache_budget_bytes = self.prefix_cache.budget_bytes
            return snapshot

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = EngineStats()
            self.prefix_cache.reset_peak()

    def exclusive(self) -> Any:
        """A context manager that holds the engine across several calls (``with engine.exclusive():``).

        No other thread's call runs until the block ends, so a ``stats()`` delta taken inside belongs
        to the block alone. The lock is re-entrant: calls made inside the block proceed as usual.
        """
        return self._lock

    def clear_cache(self) -> None:
        """Drop all cached prefixes not in use."""
        with self._lock:
            self.prefix_cache.clear()

    # -- core -----------------------------------------------------------------------------------
    def _forward(self, input_ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
        """One model pass that survives running out of memory: on ``torch.OutOfMemoryError`` /
        ``MemoryError`` the request's cache is rolled back, the prefix cache evicts and shrinks its
        budget (``rsbcm.oom_budget_shrink``), and the pass is retried, ``rsbcm.oom_max_attempts``
        tries in all; then ``ForwardOutOfMemoryError``."""
        # input_ids: (B, T); the cache holds the B rows' earlier positions.
        rsbcm = self.config.rsbcm
        return run_with_oom_retry(
            lambda: self._model(input_ids=input_ids, use_cache=True, **{self._cache_kwarg: cache}, **kwargs),
            cache,
            on_oom=self._free_memory_after_oom,
            max_attempts=rsbcm.oom_max_attempts,
            backoff_s=rsbcm.oom_backoff_s,
        )

    def _free_memory_after_oom(self, error: BaseException, attempt: int) -> None:
        self._stats.oom_retries += 1
        self.prefix_cache.shrink_budget(self.config.rsbcm.oom_budget_shrink)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def annotate_cache(self, token_ids: Sequence[int], *, start: int = 0, branch_score: float, depth: int) -> int:
        """Tell RSBCM what cached KV is worth: set ``branch_score`` and ``depth`` (reasoning steps from
        the root) on the cached KV of ``token_ids[start:]``; ``omega`` eviction reads them. Returns the
        number of cached tokens annotated (0 when the cache is off)."""
        with self._lock:
            if not self._cacheable:
                return 0
            return self.prefix_cache.annotate(list(token_ids), start=start, branch_score=branch_score, depth=depth)

    def tree_search(self, question: str, **kwargs: Any) -> Any:
        """Beam search over reasoning steps, sharing each parent's KV with its children, inside the
        RSBCM cache budget; see ``rksc_engine.tree_search.tree_search`` for the keyword args
        (``breadth``, ``depth``, ``beam``, ``step_delimiter``, ``scorer``, ``params``, ...).

        Returns:
            A ``SearchResult`` with the best path, its answer, and the scored tree.
        """
        from .tree_search import tree_search

        return tree_search(self, question, **kwargs)

    # -- multi-branch reasoning -------------------------------------------------------------------
    def reason(self, question: str, **kwargs: Any) -> Any:
        """Answer ``question`` by self-consistency over ``n`` branches, verified with CGEE.

        Keyword args (see ``rksc_engine.reasoning.reason``): ``n`` (8), ``params``, ``few_shot``
        (worked ``Problem``s) or ``prompt`` (your own messages), ``answer_extractor`` (``"gsm8k"``,
        ``"choice"`` or a callable), ``verifier`` (default: this engine as a Yes/No judge; any
        ``Verifier`` or ``fn(question, candidates) -> scores``), ``cgee`` (``CGEEConfig``; default
        ``self.config.cgee``).

        Returns:
            A ``ReasoningResult`` with the answer, votes, branches and ``VerificationReport``.
        """
        from .reasoning import reason

        return reason(self, question, **kwargs)

    def _cache_for_prefix(self, prompt_ids: list[int]) -> tuple[Any, int, Any]:
        """A batch-1 DynamicCache holding the longest cached prefix of ``prompt_ids`` (always leaving
        the last token to compute). Returns ``(cache, matched_tokens, locked_node_or_None)``; the
        caller unlocks the node when done."""
        from transformers import DynamicCache

        if self._cacheable:
            match = self.prefix_cache.match_prefix(prompt_ids, max_tokens=len(prompt_ids) - 1)
            if match.num_tokens:
                self.prefix_cache.lock(match.last_node)
                kv = match.kv  # (L, 2, H_kv, T, D)
                layers = [(kv[i, 0][None], kv[i, 1][None]) for i in range(kv.shape[0])]
                return DynamicCache(ddp_cache_data=layers, config=self._model.config), match.num_tokens, match.last_node
        return DynamicCache(config=self._model.config), 0, None

    @torch.inference_mode()
    def _prefill(self, prompt_ids: list[int]) -> _Prefilled:
        prefilled = self._prefill_with_asks(prompt_ids)
        if prefilled is not None:
            return prefilled
        cache, matched, node = self._cache_for_prefix(prompt_ids)
        try:
            input_ids = torch.tensor([prompt_ids[matched:]], device=self.device)
            out = self._forward(input_ids, cache, logits_to_keep=1)
            if self._cacheable:
                self.prefix_cache.insert(prompt_ids, _stack_kv(cache))
        finally:
            if node is not None:
                self.prefix_cache.unlock(node)
        self._stats.prefills += 1
        self._stats.prompt_tokens_computed += len(prompt_ids) - matched
        self._stats.prompt_tokens_reused += matched
        if matched:
            self._stats.cache_hits += 1
        else:
            self._stats.cache_misses += 1
        return _Prefilled(prompt_ids, cache, out.logits[:, -1, :], matched)

    def _prefill_with_asks(self, prompt_ids: list[int]) -> _Prefilled | None:
        """Prefill through ASKS (``config.asks``, ``rksc_engine.asks``) when the prompt realigns with a
        cached sequence after a short differing span; None when ASKS does not act (off, ``tau = 1``,
        unsupported model, or no realignment), so the token-exact path runs unchanged.

        Only the exact part of the prompt's KV is inserted into the radix cache: all of it after a
        fallback, the shared prefix and the request's own span after a reuse."""
        config = self.config.asks
        if not (config.enabled and config.tau < 1.0 and self._cacheable and asks.supports_asks(self._model)):
            return None
        alignment = asks.find_alignment(self.prefix_cache, prompt_ids, config)
        if alignment is None:
            return None
        match = self.prefix_cache.match_prefix(list(alignment.cached_ids))
        needed = alignment.prefix_tokens + alignment.cached_span_tokens + alignment.remainder_tokens
        if match.num_tokens < needed:
            return None
        self.prefix_cache.lock(match.last_node)
        try:
            result = asks.prefill_with_asks(prompt_ids, alignment, match.kv, self._forward, self._model, config)
            exact_kv = _stack_kv(result.cache)[:, :, :, :result.num_exact_tokens]  # (L, 2, H_kv, T, D)
            self.prefix_cache.insert(prompt_ids[:result.num_exact_tokens], exact_kv)
        finally:
            self.prefix_cache.unlock(match.last_node)
        decision = result.decision
        self._stats.prefills += 1
        self._stats.prompt_tokens_computed += result.num_computed_tokens
        self._stats.prompt_tokens_reused += result.num_reused_tokens
        self._stats.cache_hits += 1 if result.num_reused_tokens else 0
        self._stats.cache_misses += 0 if result.num_reused_tokens else 1
        self._stats.asks_checks += 1
        self._stats.asks_reuses += int(decision.reused)
        self._stats.asks_reused_tokens += decision.reused_tokens
        self._stats.asks_recomputed_tokens += decision.recomputed_tokens
        self._stats.asks_check_tokens += decision.check_tokens
        return _Prefilled(prompt_ids, result.cache, result.last_logits, result.num_reused_tokens,
                          exact=result.exact, asks=decision)

    @torch.inference_mode()
    def _run(
        self, prompt_ids: list[int], n: int, params: SamplingParams, info: dict
    ) -> Iterator[tuple[list[_Branch], list[int]]]:
        """Prefill once, decode ``n`` branches; yields ``(branches, tokens of branch 0 this step)``."""
        seed = params.seed if params.seed is not None else secrets.randbelow(2**31)
        shared_prefix = self._use_shared_prefix()  # may raise (forced but unsupported) before any state changes
        self._stats.requests += 1
        prefilled = self._prefill(prompt_ids)
        info.update(num_prompt_tokens=len(prompt_ids), num_cached_tokens=prefilled.num_cached_tokens, seed=seed,
                    asks=prefilled.asks)
        max_new = min(params.max_new_tokens, self.context_window - len(prompt_ids))
        cache, forward_kwargs = self._decode_cache(prefilled.cache, n, max_new, shared_prefix)
        logits = prefilled.last_logits if n == 1 else prefilled.last_logits.expand(n, -1)
        generators = [] if params.greedy else make_generators(seed, n, self.device)
        branches = [_Branch(i) for i in range(n)]
        active = list(range(n))  # active[row] = branch index of that batch row
        while True:
            tokens, logprobs = choose_next_tokens(logits, params, [generators[b] for b in active] if generators else [])
            token_list, logprob_list = tokens.tolist(), logprobs.tolist()
            keep_rows = []
            for row, b in enumerate(active):
                self._advance(branches[b], token_list[row], logprob_list[row], params, max_new)
                if branches[b].finish_reason is None:
                    keep_rows.append(row)
            self._stats.decode_tokens += len(active)
            yield branches, [token_list[0]] if active[0] == 0 else []
            if not keep_rows:
                if n == 1 and prefilled.exact:  # approximate (ASKS) KV never enters the exact cache
                    self._cache_generated(prompt_ids, branches[0].token_ids, cache)
                return
            if len(keep_rows) < len(active):
                index = torch.tensor(keep_rows, device=self.device)
                cache.batch_select_indices(index)
                tokens = tokens[index]
                active = [active[r] for r in keep_rows]
            out = self._decode_forward(tokens[:, None], cache, forward_kwargs)
            logits = out.logits[:, -1, :]

    def _use_shared_prefix(self) -> bool:
        """Whether branches decode through ``SharedPrefixCache`` (config ``decode_attention``).

        ``"auto"`` probes the model once (``shared_prefix.probe``) and falls back to the plain
        ``DynamicCache`` path if it fails; ``"shared_prefix"`` raises instead."""
        mode = self.config.decode_attention
        if mode == "dynamic_cache":
            return False
        if self._shared_prefix_probe is None:
            self._shared_prefix_probe = probe(self._model, self._forward)
        if mode == "shared_prefix" and not self._shared_prefix_probe.supported:
            raise ValueError(
                "decode_attention='shared_prefix' is not supported by this model "
                f"({self._shared_prefix_probe.reason}); use 'auto' or 'dynamic_cache'"
            )
        return self._shared_prefix_probe.supported

    def _decode_cache(self, cache: Any, n: int, max_new: int, shared_prefix: bool) -> tuple[Any, dict]:
        """The cache ``n`` branches decode with, and the extra forward kwargs it needs.

        Shared prefix: the prefill's batch-1 KV is kept once and each branch gets a preallocated
        suffix of ``max_new`` tokens (capped, see ``initial_suffix_capacity``; it doubles if needed). Plain: the prefill's
        ``DynamicCache`` with its row repeated ``n`` times."""
        if shared_prefix and SharedPrefixCache.can_share(cache):
            shared = SharedPrefixCache.from_dynamic_cache(cache, n, suffix_capacity=initial_suffix_capacity(max_new))
            return shared, shared.forward_kwargs()
        if n > 1:
            cache.batch_repeat_interleave(n)
        return cache, {}

    def _decode_forward(self, input_ids: torch.Tensor, cache: Any, forward_kwargs: dict) -> Any:
        # input_ids: (B, 1). The shared-prefix cache needs its attention function for this forward only.
        if not forward_kwargs:
            return self._forward(input_ids, cache)
        with attention_implementation(self._model, ATTENTION_NAME):
            return self._forward(input_ids, cache, **forward_kwargs)

    def _cache_generated(self, prompt_ids: list[int], token_ids: list[int], cache: Any) -> None:
        """Keep a single completion's KV too, the way SGLang caches finished requests: an agent's
        next prompt usually repeats this answer, so it is served from the cache instead of recomputed."""
        # The last generated token was never fed back, so its KV does not exist.
        sequence = prompt_ids + token_ids[:-1]
        if not self._cacheable or len(sequence) <= len(prompt_ids):
            return
        kv_all = cache.stacked_kv(0) if isinstance(cache, SharedPrefixCache) else _stack_kv(cache)
        if kv_all.shape[3] == len(sequence):
            self.prefix_cache.insert(sequence, kv_all)

    def _advance(self, branch: _Branch, token: int, logprob: float, params: SamplingParams, max_new: int) -> None:
        branch.token_ids.append(token)
        branch.logprobs.append(logprob)
        if token in self._eos_ids:
            branch.finish_reason = "eos"
            return
        branch.text = self._tokenizer.decode(branch.token_ids, skip_special_tokens=True)
        if params.stop:
            cut = _first_stop(branch.text, params.stop)
            if cut is not None:
                branch.text = branch.text[:cut]
                branch.finish_reason = "stop"
                return
        if len(branch.token_ids) >= max_new:
            branch.finish_reason = "length"

    @staticmethod
    def _to_completion(branch: _Branch, info: dict) -> Completion:
        return Completion(
            text=branch.text,
            token_ids=tuple(branch.token_ids),
            logprobs=tuple(branch.logprobs),
            finish_reason=branch.finish_reason or "length",
            num_prompt_tokens=info["num_prompt_tokens"],
            num_cached_tokens=info["num_cached_tokens"],
            branch_index=branch.index,
            seed=info["seed"],
            asks=info.get("asks"),
        )


def _stack_kv(cache: Any) -> torch.Tensor:
    """Row 0 of a DynamicCache as one tensor (L, 2, H_kv, T, D), the radix cache's layout."""
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])


def _first_stop(text: str, stops: tuple[str, ...]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _safe_stream_end(text: str, stops: tuple[str, ...]) -> int:
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
