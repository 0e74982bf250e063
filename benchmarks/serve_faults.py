"""How fast ``rksc serve`` answers ``/health`` and ``/metrics`` when the engine is busy or held.

The app (``rksc_serve.app.create_app``) runs in this process under uvicorn on a free loopback port,
so the benchmark can hold its engine. A prober sends ``GET /health`` and ``GET /metrics`` in turn,
every ``--interval-ms``, ``--probes`` of each per phase, and reports their p50 and p99 latency:

    idle        nothing else runs: the floor.
    load        ``--clients`` concurrent chat clients (greedy, ``--max-tokens`` each, half of them
                streamed); a seeded ``--disconnect-rate`` of them hang up before their answer (a
                stream after a few events, a whole answer right after sending), so the server is
                cancelling work too. The probes run until the clients are done (at least ``--probes``).
    exclusive   another thread holds the engine (``with engine.exclusive():``) for the whole phase,
                as a long verifier pass or a tool that drives the model itself would.

A probe that gets no answer within ``--probe-timeout-s`` counts as a failure. On a server whose event
loop waited for the engine, the ``exclusive`` phase's probes would all fail; on this one they answer
as fast as at idle.

    python benchmarks/serve_faults.py --model /path/to/model          # 64 clients, 8 tokens, 40 probes
    python benchmarks/serve_faults.py --clients 16 --probes 20        # shorter
"""

from __future__ import annotations

import argparse
import json
import math
import random
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn

from rksc_bench import harness
from rksc_engine import RKSCEngine
from rksc_serve.app import create_app

ENDPOINTS = ("/health", "/metrics")


@dataclass
class Probes:
    """One phase's probe latencies per endpoint, in seconds, and the probes that failed."""

    phase: str
    seconds: dict[str, list[float]] = field(default_factory=lambda: {e: [] for e in ENDPOINTS})
    failures: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ENDPOINTS, 0))


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` under uvicorn on a free loopback port in a background thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="bench-uvicorn", daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def probe(url: str, phase: str, args: argparse.Namespace, until: Callable[[], bool] = lambda: True) -> Probes:
    """Probe each endpoint in turn every ``--interval-ms`` until ``--probes`` of each are done and
    ``until()`` holds."""
    result = Probes(phase)
    with httpx.Client(base_url=url, timeout=args.probe_timeout_s) as http:
        while min(len(s) for s in result.seconds.values()) < args.probes or not until():
            for endpoint in ENDPOINTS:
                start = time.perf_counter()
                try:
                    ok = http.get(endpoint).status_code == 200
                except httpx.HTTPError:
                    ok = False
                result.seconds[endpoint].append(time.perf_counter() - start)
                result.failures[endpoint] += not ok
            time.sleep(args.interval_ms / 1000)
    return result


def client(url: str, index: int, leaves_after: int | None, args: argparse.Namespace) -> None:
    """One chat client; with ``leaves_after`` it hangs up early (after that many stream lines, or
    right after sending a whole request)."""
    body = {"messages": [{"role": "user", "content": f"Client {index}: tell me something."}],
            "max_tokens": args.max_tokens, "temperature": 0, "stream": index % 2 == 1}
    if leaves_after is not None and not body["stream"]:
        host, port = url.removeprefix("http://").split(":")
        payload = json.dumps(body).encode()
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
        return
    with httpx.Client(base_url=url, timeout=600) as http:
        if not body["stream"]:
            http.post("/v1/chat/completions", json=body).raise_for_status()
            return
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            for read, _line in enumerate(response.iter_lines()):
                if leaves_after is not None and read >= leaves_after:
                    break


def under_load(url: str, args: argparse.Namespace) -> Probes:
    rng = random.Random(args.seed)
    leaves = [rng.choice([0, 1, 3, 6]) if rng.random() < args.disconnect_rate else None for _ in range(args.clients)]
    with ThreadPoolExecutor(args.clients) as pool:
        futures = [pool.submit(client, url, i, leaves[i], args) for i in range(args.clients)]
        probes = probe(url, "load", args, until=lambda: all(f.done() for f in futures))
        for future in futures:
            future.result()
    return probes


def while_held(engine: RKSCEngine, url: str, args: argparse.Namespace) -> Probes:
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with engine.exclusive():
            held.set()
            release.wait()

    holder = threading.Thread(target=hold, name="bench-holder", daemon=True)
    holder.start()
    held.wait()
    try:
        return probe(url, "exclusive", args)
    finally:
        release.set()
        holder.join()


def markdown(phases: list[Probes], args: argparse.Namespace) -> str:
    lines = [f"`/health` and `/metrics` latency: {args.probes}+ probes each per phase, every {args.interval_ms} ms; "
             f"load = {args.clients} clients x {args.max_tokens} tokens, {args.disconnect_rate:.0%} hanging up early.",
             "",
             "| phase | endpoint | probes | p50 ms | p99 ms | max ms | failed |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for phase in phases:
        for endpoint in ENDPOINTS:
            seconds = phase.seconds[endpoint]
            lines.append(f"| {phase.phase} | `{endpoint}` | {len(seconds)} | {1000 * statistics.median(seconds):.1f} | "
                         f"{1000 * percentile(seconds, 0.99):.1f} | {1000 * max(seconds):.1f} | "
                         f"{phase.failures[endpoint]} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = harness.bench_parser(__file__, __doc__, json_out="optional")
    parser.add_device()
    parser.add_dtype()
    parser.add_count("--clients", 64, "concurrent clients in the load phase")
    parser.add_count("--max-tokens", 8, "max_tokens of every client request")
    parser.add_argument("--disconnect-rate", type=float, default=0.3,
                        help="share of clients that hang up before their answer (default 0.3)")
    parser.add_count("--probes", 40, "least probes per endpoint and phase")
    parser.add_argument("--interval-ms", type=float, default=50.0, help="pause between probe rounds (default 50)")
    parser.add_argument("--probe-timeout-s", type=float, default=10.0,
                        help="a probe unanswered this long fails (default 10)")
    parser.add_seed(0, "seeds which clients hang up")
    args = parser.parse_args(argv)
    if not 0 <= args.disconnect_rate <= 1:
        parser.error("--disconnect-rate must be in [0, 1]")
    if args.interval_ms < 0 or args.probe_timeout_s <= 0:
        parser.error("--interval-ms must be >= 0 and --probe-timeout-s > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    harness.start_run(args)
    engine = harness.load_engine(args, progress=False)
    with serving(create_app(engine)) as url:
        phases = [probe(url, "idle", args), under_load(url, args), while_held(engine, url, args)]
    print(markdown(phases, args))
    if args.json_out:
        harness.write_json(args.json_out, {"args": vars(args), "phases": phases})
    return 0 if not any(sum(p.failures.values()) for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
