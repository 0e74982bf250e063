"""Servers on loopback for the benchmarks that reason over one: ``rksc serve`` in this process (an
engine's app on a uvicorn thread, so its engine's own counters stay readable) and ``transformers
serve`` as a subprocess over a model directory, offline.

``transformers serve`` samples only when the model's generation config says ``do_sample`` (a
request's ``temperature`` alone does not switch it on) and then applies that config's ``top_k``
(transformers' default 50); ``sampling_model_dir`` gives it a directory beside the model's whose
generation config samples with no top-k, so its branches sample as rksc's do (``temperature`` and
``top_p`` come with each request).
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
from collections.abc import Iterator
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


@contextlib.contextmanager
def transformers_serve(model_dir: Path, timeout_s: float = STARTUP_TIMEOUT_S, threads: int | None = None
                       ) -> Iterator[str]:
    """``transformers serve MODEL_DIR`` on CPU on a free loopback port, offline; yields its base
    URL once ``/v1/models`` answers and stops it afterwards."""
    import httpx

    exe = Path(sys.executable).with_name("transformers")
    if not exe.exists():
        raise RuntimeError(f"the transformers CLI is not installed next to {sys.executable}")
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen([str(exe), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                                    "--device", "cpu", "--log-level", "warning"], stdout=log,
                                   stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if process.poll() is not None:
                    log.seek(0)
                    raise RuntimeError(f"transformers serve exited ({process.returncode}): {log.read()[-1500:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"transformers serve did not answer within {timeout_s:.0f} s")
                time.sleep(0.5)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
