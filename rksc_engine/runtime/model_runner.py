"""The model runner: the only code that calls the model. It owns the forward pass, its
out-of-memory roll-back and retry, what the model is (device, dtype, context window, KV size, EOS
ids), and the one-time probe of the batched shared-prefix decode.

Callers hold the engine lock (``runtime.lock``); the runner takes no lock itself.
"""

from __future__ import annotations

import contextlib
import enum
import inspect
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import EngineConfig
from ..kvcache.cache_layers import (
    keeps_token_kv,
    layer_types,
    new_kv_cache,
    prefix_cache_refusal,
    unsupported_layer_types,
)
from ..kvcache.memory import ForwardOutOfMemoryError, is_out_of_memory, run_with_oom_retry
from ..kvcache.probe import ProbeResult, logit_tolerance, probe
from ..kvcache.radix import RadixPrefixCache
from ..kvcache.static_rows import StaticRowPool
from . import weight_left_linear
from .static_decode import StaticStep, probe_static_rows
from .stats import Counters

logger = logging.getLogger(__name__)
# Inconclusive shared-prefix probes (exceptions) tolerated before the fast path is given up.
MAX_PROBE_ATTEMPTS = 3


def ran_out_of_memory(error: BaseException) -> bool:
    """Whether a pass failed for want of memory: on every try (``ForwardOutOfMemoryError``), or in an
    allocation that was not retried (``is_out_of_memory``)."""
    return isinstance(error, ForwardOutOfMemoryError) or is_out_of_memory(error)


class DecodeLayout(enum.Enum):
    """How a request's branches hold their KV while they decode (``EngineConfig.decode_attention``).

    * ``SHARED_PREFIX``: the prompt once, each branch's suffix apart; a step's attention reads a
      prompt segment once for every row that shares it (``kvcache.shared_prefix``).
    * ``STATIC_ROWS``: each row's whole KV in a fixed-shape pool; one attention call per layer for
      every row, and a step that can be compiled (``kvcache.static_rows``).
    * ``DYNAMIC_CACHE``: the model's own cache, the prompt copied per branch; one forward per request.
    """

    SHARED_PREFIX = "shared_prefix"
    STATIC_ROWS = "static_rows"
    DYNAMIC_CACHE = "dynamic_cache"


class ModelRunner:
    """Runs the forward passes of one ``transformers`` causal LM.

    Args:
        model: The model (put in eval mode).
        tokenizer: Its tokenizer (for the EOS ids and the context window's fallback).
        config: The engine's settings (``rsbcm`` out-of-memory recovery, ``decode_attention``).
        prefix_cache: The radix cache whose budget shrinks when a pass runs out of memory.
        counters: Where out-of-memory retries and probe errors are counted.
    """

    def __init__(self, model: Any, tokenizer: Any, config: EngineConfig, prefix_cache: RadixPrefixCache,
                 counters: Counters) -> None:
        # Fixed for the model's life, and worked out from its config at some cost: once.
        self._layer_types = layer_types(model.config) if hasattr(model.config, "get_text_config") else None
        unsupported = unsupported_layer_types(self._layer_types or [])
        if unsupported:
            raise NotImplementedError(f"rksc cannot run layers of type {unsupported}: transformers' DynamicCache has no "
                                      "layer for them, so no exact cache can be kept")
        self.model = model.eval()
        # Its float32 CPU linear layers compute otherwise only inside `decode_forward`; elsewhere as before.
        # A compiled step traces the model's own layers: the weight-left gate would only get in its way.
        turn = config.decode_matmul == "auto" and config.decode_capture == "off"
        self.weight_left_layers = weight_left_linear.install(model) if turn else 0
        self._prefix_cache_refusal = prefix_cache_refusal(self._layer_types or [])
        self.config = config
        self.prefix_cache = prefix_cache
        self.counters = counters
        first_param = next(model.parameters())
        self.device, self.dtype = first_param.device, first_param.dtype
        self.eos_token_ids = _collect_eos_ids(model, tokenizer)
        self._tokenizer_max_length = tokenizer.model_max_length
        # transformers 5.x renamed the forward's `past_key_values` to `cache`; support both.
        forward_params = inspect.signature(model.forward).parameters
        self.cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        # The prompt tokens the largest request being served needs: an out-of-memory shrink of the
        # cache budget never goes below them (the scheduler, which knows its requests, sets it).
        self.min_budget_tokens: Callable[[], int] = lambda: 0
        self.shared_prefix_probe: ProbeResult | None = None  # probed on first decode
        self.static_step: StaticStep | None = None  # built, and probed, on the first static-rows decode
        self.static_rows_refusal: str | None = None  # why not, when the probe said no
        self._probe_failures = 0
        self._oom_since_relax = False

    # -- what the model is ----------------------------------------------------------------------
    @property
    def text_config(self) -> Any:
        config = self.model.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    @property
    def context_window(self) -> int:
        return int(getattr(self.text_config, "max_position_embeddings", None) or self._tokenizer_max_length)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token takes over all layers (keys and values), at the model's dtype."""
        cfg = self.text_config
        num_heads = int(cfg.num_attention_heads)
        num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or num_heads)
        head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads)
        return 2 * int(cfg.num_hidden_layers) * num_kv_heads * head_dim * self.dtype.itemsize

    @property
    def model_name(self) -> str:
        # A local directory's name ("SmolLM2-135M-Instruct"), not its full cache path.
        name = str(getattr(self.model.config, "_name_or_path", "") or "")
        return Path(name).name if name else type(self.model).__name__

    def supports_prefix_cache(self) -> bool:
        """Whether every layer attends over per-token KV (full or sliding-window attention), kept
        whole (``cache_layers.new_kv_cache``), so slicing it into the radix tree is exact; recurrent
        layers keep a state instead."""
        return keeps_token_kv(self.model.config if self._layer_types is None else self._layer_types)

    def sliding_window_layers(self) -> tuple[tuple[int, ...], int, int] | None:
        """``(the layers that attend within a sliding window, the model's layers, the window)``, or
        None when no layer does."""
        types = self._layer_types or []
        window = getattr(self.text_config, "sliding_window", None)
        sliding = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        if not sliding or not isinstance(window, int) or window < 1:
            return None
        return sliding, len(types), window

    def prefix_cache_refusal(self) -> str:
        """Why the radix cache cannot hold this model's prompts ("" when it can)."""
        return self._prefix_cache_refusal

    def batched_decode_refusal(self) -> str:
        """Why requests of this model decode one forward each instead of in one batch ("" when they
        batch, or before the first decode has probed the model)."""
        result = self.shared_prefix_probe
        if self.config.decode_attention == "dynamic_cache":
            return "decode_attention='dynamic_cache'"
        if result is None and self._probe_failures:
            return "the shared-prefix probe has not completed yet; requests decode one forward each until it does"
        return result.reason if result is not None and not result.supported else ""

    def new_cache(self, kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
        """A fresh batch cache for the model (``cache_layers.new_kv_cache``), optionally holding ``kv``."""
        return new_kv_cache(self.model.config, kv, self._layer_types)

    # -- passes ---------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
        """One model pass over ``input_ids`` (B, T) after ``cache`` that survives running out of
        memory: on ``torch.OutOfMemoryError`` / ``MemoryError`` the cache is rolled back, the prefix
        cache evicts and shrinks its budget (``rsbcm.oom_budget_shrink``), and the pass is retried,
        ``rsbcm.oom_max_attempts`` tries in all; then ``ForwardOutOfMemoryError``."""
        return self.run_with_oom_retry(
            lambda: self.model(input_ids=input_ids, use_cache=True, **{self.cache_kwarg: cache}, **kwargs), cache
        )

    def decode_forward(self, input_ids: torch.Tensor, cache: Any, **kwargs: Any) -> Any:
        """``forward`` for a decode step's rows. With ``decode_matmul="auto"`` on a CPU, its linear
        layers take the weight-left product at 2 to ``weight_left_linear.MAX_ROWS`` rows."""
        products = weight_left_linear.weight_left_products() if self.weight_left_layers else contextlib.nullcontext()
        with products:
            return self.forward(input_ids, cache, **kwargs)

    def decode_static(self, pool: StaticRowPool) -> torch.Tensor:
        """One decode step of ``pool``'s rows ``[0, top)`` (``StaticStep.logits``), with the
        out-of-memory retry of ``forward`` (a failed try leaves nothing to roll back: the next one
        writes the same positions again); returns the next-token logits (top, V)."""
        step = self.static_step
        if step is None:
            raise RuntimeError("decode_static before decode_layout() chose static rows")
        if self.weight_left_layers and not step.compiled:
            products = weight_left_linear.weight_left_products()
        else:
            products = contextlib.nullcontext()
        with products:
            return self.run_with_oom_retry(lambda: step.logits(pool, pool.next_tokens), None)

    def decode_static_drafted(self, pool: StaticRowPool, inputs: torch.Tensor) -> torch.Tensor:
        """One drafted step of ``pool``'s rows ``[0, top)`` over ``inputs`` (top, T)
        (``StaticStep.drafted_logits``), with ``decode_static``'s retry; returns (top, T, V)."""
        step = self.static_step
        if step is None:
            raise RuntimeError("decode_static_drafted before decode_layout() chose static rows")
        return self.run_with_oom_retry(lambda: step.drafted_logits(pool, inputs, self.context_window - 1), None)

    def run_decoder(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """The decoder body (no LM head) over ``input_ids`` (B, T) after ``cache``; returns the final
        hidden states (B, T, hidden), with the same out-of-memory roll-back and retry."""
        body = self.model.get_decoder()
        return self.run_with_oom_retry(
            lambda: body(input_ids=input_ids, use_cache=True, **{self.cache_kwarg: cache}), cache
        ).last_hidden_state

    def run_with_oom_retry(self, forward: Callable[[], Any], cache: Any) -> Any:
        rsbcm = self.config.rsbcm
        return run_with_oom_retry(forward, cache, on_oom=self._free_memory_after_oom,
                                  max_attempts=rsbcm.oom_max_attempts, backoff_s=rsbcm.oom_backoff_s)

    def _free_memory_after_oom(self, error: BaseException, attempt: int) -> None:
        self.counters.count("oom_retries")
        self._oom_since_relax = True
        # Never below what the largest prompt being served needs, or the cache could not hold it.
        floor = self.min_budget_tokens() * self.kv_bytes_per_token
        self.prefix_cache.shrink_budget(self.config.rsbcm.oom_budget_shrink, min_budget_bytes=max(1, floor))
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def request_finished(self) -> None:
        """A request finished: if no pass ran out of memory since the last one, memory pressure has
        eased, so a budget shrunk by an earlier out-of-memory error grows back a step."""
        cache = self.prefix_cache
        if self._oom_since_relax:
            self._oom_since_relax = False
        elif cache.budget_bytes < cache.configured_budget_bytes:
            cache.relax_budget(self.config.rsbcm.oom_budget_restore)

    # -- the decode layout and its probes ---------------------------------------------------------
    def decode_layout(self) -> DecodeLayout:
        """How the next request's branches decode (``DecodeLayout``), from ``decode_attention``.

        ``"static_rows"`` builds the step (compiled when ``decode_capture="compile"``) and probes the
        model once against its own cache; a model it does not fit (recurrent layers, or logits that
        differ) raises ``ValueError``. Otherwise ``decodes_with_shared_prefix`` decides."""
        if self.config.decode_attention == "static_rows":
            self._build_static_step()
            if self.static_rows_refusal:
                raise ValueError(f"decode_attention='static_rows' is not supported by this model "
                                 f"({self.static_rows_refusal}); use 'auto', 'shared_prefix' or 'dynamic_cache'")
            return DecodeLayout.STATIC_ROWS
        return DecodeLayout.SHARED_PREFIX if self.decodes_with_shared_prefix() else DecodeLayout.DYNAMIC_CACHE

    def _build_static_step(self) -> None:
        if self.static_step is not None or self.static_rows_refusal is not None:
            return
        types = self._layer_types or []
        if not keeps_token_kv(types):
            self.static_rows_refusal = f"the model has layers without per-token KV: {sorted(set(types))}"
            return
        window = getattr(self.text_config, "sliding_window", None)
        step = StaticStep(self.model, self.cache_kwarg, types, window, compiled=self.config.decode_capture == "compile")
        # The probe runs eagerly: a compiled step is built on the first real shapes instead.
        eager = StaticStep(self.model, self.cache_kwarg, types, window)
        supported, reason = probe_static_rows(self.model, eager, self.forward, logit_tolerance)
        if not supported:
            self.static_rows_refusal = reason
            return
        self.static_step = step

    def decodes_with_shared_prefix(self) -> bool:
        """Whether branches decode through ``SharedPrefixCache`` (config ``decode_attention``).

        ``"auto"`` probes the model once (``shared_prefix.probe``) and falls back to the plain
        ``DynamicCache`` path if it fails; ``"shared_prefix"`` raises instead."""
        mode = self.config.decode_attention
        if mode == "dynamic_cache":
            return False
        if self.shared_prefix_probe is None:
            result = probe(self.model, self.forward)
            if result.inconclusive:
                # No verdict: this request takes the plain path; a later one probes again, and after
                # a few failures in a row the path is given up (and the reason kept in the probe).
                self.counters.count("shared_prefix_probe_errors")
                self._probe_failures += 1
                logger.warning("shared-prefix probe did not complete (%s); retrying on a later request",
                               result.reason)
                if self._probe_failures < MAX_PROBE_ATTEMPTS:
                    if mode == "shared_prefix":
                        raise RuntimeError(f"the shared-prefix probe did not complete: {result.reason}")
                    return False
            self.shared_prefix_probe = result
        if mode == "shared_prefix" and not self.shared_prefix_probe.supported:
            raise ValueError(
                "decode_attention='shared_prefix' is not supported by this model "
                f"({self.shared_prefix_probe.reason}); use 'auto' or 'dynamic_cache'"
            )
        return self.shared_prefix_probe.supported


def _collect_eos_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return frozenset(ids)
