"""``rksc serve``: an OpenAI-compatible HTTP server over one engine (``rksc_serve.app``).

Safe by default: it binds to loopback (``--host 127.0.0.1``) unless told otherwise, and warns when
it listens beyond loopback without ``--api-key`` (``rksc_serve.app.warn_if_exposed``, the check every
entry point shares). FastAPI, uvicorn and prometheus-client are imported only when the command runs
(``pip install 'rksc[serve]'``), so ``rksc --help`` works without them.

``--replicas N`` with N > 1 serves N engines behind one endpoint on Ray Serve (``rksc_serve.cluster``,
``pip install "rksc[cluster]"``), on this machine or on the Ray cluster ``RAY_ADDRESS`` names; Ray is
imported only then. One replica is the plain single-process server.
"""

from __future__ import annotations

import argparse
import sys

from rksc_serve.workers import DEFAULT_WORKER_THREADS

SERVE_HELP = "serve the model over an OpenAI-compatible HTTP API (chat, completions, streaming, metrics)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``rksc serve``'s arguments to ``parser`` and make ``run`` its handler (``args.func``)."""
    parser.add_argument("--model", default=None, help="local Hugging Face model directory (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (all but /health)")
    parser.add_argument("--max-tokens-limit", type=int, default=4096, help="most max_tokens one request may ask for (default 4096)")
    parser.add_argument("--max-n", type=int, default=64, help="most choices one request may ask for (default 64)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    parser.add_argument("--served-model-name", default=None, help="model id in /v1/models and responses (default: the model's name)")
    parser.add_argument("--worker-threads", type=int, default=DEFAULT_WORKER_THREADS,
                        help="threads of each pool for blocking engine work (one for tool turns and JSON answers, "
                             f"one for tree searches); calls beyond them queue (default {DEFAULT_WORKER_THREADS})")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    cluster = parser.add_argument_group("replicas (Ray Serve; pip install \"rksc[cluster]\")")
    cluster.add_argument("--replicas", type=int, default=1,
                         help="engine replicas behind the endpoint (default 1: one process, no Ray)")
    cluster.add_argument("--routing", default="prefix", choices=["prefix", "round_robin", "pow2"],
                         help="how requests pick a replica: prefix (default; Ray Serve LLM's prefix-cache affinity), "
                              "round_robin, or pow2 (Ray Serve's default, power of two choices)")
    cluster.add_argument("--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per replica (default 1)")
    cluster.add_argument("--replica-gpus", type=float, default=0.0,
                         help="GPUs Ray reserves per replica (default 0; a replica sees only the GPUs it reserves)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``rksc serve`` with the parsed ``args`` until interrupted; returns the exit status."""
    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in [1, 65535], got {args.port}")
    if args.replicas < 1:
        raise ValueError(f"--replicas must be >= 1, got {args.replicas}")
    if args.replicas > 1:
        return _run_replicas(args)
    try:
        import uvicorn

        from rksc_serve.app import create_app
    except ImportError as error:
        raise SystemExit(f"rksc serve needs the serve extra: pip install 'rksc[serve]' ({error})") from None
    from rksc_engine import RKSCEngine

    engine = RKSCEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    app = create_app(engine, api_key=args.api_key, model_name=args.served_model_name,
                     max_tokens_limit=args.max_tokens_limit, max_n=args.max_n, max_body_bytes=args.max_body_bytes,
                     worker_threads=args.worker_threads, host=args.host)
    print(f"rksc serve: {engine.model_name} at http://{args.host}:{args.port}/v1", file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _run_replicas(args: argparse.Namespace) -> int:
    """``--replicas N`` (N > 1): deploy N replicas on Ray Serve and serve until interrupted."""
    try:
        from rksc_serve import cluster
    except ImportError as error:
        raise SystemExit(f'rksc serve --replicas needs the cluster extra: pip install "rksc[cluster]" ({error})') from None
    spec = cluster.ReplicaSpec(model=args.model, device=args.device, dtype=args.dtype, api_key=args.api_key,
                               served_model_name=args.served_model_name, max_tokens_limit=args.max_tokens_limit,
                               max_n=args.max_n, max_body_bytes=args.max_body_bytes,
                               worker_threads=args.worker_threads)
    cluster.run_cluster(spec, args.replicas, args.host, args.port, routing=args.routing,
                        replica_cpus=args.replica_cpus, replica_gpus=args.replica_gpus, log_level=args.log_level)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rksc serve", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
