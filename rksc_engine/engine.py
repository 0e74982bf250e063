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
    * Many requests at once: every call goes through ``submit`` to one scheduler
      (``rksc_engine.scheduler``), which decodes the branches of all running requests in one forward.
      A request's tokens do not depend on which other requests shared its batch (each request
      attends to its own KV with its own operations; only the linear layers see a wider batch).
    * Bad input raises ``ValueError``/``TypeError`` before any cache or counter changes.
    * The model and caches are touched only under the engine lock, one scheduler step (or one verifier
      pass) at a time; no lock is held while a caller reads a stream.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
from collections.abc import AsyncIterator, Callable, Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from . import asks, chunk_reuse
from .config import EngineConfig, SamplingParams, check_request_shape
from .loading import ensure_default_model, load_model_dir, resolve_device, resolve_dtype
from .memory import run_with_oom_retry
from .prefix_cache import RadixPrefixCache
from .requests import BranchMonitor, LogitsProcessor, RequestHandle, astream_chunks, stream_chunks
from .scheduler import Scheduler
from .shared_prefix import ProbeResult, SharedPrefixCache, initial_suffix_capacity, probe
from .types import ASKSDecision, ChunkReuseDecision, Completion, EngineStats, StreamChunk

logger = logging.getLogger(__name__)
# Inconclusive shared-prefix probes (exceptions) tolerated before the fast path is given up.
MAX_PROBE_ATTEMPTS = 3

ChatMessage = dict[str, Any]
Prompt = str | Sequence[ChatMessage] | Sequence[int]
CHAT_ROLES = ("system", "user", "assistant", "tool")
T = TypeVar("T")


@dataclass
class Prefilled:
    """A prompt whose KV is computed: the batch-1 cache and the logits of its last position.

    Attributes:
        prompt_ids: The prompt's token ids.
        cache: A batch-1 ``transformers`` ``DynamicCache`` holding the whole prompt's KV (the
            caller's own; the prefix cache keeps its own copy of the exact part).
        last_logits: (1, V) next-token logits after the prompt.
        num_cached_tokens: Prompt tokens served by the prefix cache instead of computed.
        exact: False when ASKS reused approximate KV.
        asks: What ASKS did, None when it did not act.
    """

    prompt_ids: list[int]
    cache: Any  # transformers DynamicCache, batch 1
    last_logits: torch.Tensor  # (1, V)
    num_cached_tokens: int
    # False when ASKS reused approximate KV: then nothing past the prompt's exact part, and nothing
    # decoded on top of it, may go into the token-exact prefix cache.
    exact: bool = True
    asks: ASKSDecision | ChunkReuseDecision | None = None  # what ASKS did, None when it did not act


class EngineLock:
    """A re-entrant lock that knows its owner, so "does this thread hold the engine?" is answered
    without reaching into ``threading.RLock`` internals. Used as ``with lock:``."""

    def __init__(self, on_release: Callable[[], None] | None = None) -> None:
        self._lock = threading.RLock()
        self._owner: int | None = None
        self._depth = 0
        self._on_release = on_release  # run by the outermost release, while the lock is still held

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if not self._lock.acquire(blocking, timeout):
            return False
        self._owner = threading.get_ident()
        self._depth += 1
        return True

    def release(self, run_hook: bool = True) -> None:
        if self._owner != threading.get_ident():
            raise RuntimeError("the engine lock is released by a thread that does not hold it")
        if run_hook and self._depth == 1 and self._on_release is not None:
            try:
                self._on_release()
            except Exception:  # a convenience (the stats snapshot): never a reason to keep the lock
                logger.exception("the engine lock's release hook failed")
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def held_by_caller(self) -> bool:
        return self._owner == threading.get_ident()

    def __enter__(self) -> EngineLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


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
        # Whoever lets go of the engine last (a step, a verifier pass, an exclusive() block) publishes
        # the stats snapshot that stats() returns while someone else holds it.
        self._lock = EngineLock(on_release=self.publish_stats)
        self._stats = EngineStats()
        self._published_stats = EngineStats()
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
        self._shared_prefix_probe: ProbeResult | None = None  # probed on first decode, see decodes_with_shared_prefix
        self._scheduler = Scheduler(self)
        self._probe_failures = 0
        self._oom_since_relax = False

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
        if isinstance(prompt, (bytes, bytearray, memoryview)):
            raise TypeError(f"prompt must be a string, a list of chat messages or a list of token ids, got "
                            f"{type(prompt).__name__}; decode bytes first (prompt.decode('utf-8'))")
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string, list of chat messages or token ids")
            _check_encodable(prompt, "prompt")
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

    def encode_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> list[int]:
        """Token ids of chat ``messages`` rendered with the model's chat template (generation prompt
        appended); ``template_kwargs`` go to ``apply_chat_template`` (``tools=...``)."""
        return self._encode_chat(list(messages), **template_kwargs)

    def _encode_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> list[int]:
        # Extra keys (LangChain's ``name``, ``id``, ``tool_calls``...) go to the chat template as they
        # are, which uses what it knows; any non-empty history of known roles is accepted, an
        # assistant-only one included (the model then writes the next assistant turn).
        for i, message in enumerate(messages):
            role = message.get("role")
            if role not in CHAT_ROLES:
                raise ValueError(f"messages[{i}]['role'] must be one of {list(CHAT_ROLES)}, got {role!r}")
            content = message.get("content")
            if not isinstance(content, str):
                raise TypeError(f"messages[{i}]['content'] must be a string, got {type(content).__name__}")
            _check_encodable(content, f"messages[{i}]['content']")
        if not getattr(self._tokenizer, "chat_template", None):
            raise ValueError("this tokenizer has no chat template; pass the prompt as a string")
        text = self.render_chat(messages, **template_kwargs)
        return list(self._tokenizer(text, add_special_tokens=False)["input_ids"])

    def render_chat(self, messages: list[ChatMessage], **template_kwargs: Any) -> str:
        """The chat template applied to ``messages`` with the assistant's generation prompt appended."""
        return self._tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **template_kwargs
        )

    @property
    def prefix_cache_enabled(self) -> bool:
        """Whether the radix prefix cache is in use (configured on, and the model's cache layers allow it)."""
        return self._cacheable

    def holds_engine(self) -> bool:
        """Whether the calling thread holds the engine (is inside ``exclusive()`` or a scheduler step)."""
        return self._lock.held_by_caller()

    def count(self, counter: str, amount: int = 1) -> None:
        """Add ``amount`` to the ``EngineStats`` field ``counter`` (or to ``extra[counter]`` for a
        counter that is not a field); how the scheduler reports requests, decode tokens, preemptions."""
        if counter in EngineStats.__dataclass_fields__ and counter != "extra":
            setattr(self._stats, counter, getattr(self._stats, counter) + amount)
        else:
            self._stats.extra[counter] = self._stats.extra.get(counter, 0) + amount

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token takes over all layers (keys and values), at the model's dtype."""
        cfg = self._model.config.get_text_config() if hasattr(self._model.config, "get_text_config") else self._model.config
        num_heads = int(cfg.num_attention_heads)
        num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
        return 2 * int(cfg.num_hidden_layers) * num_kv_heads * head_dim * self.dtype.itemsize

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Token ids that end a branch (the generation config's and the tokenizer's EOS)."""
        return self._eos_ids

    def validate_request(self, prompt_ids: list[int], n: int, params: SamplingParams | None) -> SamplingParams:
        """Check a request before anything runs: ``params`` (default ``SamplingParams()``), ``n`` and the
        prompt's length against the context window. Returns the params to use."""
        params = check_request_shape(n, params)
        if len(prompt_ids) >= self.context_window:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the model's context window is {self.context_window}, "
                f"so the prompt must have at most {self.context_window - 1}"
            )
        # Every branch gets its own suffix buffer up front: refuse a request whose buffers alone
        # could not fit in the cache budget, before any work.
        max_new = min(params.max_new_tokens, self.context_window - len(prompt_ids))
        suffix_bytes = n * initial_suffix_capacity(max_new) * self.kv_bytes_per_token
        budget = self.prefix_cache.configured_budget_bytes
        if suffix_bytes > budget:
            most = max(1, budget // (initial_suffix_capacity(max_new) * self.kv_bytes_per_token))
            raise ValueError(
                f"n={n} branches of up to {max_new} new tokens need {suffix_bytes / 2**20:,.0f} MiB of KV "
                f"({self.kv_bytes_per_token:,} bytes per token), more than the cache budget of "
                f"{budget / 2**20:,.0f} MiB (rsbcm.cache_budget_mb): n can be at most {most} here; lower n or "
                f"max_new_tokens, or raise rsbcm.cache_budget_mb"
            )
        return params

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
        Bad input raises here, before anything is queued or counted.

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
                some or add more (early-stop rules; ``rksc_engine.early_stop``).
            max_branches: The most branches ``monitor`` may bring the request to (default ``n``: none
                added). Added branches fork off the prompt's KV, kept while the request runs.

        Returns:
            A ``RequestHandle``: ``.result()``, iterate it, ``await`` it, or ``.cancel()`` it.
        """
        prompt_ids = self.encode(prompt)
        params = self.validate_request(prompt_ids, n, params)
        if logits_processor is not None and not callable(logits_processor):
            raise TypeError(f"logits_processor must be callable, got {type(logits_processor).__name__}")
        if not isinstance(stream, bool):
            raise TypeError(f"stream must be a bool, got {type(stream).__name__}")
        if monitor is not None and not callable(getattr(monitor, "observe", None)):
            raise TypeError(f"monitor must have an observe(events) method, got {type(monitor).__name__}")
        if max_branches is None:
            max_branches = n
        elif not isinstance(max_branches, int) or isinstance(max_branches, bool):
            raise TypeError(f"max_branches must be an int or None, got {type(max_branches).__name__}")
        elif max_branches < n:
            raise ValueError(f"max_branches must be >= n ({n}), got {max_branches}")
        if max_branches > n:
            check_request_shape(max_branches, params)  # the added branches obey the same bounds
            if monitor is None:
                raise ValueError("max_branches > n needs a monitor, which is what adds branches")
        return self._scheduler.submit(prompt_ids, n, params, stream=stream, logits_processor=logits_processor,
                                      segments=self.prompt_segments(prompt, prompt_ids), monitor=monitor,
                                      max_branches=max_branches)

    def prompt_segments(self, prompt: Prompt, prompt_ids: list[int]) -> tuple[tuple[int, int], ...] | None:
        """Token spans tiling ``prompt_ids`` cut at ``config.asks.chunk_separator``, for retrieved-context
        reuse; None when it is off, the prompt is token ids (no text to cut), or the tokenizer gives
        no character offsets. The spans come from the same tokenisation as ``prompt_ids``, which is
        checked token for token, so cutting never changes how the prompt is tokenised."""
        config = self.config.asks
        if not (config.enabled and config.reuse_chunks and self._cacheable):
            return None
        if isinstance(prompt, str):
            text, special = prompt, True
        elif isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], dict):
            text, special = self.render_chat(list(prompt)), False
        else:
            return None
        if config.chunk_separator not in text:
            return None
        try:
            encoded = self._tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        except (NotImplementedError, ValueError, TypeError):  # a slow tokenizer has no offsets
            return None
        if list(encoded["input_ids"]) != prompt_ids:
            return None
        offsets = [tuple(pair) for pair in encoded["offset_mapping"]]
        return tuple(chunk_reuse.segment_spans(text, offsets, config.chunk_separator))

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
        encoded = [self.encode(p) for p in prompts]
        checked = [self.validate_request(ids, n, params) for ids in encoded]
        return [self._scheduler.submit(ids, n, p, stream=False, logits_processor=None) for ids, p in zip(encoded, checked)]

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

    # -- stats ----------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """A snapshot of the engine's counters (prompt tokens computed/reused, decode tokens, cache).

        Never waits for the engine: while a scheduler step, a verifier pass or an ``exclusive()``
        block of another thread holds it, this returns the snapshot published when the engine was
        last let go of (and before any request finished), so a server's ``/metrics`` never stalls
        behind the model.
        """
        if not self._lock.acquire(blocking=False):
            return self._published_stats
        try:
            return self.publish_stats()
        finally:
            self._lock.release(run_hook=False)  # just published

    def publish_stats(self) -> EngineStats:
        """Take a fresh snapshot and make it the one ``stats()`` returns while the engine is busy.
        Runs whenever the engine is let go of, and when the scheduler finishes a request (before its
        caller wakes); the caller holds the engine."""
        self._published_stats = snapshot = self._take_stats()
        return snapshot

    def _take_stats(self) -> EngineStats:
        snapshot = EngineStats(**{k: v for k, v in vars(self._stats).items() if k != "extra"})
        snapshot.extra = dict(self._stats.extra)
        snapshot.cache_bytes = self.prefix_cache.total_bytes
        snapshot.cache_tokens = self.prefix_cache.total_tokens
        snapshot.cache_evicted_tokens = self.prefix_cache.evicted_tokens
        snapshot.cache_peak_bytes = self.prefix_cache.peak_bytes
        snapshot.cache_budget_bytes = self.prefix_cache.budget_bytes
        scheduler = self._scheduler
        snapshot.running_requests = scheduler.num_running_requests
        snapshot.waiting_requests = scheduler.num_waiting
        snapshot.running_kv_bytes = scheduler.running_kv_bytes()
        snapshot.peak_running_kv_bytes = scheduler.peak_running_kv_bytes
        snapshot.peak_batch_rows = scheduler.peak_batch_rows
        return snapshot

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = EngineStats()
            self.prefix_cache.reset_peak()
            self._scheduler.peak_batch_rows = self._scheduler.num_running_rows
            self._scheduler.peak_running_kv_bytes = self._scheduler.running_kv_bytes()
            self.publish_stats()

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
        return self._run_with_oom_retry(
            lambda: self._model(input_ids=input_ids, use_cache=True, **{self._cache_kwarg: cache}, **kwargs), cache
        )

    def _run_with_oom_retry(self, forward: Any, cache: Any) -> Any:
        rsbcm = self.config.rsbcm
        return run_with_oom_retry(
            forward,
            cache,
            on_oom=self._free_memory_after_oom,
            max_attempts=rsbcm.oom_max_attempts,
            backoff_s=rsbcm.oom_backoff_s,
        )

    def request_finished(self) -> None:
        """A request finished: if no pass ran out of memory since the last one, memory pressure has
        eased, so a budget shrunk by an earlier out-of-memory error grows back a step."""
        cache = self.prefix_cache
        if self._oom_since_relax:
            self._oom_since_relax = False
        elif cache.budget_bytes < cache.configured_budget_bytes:
            cache.relax_budget(self.config.rsbcm.oom_budget_restore)

    def _free_memory_after_oom(self, error: BaseException, attempt: int) -> None:
        self._stats.oom_retries += 1
        self._oom_since_relax = True
        # Never below what the largest prompt being served needs, or the cache could not hold it.
        floor = self._scheduler.largest_prompt_tokens() * self.kv_bytes_per_token
        self.prefix_cache.shrink_budget(self.config.rsbcm.oom_budget_shrink, min_budget_bytes=max(1, floor))
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
        ``self.config.cgee``), ``early_stop`` (``"decided"``, the exact default: running branches are
        cancelled once they cannot change the vote's winner; ``"answered"``, ``"adaptive"``,
        ``"confidence"``, an ``EarlyStopConfig``, or None for every branch to its end).

        Returns:
            A ``ReasoningResult`` with the answer, votes, branches, ``VerificationReport`` and
            ``early_stop`` report (branches launched and cancelled, decode tokens, which rule stopped what).
        """
        from .reasoning import reason

        return reason(self, question, **kwargs)

    def prefill(self, prompt: Prompt) -> Prefilled:
        """Compute a prompt's KV (its longest cached prefix from the prefix cache, the rest computed
        and cached) without generating, and hand the caller the batch-1 cache and last logits. For
        tools and benchmarks that drive the model themselves (with ``forward``)."""
        prompt_ids = self.encode(prompt)
        self.validate_request(prompt_ids, 1, None)
        with self._lock:
            return self._prefill(prompt_ids)

    def forward(self, input_ids: torch.Tensor, cache: Any, **model_kwargs: Any) -> Any:
        """One model pass over ``input_ids`` (B, T) after a caller-owned ``transformers`` cache, under
        the engine lock (between scheduler steps) and with the out-of-memory roll-back and retry."""
        with self._lock, torch.inference_mode():
            return self._forward(input_ids, cache, **model_kwargs)

    def warm_cache(self, prompt: Prompt) -> int:
        """Compute the KV of ``prompt`` into the prefix cache without generating (a no-op for the part
        already cached). Returns the prompt tokens computed. Used to share one prefill among requests
        that are about to follow it."""
        prompt_ids = self.encode(prompt)
        self.validate_request(prompt_ids, 1, None)
        with self._lock:
            before = self._stats.prompt_tokens_computed
            self._prefill(prompt_ids)
            return self._stats.prompt_tokens_computed - before

    def cached_prefix_length(self, token_ids: Sequence[int]) -> int:
        """How many leading tokens of ``token_ids`` the prefix cache holds KV for (0 when it is off)."""
        with self._lock:
            if not self._cacheable:
                return 0
            return self.prefix_cache.match_prefix(list(token_ids)).num_tokens

    @contextlib.contextmanager
    def cached_prefix(self, prefix_ids: Sequence[int]) -> Iterator[CachedPrefix]:
        """Hold the engine and lend a batch-1 ``transformers`` cache holding the longest cached prefix
        of ``prefix_ids`` (always leaving its last token to compute), for a caller that runs its own
        pass over the model (the verifier's batched Yes/No pass).

        Inside the block no scheduler step runs. Run passes with ``CachedPrefix.run_decoder`` (the
        out-of-memory retry applies) and set ``CachedPrefix.computed_tokens``/``reused_tokens``; they
        are added to the engine's counters when the block ends, and the prefix is unlocked.
        """
        with self._lock:
            cache, matched, node = self._cache_for_prefix(list(prefix_ids))
            lent = CachedPrefix(self, cache, matched)
            try:
                yield lent
            finally:
                if node is not None:
                    self.prefix_cache.unlock(node)
                self._stats.prompt_tokens_computed += lent.computed_tokens
                self._stats.prompt_tokens_reused += lent.reused_tokens

    async def areason(self, question: str, **kwargs: Any) -> Any:
        """``reason`` for asyncio: the branches decode in the scheduler beside every other request
        while the event loop stays free. Same keyword args and result."""
        from .reasoning import areason

        return await areason(self, question, **kwargs)

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

    def _prefill(self, prompt_ids: list[int]) -> Prefilled:
        """The whole prompt's KV in one pass (its cached prefix served by the radix cache)."""
        return _run_to_end(self.prefill_steps(prompt_ids, None))

    def prefill_steps(self, prompt_ids: list[int], chunk_tokens: int | Callable[[], int] | None,
                      segments: Sequence[tuple[int, int]] | None = None) -> Generator[int, None, Prefilled]:
        """Prefill ``prompt_ids`` in passes of at most ``chunk_tokens`` new tokens (one pass when None;
        a callable is asked before each pass, so the scheduler can hand each pass what is left of its
        step's token budget); the scheduler's chunked prefill. The caller holds the engine (``exclusive()``).

        A generator: it yields the tokens each pass computed, between passes, so the scheduler can
        decode other requests in between, and returns the ``Prefilled``. The matched prefix stays
        locked until it returns or is closed (``close()`` on a cancelled request unlocks it).
        ``segments`` (``prompt_segments``) let retrieved chunks be reused (``config.asks.reuse_chunks``)."""
        with torch.inference_mode():
            prefilled = self._prefill_with_chunks(prompt_ids, segments) if segments else None
            if prefilled is None:
                prefilled = self._prefill_with_asks(prompt_ids)
        if prefilled is not None:
            return prefilled
        prefilled = yield from self._prefill_exact(prompt_ids, chunk_tokens)
        matched = prefilled.num_cached_tokens
        self._stats.prefills += 1
        self._stats.prompt_tokens_computed += len(prompt_ids) - matched
        self._stats.prompt_tokens_reused += matched
        if matched:
            self._stats.cache_hits += 1
        else:
            self._stats.cache_misses += 1
        return prefilled

    def _prefill_exact(self, token_ids: list[int], chunk_tokens: int | Callable[[], int] | None
                       ) -> Generator[int, None, Prefilled]:
        """Token-exact prefill of ``token_ids``: the longest cached prefix from the radix cache (always
        leaving the last token to compute, for its logits), the rest computed in passes of at most
        ``chunk_tokens`` new tokens (one pass when None), and the whole sequence's KV inserted into the
        radix cache (when it is on).

        A generator like ``prefill_steps``: it yields the tokens each pass computed, between passes,
        and returns the ``Prefilled`` (``num_cached_tokens`` is the matched prefix). The matched
        prefix stays locked until it returns or is closed. It counts nothing in the engine's stats: a
        prompt's prefill and a retrieved chunk cached for reuse are counted differently, by the callers."""
        cache, matched, node = self._cache_for_prefix(token_ids)
        try:
            position = matched
            while True:
                limit = chunk_tokens() if callable(chunk_tokens) else chunk_tokens
                end = len(token_ids) if limit is None else min(len(token_ids), position + max(1, limit))
                with torch.inference_mode():
                    input_ids = torch.tensor([token_ids[position:end]], device=self.device)
                    out = self._forward(input_ids, cache, logits_to_keep=1)
                computed, position = end - position, end
                if position == len(token_ids):
                    break
                yield computed  # outside inference_mode: the caller's code runs between passes
            with torch.inference_mode():
                if self._cacheable:
                    self.prefix_cache.insert(token_ids, _stack_kv(cache))
        finally:
            if node is not None:
                self.prefix_cache.unlock(node)
        return Prefilled(token_ids, cache, out.logits[:, -1, :], matched)

    def _prefill_with_chunks(self, prompt_ids: list[int], segments: Sequence[tuple[int, int]]) -> Prefilled | None:
        """Prefill with retrieved chunks' KV reused at their positions in this prompt
        (``rksc_engine.chunk_reuse``); None when no chunk can be reused, so the other paths run.

        Each segment between the first and the last is a chunk, cached as ``header + chunk`` (the
        header being the prompt's first segment) in the radix cache and prefilled that way the first
        time it is seen. The last segment (the question) may start with a cached chunk; that part
        is reused too. Only the exact part, the prompt up to the first reused chunk, is inserted."""
        config = self.config.asks
        if not (config.enabled and config.reuse_chunks and self._cacheable and asks.supports_asks(self._model)):
            return None
        if len(segments) < 3 or config.recompute_fraction >= 1.0:  # nothing between header and question, or exact
            return None
        anchor = prompt_ids[:segments[0][1]]  # the header: chunks are cached as computed right after it
        last = len(prompt_ids) - 1  # the last prompt token is always computed: it gives the logits
        candidates = [(start, min(end, last)) for start, end in segments[1:]
                      if min(end, last) - start >= config.min_reuse_tokens]
        cached_tokens = 0
        cached_chunks = 0
        for start, end in candidates:
            if end <= segments[-1][0]:  # a middle segment: cache it on its own the first time it is seen
                computed = self._cache_sequence(anchor + prompt_ids[start:end])
                cached_tokens += computed
                cached_chunks += computed > 0
        # The first chunk is now a token-exact continuation of the header; whatever the radix cache
        # matches exactly is served exact, and only the chunks after it are reused.
        exact_tokens = self.prefix_cache.match_prefix(prompt_ids, max_tokens=last).num_tokens
        candidates = [(start, end) for start, end in candidates if start >= exact_tokens]
        self._stats.prompt_tokens_computed += cached_tokens
        self._stats.chunk_tokens_cached += cached_tokens
        locked, chunks = [], []
        try:
            for start, end in candidates:
                found = self.prefix_cache.match_prefix(anchor + prompt_ids[start:end])
                size = found.num_tokens - len(anchor)
                if size < config.min_reuse_tokens:
                    continue  # evicted since, or a question segment that does not start with a chunk
                self.prefix_cache.lock(found.last_node)
                locked.append(found.last_node)
                chunks.append(chunk_reuse.ReusedChunk(start, found.kv[:, :, :, len(anchor):], len(anchor)))
            if not chunks:
                return None
            cache, matched, node = self._cache_for_prefix(prompt_ids[:chunks[0].start + 1])
            if node is not None:
                locked.append(node)
            result = chunk_reuse.prefill_with_chunks(
                prompt_ids, cache, chunks, self._forward, self._model, config,
                num_segments=len(segments), num_cached_chunks=cached_chunks)
            exact_kv = _stack_kv(result.cache)[:, :, :, :result.num_exact_tokens]
            self.prefix_cache.insert(prompt_ids[:result.num_exact_tokens], exact_kv)
        finally:
            for held in locked:
                self.prefix_cache.unlock(held)
        decision = result.decision
        reused = matched + decision.reused_tokens
        self._stats.prefills += 1
        self._stats.prompt_tokens_computed += result.num_computed_tokens
        self._stats.prompt_tokens_reused += reused
        self._stats.cache_hits += 1 if reused else 0
        self._stats.cache_misses += 0 if reused else 1
        self._stats.chunk_reuse_prompts += int(decision.reused)
        self._stats.chunks_reused += decision.chunks_reused
        self._stats.chunk_recomputed_tokens += decision.recomputed_tokens
        self._stats.chunk_probe_tokens += decision.probe_tokens
        return Prefilled(prompt_ids, result.cache, result.last_logits, reused, exact=result.exact, asks=decision)

    def _cache_sequence(self, token_ids: list[int]) -> int:
        """Make sure the radix cache holds ``token_ids`` (prefilling what it lacks on top of what it
        has); returns the tokens computed. Only the KV is wanted, not the logits."""
        if self.prefix_cache.match_prefix(token_ids).num_tokens == len(token_ids):
            return 0
        # At least the last token is missing, so the exact prefill's match, which always leaves the
        # last token to compute, still reuses everything the cache holds of ``token_ids``.
        prefilled = _run_to_end(self._prefill_exact(token_ids, None))
        return len(token_ids) - prefilled.num_cached_tokens

    def _prefill_with_asks(self, prompt_ids: list[int]) -> Prefilled | None:
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
        return Prefilled(prompt_ids, result.cache, result.last_logits, result.num_reused_tokens,
                          exact=result.exact, asks=decision)

    def decodes_with_shared_prefix(self) -> bool:
        """Whether branches decode through ``SharedPrefixCache`` (config ``decode_attention``).

        ``"auto"`` probes the model once (``shared_prefix.probe``) and falls back to the plain
        ``DynamicCache`` path if it fails; ``"shared_prefix"`` raises instead."""
        mode = self.config.decode_attention
        if mode == "dynamic_cache":
            return False
        if self._shared_prefix_probe is None:
            result = probe(self._model, self._forward)
            if result.inconclusive:
                # No verdict: this request takes the plain path; a later one probes again, and after
                # a few failures in a row the path is given up (and the reason kept in the probe).
                self._stats.extra["shared_prefix_probe_errors"] = self._stats.extra.get(
                    "shared_prefix_probe_errors", 0) + 1
                self._probe_failures += 1
                logger.warning("shared-prefix probe did not complete (%s); retrying on a later request",
                               result.reason)
                if self._probe_failures < MAX_PROBE_ATTEMPTS:
                    if mode == "shared_prefix":
                        raise RuntimeError(f"the shared-prefix probe did not complete: {result.reason}")
                    return False
            self._shared_prefix_probe = result
        if mode == "shared_prefix" and not self._shared_prefix_probe.supported:
            raise ValueError(
                "decode_attention='shared_prefix' is not supported by this model "
                f"({self._shared_prefix_probe.reason}); use 'auto' or 'dynamic_cache'"
            )
        return self._shared_prefix_probe.supported

    def cache_generated(self, prompt_ids: list[int], token_ids: list[int], cache: Any) -> None:
        """Keep a single completion's KV too, the way SGLang caches finished requests: an agent's
        next prompt usually repeats this answer, so it is served from the cache instead of recomputed."""
        # The last generated token was never fed back, so its KV does not exist.
        sequence = prompt_ids + token_ids[:-1]
        if not self._cacheable or len(sequence) <= len(prompt_ids):
            return
        if isinstance(cache, SharedPrefixCache):
            # Only the generated part is new: the prompt is (or is not, if it did not fit) in the cache.
            suffix = cache.suffix_kv(0)
            if suffix.shape[3] == len(sequence) - len(prompt_ids):
                self.prefix_cache.insert(sequence, suffix, kv_offset=len(prompt_ids))
            return
        kv_all = _stack_kv(cache)
        if kv_all.shape[3] == len(sequence):
            self.prefix_cache.insert(sequence, kv_all)


class CachedPrefix:
    """What ``RKSCEngine.cached_prefix`` lends: a cache holding a prompt's cached prefix.

    Attributes:
        cache: A batch-1 ``transformers`` cache of the matched prefix (the caller may repeat its rows).
        num_tokens: Tokens of the prefix it holds.
        computed_tokens / reused_tokens: What the caller's passes computed and reused; counted when
            the block ends.
    """

    def __init__(self, engine: RKSCEngine, cache: Any, num_tokens: int) -> None:
        self._engine = engine
        self.cache = cache
        self.num_tokens = num_tokens
        self.computed_tokens = 0
        self.reused_tokens = 0

    def run_decoder(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The decoder body (no LM head) over ``input_ids`` (B, T) after the cache; returns the final
        hidden states (B, T, hidden). Out of memory: rolled back and retried like any engine pass."""
        engine = self._engine
        body = engine.model.get_decoder()
        forward = lambda: body(input_ids=input_ids, use_cache=True, **{engine._cache_kwarg: self.cache})  # noqa: E731
        return engine._run_with_oom_retry(forward, self.cache).last_hidden_state


def _check_encodable(text: str, name: str) -> None:
    """``ValueError`` naming ``name`` when ``text`` cannot be UTF-8 encoded (a lone surrogate), which the
    tokenizer would otherwise report as an opaque ``TypeError``."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise ValueError(f"{name} is not valid Unicode text: {error.reason} at index {error.start} "
                         f"({text[error.start:error.end]!r}); remove or replace it") from None


def _run_to_end(steps: Generator[Any, None, T]) -> T:
    """Run a generator through all its yields and return what it returns."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def _stack_kv(cache: Any) -> torch.Tensor:
    """Row 0 of a DynamicCache as one tensor (L, 2, H_kv, T, D), the radix cache's layout."""
    return torch.stack([torch.stack((layer.keys[0], layer.values[0])) for layer in cache.layers])
