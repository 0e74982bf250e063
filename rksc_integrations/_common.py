"""Rules both adapters (LangChain and LlamaIndex) apply the same way, kept in one place so they agree.

* Stop strings: one string is accepted wherever a list of them is (constructor fields and per-call
  arguments alike), as LangChain's own models do.
* Empty prompts: a prompt with no text raises ``ValueError`` naming the prompt, on every path
  (complete, chat, stream, async): a completion prompt that is empty or whitespace, or a chat in
  which no message has text or tool calls. The engine refuses an empty prompt too; a chat template
  would render an empty user turn into a non-empty prompt, but the model would then answer nothing
  the user asked.
* Per-call options: the keyword arguments of a call override the model's fields of the same name
  (``call_sampling_params``); an unknown one raises ``TypeError`` listing the accepted ones.
* Tool-call turns: with tools offered through the system-prompt protocol (a chat template that does
  not take ``tools``, SmolLM2's for one), whatever the model writes before ``<tool_call>`` is dropped
  from the message content (``rksc_engine.structured.tools.tool_turn_content``, applied by
  ``rksc_engine.structured.tools.finish_tool_turn``). Small models mostly write the protocol's own instruction
  there ("You can call a tool, reply with one block per call and nothing else:"), and an agent feeds
  the content back into its history, where the echo compounds. A template that takes tools keeps the
  text: there it is the model's own words.
* Arguments written for Hugging Face's wrappers (``HuggingFaceLLM``'s ``generate_kwargs`` and
  ``device_map``, ``HuggingFacePipeline.from_model_id``'s ``pipeline_kwargs`` and ``model_kwargs``):
  each is translated to the rksc setting that does the same, or refused with what to write instead;
  an unknown argument raises ``TypeError`` naming it and the closest accepted name. A model id must be
  a local directory: rksc never downloads weights.
* A model built on another (``ChatRKSC(llm=...)``, ``MultiBranchReasoner(llm=...)``) takes the
  settings the user set on it; the arguments given to the new model win.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rksc_engine import SamplingParams
from rksc_engine.structured.tools import tool_turn_content

__all__ = [
    "call_sampling_params",
    "check_chat_has_text",
    "check_prompt_text",
    "device_from_device_map",
    "explicit_settings",
    "loading_from_model_kwargs",
    "local_model_dir",
    "normalise_stop",
    "put_settings",
    "sampling_from_generate_kwargs",
    "tool_turn_content",
    "unknown_argument",
]


def call_sampling_params(
    fields: Any, kwargs: Mapping[str, Any], call_kwargs: Sequence[str], stop: str | Sequence[str], *,
    n_name: str = "n", branch_temperature: float | None = None,
) -> tuple[SamplingParams, int]:
    """The engine parameters of one adapter call, and its number of generations.

    Args:
        fields: The adapter model; its ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``,
            ``seed`` and ``n_name`` attributes are the defaults.
        kwargs: The call's keyword arguments, overriding the fields of the same name (``max_tokens``
            is ``max_new_tokens``).
        call_kwargs: The keyword arguments a call accepts.
        stop: The call's stop strings, as the adapter merges them (one string or a sequence).
        n_name: The name of the generations count (``"n"``, ``"branches"``).
        branch_temperature: Used instead of a temperature of 0 when there are several generations
            (greedy branches would all be the same); None keeps the temperature.

    Raises:
        TypeError: An unknown keyword argument (the message lists ``call_kwargs``), both
            ``max_tokens`` and ``max_new_tokens``, or a value of the wrong type.
        ValueError: A generations count that is not an int >= 1 (named ``n_name``), or a value out of range.
    """
    unknown = sorted(set(kwargs) - set(call_kwargs))
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) {unknown}; per-call options are {list(call_kwargs)}")
    if "max_tokens" in kwargs and "max_new_tokens" in kwargs:
        raise TypeError("pass max_tokens or max_new_tokens, not both")
    n = kwargs.get(n_name, getattr(fields, n_name))
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{n_name} must be an int >= 1, got {n!r}")
    temperature = kwargs.get("temperature", fields.temperature)
    if branch_temperature is not None and n > 1 and temperature == 0:
        temperature = branch_temperature
    params = SamplingParams(
        max_new_tokens=kwargs.get("max_new_tokens", kwargs.get("max_tokens", fields.max_new_tokens)),
        temperature=temperature,
        top_p=kwargs.get("top_p", fields.top_p),
        top_k=kwargs.get("top_k", fields.top_k),
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        seed=kwargs.get("seed", fields.seed),
    )
    return params, n


def normalise_stop(value: Any) -> Any:
    """``[value]`` for one stop string; anything else unchanged (the field's own type check judges it)."""
    return [value] if isinstance(value, str) else value


def check_prompt_text(prompt: str, name: str = "prompt") -> None:
    """``TypeError`` unless ``prompt`` is a string, ``ValueError`` if it has no non-whitespace text."""
    if not isinstance(prompt, str):
        raise TypeError(f"{name} must be a string, got {type(prompt).__name__}")
    if not prompt.strip():
        raise ValueError(f"{name} must be a non-empty string (with non-whitespace text), got {prompt!r}")


def check_chat_has_text(messages: Sequence[dict[str, Any]]) -> None:
    """``ValueError`` when no engine chat message has text or tool calls (an empty conversation)."""
    if not any(str(m.get("content") or "").strip() or m.get("tool_calls") for m in messages):
        raise ValueError("prompt must be non-empty: every message in it has blank content and no tool calls")


# -- arguments written for Hugging Face's own wrappers ----------------------------------------------
# Users move to rksc from ``HuggingFaceLLM`` (LlamaIndex) and ``HuggingFacePipeline.from_model_id`` /
# ``ChatHuggingFace`` (LangChain). Their arguments are translated here, once, for both adapters: what
# rksc can honour becomes the rksc setting, what it cannot is refused with what to write instead, and
# nothing is dropped silently.

# transformers ``generate()`` arguments rksc honours (``generate_kwargs``, ``pipeline_kwargs``).
GENERATE_KWARGS = ("max_new_tokens", "do_sample", "temperature", "top_p", "top_k", "stop_strings")
# transformers' own sampling defaults, used when the arguments ask for sampling without setting these
# (the defaults of a model whose generation_config.json sets none; rksc does not read that file).
TRANSFORMERS_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_k": 50}
_REFUSED_GENERATE_KWARGS = {
    "max_length": "rksc bounds the new tokens only: pass max_new_tokens",
    "num_beams": "rksc decodes greedily or samples; it has no beam search",
    "num_return_sequences": "pass n= (LangChain) or branches= (LlamaIndex) for several generations",
    "repetition_penalty": "rksc applies no repetition penalty",
    "no_repeat_ngram_size": "rksc applies no repetition penalty",
    "pad_token_id": "rksc pads batches itself; drop it",
    "eos_token_id": "generation ends at the model's end-of-turn token; pass stop strings for more",
    "stop_sequence": "pass stop= (a string or a list of strings)",
    "seed": "pass seed= (the adapter's field)",
}
_DEVICE_MAP_SPREADS = ("balanced", "balanced_low_0", "sequential")


def unknown_argument(name: str, accepted: Iterable[str], owner: str) -> TypeError:
    """The ``TypeError`` for an argument ``owner`` does not take, naming it and the closest accepted name."""
    close = difflib.get_close_matches(name, sorted(accepted), n=1, cutoff=0.75)
    suggestion = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"{owner} got an unexpected keyword argument {name!r}{suggestion}")


def sampling_from_generate_kwargs(kwargs: Any, name: str) -> dict[str, Any]:
    """rksc sampling settings for transformers ``generate()`` keyword arguments.

    Accepts ``max_new_tokens``, ``do_sample``, ``temperature``, ``top_p``, ``top_k`` and
    ``stop_strings`` and returns the rksc fields they set (``max_new_tokens``, ``temperature``,
    ``top_p``, ``top_k``, ``stop``). As in transformers, ``do_sample=False`` decodes greedily and
    ``do_sample=True`` samples at temperature 1.0 and top_k 50 unless they are given. Unlike
    transformers, which decodes greedily (with a warning) when ``do_sample`` is left out, a temperature
    > 0, ``top_p`` or ``top_k`` without ``do_sample`` samples: that is what asking for them means.

    Args:
        kwargs: The mapping, e.g. ``{"do_sample": True, "temperature": 0.7, "top_p": 0.95}``.
        name: The argument it came in (``"generate_kwargs"``), for error messages.

    Raises:
        TypeError: ``kwargs`` is not a mapping, or holds a key rksc does not honour (the message says
            what to write instead).
        ValueError: Contradictory settings (``do_sample=False`` with a temperature > 0, ``top_p`` or
            ``top_k``; ``do_sample=True`` with temperature 0).
    """
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"{name} must be a dict of generate() arguments, got {type(kwargs).__name__}")
    for key in kwargs:
        if key not in GENERATE_KWARGS:
            hint = _REFUSED_GENERATE_KWARGS.get(key, f"rksc honours {list(GENERATE_KWARGS)}")
            raise TypeError(f"{name}[{key!r}] is not supported: {hint}")
    settings = {key: kwargs[key] for key in ("max_new_tokens", "temperature", "top_p", "top_k") if key in kwargs}
    if "stop_strings" in kwargs:
        settings["stop"] = normalise_stop(kwargs["stop_strings"])
    do_sample = kwargs.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        raise TypeError(f"{name}['do_sample'] must be a bool, got {do_sample!r}")
    sampling_keys = [k for k in ("top_p", "top_k") if k in kwargs]
    if isinstance(settings.get("temperature"), (int, float)) and settings["temperature"] > 0:
        sampling_keys.insert(0, "temperature")
    if do_sample is False:
        if sampling_keys:
            raise ValueError(f"{name} has do_sample=False (greedy decoding) with {sampling_keys}, which only "
                             f"sampling uses; drop them or set do_sample=True")
        settings["temperature"] = 0.0
    elif do_sample or sampling_keys:
        if do_sample and settings.get("temperature", 1.0) == 0:
            raise ValueError(f"{name} has do_sample=True with temperature=0; sampling needs temperature > 0 "
                             f"(or drop do_sample for greedy decoding)")
        for key, default in TRANSFORMERS_SAMPLING_DEFAULTS.items():
            settings.setdefault(key, default)
    return settings


def loading_from_model_kwargs(kwargs: Any, name: str) -> dict[str, Any]:
    """rksc loading settings (``dtype``, ``device``) for transformers ``from_pretrained`` keyword arguments.

    Accepts ``torch_dtype`` or ``dtype`` (a ``torch.dtype`` or its name) and ``device_map`` (one device).

    Raises:
        TypeError: ``kwargs`` is not a mapping, or holds a key rksc does not honour.
        ValueError: A ``device_map`` that spreads the model over devices.
    """
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"{name} must be a dict of from_pretrained() arguments, got {type(kwargs).__name__}")
    settings: dict[str, Any] = {}
    for key, value in kwargs.items():
        if key in ("torch_dtype", "dtype"):
            if "dtype" in settings:
                raise TypeError(f"{name} has both torch_dtype and dtype; pass one")
            settings["dtype"] = str(value).removeprefix("torch.")
        elif key == "device_map":
            settings["device"] = device_from_device_map(value, f"{name}['device_map']")
        elif key == "trust_remote_code":
            raise TypeError(f"{name}['trust_remote_code'] is an engine setting: build the engine with "
                            f"RKSCEngine.from_pretrained(path, config=EngineConfig(trust_remote_code=True)) and pass engine=")
        else:
            raise TypeError(f"{name}[{key!r}] is not supported: rksc loads a model from its directory with a dtype "
                            f"and a device only (torch_dtype/dtype, device_map); to load it another way, build "
                            f"RKSCEngine(model, tokenizer) and pass engine=")
    return settings


def device_from_device_map(value: Any, name: str) -> str:
    """rksc's device for a transformers ``device_map`` naming one device: ``"auto"``, ``"cpu"``,
    ``"cuda"``, ``"cuda:1"``, ``"mps"`` or a GPU index.

    Raises:
        ValueError: A map that spreads the model over several devices (a dict, ``"balanced"``,
            ``"sequential"``): rksc keeps the whole model on one device.
    """
    if isinstance(value, int) and not isinstance(value, bool):
        return "cpu" if value < 0 else f"cuda:{value}"
    if isinstance(value, str) and value not in _DEVICE_MAP_SPREADS:
        return value
    raise ValueError(f"{name}={value!r} spreads the model over devices; rksc keeps it on one: pass 'auto', "
                     f"'cpu', 'cuda' or 'cuda:<i>'")


def local_model_dir(value: Any, name: str) -> str:
    """``value`` when it is a local model directory (holding a ``config.json``).

    Raises:
        TypeError: Not a path.
        ValueError: Not a local model directory, a Hub id for one: rksc never downloads weights.
    """
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be a local model directory (a path), got {type(value).__name__}; for a model "
                        f"already loaded, pass engine=RKSCEngine(model, tokenizer)")
    if not (Path(value) / "config.json").is_file():
        raise ValueError(f"{name}={str(value)!r} is not a local model directory (no config.json there), and rksc "
                         f"never downloads weights: download it first (e.g. `huggingface-cli download {value} "
                         f"--local-dir DIR`) and pass {name}=DIR")
    return str(value)


def put_settings(fields: dict[str, Any], settings: Mapping[str, Any], source: str,
                 aliases: Mapping[str, str] | None = None) -> None:
    """Add ``settings`` (translated from the argument ``source``) to ``fields``.

    Raises:
        ValueError: A setting ``fields`` already has (under its name or an alias): it was given twice.
    """
    aliases = aliases or {}
    for key, value in settings.items():
        given = [k for k in (key, aliases.get(key)) if k is not None and k in fields]
        if given:
            raise ValueError(f"{key} is given twice, as {given[0]}= and in {source}; pass it once")
        fields[key] = value


def explicit_settings(model: Any, names: Mapping[str, str]) -> dict[str, Any]:
    """The settings a user set on an adapter model (pydantic's ``model_fields_set``), by our name.

    Args:
        model: A pydantic adapter model (``ChatRKSC``, either ``RKSCLLM``).
        names: Our setting's name -> the model's field name.
    """
    given = getattr(model, "model_fields_set", set())
    return {ours: getattr(model, theirs) for ours, theirs in names.items() if theirs in given}
