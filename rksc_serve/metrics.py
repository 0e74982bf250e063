"""Prometheus metrics of one ``rksc serve`` app (``GET /metrics``), in a registry of its own.

Counted by the server as it answers:
    ``rksc_http_requests_total{path, status}``: every HTTP request, by route (``other`` for paths the
        app does not serve, so scanners cannot blow up the label set) and status code.
    ``rksc_prompt_tokens_total``, ``rksc_prompt_cached_tokens_total``: prompt tokens of the
        generation requests served (chat, completions, ``/v1/rksc/reason``'s branches), and those of
        them whose KV came from the prefix cache.
    ``rksc_generation_tokens_total``: tokens generated for them. A tree search's per-step requests
        are not in these three; the engine's own counters below include them.

Read from ``engine.stats()`` at each scrape (so they count every user of the engine, not only HTTP):
    ``rksc_engine_prompt_tokens_computed_total``, ``rksc_engine_prompt_tokens_reused_total``,
    ``rksc_engine_decode_tokens_total``, ``rksc_engine_requests_total``; the gauges
    ``rksc_prefix_cache_bytes``, ``rksc_prefix_cache_budget_bytes``, ``rksc_prefix_cache_tokens``,
    ``rksc_prompt_reuse_ratio``, ``rksc_running_requests``, ``rksc_waiting_requests``,
    ``rksc_running_kv_bytes`` and ``rksc_peak_batch_rows``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rksc_engine import Completion
from rksc_engine.protocol import Engine


class EngineCollector:
    """Exposes ``engine.stats()`` as metrics, read at scrape time.

    ``stats()`` never waits for the engine (while a step or an ``exclusive()`` block holds it, it
    answers the snapshot published after the last step), so a scrape on the event loop never waits
    behind the model.
    """

    # (metric name, EngineStats field, help); counters get ``_total`` appended by prometheus_client.
    COUNTERS = (
        ("rksc_engine_requests", "requests", "Requests the engine has run (all callers)."),
        ("rksc_engine_prompt_tokens_computed", "prompt_tokens_computed", "Prompt tokens the engine computed."),
        ("rksc_engine_prompt_tokens_reused", "prompt_tokens_reused",
         "Prompt tokens served from the prefix cache (cache hit tokens)."),
        ("rksc_engine_decode_tokens", "decode_tokens", "Tokens the engine decoded."),
    )
    GAUGES = (
        ("rksc_prefix_cache_bytes", "cache_bytes", "KV bytes the prefix cache holds."),
        ("rksc_prefix_cache_budget_bytes", "cache_budget_bytes", "The prefix cache's effective byte budget."),
        ("rksc_prefix_cache_tokens", "cache_tokens", "Tokens whose KV the prefix cache holds."),
        ("rksc_running_requests", "running_requests", "Requests decoding now."),
        ("rksc_waiting_requests", "waiting_requests", "Requests queued for admission."),
        ("rksc_running_kv_bytes", "running_kv_bytes", "KV bytes running requests hold outside the prefix cache."),
        ("rksc_peak_batch_rows", "peak_batch_rows", "Most branches decoded in one forward since the stats reset."),
    )

    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterable[Any]:
        stats = self._engine.stats()
        for name, field, help_text in self.COUNTERS:
            yield CounterMetricFamily(name, help_text, value=getattr(stats, field))
        for name, field, help_text in self.GAUGES:
            yield GaugeMetricFamily(name, help_text, value=getattr(stats, field))
        yield GaugeMetricFamily("rksc_prompt_reuse_ratio", "Share of prompt tokens served from the prefix cache.",
                                value=stats.prompt_reuse_rate)


class ServeMetrics:
    """The app's registry and the counters it updates."""

    def __init__(self, engine: Engine) -> None:
        self.registry = CollectorRegistry()
        self.http_requests = Counter("rksc_http_requests", "HTTP requests answered, by route and status.",
                                     ["path", "status"], registry=self.registry)
        self.prompt_tokens = Counter("rksc_prompt_tokens", "Prompt tokens of the generation requests served.",
                                     registry=self.registry)
        self.prompt_cached_tokens = Counter(
            "rksc_prompt_cached_tokens", "Prompt tokens of served requests whose KV came from the prefix cache.",
            registry=self.registry)
        self.generation_tokens = Counter("rksc_generation_tokens", "Tokens generated for served requests.",
                                         registry=self.registry)
        self.registry.register(EngineCollector(engine))

    def count_tokens(self, prompts: list[list[Completion]]) -> None:
        """Count one served request: its completions, grouped per prompt."""
        for completions in prompts:
            if completions:
                self.prompt_tokens.inc(completions[0].num_prompt_tokens)
                self.prompt_cached_tokens.inc(completions[0].num_cached_tokens)
            self.generation_tokens.inc(sum(c.num_generated_tokens for c in completions))

    def count_usage(self, usage_body: dict[str, Any]) -> None:
        """Count one served request from its OpenAI ``usage`` body (answers that took several engine
        calls, such as a tool call decoded under its schema, report their totals there)."""
        self.prompt_tokens.inc(usage_body["prompt_tokens"])
        self.prompt_cached_tokens.inc(usage_body["prompt_tokens_details"]["cached_tokens"])
        self.generation_tokens.inc(usage_body["completion_tokens"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


class CountRequests:
    """ASGI middleware counting every HTTP response by route and status (streaming-safe: it only
    watches ``http.response.start``)."""

    def __init__(self, app: Any, metrics: ServeMetrics, paths: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = paths

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.paths else "other"
        status = 500

        async def send_and_note(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            self.metrics.http_requests.labels(path, str(status)).inc()
