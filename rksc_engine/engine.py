"""The engine: the public facade over one model (``RKSCEngine``).

It builds the runtime (``runtime/``: the model runner, the prefill, the scheduler) and the radix
cache (``kvcache/``), encodes and checks what callers pass, and hands every request to the
scheduler. Reasoning (``reasoning/``) and tree search are reached from here but live on top of it.

Contract:
    * ``generate`` / ``generate_branches`` / ``generate_many`` / ``stream`` take a prompt (a string,
      a list of chat messages, or token ids) and ``SamplingParams``, and return ``Completion``s that hold
      generated text only.
    * One prefill per prompt: the prompt's longest cached prefix comes from the radix cache, only the
      rest is computed, and its KV is fanned out to the ``n`` sibling branches, which decode as one batch.
      A branch that finishes leaves the batch, so it stops costing compute.
    * Exactness: with the prefix cache on or off, greedy output equals ``model.generate(do_sample=False)``
      token for token, and branch i (seeded ``seed + i``) is the same alone or among siblings.
    * Many requests at once: every call goes through ``submit`` to one scheduler
      (``runtime.scheduler``), which decodes the branches of all running requests in one forward.
      A request's tokens do not depend on which other requests shared its batch (each request
      attends to its own KV with its own operations; only the linear layers see a wider batch).
    * Bad input raises ``ValueError``/``TypeError`` before any cache or counter changes.
    * The model and caches are touched only under the engine lock, one scheduler step (or one verifier
      pass) at a time; no lock is held while a caller reads a stream.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import torch

from .config import EngineConfig, SamplingParams, check_branch_hooks, check_request_shape
from .kvcache.memory import available_memory_bytes
from .kvcache.radix import RadixPrefixCache
from .kvcache.shared_prefix import initial_suffix_capacity
from .kvcache.state_snapshots import StateSnapshots
from .results import Completion, EngineStats, StreamChunk
from .runtime.cpu_threads import release_openmp_workers
from .runtime.handle import BranchMonitor, LogitsProcessor, RequestHandle, astream_chunks, stream_chunks
from .runtime.loading import ensure_default_model, load_model_dir, resolve_device, resolve_dtype
from .runtime.model_runner import ModelRunner
from .runtime.prefill import Prefiller
from .runtime.prefix_access import CachedPrefix, Prefilled
from .runtime.prompts import ChatMessage, Prompt, PromptEncoder
from .runtime.sampling import decode_bytes_per_row
from .runtime.scheduler import Scheduler
from .runtime.stats import Counters
from .units import format_bytes

__all__ = ["CachedPrefix", "ChatMessage", "Prefilled", "Prompt", "RKSCEngine"]


class RKSCEngine:
    """Multi-branch generation over one shared prompt prefill, with a radix prefix cache across calls.

    Example:
        >>> engine = RKSCEngine.from_pretrained()  # embedded SmolLM2-135M-Instruct
        >>> branches = engine.generate_branches("Q: 2+3=?\\nA:", n=4,
        ...     params=SamplingParams(temperature=0.7, max_new_tokens=16, seed=0))
        >>> engine.stats().prompt_tokens_computed  # the prompt was prefilled once, not 4 times

    Attributes:
        config: The engine's settings.
        prefix_cache: The radix prefix cache (RSBCM budget and eviction).
        runner: The model runner: every forward pass (``runtime.model_runner``).
        scheduler: The step loop that serves every request (``runtime.scheduler``).
        device, dtype: Where the model's weights are, and their dtype.
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig | None = None) -> None:
        config = EngineConfig() if config is None else config
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        self._config = config
        self._tokenizer = tokenizer
        self._counters = Counters()
        self.prefix_cache = RadixPrefixCache(
            config.rsbcm.budget_bytes, policy=config.rsbcm.policy, block_size=config.rsbcm.block_size
        )
        self.runner = ModelRunner(model, tokenizer, config, self.prefix_cache, self._counters)
        self.device, self.dtype = self.runner.device, self.runner.dtype
        cacheable = config.rsbcm.enabled and self.runner.supports_prefix_cache()
        sliding = self.runner.sliding_window_layers() if cacheable and config.rsbcm.free_out_of_window else None
        if sliding is not None:
            # Out-of-window KV of those layers is freed first under the budget (radix.py).
            self.prefix_cache.set_sliding_window(*sliding)
        # A model the radix cache cannot hold keeps snapshots of its prompts' states instead.
        snapshots = StateSnapshots(config.rsbcm.budget_bytes) if config.rsbcm.enabled and not cacheable else None
        self._prefill = Prefiller(self.runner, self.prefix_cache, config.asks, cacheable, self._counters, snapshots)
        self._prompts = PromptEncoder(tokenizer, int(model.config.vocab_size), config.asks, cacheable)
        self.scheduler = Scheduler(self.runner, self._prefill, tokenizer, config.scheduler, self._counters)
        self._lock = self.scheduler.lock
        # This thread loaded the model; the scheduler's thread runs it from now on.
        release_openmp_workers()

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
    def config(self) -> EngineConfig:
        """The engine's settings. Assigning a new ``EngineConfig`` applies its ASKS, scheduler,
        decode and out-of-memory settings from the next request on; the cache's budget, block size
        and policy, and whether the cache is on, stay as the engine was built."""
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        if not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an EngineConfig, got {type(config).__name__}")
        with self._lock:
            self._config = config
            self.runner.config = config
            self._prefill.asks_config = self._prompts.asks_config = config.asks
            self.scheduler.config = config.scheduler

    @property
    def model(self) -> Any:
        """The underlying ``transformers`` model."""
        return self.runner.model

    @property
    def tokenizer(self) -> Any:
        """The underlying ``transformers`` tokenizer."""
        return self._tokenizer

    @property
    def context_window(self) -> int:
        return self.runner.context_window

    @property
    def model_name(self) -> str:
        return self.runner.model_name

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token takes over all layers (keys and values), at the model's dtype."""
        return self.runner.kv_bytes_per_token

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a branch (the generation config's and the tokenizer's EOS)."""
        return self.runner.eos_token_ids

    @property
    def prefix_cache_enabled(self) -> bool:
        """Whether the radix prefix cache is in use (configured on, and the model's cache layers allow it)."""
        return self._prefill.cacheable

    # -- prompts --------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a string (tokenised as ``tokenizer(prompt)`` does), a list of chat
        messages (rendered with the model's chat template, generation prompt appended), or token ids.
        """
        return self._prompts.encode(prompt)

    def encode_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> list[int]:
        """Token ids of chat ``messages`` rendered with the model's chat template (generation prompt
        appended); ``template_kwargs`` go to ``apply_chat_template`` (``tools=...``)."""
        return self._prompts.encode_chat(list(messages), **template_kwargs)

    def render_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> str:
        """The chat template applied to ``messages`` with the assistant's generation prompt appended."""
        return self._prompts.render_chat(messages, **template_kwargs)

    def validate_request(self, prompt_ids: list[int], n: int, params: SamplingParams | None) -> SamplingParams:
        """Check a request before anything runs: ``params`` (default ``SamplingParams()``), ``n`` and the
        prompt's length against the context window, and whether ``n`` branches can fit: their KV in
        the cache budget, and their KV, logits and sampling buffers in the memory the device has
        available now. Returns the params to use."""
        params = check_request_shape(n, params)
        window = self.context_window
        if len(prompt_ids) >= window:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the model's context window is {window}, "
                f"so the prompt must have at most {window - 1}"
            )
        # Every branch gets its own suffix buffer up front: refuse a request whose buffers alone
        # could not fit in the cache budget, before any work.
        max_new = min(params.max_new_tokens, window - len(prompt_ids))
        per_branch = initial_suffix_capacity(max_new) * self.kv_bytes_per_token
        budget = self.prefix_cache.configured_budget_bytes
        if n * per_branch > budget:
            most = max(1, budget // per_branch)
            raise ValueError(
                f"n={n} branches of up to {max_new} new tokens need {format_bytes(n * per_branch)} of KV "
                f"({self.kv_bytes_per_token:,} bytes per token), more than the cache budget of "
                f"{format_bytes(budget)} (rsbcm.cache_budget_mb): n can be at most {most} here; lower n or "
                f"max_new_tokens, or raise rsbcm.cache_budget_mb"
            )
        self._check_branch_memory("n", n, per_branch)
        return params

    def _check_branch_memory(self, name: str, branches: int, kv_per_branch: int) -> None:
        """``ValueError`` naming ``name`` when ``branches`` decoding rows would need more memory than
        the device has available: each row's first KV buffer, and its logits and sampling buffers
        over the whole vocabulary (``decode_bytes_per_row``), which every step of the request holds."""
        vocab_size = self._prompts.vocab_size
        per_branch = decode_bytes_per_row(vocab_size, self.dtype) + kv_per_branch
        need = branches * per_branch
        available = available_memory_bytes(self.device)
        if available is None or need <= available:
            return
        most = max(1, available // per_branch)
        raise ValueError(
            f"{name}={branches} branches need about {format_bytes(need)} of memory on {self.device.type} "
            f"({format_bytes(per_branch)} a branch: its logits and sampling buffers over a vocabulary of "
            f"{vocab_size:,} entries at {str(self.dtype).removeprefix('torch.')}, and its KV), more than the "
            f"{format_bytes(available)} available there now: {name} can be at most {most}; lower {name}"
        )

    # -- public generation ----------------------------------------------------------------------
    def submit(
        self,
        prompt: Prompt,
        n: int = 1,
        params: SamplingParams | None = None,
        *,
        stream: bool = False,
        logits_processor: LogitsProcessor | None = None,
        monitor: BranchMonitor | None = None,
        max_branches: int | None = None,
    ) -> RequestHandle:
        """Queue a request of ``n`` branches and return its handle at once.

        The scheduler batches it with every other running request (one forward decodes all their
        branches); the prompt is prefilled once, its longest cached prefix served by the radix cache.
        Bad input raises here, before anything is queued or counted; a text whose length in
        characters alone proves it longer than the context window is refused before it is
        tokenized (``runtime.prompt_bound``), so a megabyte of text costs no seconds of tokenizing.

        Args:
            prompt: A string, a list of chat messages, or token ids.
            n: Sibling branches (>= 1); branch ``i`` samples with the generator seeded ``seed + i``.
            params: Sampling settings (default greedy, 256 new tokens).
            stream: Deliver a ``StreamChunk`` per step and branch (iterate the handle); otherwise only
                each branch's final chunk.
            logits_processor: ``fn(token_ids_per_row, logits (rows, V)) -> logits`` applied to this
                request's rows before sampling (token masks, constrained decoding); logprobs are then
                over the processed distribution.
            monitor: A ``BranchMonitor`` that sees this request's branches step by step and may stop
                some or add more (early-stop rules; ``rksc_engine.reasoning.early_stop``).
            max_branches: The most branches ``monitor`` may bring the request to (default ``n``: none
                added). Added branches fork off the prompt's KV, kept while the request runs.

        Returns:
            A ``RequestHandle``: ``.result()``, iterate it, ``await`` it, or ``.cancel()`` it.
        """
        # A text that certainly overflows the context window is refused before it is tokenized.
        prompt_ids = self._prompts.encode(prompt, self.context_window)
        params = self.validate_request(prompt_ids, n, params)
        if logits_processor is not None and not callable(logits_processor):
            raise TypeError(f"logits_processor must be callable, got {type(logits_processor).__name__}")
        max_branches = check_branch_hooks(n, params, stream, monitor, max_branches)
        if max_branches > n:
            max_new = min(params.max_new_tokens, self.context_window - len(prompt_ids))
            self._check_branch_memory("max_branches", max_branches,
                                      initial_suffix_capacity(max_new) * self.kv_bytes_per_token)
            if monitor is None:
                raise ValueError("max_branches > n needs a monitor, which is what adds branches")
        return self.scheduler.submit(prompt_ids, n, params, stream=stream, logits_processor=logits_processor,
                                      context_spans=self._prompts.context_spans(prompt, prompt_ids), monitor=monitor,
                                      max_branches=max_branches)

    def prompt_segments(self, prompt: Prompt, prompt_ids: list[int]) -> tuple[tuple[int, int], ...] | None:
        """Token spans tiling ``prompt_ids`` cut at ``config.asks.chunk_separator``, for retrieved-context
        reuse; None when it is off or the prompt has no text to cut (``PromptEncoder.context_spans``)."""
        return self._prompts.context_spans(prompt, prompt_ids)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None) -> Completion:
        """One completion of ``prompt``."""
        return self.submit(prompt, 1, params).result()[0]

    def generate_branches(self, prompt: Prompt, n: int, params: SamplingParams | None = None) -> list[Completion]:
        """``n`` sibling completions of one prompt, prefilled once and decoded as one batch."""
        return self.submit(prompt, n, params).result()

    def generate_many(self, prompts: Sequence[Prompt], params: SamplingParams | None = None) -> list[Completion]:
        """One completion per prompt, all submitted at once and decoded together.

        Every prompt is checked before any is queued. Requests admitted in one step are prefilled in
        order through the radix cache, so a prefix shared by several prompts is computed once.
        """
        handles = self._submit_all(prompts, 1, params)
        return [h.result()[0] for h in handles]

    def _submit_all(self, prompts: Sequence[Prompt], n: int, params: SamplingParams | None) -> list[RequestHandle]:
        if isinstance(prompts, (str, bytes, bytearray)) or not isinstance(prompts, Sequence):
            raise TypeError("prompts must be a list of prompts")
        encoded = [self._prompts.encode(p, self.context_window) for p in prompts]
        checked = [self.validate_request(ids, n, params) for ids in encoded]
        return [self.scheduler.submit(ids, n, p, stream=False, logits_processor=None) for ids, p in zip(encoded, checked)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield the text of one completion as it is generated.

        Text that could still turn out to be the start of a stop string is held back until it is
        known not to be, so a stop string never leaks into the stream. The last chunk carries the
        finished ``Completion``. No lock is held while the caller reads: closing the iterator (or
        dropping it) from any thread cancels the request and frees its KV.
        """
        handle = self.submit(prompt, 1, params, stream=True)
        return stream_chunks(handle)

    async def agenerate(self, prompt: Prompt, params: SamplingParams | None = None) -> Completion:
        """``generate`` for asyncio: awaits the scheduler without blocking the event loop."""
        return (await self.submit(prompt, 1, params))[0]

    async def agenerate_branches(self, prompt: Prompt, n: int, params: SamplingParams | None = None
                                 ) -> list[Completion]:
        """``generate_branches`` for asyncio."""
        return await self.submit(prompt, n, params)

    async def agenerate_many(self, prompts: Sequence[Prompt], params: SamplingParams | None = None
                             ) -> list[Completion]:
        """``generate_many`` for asyncio."""
        handles = self._submit_all(prompts, 1, params)
        return [(await h)[0] for h in handles]

    async def astream(self, prompt: Prompt, params: SamplingParams | None = None) -> AsyncIterator[StreamChunk]:
        """``stream`` for asyncio; cancelling the consuming task cancels the request."""
        async for chunk in astream_chunks(self.submit(prompt, 1, params, stream=True)):
            yield chunk

    # -- stats and holding the engine -----------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (prompt tokens computed/reused, decode tokens, cache).

        Never waits for the engine: while a scheduler step, a verifier pass or an ``exclusive()``
        block of another thread holds it, this returns the snapshot published when the engine was
        last let go of (and before any request finished), so a server's ``/metrics`` never stalls
        behind the model.
        """
        return self.scheduler.stats()

    def reset_stats(self) -> None:
        with self._lock:
            self.scheduler.reset_stats()

    def exclusive(self) -> AbstractContextManager[Any]:
        """A context manager that holds the engine across several calls (``with engine.exclusive():``).

        No other thread's call runs until the block ends, so a ``stats()`` delta taken inside belongs
        to the block alone. The lock is re-entrant: calls made inside the block proceed as usual.
        """
        return self._lock

    def holds_engine(self) -> bool:
        """Whether the calling thread holds the engine (is inside ``exclusive()`` or a scheduler step)."""
        return self._lock.held_by_caller()

    def clear_cache(self) -> None:
        """Drop all cached prefixes not in use."""
        with self._lock:
            self.prefix_cache.clear()
            self._prefill.clear_snapshots()

    # -- the cache, for callers that drive the model themselves --------------------------------------
    def annotate_cache(self, token_ids: Sequence[int], *, start: int = 0, branch_score: float, depth: int) -> int:
        """Tell RSBCM what cached KV is worth: set ``branch_score`` and ``depth`` (reasoning steps from
        the root) on the cached KV of ``token_ids[start:]``; ``omega`` eviction reads them. Returns the
        number of cached tokens annotated (0 when the cache is off)."""
        with self._lock:
            return self._prefill.annotate(token_ids, start=start, branch_score=branch_score, depth=depth)

    def prefill(self, prompt: Prompt) -> Prefilled:
        """Compute a prompt's KV (its longest cached prefix from the prefix cache, the rest computed
        and cached) without generating, and hand the caller the batch-1 cache and last logits. For
        tools and benchmarks that drive the model themselves (with ``forward``)."""
        prompt_ids = self.encode(prompt)
        self.validate_request(prompt_ids, 1, None)
        with self._lock:
            return self._prefill.prefill(prompt_ids)

    def forward(self, input_ids: torch.Tensor, cache: Any, **model_kwargs: Any) -> Any:
        """One model pass over ``input_ids`` (B, T) after a caller-owned ``transformers`` cache, under
        the engine lock (between scheduler steps) and with the out-of-memory roll-back and retry."""
        with self._lock, torch.inference_mode():
            return self.runner.forward(input_ids, cache, **model_kwargs)

    def warm_cache(self, prompt: Prompt) -> int:
        """Compute the KV of ``prompt`` into the prefix cache without generating (a no-op for the part
        already cached). Returns the prompt tokens computed. Used to share one prefill among requests
        that are about to follow it."""
        prompt_ids = self.encode(prompt)
        self.validate_request(prompt_ids, 1, None)
        with self._lock:
            return self._prefill.warm(prompt_ids)

    def cached_prefix_length(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the prefix cache holds KV for (0 when it is off)."""
        with self._lock:
            return self._prefill.cached_prefix_length(token_ids)

    @contextlib.contextmanager
    def cached_prefix(self, prefix_ids: Sequence[int]) -> Iterator[CachedPrefix]:
        """Hold the engine and lend a batch-1 ``transformers`` cache holding the longest cached prefix
        of ``prefix_ids`` (always leaving its last token to compute), for a caller that runs its own
        pass over the model (the verifier's batched Yes/No pass).

        Inside the block no scheduler step runs. Run passes with ``CachedPrefix.run_decoder`` (the
        out-of-memory retry applies) and set ``CachedPrefix.computed_tokens``/``reused_tokens``; they
        are added to the engine's counters when the block ends, and the prefix is unlocked.
        """
        with self._lock, self._prefill.lend(prefix_ids) as lent:
            yield lent

    # -- multi-branch reasoning -------------------------------------------------------------------
    def reason(self, question: str, **kwargs: Any) -> Any:
        """Answer ``question`` by self-consistency over ``n`` branches, verified with CGEE.

        Keyword args (see ``rksc_engine.reasoning.reason``): ``n`` (8), ``params``, ``few_shot``
        (worked ``Problem``s) or ``prompt`` (your own messages), ``answer_extractor`` (``"gsm8k"``,
        ``"choice"`` or a callable), ``verifier`` (default: this engine as a Yes/No judge; any
        ``Verifier`` or ``fn(question, candidates) -> scores``), ``cgee`` (``CGEEConfig``; default
        ``self.config.cgee``), ``early_stop`` (``"decided"``, the exact default: running branches are
        cancelled once they cannot change the vote's winner; ``"answered"``, ``"adaptive"``,
        ``"confidence"``, an ``EarlyStopConfig``, or None for every branch to its end), ``cancel`` (a
        ``CancelToken``: cancelling it stops the call with ``RequestCancelled``, its branches at once,
        or before the verifier pass), ``vote`` (``"exact"``, the default; ``"cluster"`` to group
        equivalent free-text answers before counting, e.g. with
        ``answer_extractor=rksc_engine.reasoning.answer_key``; or a ``VoteConfig``).

        Returns:
            A ``ReasoningResult`` with the answer, votes, branches, ``VerificationReport`` and
            ``early_stop`` report (branches launched and cancelled, decode tokens, which rule stopped what).
        """
        from .reasoning.self_consistency import reason  # reasoning is built on the engine, not under it

        return reason(self, question, **kwargs)

    async def areason(self, question: str, **kwargs: Any) -> Any:
        """``reason`` for asyncio: the branches decode in the scheduler beside every other request
        while the event loop stays free. Same keyword args and result."""
        from .reasoning.self_consistency import areason

        return await areason(self, question, **kwargs)

    def tree_search(self, question: str, **kwargs: Any) -> Any:
        """Beam search over reasoning steps, sharing each parent's KV with its children, inside the
        RSBCM cache budget; see ``rksc_engine.reasoning.tree_search`` for the keyword args
        (``breadth``, ``depth``, ``beam``, ``step_delimiter``, ``scorer``, ``params``, ``early_stop``
        to end a node's children that run far longer than their finished siblings, ``cancel`` (a
        ``CancelToken``: the search stops before its next level with ``RequestCancelled``, its
        requests in flight cancelled at once), ...).

        Returns:
            A ``SearchResult`` with the best path, its answer, and the scored tree.
        """
        from .reasoning.tree_search import tree_search

        return tree_search(self, question, **kwargs)
