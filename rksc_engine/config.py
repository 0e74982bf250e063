"""Typed, validated configuration for the engine and for one generation call.

Every field has a documented default and is checked in ``__post_init__``; a bad value raises
``ValueError`` (or ``TypeError`` for a wrong type) naming the field and the allowed range, before
any model or cache state is touched.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace


def check_type(name: str, value: object, expected: type | tuple[type, ...]) -> None:
    """``TypeError`` naming ``name`` unless ``value`` is an ``expected``; a bool is never taken for an int."""
    # bool is an int subclass; a flag passed where a count is expected is a bug, not a 1.
    if isinstance(value, bool) and bool not in (expected if isinstance(expected, tuple) else (expected,)):
        raise TypeError(f"{name} must be {_type_name(expected)}, got bool")
    if not isinstance(value, expected):
        raise TypeError(f"{name} must be {_type_name(expected)}, got {type(value).__name__}")


def _type_name(expected: type | tuple[type, ...]) -> str:
    if isinstance(expected, tuple):
        return " or ".join(t.__name__ for t in expected)
    return expected.__name__


# The largest seed any branch's generator gets. ``torch.Generator.manual_seed`` takes [0, 2**64)
# and raises "Overflow when unpacking long long" above it; staying in int64 keeps seeds storable
# wherever an int64 is (tensors, NumPy, JSON readers that parse into int64).
MAX_BRANCH_SEED = 2**63 - 1
# Seeds kept free above ``SamplingParams.seed`` for sibling branches (``seed + i``) and tree-search
# children (``seed + node * breadth + k``), so a valid seed never overflows one of them.
SEED_HEADROOM = 2**20
# The largest ``SamplingParams.seed``.
MAX_SEED = MAX_BRANCH_SEED - SEED_HEADROOM
# Below this temperature sampling is treated as greedy: at 1e-5 a logit gap of 1e-3 already makes
# the runner-up e^-100 times as likely, so a draw can differ from the argmax only between tokens
# whose logits are within about 1e-4 of each other; far smaller ones overflow float32 (NaN).
MIN_SAMPLING_TEMPERATURE = 1e-5
# Below this top_p the nucleus is the top token alone for any vocabulary under a million tokens
# (the top token's probability is at least 1 / vocab_size), which is greedy decoding.
MIN_TOP_P = 1e-6


def check_branch_seeds(seed: int, n: int) -> None:
    """Raise ``ValueError`` unless the seeds ``seed .. seed + n - 1`` of ``n`` branches are all in
    ``[0, MAX_BRANCH_SEED]`` (``SamplingParams`` checks ``seed`` alone)."""
    if seed < 0 or seed + n - 1 > MAX_BRANCH_SEED:
        raise ValueError(f"seed + n - 1 must be <= {MAX_BRANCH_SEED} (branch i is seeded seed + i), "
                         f"got seed={seed}, n={n}")


def check_request_shape(n: object, params: object) -> SamplingParams:
    """The checks every engine (local or remote) makes of a request's ``n`` and ``params`` before
    anything runs; returns the params to use (``SamplingParams()`` for None)."""
    params = SamplingParams() if params is None else params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(n, int) or isinstance(n, bool):
        raise TypeError(f"n must be an int, got {type(n).__name__}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if params.seed is not None:
        check_branch_seeds(params.seed, n)
    return params


def check_branch_hooks(n: int, params: SamplingParams, stream: object, monitor: object,
                       max_branches: object) -> int:
    """The checks every engine makes of a request's ``stream``, ``monitor`` and ``max_branches``
    (``n`` and ``params`` already checked); returns ``max_branches`` (``n`` for None)."""
    if not isinstance(stream, bool):
        raise TypeError(f"stream must be a bool, got {type(stream).__name__}")
    if monitor is not None and not callable(getattr(monitor, "observe", None)):
        raise TypeError(f"monitor must have an observe(events) method, got {type(monitor).__name__}")
    if max_branches is None:
        return n
    if not isinstance(max_branches, int) or isinstance(max_branches, bool):
        raise TypeError(f"max_branches must be an int or None, got {type(max_branches).__name__}")
    if max_branches < n:
        raise ValueError(f"max_branches must be >= n ({n}), got {max_branches}")
    if max_branches > n:
        check_request_shape(max_branches, params)  # the added branches obey the same bounds
    return max_branches


@dataclass(frozen=True)
class SamplingParams:
    """How to decode one request.

    Attributes:
        max_new_tokens: Upper bound on generated tokens per branch, >= 1. Default 256.
        temperature: Finite, >= 0. 0 means greedy (argmax); > 0 samples from
            ``softmax(logits / temperature)``. Default 0.
        top_p: Nucleus mass in (0, 1]; 1 disables it; the most likely token is always kept. Default 1.
        top_k: Keep the k most likely tokens; 0 disables it. Default 0.
        stop: Strings that end a branch; the text is cut before the first occurrence. Default none.
        seed: Seed of branch 0, in ``[0, MAX_SEED]``; branch i draws from its own generator seeded
            ``seed + i``, so a branch is the same whether it runs alone or beside siblings. ``None``
            picks a fresh seed per call.

    Near-zero settings: a temperature in ``(0, MIN_SAMPLING_TEMPERATURE)`` or a ``top_p`` below
    ``MIN_TOP_P`` decodes greedily (``greedy`` is True): there sampling could differ from the argmax
    only between near-tied tokens, and dividing logits by a temperature like 1e-45 overflows float32
    to ``inf``, whose softmax is NaN.
    """

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        check_type("max_new_tokens", self.max_new_tokens, int)
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        check_type("temperature", self.temperature, (int, float))
        if not 0 <= self.temperature < math.inf:  # also rejects NaN
            raise ValueError(f"temperature must be finite and >= 0 (0 = greedy), got {self.temperature}")
        check_type("top_p", self.top_p, (int, float))
        if not 0 < self.top_p <= 1:  # also rejects NaN and inf
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        check_type("top_k", self.top_k, int)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = disabled), got {self.top_k}")
        stop = self.stop
        if isinstance(stop, str):
            stop = (stop,)
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise TypeError(f"stop must be a string or a sequence of strings, got {self.stop!r}")
        if any(s == "" for s in stop):
            raise ValueError("stop strings must be non-empty")
        object.__setattr__(self, "stop", tuple(stop))
        if self.seed is not None:
            check_type("seed", self.seed, int)
            if not 0 <= self.seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, {MAX_SEED}] (MAX_SEED, leaving room for seed + i of "
                                 f"every branch) or None, got {self.seed}")

    @property
    def greedy(self) -> bool:
        """Decode by argmax: temperature 0, or a temperature or ``top_p`` too small to sample with."""
        return self.temperature < MIN_SAMPLING_TEMPERATURE or self.top_p < MIN_TOP_P


@dataclass(frozen=True)
class PrefixCacheConfig:
    """Deprecated: whether the radix prefix cache is on is ``RSBCMConfig.enabled`` now, beside the
    rest of that cache's settings. ``EngineConfig(prefix_cache=PrefixCacheConfig(enabled=False))``
    still works (with a ``DeprecationWarning``) and means ``EngineConfig(rsbcm=RSBCMConfig(enabled=False))``.

    Attributes:
        enabled: Reuse KV of previously computed token prefixes. Default True.
    """

    enabled: bool = True

    def __post_init__(self) -> None:
        check_type("prefix_cache.enabled", self.enabled, bool)


# The radix cache's eviction policies by name (``kvcache.radix.EVICTION_POLICIES`` implements each).
EVICTION_POLICY_NAMES = ("lru", "omega")


@dataclass(frozen=True)
class RSBCMConfig:
    """The radix prefix cache shared across calls, RSBCM: whether it is on, its memory budget, block
    size, eviction policy and out-of-memory recovery.

    Attributes:
        cache_budget_mb: Most KV the prefix cache keeps, in MiB (> 0). Default 1024 (about 22k
            tokens on the default model in fp32). The one source of truth for the cache budget.
        block_size: Tokens per KV block (>= 1), the unit of eviction. Default 16.
        policy: Eviction order of unlocked leaf blocks: ``"omega"`` (default; increasing
            ``branch_score / (depth + 1)``, ties least recently used) or ``"lru"``.
        oom_max_attempts: Tries of a forward pass that runs out of memory (>= 1), evicting and
            shrinking the cache budget between tries. Default 3.
        oom_budget_shrink: Factor in (0, 1) applied to the cache budget (and to the unlocked KV it
            holds) after each out-of-memory error; the budget stays at least what the running
            request needs. Default 0.5.
        oom_budget_restore: Factor in (1, 1024] by which a shrunk budget grows back towards
            ``cache_budget_mb`` after each request that ran without running out of memory.
            Default 2 (a halved budget is whole again after one clean request).
        oom_backoff_s: First wait between tries in seconds (>= 0), doubling each retry. Default 0.05.
        enabled: Reuse KV of previously computed token prefixes across calls. Default True. Off, every
            prompt is computed in full (the budget still bounds the branches' own KV).
        free_out_of_window: For models with sliding-window layers, free those layers' cached KV that
            no cached prompt's window reaches before evicting anything, and reuse a prefix only
            where its last window of positions keeps every layer (SGLang's rule). Exact either way.
            Default True.
    """

    cache_budget_mb: float = 1024.0
    block_size: int = 16
    policy: str = "omega"
    oom_max_attempts: int = 3
    oom_budget_shrink: float = 0.5
    oom_budget_restore: float = 2.0
    oom_backoff_s: float = 0.05
    enabled: bool = True
    free_out_of_window: bool = True

    def __post_init__(self) -> None:
        check_type("rsbcm.enabled", self.enabled, bool)
        check_type("rsbcm.free_out_of_window", self.free_out_of_window, bool)
        check_type("rsbcm.cache_budget_mb", self.cache_budget_mb, (int, float))
        if not self.cache_budget_mb > 0 or self.cache_budget_mb == float("inf"):
            raise ValueError(f"rsbcm.cache_budget_mb must be > 0 and finite, got {self.cache_budget_mb}")
        if self.budget_bytes < 1:
            raise ValueError(f"rsbcm.cache_budget_mb must be at least one byte, got {self.cache_budget_mb}")
        check_type("rsbcm.block_size", self.block_size, int)
        if self.block_size < 1:
            raise ValueError(f"rsbcm.block_size must be >= 1, got {self.block_size}")
        check_type("rsbcm.policy", self.policy, str)
        if self.policy not in EVICTION_POLICY_NAMES:
            raise ValueError(f"rsbcm.policy must be one of {sorted(EVICTION_POLICY_NAMES)}, got {self.policy!r}")
        check_type("rsbcm.oom_max_attempts", self.oom_max_attempts, int)
        if self.oom_max_attempts < 1:
            raise ValueError(f"rsbcm.oom_max_attempts must be >= 1, got {self.oom_max_attempts}")
        check_type("rsbcm.oom_budget_shrink", self.oom_budget_shrink, (int, float))
        if not 0 < self.oom_budget_shrink < 1:
            raise ValueError(f"rsbcm.oom_budget_shrink must be in (0, 1), got {self.oom_budget_shrink}")
        check_type("rsbcm.oom_budget_restore", self.oom_budget_restore, (int, float))
        if not 1 < self.oom_budget_restore <= 1024:
            raise ValueError(f"rsbcm.oom_budget_restore must be in (1, 1024], got {self.oom_budget_restore}")
        check_type("rsbcm.oom_backoff_s", self.oom_backoff_s, (int, float))
        if not 0 <= self.oom_backoff_s <= 60:
            raise ValueError(f"rsbcm.oom_backoff_s must be in [0, 60], got {self.oom_backoff_s}")

    @property
    def budget_bytes(self) -> int:
        return int(self.cache_budget_mb * 1024 * 1024)


@dataclass(frozen=True)
class CGEEConfig:
    """Thresholds of both CGEE levels (see ``rksc_engine.reasoning.cgee`` for the rules they feed).

    The defaults are the settings that cannot change an answer: level 1 skips only a unanimous vote
    (whose single candidate verification could not overturn) and level 2 is off. Looser thresholds
    pay only where a model's vote is often confident and its judge's middle layers already hold the
    final decision; how much they save, and at what decision error, depends on the model and the
    workload (measured in ``docs/bench/cgee_ladder.md`` and ``docs/bench/cgee_lens_exit.md``, with
    their commands). Choose them on your own questions with ``rksc_engine.evaluation.calibration.calibrate`` (decision
    error against full verification) or ``calibrate_split`` (accuracy against the right answers).

    Attributes:
        skip_enabled: Level 1, skip verification when the vote is confident. Default True.
        tau_conf: Smallest confidence-weighted winner share that may skip, in [0, 1]. Default 1.0
            (every answering branch agrees).
        margin: Smallest lead over the runner-up that may skip, in [0, 1]. Default 1.0.
        exit_enabled: Level 2, stop verifier passes early on low label entropy. Default False.
        theta: Label-entropy threshold in nats, > 0 (max for 2 labels is ln 2 = 0.693). Default 0.4.
        epsilon: Largest entropy change between consecutive layers that counts as stable, > 0.
            Default 0.05.
        min_layer: First layer (0-based) whose entropy is checked, >= 0; it sets the baseline, so the
            earliest exit is ``min_layer + 1``. Default 24, late in the default model's 30 layers, so
            that turning level 2 on without calibrating checks only where the lens can have settled.
    """

    skip_enabled: bool = True
    tau_conf: float = 1.0
    margin: float = 1.0
    exit_enabled: bool = False
    theta: float = 0.4
    epsilon: float = 0.05
    min_layer: int = 24

    def __post_init__(self) -> None:
        for name in ("skip_enabled", "exit_enabled"):
            check_type(f"cgee.{name}", getattr(self, name), bool)
        for name in ("tau_conf", "margin"):
            value = getattr(self, name)
            check_type(f"cgee.{name}", value, (int, float))
            if not 0 <= value <= 1:
                raise ValueError(f"cgee.{name} must be in [0, 1], got {value}")
        for name in ("theta", "epsilon"):
            value = getattr(self, name)
            check_type(f"cgee.{name}", value, (int, float))
            if not value > 0:
                raise ValueError(f"cgee.{name} must be > 0, got {value}")
        check_type("cgee.min_layer", self.min_layer, int)
        if self.min_layer < 0:
            raise ValueError(f"cgee.min_layer must be >= 0, got {self.min_layer}")

    @classmethod
    def off(cls) -> CGEEConfig:
        """Both levels disabled: every candidate is verified at full depth."""
        return cls(skip_enabled=False, exit_enabled=False)


RECOMPUTE_SELECTIONS = ("deviation", "nearest")


@dataclass(frozen=True)
class ASKSConfig:
    """ASKS: reuse cached KV across prompts that differ only in a short span of wording
    (``rksc_engine.kvcache.asks``). Approximate when it reuses, so it is off by default.

    Attributes:
        enabled: Try ASKS when a prompt's token-exact cached prefix ends early. Default False.
        tau: Reuse when the spans' layer-weighted hidden-state similarity ``sigma >= tau``, in [0, 1];
            1 never reuses (token-exact caching, token for token), 0 reuses whenever a realignment
            is found. Default 0.99, deliberately conservative: reuse then fires only for spans whose
            hidden states nearly coincide, because looser thresholds changed final answers on
            reworded prompts more often than the 99% agreement target allows (measurements and their
            commands: ``docs/bench/asks_fidelity.md``).
        alpha: Depth emphasis of the layer weights ``exp(alpha * l / L)``, >= 0. Default 1.0.
        max_span_tokens: Longest differing span, on either side, that ASKS compares, >= 1. Default 64.
        min_reuse_tokens: Shortest realigned remainder worth reusing, >= 1. Default 32.
        max_candidates: Cached sequences examined per request, >= 1. Default 8.
        recompute_fraction: Share of the reused remainder that is recomputed instead of reused,
            in [0, 1] (CacheBlend-style repair; 1 recomputes it all, which is exact). Default 0.
        recompute_selection: Which remainder tokens ``recompute_fraction`` recomputes.
            ``"deviation"`` (default): the remainder is first run through the first two decoder
            layers (2 of L layers' cost), which makes those layers' KV exact and measures, per
            token, how far the reused KV of layer 2 is from the exact one; the most-deviating tokens
            are recomputed through every layer. ``"nearest"``: the tokens right after the changed
            span, with no probe.
        max_mean_deviation: Reuse only when the remainder's mean relative KV deviation at the probe
            layer is at most this, >= 0 (needs ``recompute_selection="deviation"``); above it the
            remainder is computed exactly. Default ``inf`` (no deviation gate, ``tau`` alone decides).
        reuse_chunks: Retrieved-context reuse (``rksc_engine.kvcache.chunk_reuse``): cut a text prompt at
            ``chunk_separator``, cache each segment between the first and the last (a retrieved
            chunk) on its own, and reuse its KV wherever it appears in a later prompt, repaired by
            ``recompute_fraction`` and gated by ``max_mean_deviation``. Needs ``enabled``. Default False.
        chunk_separator: The text that separates retrieved chunks, non-empty. Default a blank line
            (``"\n\n"``), what LlamaIndex's response synthesizers and LangChain's stuff-documents
            chain put between documents.
    """

    enabled: bool = False
    tau: float = 0.99
    alpha: float = 1.0
    max_span_tokens: int = 64
    min_reuse_tokens: int = 32
    max_candidates: int = 8
    recompute_fraction: float = 0.0
    recompute_selection: str = "deviation"
    max_mean_deviation: float = math.inf
    reuse_chunks: bool = False
    chunk_separator: str = "\n\n"

    @classmethod
    def for_retrieved_context(cls, recompute_fraction: float = 0.15, **overrides: object) -> ASKSConfig:
        """Retrieved-context reuse on, reworded-span reuse off (``tau=1``). ``recompute_fraction``
        0.15 is CacheBlend's operating point; what it costs in answers on a given model is measured
        by ``benchmarks/rag_reuse.py`` (``docs/bench/rag_reuse.md``)."""
        return cls(enabled=True, tau=1.0, reuse_chunks=True, recompute_fraction=recompute_fraction, **overrides)

    def __post_init__(self) -> None:
        check_type("asks.enabled", self.enabled, bool)
        check_type("asks.reuse_chunks", self.reuse_chunks, bool)
        check_type("asks.chunk_separator", self.chunk_separator, str)
        if not self.chunk_separator:
            raise ValueError("asks.chunk_separator must be a non-empty string")
        if self.reuse_chunks and not self.enabled:
            raise ValueError("asks.reuse_chunks needs asks.enabled=True (chunk reuse is approximate, as ASKS is)")
        check_type("asks.recompute_selection", self.recompute_selection, str)
        if self.recompute_selection not in RECOMPUTE_SELECTIONS:
            raise ValueError(f"asks.recompute_selection must be one of {list(RECOMPUTE_SELECTIONS)}, "
                             f"got {self.recompute_selection!r}")
        check_type("asks.max_mean_deviation", self.max_mean_deviation, (int, float))
        if not self.max_mean_deviation >= 0:
            raise ValueError(f"asks.max_mean_deviation must be >= 0, got {self.max_mean_deviation}")
        if self.max_mean_deviation != math.inf and self.recompute_selection != "deviation":
            raise ValueError("asks.max_mean_deviation needs asks.recompute_selection='deviation' "
                             "(the deviation is measured by its probe)")
        for name in ("tau", "recompute_fraction"):
            value = getattr(self, name)
            check_type(f"asks.{name}", value, (int, float))
            if not 0 <= value <= 1:
                raise ValueError(f"asks.{name} must be in [0, 1], got {value}")
        check_type("asks.alpha", self.alpha, (int, float))
        if not self.alpha >= 0 or self.alpha == float("inf"):
            raise ValueError(f"asks.alpha must be finite and >= 0, got {self.alpha}")
        for name in ("max_span_tokens", "min_reuse_tokens", "max_candidates"):
            value = getattr(self, name)
            check_type(f"asks.{name}", value, int)
            if value < 1:
                raise ValueError(f"asks.{name} must be >= 1, got {value}")


DEFAULT_MAX_COPIED_PROMPT_TAIL = 256  # SchedulerConfig.max_copied_prompt_tail
# The least SchedulerConfig.max_pooled_suffix_tokens other than 0: the pool's padding unit
# (``kvcache.suffix_pool.SUFFIX_ALIGNMENT``).
MIN_POOLED_SUFFIX_TOKENS = 64
# Where a branch's drafts may come from (``SchedulerConfig.draft_sources``).
DRAFT_SOURCES = ("prompt", "siblings", "cache")
# Most tokens a draft may propose (``SchedulerConfig.draft_tokens``): a verify forward runs this many
# positions a row, plus one.
MAX_DRAFT_TOKENS = 16


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler batches concurrent requests (``rksc_engine.runtime.scheduler``).

    Attributes:
        max_batch_rows: Most branches, over all running requests, decoded in one forward (>= 1).
            A request with more branches than this still runs, alone. Default 64 (decode throughput
            on a 2-core CPU stops growing between 32 and 64 rows; a GPU gains to far more).
        max_prefill_tokens: Prompt tokens one step may prefill before it decodes (>= 1). A prompt
            longer than this is prefilled in chunks of this size over several steps (chunked
            prefill), so running branches never wait on more than one chunk. Chunking changes the
            prompt's KV only by float rounding (shorter matrix products). Default 4096.
        packed_prefill: Prefill the prompts admitted in one step together, in one forward, instead
            of one forward each (default True). Tokens are the same; the prompts' KV may differ in
            the last bits from a prompt prefilled alone, as any batched matrix product's do. False
            prefills every prompt on its own, so a request's KV never depends on its neighbours.
        mixed_prefill: Prefill the prompts a step admits in the same forward as the running rows'
            next tokens, when rows are decoding (default False): the weights are read once for both,
            which pays where a forward's cost is reading them (a GPU at small batches). On a CPU,
            where the forward's cost grows with its tokens, it saves nothing and delays an arrival's
            first token by a decode step, hence off by default. Tokens are the same; the bits may
            differ as with ``packed_prefill``. The first such step is checked against the two done
            apart, and a model that fails it is never mixed again.
        max_copied_prompt_tail: A prompt read in place from the prefix cache has its last segments
            (its own tokens, and short nodes a few other prompts share, after the prefix many
            share) copied to the front of each branch's suffix, as many as hold at most this many
            tokens together; the first segment always stays in place (default 256; 0 never
            copies). A decode step's cost grows with the attention calls per request and layer,
            where a step is short (a CPU, a small batch); a request's own tokens in its suffix cost
            no call of their own. Longer tails stay read in place, since a copy costs their KV
            again per branch. Tokens are the same; the bits may differ as with ``packed_prefill``.
        max_pooled_suffix_tokens: Every running request's generated tokens are kept in one buffer
            per layer (``kvcache.suffix_pool``), so that a step writes all rows' new KV with one copy
            and attends all rows to their own tokens with one call, instead of one of each per
            request. A request whose suffix outgrows this many tokens a row moves to buffers of its
            own, so one long request does not lengthen every row of the pool (default 512; 0 keeps
            every request's suffix in buffers of its own; else at least 64). Tokens are the same;
            the bits may differ as with ``packed_prefill`` (with one thread they do not).
        draft_tokens: Speculative decoding without a draft model (``runtime.drafts``): each branch
            may propose up to this many next tokens by matching its last tokens against text the
            request already has (``draft_sources``), and a step verifies them in the same forward
            as the other rows, keeping those the branch would have chosen itself. Tokens are the same
            as without drafting (greedy and seeded sampling alike); the bits of the logits may
            differ, as with ``packed_prefill``. 0 (default) never drafts; at most
            ``MAX_DRAFT_TOKENS``. The ``shared_prefix`` layout drafts for a request of one row (a
            drafting request's branches decode as one-row members), ``static_rows`` for every row
            (each keeps its own length; its drafted steps run eagerly, ``decode_capture`` or not);
            with ``decode_attention="dynamic_cache"`` a value above 0 is refused.
        draft_sources: Where drafts come from (the n-gram sources tried in this order, ``"cache"``
            first): ``"prompt"`` (the branch's own
            prompt and the tokens it has generated, as prompt lookup decoding does),
            ``"siblings"`` (the tokens the other branches of the same request have generated) and
            ``"cache"`` (what an earlier request went on with after the branch's whole context, where
            the radix prefix cache holds it; matched on the whole context, so tried first). Default
            all three.
    """

    max_batch_rows: int = 64
    max_prefill_tokens: int = 4096
    packed_prefill: bool = True
    mixed_prefill: bool = False
    max_copied_prompt_tail: int = DEFAULT_MAX_COPIED_PROMPT_TAIL
    max_pooled_suffix_tokens: int = 512
    draft_tokens: int = 0
    draft_sources: tuple[str, ...] = DRAFT_SOURCES

    def __post_init__(self) -> None:
        check_type("scheduler.draft_tokens", self.draft_tokens, int)
        if not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"scheduler.draft_tokens must be in [0, {MAX_DRAFT_TOKENS}], got {self.draft_tokens}")
        check_type("scheduler.draft_sources", self.draft_sources, (tuple, list))
        unknown = [s for s in self.draft_sources if s not in DRAFT_SOURCES]
        if unknown:
            raise ValueError(f"scheduler.draft_sources must name sources of {list(DRAFT_SOURCES)}, got {unknown!r}")
        if len(set(self.draft_sources)) != len(self.draft_sources):
            raise ValueError(f"scheduler.draft_sources names a source twice: {list(self.draft_sources)!r}")
        if self.draft_tokens and not self.draft_sources:
            raise ValueError("scheduler.draft_sources must name at least one source when scheduler.draft_tokens > 0")
        object.__setattr__(self, "draft_sources", tuple(self.draft_sources))
        check_type("scheduler.max_pooled_suffix_tokens", self.max_pooled_suffix_tokens, int)
        if self.max_pooled_suffix_tokens and self.max_pooled_suffix_tokens < MIN_POOLED_SUFFIX_TOKENS:
            raise ValueError(f"scheduler.max_pooled_suffix_tokens must be 0 or >= {MIN_POOLED_SUFFIX_TOKENS}, "
                             f"got {self.max_pooled_suffix_tokens}")
        check_type("scheduler.max_copied_prompt_tail", self.max_copied_prompt_tail, int)
        if self.max_copied_prompt_tail < 0:
            raise ValueError(f"scheduler.max_copied_prompt_tail must be >= 0, got {self.max_copied_prompt_tail}")
        for name in ("max_batch_rows", "max_prefill_tokens"):
            value = getattr(self, name)
            check_type(f"scheduler.{name}", value, int)
            if value < 1:
                raise ValueError(f"scheduler.{name} must be >= 1, got {value}")
        check_type("scheduler.packed_prefill", self.packed_prefill, bool)
        check_type("scheduler.mixed_prefill", self.mixed_prefill, bool)


DECODE_ATTENTION_MODES = ("auto", "shared_prefix", "static_rows", "dynamic_cache")
DECODE_MATMUL_MODES = ("auto", "linear")
DECODE_CAPTURE_MODES = ("off", "compile")


@dataclass(frozen=True)
class EngineConfig:
    """Engine-wide settings.

    Attributes:
        rsbcm: The radix prefix cache: on or off, its budget, blocks, eviction policy and out-of-memory recovery.
        prefix_cache: Deprecated (``rsbcm.enabled``); None.
        trust_remote_code: Passed to ``transformers`` when loading a model directory. Default False.
        cgee: Default CGEE thresholds of ``engine.reason`` when a call passes none.
        decode_attention: How branches attend to the prompt while decoding. ``"auto"`` (default):
            one shared copy of the prompt's KV with split prefix/suffix attention
            (``rksc_engine.kvcache.shared_prefix``) where a one-time numerical probe shows the model supports
            it, else ``"dynamic_cache"``; ``"shared_prefix"``: the same, but an unsupported model
            raises instead of falling back; ``"static_rows"``: every running row's whole KV (its
            prompt copied in) in one fixed-shape pool, and one attention call per layer for all rows
            (``rksc_engine.kvcache.static_rows``): a step's host work does not grow with the requests,
            and the step can be compiled (``decode_capture``); each branch reads its own copy of the
            prompt, so a memory-bound step (a CPU, a long shared prompt) is slower than with
            ``"shared_prefix"``; an unsupported model (recurrent layers) raises. ``"dynamic_cache"``:
            the plain path, the prompt's KV copied once per branch in a ``transformers``
            ``DynamicCache``.
        asks: ASKS settings (off by default): KV reuse across prompts that differ in wording.
        scheduler: How concurrent requests are batched.
        decode_matmul: How a decode step's linear layers multiply. ``"auto"`` (default): on a CPU,
            the float32 ``torch.nn.Linear`` layers of a step of 2 to 32 rows compute ``(W @ x.T).T``,
            which the CPU's BLAS runs several times faster than ``linear``'s ``x @ W.T`` at a few rows
            (``rksc_engine.runtime.weight_left_linear``); elsewhere, and on a GPU, the model's own
            layers. ``"linear"``: always the model's own layers.
        decode_capture: How a static-rows decode step runs. ``"off"`` (default): eagerly.
            ``"compile"``: through ``torch.compile`` (inductor), built once per shape the step meets
            (the first steps of each new batch or length bucket wait for it: seconds for a tiny
            model, a minute or more for a 30-layer one on a CPU). Implies
            ``decode_attention="static_rows"`` when that is ``"auto"``; refused with another layout.
    """

    rsbcm: RSBCMConfig = field(default_factory=RSBCMConfig)
    prefix_cache: PrefixCacheConfig | None = None
    trust_remote_code: bool = False
    cgee: CGEEConfig = field(default_factory=CGEEConfig)
    decode_attention: str = "auto"
    asks: ASKSConfig = field(default_factory=ASKSConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    decode_matmul: str = "auto"
    decode_capture: str = "off"

    def __post_init__(self) -> None:
        check_type("rsbcm", self.rsbcm, RSBCMConfig)
        if self.prefix_cache is not None:
            check_type("prefix_cache", self.prefix_cache, PrefixCacheConfig)
            warnings.warn("EngineConfig(prefix_cache=PrefixCacheConfig(enabled=...)) is deprecated: use "
                          "EngineConfig(rsbcm=RSBCMConfig(enabled=...))", DeprecationWarning, stacklevel=3)
            # One config per cache: fold the old switch into rsbcm, so nothing reads two places.
            object.__setattr__(self, "rsbcm", replace(self.rsbcm, enabled=self.rsbcm.enabled and self.prefix_cache.enabled))
            object.__setattr__(self, "prefix_cache", None)
        check_type("cgee", self.cgee, CGEEConfig)
        check_type("asks", self.asks, ASKSConfig)
        check_type("scheduler", self.scheduler, SchedulerConfig)
        check_type("trust_remote_code", self.trust_remote_code, bool)
        check_type("decode_attention", self.decode_attention, str)
        if self.decode_attention not in DECODE_ATTENTION_MODES:
            raise ValueError(
                f"decode_attention must be one of {list(DECODE_ATTENTION_MODES)}, got {self.decode_attention!r}"
            )
        check_type("decode_matmul", self.decode_matmul, str)
        if self.decode_matmul not in DECODE_MATMUL_MODES:
            raise ValueError(f"decode_matmul must be one of {list(DECODE_MATMUL_MODES)}, got {self.decode_matmul!r}")
        check_type("decode_capture", self.decode_capture, str)
        if self.decode_capture not in DECODE_CAPTURE_MODES:
            raise ValueError(f"decode_capture must be one of {list(DECODE_CAPTURE_MODES)}, got {self.decode_capture!r}")
        if self.decode_capture != "off":
            if self.decode_attention == "auto":
                object.__setattr__(self, "decode_attention", "static_rows")
            elif self.decode_attention != "static_rows":
                raise ValueError(f"decode_capture={self.decode_capture!r} needs decode_attention='static_rows' "
                                 f"(or 'auto'), got {self.decode_attention!r}")
        if self.scheduler.draft_tokens and self.decode_attention == "dynamic_cache":
            raise ValueError(f"scheduler.draft_tokens={self.scheduler.draft_tokens} needs the shared-prefix or "
                             f"static-rows decode layout, got decode_attention={self.decode_attention!r}")
