"""``rksc serve`` over HTTP against the engine in-process, and against ``transformers serve``.

Every arm answers the same workload: ``--clients`` concurrent clients, each sending ``--requests``
chat requests one after another (distinct questions), greedy, ``--max-tokens`` each:

    in-process          ``engine.submit`` from asyncio tasks in this process: the baseline, no HTTP.
    in-process, mixed prefill on
                        the same with ``SchedulerConfig(mixed_prefill=True)``: each arrival's prompt
                        prefilled in the running rows' decode forward rather than in a forward of its
                        own (cache cleared first, so both arms start cold).
    in-process, linear products
                        the same on a second engine over the same model with
                        ``EngineConfig(decode_matmul="linear")``: the decode step's linear layers
                        compute ``x @ W.T`` as the model's own do, not ``(W @ x.T).T``.
    rksc serve          the ``rksc serve`` command as a subprocess on a free loopback port.
    transformers serve  ``transformers serve <model dir>`` as a subprocess on a free loopback port,
                        offline (``HF_HUB_OFFLINE=1``), same device and dtype. When it cannot run, the
                        table says exactly why and the other arms still report.
    Ray replicas        ``--ray-replicas N``: ``rksc serve`` behind Ray Serve replicas
                        (``rksc_serve.cluster``); reported as not run until that arm is wired in.

An arm's figure is generated tokens (the server's ``usage.completion_tokens``) per wall second of the
whole workload, after one warm-up request outside the timing. ``vs in-process`` is that figure over
the in-process arm's (the HTTP overhead, for ``rksc serve``); the ``rksc serve`` over
``transformers serve`` ratio is printed under the table. ``same answers`` counts the answers equal
to the in-process arm's greedy text: ``rksc serve`` must match all of them.

With ``--arrivals poisson``, the ``--clients`` requests arrive instead at the times of a Poisson
process (``--arrival-rate`` requests per second, seeded by ``--seed``), one streamed request each, and
every arm also reports the time to first token (from sending a request to its first generated token)
at the 50th and 99th percentiles (nearest rank: of 16 requests, p99 is the slowest).

    python benchmarks/serve.py --quick                    # smoke run: 2 clients x 2 requests, 8 tokens
    python benchmarks/serve.py --out docs/bench/serve.md  # 8 clients x 4 requests, 64 tokens
    python benchmarks/serve.py --arrivals poisson --clients 16 --transformers-continuous-batching
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from rksc_bench import harness
from rksc_engine import RKSCEngine, SamplingParams
from rksc_engine.runtime.loading import ensure_default_model, resolve_device, resolve_dtype

STARTUP_TIMEOUT_S = 300.0
QUICK = {"clients": 2, "requests": 2, "max_tokens": 8}
Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Workload:
    prompts: list[Messages]  # request i is sent by client i % clients
    clients: int
    max_tokens: int
    arrivals: list[float] | None = None  # seconds from the start at which request i is sent (streamed)

    def per_client(self, client: int) -> list[tuple[int, Messages]]:
        return [(i, p) for i, p in enumerate(self.prompts) if i % self.clients == client]


@dataclass
class Arm:
    """One arm's outcome: its answers and timing, or why it did not run."""

    name: str
    answers: list[str] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    not_run: str | None = None
    first_token_s: list[float] = field(default_factory=list)  # per request, with arrivals

    def first_token_percentile(self, q: float) -> float:
        """Nearest-rank percentile ``q`` (0-100) of the times to first token."""
        ordered = sorted(self.first_token_s)
        return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class ServerFailed(RuntimeError):
    """A server subprocess that exited or never became healthy; the message says why."""


def workload(clients: int, requests: int, max_tokens: int, arrivals: list[float] | None = None) -> Workload:
    prompts = [[{"role": "user", "content": f"Question {i}: what is {3 + i} plus {7 * i + 2}? Explain briefly."}]
               for i in range(clients * requests)]
    return Workload(prompts, clients, max_tokens, arrivals)


def poisson_arrivals(count: int, rate: float, seed: int) -> list[float]:
    """``count`` arrival times (s) of a Poisson process of ``rate`` per second: exponential gaps."""
    rng, now, times = random.Random(seed), 0.0, []
    for _ in range(count):
        now += rng.expovariate(rate)
        times.append(now)
    return times


WARM_UP: Messages = [{"role": "user", "content": "Warm-up: say hello."}]


# -- clients ------------------------------------------------------------------------------------
async def _drive(work: Workload, ask: Callable[[Messages], Any], name: str) -> Arm:
    """Run the workload with ``ask(messages) -> (text, generated tokens, first token time or None)``;
    the clock covers it all."""
    arm = Arm(name, answers=[""] * len(work.prompts))
    if work.arrivals is not None:
        return await _drive_arrivals(work, ask, arm)
    await ask(work.prompts[0])  # warm-up, outside the timing
    bar = tqdm(total=len(work.prompts), desc=name, file=sys.stderr, leave=False)

    async def client(k: int) -> int:
        tokens = 0
        for i, messages in work.per_client(k):
            arm.answers[i], generated, _ = await ask(messages)
            tokens += generated
            bar.update(1)
        return tokens

    start = time.perf_counter()
    arm.tokens = sum(await asyncio.gather(*(client(k) for k in range(work.clients))))
    arm.seconds = time.perf_counter() - start
    bar.close()
    return arm


async def _drive_arrivals(work: Workload, ask: Callable[[Messages], Any], arm: Arm) -> Arm:
    """Each request sent at its arrival time, whatever the others are doing (an open loop)."""
    arrivals = work.arrivals or []
    arm.first_token_s = [0.0] * len(work.prompts)
    await ask(WARM_UP)  # warm-up, outside the timing, with a prompt no request begins with
    bar = tqdm(total=len(work.prompts), desc=arm.name, file=sys.stderr, leave=False)
    start = time.perf_counter()

    async def one(i: int) -> int:
        await asyncio.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
        sent = time.perf_counter()
        arm.answers[i], generated, first = await ask(work.prompts[i])
        arm.first_token_s[i] = (first if first is not None else time.perf_counter()) - sent
        bar.update(1)
        return generated

    arm.tokens = sum(await asyncio.gather(*(one(i) for i in range(len(work.prompts)))))
    arm.seconds = time.perf_counter() - start
    bar.close()
    return arm


def in_process_arm(engine: RKSCEngine, work: Workload, name: str = "in-process") -> Arm:
    params = SamplingParams(max_new_tokens=work.max_tokens, temperature=0.0)

    async def ask(messages: Messages) -> tuple[str, int, float | None]:
        if work.arrivals is None:
            [completion] = await engine.submit(messages, 1, params)
            return completion.text, completion.num_generated_tokens, None
        first, text, generated = None, "", 0
        async for chunk in engine.submit(messages, 1, params, stream=True):
            if chunk.token_ids and first is None:
                first = time.perf_counter()
            generated += len(chunk.token_ids)
            if chunk.completion is not None:
                text = chunk.completion.text
        return text, generated, first

    return asyncio.run(_drive(work, ask, name))


def mixed_in_process_arm(engine: RKSCEngine, work: Workload) -> Arm:
    """The in-process arm with ``mixed_prefill`` on, from a cold cache; the engine's config is restored."""
    config = engine.config
    engine.config = replace(config, scheduler=replace(config.scheduler, mixed_prefill=True))
    engine.clear_cache()
    try:
        return in_process_arm(engine, work, "in-process, mixed prefill on")
    finally:
        engine.config = config


def linear_products_arm(engine: RKSCEngine, work: Workload) -> Arm:
    """The in-process arm on an engine over the same model whose decode step keeps the model's own
    linear layers (``decode_matmul="linear"``)."""
    linear = RKSCEngine(engine.model, engine.tokenizer, replace(engine.config, decode_matmul="linear"))
    harness.warm_up(linear)
    try:
        return in_process_arm(linear, work, "in-process, linear products")
    finally:
        linear.clear_cache()  # its KV is no use to the later arms


def http_arm(base_url: str, model: str, work: Workload, name: str, count_tokens: Callable[[str], int]) -> Arm:
    """The workload over HTTP, one ``httpx`` connection pool shared by the clients."""

    async def run() -> Arm:
        limits = httpx.Limits(max_connections=work.clients + 1, max_keepalive_connections=work.clients + 1)
        async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as http:
            body = {"model": model, "max_tokens": work.max_tokens, "temperature": 0}

            async def ask(messages: Messages) -> tuple[str, int, float | None]:
                if work.arrivals is not None:
                    return await _ask_streamed(http, {**body, "messages": messages}, count_tokens)
                response = await http.post("/v1/chat/completions", json={**body, "messages": messages})
                if response.status_code != 200:
                    raise ServerFailed(f"HTTP {response.status_code}: {response.text[:300]}")
                answer = response.json()
                text = answer["choices"][0]["message"]["content"] or ""
                generated = (answer.get("usage") or {}).get("completion_tokens")
                return text, generated if isinstance(generated, int) else count_tokens(text), None

            return await _drive(work, ask, name)

    return asyncio.run(run())


# -- servers ------------------------------------------------------------------------------------
def free_port() -> int:
    """A loopback port free now (bound and released; the server binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def offline_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_DISABLE_UPDATE_CHECK="1", DO_NOT_TRACK="1")
    return env


@contextlib.contextmanager
def server_process(command: Sequence[str], health_path: str, timeout_s: float = STARTUP_TIMEOUT_S) -> Iterator[str]:
    """Run ``command`` (which must take ``--host`` and ``--port``) on a free loopback port until it
    answers ``health_path``; yields its base URL and stops it afterwards, whatever happened."""
    port = free_port()
    with tempfile.TemporaryFile(mode="w+") as log:
        process = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port)], stdout=log,
                                   stderr=subprocess.STDOUT, env=offline_env())
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_healthy(url + health_path, process, log, timeout_s)
            yield url
        finally:
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _wait_healthy(url: str, process: subprocess.Popen, log: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerFailed(f"exited with status {process.returncode} before serving: {_tail(log)}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.5)
    raise ServerFailed(f"did not answer {url} within {timeout_s:.0f} s: {_tail(log)}")


def _tail(log: Any, lines: int = 6) -> str:
    log.flush()
    log.seek(0)
    text = [line.strip() for line in log.read().splitlines() if line.strip()]
    return " | ".join(text[-lines:]) or "(no output)"


async def _ask_streamed(http: httpx.AsyncClient, body: dict[str, Any],
                        count_tokens: Callable[[str], int]) -> tuple[str, int, float | None]:
    """One streamed chat completion (server-sent events): its text, generated tokens (the server's
    usage when it sends one, else the text counted), and when its first text arrived."""
    first, parts, generated = None, [], None
    async with http.stream("POST", "/v1/chat/completions",
                           json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
        if response.status_code != 200:
            raise ServerFailed(f"HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            data = line.removeprefix("data:").strip()
            if not line.startswith("data:") or not data:
                continue
            if data == "[DONE]":
                break
            event = json.loads(data)
            usage = (event.get("usage") or {}).get("completion_tokens")
            generated = usage if isinstance(usage, int) else generated
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = time.perf_counter() if first is None else first
                    parts.append(piece)
    text = "".join(parts)
    return text, generated if generated is not None else count_tokens(text), first


def rksc_serve_arm(args: argparse.Namespace, work: Workload, count_tokens: Callable[[str], int]) -> Arm:
    command = [sys.executable, "-m", "rksc_cli", "serve", "--device", args.device, "--dtype", args.dtype_name,
               "--log-level", "warning", *(["--model", str(args.model)] if args.model else [])]
    try:
        with server_process(command, "/health") as url:
            return http_arm(url, "rksc", work, "rksc serve", count_tokens)
    except (ServerFailed, httpx.HTTPError) as error:
        return Arm("rksc serve", not_run=f"not run: rksc serve {type(error).__name__}: {error}")


def transformers_command(args: argparse.Namespace, model_dir: Path) -> list[str] | str:
    """The ``transformers serve`` command line, or why there is none."""
    script = Path(sys.executable).parent / "transformers"
    if not script.exists():
        return f"the transformers CLI is not installed next to {sys.executable}"
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        return f"transformers {transformers.__version__} has no `transformers serve` (it came with 5.x)"
    missing = [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]
    if missing:
        return f"`transformers serve` needs {missing} (pip install 'transformers[serving]')"
    device = "cpu" if args.device_obj.type == "cpu" else str(args.device_obj)
    command = [str(script), "serve", str(model_dir), "--device", device, "--dtype", args.dtype_name,
               "--log-level", "warning"]
    if args.transformers_continuous_batching:
        command.append("--continuous-batching")
    return command


def transformers_serve_arm(args: argparse.Namespace, work: Workload, model_dir: Path,
                           count_tokens: Callable[[str], int]) -> Arm:
    name = "transformers serve"
    command = transformers_command(args, model_dir)
    if isinstance(command, str):
        return Arm(name, not_run=f"not run: {command}")
    try:
        with server_process(command, "/health") as url:
            return http_arm(url, str(model_dir), work, name, count_tokens)
    except (ServerFailed, httpx.HTTPError) as error:
        return Arm(name, not_run=f"not run: transformers serve {type(error).__name__}: {error}")


def ray_replicas_arm(args: argparse.Namespace, work: Workload) -> Arm | None:
    """Arm (c), ``--ray-replicas N``: the workload against ``rksc serve`` behind N Ray Serve replicas.

    This is the hook the cluster work fills in (``rksc_serve.cluster``); until then it says why it
    did not run, so the table always has the row when it was asked for.
    """
    if not args.ray_replicas:
        return None
    name = f"Ray replicas (x{args.ray_replicas})"
    try:
        found = importlib.util.find_spec("rksc_serve.cluster") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return Arm(name, not_run="not run: rksc_serve.cluster is not importable")
    try:
        import rksc_serve.cluster  # noqa: F401
    except Exception as error:  # an optional dependency (ray) missing, most likely
        return Arm(name, not_run=f"not run: importing rksc_serve.cluster failed: {type(error).__name__}: {error}")
    return Arm(name, not_run="not run: the Ray replicas arm is not wired into benchmarks/serve.py yet "
                             "(ray_replicas_arm)")


# -- report -------------------------------------------------------------------------------------
def markdown(arms: list[Arm], work: Workload, args: argparse.Namespace) -> str:
    base = arms[0]
    timed = work.arrivals is not None
    extra_head, extra_rule = (" first token p50 s | first token p99 s |", "---:|---:|") if timed else ("", "")
    rows = [f"| arm | requests | generated tokens | wall s | tokens/s | vs in-process |{extra_head} same answers |",
            f"|---|---:|---:|---:|---:|---:|{extra_rule}---:|"]
    for arm in arms:
        if arm.not_run:
            rows.append(f"| {arm.name} | {arm.not_run} | | | | |{' | |' if timed else ''} |")
            continue
        same = sum(a == b for a, b in zip(arm.answers, base.answers))
        ratio = arm.tokens_per_s / base.tokens_per_s if base.tokens_per_s else 0.0
        first = (f" {arm.first_token_percentile(50):.3f} | {arm.first_token_percentile(99):.3f} |"
                 if timed else "")
        rows.append(f"| {arm.name} | {len(arm.answers)} | {arm.tokens} | {arm.seconds:.2f} | "
                    f"{arm.tokens_per_s:.1f} | {ratio:.2f}x |{first} {same}/{len(arm.answers)} |")
    by_name = {a.name: a for a in arms if not a.not_run}
    rksc, hf = by_name.get("rksc serve"), by_name.get("transformers serve")
    shape = (f"{len(work.prompts)} streamed requests arriving as a Poisson process of {args.arrival_rate:g}/s "
             f"(seed {args.seed}, last at {work.arrivals[-1]:.1f} s)" if timed else
             f"{work.clients} concurrent clients x {len(work.prompts) // work.clients} requests")
    lines = [
        f"Workload: {shape}, greedy, "
        f"max_tokens {work.max_tokens}; model {args.model or 'the embedded default'}; device {args.device_obj}, "
        f"{args.dtype_name}; transformers serve continuous batching "
        f"{'on' if args.transformers_continuous_batching else 'off (its default)'}.",
        "",
        *rows,
        "",
        f"rksc serve / transformers serve (generated tokens/s): {rksc.tokens_per_s / hf.tokens_per_s:.2f}x"
        if rksc and hf and hf.tokens_per_s else "rksc serve / transformers serve: not measured (see the table)",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__, json_out="optional")
    parser.add_count("--clients", 8, "concurrent clients")
    parser.add_count("--requests", 4, "requests per client, sent one after another")
    parser.add_count("--max-tokens", 64, "max_tokens of every request")
    parser.add_device()
    parser.add_dtype()
    parser.add_argument("--transformers-continuous-batching", action="store_true",
                        help="run transformers serve with --continuous-batching")
    parser.add_argument("--skip-transformers-serve", action="store_true", help="leave out arm (b)")
    parser.add_argument("--ray-replicas", type=int, default=0,
                        help="also run rksc serve behind this many Ray Serve replicas (rksc_serve.cluster)")
    parser.add_argument("--arrivals", choices=("closed", "poisson"), default="closed",
                        help="closed: each client sends its next request when its last ends (default); poisson: "
                             "--clients streamed requests arrive at Poisson times, and time to first token is reported")
    parser.add_argument("--arrival-rate", type=float, default=1.0, help="poisson arrivals per second (default 1)")
    parser.add_seed(0, "seed of the poisson arrival times")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 clients x 2 requests of 8 tokens")
    parser.add_argument("--out", type=Path, default=None, help="also write the markdown here (docs/bench/serve.md)")
    args = parser.parse_args(argv)
    if args.quick:
        args.clients, args.requests, args.max_tokens = QUICK["clients"], QUICK["requests"], QUICK["max_tokens"]
    if not (args.arrival_rate > 0 and math.isfinite(args.arrival_rate)):
        parser.error("--arrival-rate must be a positive number")
    args.device_obj = resolve_device(args.device)
    args.dtype_name = str(resolve_dtype(args.dtype, args.device_obj)).removeprefix("torch.")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    harness.start_run(args)
    if args.arrivals == "poisson":  # one request per client, at its arrival time
        work = workload(args.clients, 1, args.max_tokens, poisson_arrivals(args.clients, args.arrival_rate, args.seed))
    else:
        work = workload(args.clients, args.requests, args.max_tokens)
    model_dir = args.model or ensure_default_model()
    engine = harness.load_engine(args, dtype=args.dtype_name, progress=False)

    def count_tokens(text: str) -> int:  # for a server whose answers carry no usage
        return len(engine.tokenizer(text, add_special_tokens=False)["input_ids"])

    arms = [in_process_arm(engine, work), mixed_in_process_arm(engine, work), linear_products_arm(engine, work),
            rksc_serve_arm(args, work, count_tokens)]
    if args.skip_transformers_serve:
        arms.append(Arm("transformers serve", not_run="not run: --skip-transformers-serve"))
    else:
        arms.append(transformers_serve_arm(args, work, model_dir, count_tokens))
    ray = ray_replicas_arm(args, work)
    if ray is not None:
        arms.append(ray)
    report = markdown(arms, work, args)
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("# rksc serve: HTTP overhead and transformers serve\n\n" + report)
    if args.json_out:
        harness.write_json(args.json_out, {"clients": work.clients, "max_tokens": work.max_tokens,
                                           "arrivals": work.arrivals, "arms": arms})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
