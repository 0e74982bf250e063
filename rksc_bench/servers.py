"""Servers on loopback for the benchmarks that reason over one: ``rksc serve`` in this process (an
engine's app on a uvicorn thread, so its engine's own counters stay readable), and as subprocesses
(``server_process``: a free loopback port, a wait until a readiness URL answers, a stop however the
block ends) ``transformers serve`` over a model directory, offline, and llama.cpp's ``llama-server``
over a GGUF file.

``transformers serve`` samples only when the model's generation config says ``do_sample`` (a
request's ``temperature`` alone does not switch it on) and then applies that config's ``top_k``
(transformers' default 50); ``sampling_model_dir`` gives it a directory beside the model's whose
generation config samples with no top-k, so its branches sample as rksc's do (``temperature`` and
``top_p`` come with each request).

``llama-server`` samples by default with top-k 40, min-p 0.05 and top-p before the temperature;
``llama_server_command`` sets its sampling chain to rksc's (temperature, top-k off, top-p), gives
every slot a context of its own (``llama_server_ctx_size``) and turns on ``/metrics``, from which
``llama_server_decode_tokens`` reads what the server decoded. ``llama_server_prompt_difference``
checks that it renders and tokenizes chat prompts as an ``RKSCEngine`` does.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

STARTUP_TIMEOUT_S = 300.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def app_in_thread(app: Any, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve the ASGI ``app`` with uvicorn on a free loopback port in a daemon thread; yields the
    base URL (``http://127.0.0.1:PORT``) and stops the server afterwards."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bench-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
        sock.close()


def sampling_model_dir(model_dir: Path, into: Path) -> Path:
    """A directory in ``into`` holding links to ``model_dir``'s files and a generation config that
    samples (``do_sample``) with top-k off, for ``transformers serve`` (see the module docstring)."""
    into.mkdir(parents=True, exist_ok=True)
    for path in Path(model_dir).iterdir():
        if path.is_file() and path.name != "generation_config.json":
            target = into / path.name
            if not target.exists():
                target.symlink_to(path.resolve())
    source = Path(model_dir) / "generation_config.json"
    config = json.loads(source.read_text()) if source.exists() else {}
    config.update(do_sample=True, top_k=0)
    (into / "generation_config.json").write_text(json.dumps(config, indent=2))
    return into


class ServerFailed(RuntimeError):
    """A server subprocess exited, or did not answer its readiness URL in time; the message says
    which and ends with the tail of the server's output."""


@contextlib.contextmanager
def server_process(command: Sequence[str], port: int, ready_path: str, *, name: str,
                   env: Mapping[str, str] | None = None, timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """Run ``command``, a server that listens on ``127.0.0.1:port``, until ``GET ready_path`` answers
    200; yields its base URL (``http://127.0.0.1:PORT``) and stops it afterwards, however the block
    ends (an error, Ctrl-C): SIGTERM, then SIGKILL after 30 s. Its output goes to a temporary file,
    whose tail ``ServerFailed`` quotes."""
    import httpx

    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen(list(command), stdout=log, stderr=subprocess.STDOUT,
                                   env=None if env is None else dict(env))
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if process.poll() is not None:
                    raise ServerFailed(f"{name} exited ({process.returncode}): {_tail(log)}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + ready_path, timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise ServerFailed(f"{name} did not answer {ready_path} within {timeout_s:.0f} s: {_tail(log)}")
                time.sleep(0.25)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _tail(log: Any, chars: int = 1500) -> str:
    log.flush()
    log.seek(0)
    return log.read()[-chars:].strip() or "(no output)"


@contextlib.contextmanager
def transformers_serve(model_dir: Path, timeout_s: float = STARTUP_TIMEOUT_S, threads: int | None = None
                       ) -> Iterator[str]:
    """``transformers serve MODEL_DIR`` on CPU on a free loopback port, offline; yields its base
    URL once ``/v1/models`` answers and stops it afterwards."""
    exe = Path(sys.executable).with_name("transformers")
    if not exe.exists():
        raise ServerFailed(f"the transformers CLI is not installed next to {sys.executable}")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    command = [str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
               "--log-level", "warning"]
    with server_process(command, port, "/v1/models", name="transformers serve", env=env, timeout_s=timeout_s) as url:
        yield url


# -- llama.cpp's server ---------------------------------------------------------------------------
# llama.cpp rounds each slot's context up to a multiple of this many tokens.
LLAMA_CTX_ALIGN = 256
# rksc's sampling chain: temperature, then top-k (off unless a request sends ``top_k``), then top-p.
# llama-server's default chain also has penalties, DRY, top-n-sigma, typical-p, min-p (0.05) and
# XTC, applies top-k (40) and top-p before the temperature.
LLAMA_SAMPLERS = "temperature;top_k;top_p"
# Counters of llama-server's /metrics are printed with six significant digits.
LLAMA_EXACT_COUNT_BELOW = 1_000_000


def _check_count(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    return value


def llama_server_ctx_size(max_prompt_tokens: int, max_new_tokens: int, parallel: int) -> int:
    """The ``--ctx-size`` that gives each of ``parallel`` slots room for the longest prompt and its
    new tokens. Without a unified KV cache llama.cpp gives each slot ``ctx_size / parallel`` tokens
    (rounded up to a multiple of 256) and ends a generation once prompt and output are one token short
    of that, so each slot gets the prompt, the new tokens and two more, rounded up to 256."""
    for name, value in (("max_prompt_tokens", max_prompt_tokens), ("max_new_tokens", max_new_tokens),
                        ("parallel", parallel)):
        _check_count(name, value)
    per_slot = -(-(max_prompt_tokens + max_new_tokens + 2) // LLAMA_CTX_ALIGN) * LLAMA_CTX_ALIGN
    return per_slot * parallel


def llama_server_command(binary: Path | str, gguf: Path | str, port: int, *, threads: int, parallel: int,
                         ctx_size: int) -> list[str]:
    """The ``llama-server`` command line: ``gguf`` on ``127.0.0.1:port`` with ``threads`` CPU threads
    (prompt batches included), ``parallel`` slots decoded together, each with its own
    ``ctx_size / parallel`` tokens of KV (no unified cache, so the share is fixed), prompt caching,
    the GGUF's own chat template through the Jinja engine (the template rksc reads), ``/metrics`` on,
    no web UI, and rksc's sampling chain (``LLAMA_SAMPLERS``, top-k off): what a request leaves out
    is sampled as rksc samples it, not with llama.cpp's top-k 40 and min-p 0.05."""
    for name, value in (("port", port), ("threads", threads), ("parallel", parallel), ("ctx_size", ctx_size)):
        _check_count(name, value)
    if ctx_size < parallel:
        raise ValueError(f"ctx_size must be >= parallel ({parallel}) so that every slot has a context, got {ctx_size}")
    return [str(binary), "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--threads-batch", str(threads),
            "--parallel", str(parallel), "--no-kv-unified", "--ctx-size", str(ctx_size),
            "--cache-prompt", "--jinja", "--metrics", "--no-webui",
            "--samplers", LLAMA_SAMPLERS, "--top-k", "0"]


@contextlib.contextmanager
def llama_server(binary: Path | str, gguf: Path | str, *, threads: int, parallel: int, ctx_size: int,
                 timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """``llama-server`` (``llama_server_command``) on a free loopback port; yields its base URL once
    ``/health`` answers 200 (the model is loaded) and stops it afterwards."""
    port = free_port()
    command = llama_server_command(binary, gguf, port, threads=threads, parallel=parallel, ctx_size=ctx_size)
    with server_process(command, port, "/health", name="llama-server", timeout_s=timeout_s) as url:
        yield url


def llama_server_version(binary: Path | str) -> str:
    """What ``llama-server --version`` says of itself (its build number and commit), or why nothing."""
    try:
        run = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"unknown ({type(error).__name__}: {error})"
    lines = [line.strip() for line in (run.stdout + run.stderr).splitlines() if line.strip().startswith("version")]
    return lines[0] if lines else "unknown"


def parse_llama_metrics(text: str) -> dict[str, str]:
    """``llama-server``'s ``/metrics`` (Prometheus text) as ``{name: value as printed}``, unlabelled
    series only."""
    values = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and not line.startswith("#") and "{" not in fields[0]:
            values[fields[0]] = fields[1]
    return values


def llama_server_decode_tokens(url: str, timeout_s: float = 60.0) -> int:
    """Tokens ``llama-server`` at ``url`` has generated since it started (``tokens_predicted_total``
    of ``/metrics``), read once none of its slots is busy: a request counts when its slot is let
    go, and a branch closed by the client lets go when the server notices, after the decode step it
    is in. ``RuntimeError`` when a slot stays busy past ``timeout_s`` or the count is past
    ``LLAMA_EXACT_COUNT_BELOW`` (where ``/metrics`` prints it rounded)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        response = httpx.get(f"{url}/metrics", timeout=10)
        response.raise_for_status()
        metrics = parse_llama_metrics(response.text)
        if float(metrics["llamacpp:requests_processing"]) == 0:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"llama-server at {url} still processes requests after {timeout_s:.0f} s")
        time.sleep(0.05)
    printed = metrics["llamacpp:tokens_predicted_total"]
    count = float(printed)
    if count >= LLAMA_EXACT_COUNT_BELOW:
        raise RuntimeError(f"llama-server printed tokens_predicted_total as {printed}: past "
                           f"{LLAMA_EXACT_COUNT_BELOW:,} it rounds to six significant digits")
    return int(count)


def llama_server_prompt(url: str, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
    """What ``llama-server`` at ``url`` makes of chat ``messages``: the text its chat template renders
    (``/apply-template``, the rendering ``/v1/chat/completions`` does) and its token ids, tokenized
    as the chat endpoint does (``/tokenize`` adding and parsing special tokens)."""
    import httpx

    response = httpx.post(f"{url}/apply-template", json={"messages": messages}, timeout=30)
    response.raise_for_status()
    text = response.json()["prompt"]
    response = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": True, "parse_special": True},
                          timeout=30)
    response.raise_for_status()
    return text, [int(token) for token in response.json()["tokens"]]


def llama_server_prompt_difference(url: str, engine: Any, prompts: Iterable[list[dict[str, Any]]]) -> str | None:
    """Where ``llama-server`` at ``url`` would prompt the model otherwise than ``engine`` (an
    ``RKSCEngine``, whose ``render_chat`` and ``encode_chat`` are what ``rksc serve`` sends the model)
    for any of the chat ``prompts``: the first differing character of the rendered text, else the
    first differing token id; None when every prompt is the same text and the same tokens."""
    for number, messages in enumerate(prompts):
        text, ids = llama_server_prompt(url, messages)
        expected_text, expected_ids = engine.render_chat(messages), engine.encode_chat(messages)
        if text != expected_text:
            at = _first_difference(text, expected_text)
            return (f"prompt {number}: llama-server renders the chat otherwise from character {at}: "
                    f"{text[at:at + 60]!r} where rksc has {expected_text[at:at + 60]!r}")
        if ids != expected_ids:
            at = _first_difference(ids, expected_ids)
            return (f"prompt {number}: llama-server tokenizes the same text otherwise from token {at}: "
                    f"{ids[at:at + 8]} where rksc has {expected_ids[at:at + 8]}")
    return None


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
