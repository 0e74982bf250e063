"""What ``RKSCLLM`` and ``ChatRKSC`` share: constructor fields, the engine, per-call parameters,
and how a ``Completion``'s accounting becomes LangChain metadata."""

from __future__ import annotations

import dataclasses
from typing import Any

from langchain_core.callbacks import CallbackManager, CallbackManagerForLLMRun, dispatch_custom_event
from langchain_core.runnables import RunnableConfig
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator

from rksc_engine import Completion, EngineConfig, RKSCEngine, SamplingParams
from rksc_integrations._common import (
    call_sampling_params,
    device_from_device_map,
    loading_from_model_kwargs,
    local_model_dir,
    normalise_stop,
    put_settings,
    sampling_from_generate_kwargs,
)
from rksc_integrations._engines import shared_engine

# Per-call keyword arguments (``model.invoke(x, max_tokens=8)``) that override the field of that name.
CALL_KWARGS = ("max_new_tokens", "max_tokens", "temperature", "top_p", "top_k", "seed", "n")

CACHE_EVENT = "rksc_cache_reuse"
# Sent when ASKS acted on the call's prompt; its data is the engine's ``ASKSDecision`` as a dict.
ASKS_EVENT = "rksc_asks"


class RKSCFields(BaseModel):
    """Constructor fields of both LangChain models."""

    model_config = ConfigDict(populate_by_name=True, extra="forbid", arbitrary_types_allowed=True)

    model: str | None = Field(default=None)
    """Local Hugging Face model directory; ``None`` loads the embedded default (SmolLM2-135M-Instruct)."""
    device: str = "auto"
    """Device the model is loaded on when built from ``model``: ``"auto"``, ``"cpu"``, ``"cuda"``..."""
    dtype: str = "auto"
    """Weights dtype when built from ``model``: ``"auto"`` (float32 on CPU, bfloat16 on CUDA) or a name."""
    engine_config: EngineConfig | None = Field(default=None, exclude=True)
    """Engine settings (prefix cache budget...) used when the engine is built here; None shares one engine."""
    max_new_tokens: int = Field(default=256, gt=0, alias="max_tokens")
    """Upper bound on generated tokens per generation (also accepted as ``max_tokens``)."""
    temperature: float = Field(default=0.0, ge=0)
    """0 decodes greedily (exact against transformers); > 0 samples."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus mass in (0, 1]; 1 disables it."""
    top_k: int = Field(default=0, ge=0)
    """Keep the k most likely tokens; 0 disables it."""
    stop: list[str] | None = None
    """Strings that end generation (one string or a list), matched on decoded text, so a stop spanning
    several tokens works."""
    seed: int | None = Field(default=None, ge=0)
    """Seed of generation 0 (generation i of a prompt uses seed + i); None draws a fresh seed per call."""
    n: int = Field(default=1, ge=1)
    """Generations per prompt: prefilled once, decoded as one batch, each kept as its own generation."""
    streaming: bool = False
    """Produce ``invoke`` results by streaming internally (callbacks then see every token)."""
    timeout: float | None = Field(default=None, ge=0)
    """Accepted for API parity with hosted models; local generation is bounded by ``max_new_tokens``."""
    max_retries: int = Field(default=0, ge=0)
    """Accepted for API parity; a local generation has no transient failure to retry."""

    _engine: RKSCEngine = PrivateAttr()

    def __init__(self, engine: RKSCEngine | None = None, **fields: Any) -> None:
        if engine is not None and not isinstance(engine, RKSCEngine):
            raise TypeError(f"engine must be an RKSCEngine, got {type(engine).__name__}")
        if engine is not None and fields.get("model") is not None:
            raise ValueError("pass either engine or model, not both")
        super().__init__(**fields)
        self.sampling_params({})  # a bad combination fails at construction, not at the first call
        self._engine = engine if engine is not None else shared_engine(
            self.model, self.device, self.dtype, self.engine_config
        )

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, value: Any) -> Any:
        # One stop string works per call (LangChain's stop=) and so here too.
        return normalise_stop(value)

    @classmethod
    def from_model_id(
        cls,
        model_id: str | None = None,
        task: str = "text-generation",
        backend: str = "default",
        device: int | str | None = None,
        device_map: str | int | None = None,
        model_kwargs: dict[str, Any] | None = None,
        pipeline_kwargs: dict[str, Any] | None = None,
        **fields: Any,
    ) -> Any:
        """Build from a local model directory, taking ``HuggingFacePipeline.from_model_id``'s arguments.

        Args:
            model_id: A local model directory (``None``: the embedded default). The weights are never
                downloaded: a Hub id that is not a local directory raises ``ValueError``.
            task: ``"text-generation"``, the one task rksc runs (decoder-only models); others raise
                ``ValueError``.
            backend: ``"default"``; another backend raises ``ValueError``.
            device: As in ``HuggingFacePipeline``, a device index (-1: CPU, ``i``: accelerator ``i``),
                or an rksc device string (``"cpu"``, ``"cuda:1"``). Exclusive with ``device_map``.
            device_map: One device (``"auto"``, ``"cpu"``, ``"cuda"``...); a map spreading the model over
                several devices raises ``ValueError``.
            model_kwargs: ``torch_dtype``/``dtype`` and ``device_map``; other keys raise ``TypeError``.
            pipeline_kwargs: The generation arguments: ``max_new_tokens``, ``do_sample``,
                ``temperature``, ``top_p``, ``top_k`` and ``stop_strings`` set the fields of those
                names (see ``rksc_integrations._common.sampling_from_generate_kwargs``: ``do_sample=True``
                samples at transformers' defaults, temperature 1.0 and top_k 50, unless given);
                ``return_full_text=False`` is what rksc does anyway (only new text comes back), so
                ``True`` raises ``ValueError``; other keys raise ``TypeError``.
            **fields: The model's fields (``n``, ``seed``, ``streaming``...); a field also set through
                ``pipeline_kwargs`` or ``model_kwargs`` raises ``ValueError``.

        Example:
            ``RKSCLLM.from_model_id("/models/SmolLM2-135M-Instruct", task="text-generation",
            pipeline_kwargs={"max_new_tokens": 64, "do_sample": True, "temperature": 0.7})``
        """
        if task != "text-generation":
            raise ValueError(f"task must be 'text-generation' (rksc runs decoder-only language models), got {task!r}")
        if backend != "default":
            raise ValueError(f"backend must be 'default' (rksc runs the model with PyTorch itself), got {backend!r}")
        if "batch_size" in fields:
            raise TypeError("from_model_id does not take batch_size: rksc decodes every prompt of a batch() "
                            "together, as many as the engine's KV budget holds; drop it")
        if "model" in fields:
            raise TypeError("pass the model directory as model_id (from_model_id's name for it), not model=")
        loading = loading_from_model_kwargs(model_kwargs or {}, "model_kwargs")
        if device is not None and (device_map is not None or "device" in loading):
            raise ValueError("pass either device or device_map (also in model_kwargs), not both")
        if device_map is not None:
            put_settings(loading, {"device": device_from_device_map(device_map, "device_map")}, "device_map")
        if device is not None:
            loading["device"] = device_from_device_map(device, "device") if isinstance(device, int) else device
        put_settings(fields, loading, "model_kwargs / device_map")
        put_settings(fields, _pipeline_settings(pipeline_kwargs or {}), "pipeline_kwargs", {"max_new_tokens": "max_tokens"})
        model = None if model_id is None else local_model_dir(model_id, "model_id")
        return cls(model=model, **fields)

    @property
    def engine(self) -> RKSCEngine:
        """The engine; share it with other components to share its prefix cache."""
        return self._engine

    @property
    def model_name(self) -> str:
        """The model directory's name, e.g. ``"SmolLM2-135M-Instruct"``."""
        return self._engine.model_name

    # -- per-call parameters --------------------------------------------------------------------
    def sampling_params(
        self, kwargs: dict[str, Any], stop: list[str] | None = None, extra_stop: tuple[str, ...] = ()
    ) -> tuple[SamplingParams, int]:
        """The engine parameters of one call: fields overridden by ``kwargs``; stops are merged.

        Raises:
            TypeError: An unknown keyword argument (named in the message), or a value of the wrong type.
            ValueError: A value out of range.
        """
        stops = _stop_list(self.stop, "stop") + _stop_list(stop, "stop") + list(extra_stop)
        # The field's stops and the call's both apply, de-duplicated, order kept.
        return call_sampling_params(self, kwargs, CALL_KWARGS, tuple(dict.fromkeys(stops)))

    # -- reporting ------------------------------------------------------------------------------
    def usage(self, completion: Completion, output_tokens: int | None = None) -> dict[str, Any]:
        """``UsageMetadata`` of a generation; ``cache_read`` = prompt tokens served from the prefix cache."""
        out = completion.num_generated_tokens if output_tokens is None else output_tokens
        return {
            "input_tokens": completion.num_prompt_tokens,
            "output_tokens": out,
            "total_tokens": completion.num_prompt_tokens + out,
            "input_token_details": {"cache_read": completion.num_cached_tokens},
        }

    def generation_info(self, completion: Completion) -> dict[str, Any]:
        return {
            "model_name": self._engine.model_name,
            "finish_reason": completion.finish_reason,
            "num_prompt_tokens": completion.num_prompt_tokens,
            "num_cached_tokens": completion.num_cached_tokens,
            "branch_index": completion.branch_index,
            "seed": completion.seed,
            # What ASKS decided for this prompt (spans, sigma, reused tokens), None when it did not act.
            "asks": completion_asks(completion),
        }

    def report(
        self, completion: Completion, n: int, run_manager: CallbackManagerForLLMRun | None, *, dispatch: bool = True
    ) -> dict[str, Any]:
        """Emit the call's custom events (``rksc_cache_reuse``, and ``rksc_asks`` when ASKS acted) on
        the LLM run and return the cache-reuse data.

        Args:
            dispatch: False when the caller emits the events itself, later: LangChain's chat
                ``stream()``/``astream()`` call ``_stream`` without the run's manager, so
                ``ChatRKSC`` sends them from its ``stream``/``astream`` once the run's id is known.
        """
        data = {
            "model_name": self._engine.model_name,
            "num_prompt_tokens": completion.num_prompt_tokens,
            "num_cached_tokens": completion.num_cached_tokens,
            "num_generations": n,
        }
        if not dispatch:
            return data
        # dispatch_custom_event raises without a parent run: the LLM run is that parent when we have
        # its manager; otherwise (a bare _stream call) the ambient run is, if there is one.
        config = None
        if run_manager is not None:
            manager = CallbackManager(
                handlers=run_manager.handlers, inheritable_handlers=run_manager.inheritable_handlers,
                parent_run_id=run_manager.run_id, tags=run_manager.tags, metadata=run_manager.metadata,
            )
            config = {"callbacks": manager}
        try:
            for name, event_data in custom_events(data, completion_asks(completion)):
                dispatch_custom_event(name, event_data, config=config)
        except RuntimeError:
            pass
        return data

    @property
    def _identifying_params(self) -> dict[str, Any]:
        # Both models identify themselves by the same settings (LangChain uses this for caching/tracing).
        return {
            "model_name": self.model_name, "max_new_tokens": self.max_new_tokens, "temperature": self.temperature,
            "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop, "seed": self.seed, "n": self.n,
        }

    def ls_params(self, stop: list[str] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
        stops = _stop_list(self.stop, "stop") + _stop_list(stop, "stop")
        params: dict[str, Any] = {
            "ls_provider": "rksc",
            "ls_model_name": kwargs.get("model", self._engine.model_name),  # the suite expects a per-call name honoured
            "ls_temperature": kwargs.get("temperature", self.temperature),
            "ls_max_tokens": kwargs.get("max_tokens", kwargs.get("max_new_tokens", self.max_new_tokens)),
        }
        if stops:
            params["ls_stop"] = stops
        return params


def completion_asks(completion: Completion) -> dict[str, Any] | None:
    """What ASKS decided for the completion's prompt, as a dict; None when it did not act."""
    return None if completion.asks is None else dataclasses.asdict(completion.asks)


def custom_events(cache_data: dict[str, Any], asks: dict[str, Any] | None) -> list[tuple[str, dict[str, Any]]]:
    """The custom events of one model call: cache reuse always, ASKS when it acted."""
    events = [(CACHE_EVENT, cache_data)]
    if asks is not None:
        events.append((ASKS_EVENT, asks))
    return events


def _stop_list(value: Any, name: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) for s in value):
        raise TypeError(f"{name} must be a string or a list of strings, got {value!r}")
    return list(value)


def all_at_once(config: RunnableConfig | list[RunnableConfig] | None, num_inputs: int
                ) -> RunnableConfig | list[RunnableConfig]:
    """``config`` with ``max_concurrency`` defaulting to every input at once: each input's thread only
    waits on its engine request, so all of them should be submitted before any finishes (LangChain's
    default pool would cap that at a few workers)."""
    width = max(1, num_inputs)
    if isinstance(config, list):
        return [{"max_concurrency": width, **c} for c in config]
    return {"max_concurrency": width, **(config or {})}


def _pipeline_settings(pipeline_kwargs: Any) -> dict[str, Any]:
    """The fields a ``HuggingFacePipeline`` text-generation ``pipeline_kwargs`` sets."""
    if not isinstance(pipeline_kwargs, dict):
        raise TypeError(f"pipeline_kwargs must be a dict, got {type(pipeline_kwargs).__name__}")
    generate = dict(pipeline_kwargs)
    if generate.pop("return_full_text", False):
        raise ValueError("pipeline_kwargs['return_full_text']=True is not supported: rksc returns only the new text; "
                         "prepend the prompt yourself if you need it")
    return sampling_from_generate_kwargs(generate, "pipeline_kwargs")
