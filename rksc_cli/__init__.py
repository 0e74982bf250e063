"""The ``rksc`` command: the subcommands of the layers below it, under one name.

``rksc ask`` comes from ``rksc_cli.ask``, ``rksc bench`` from ``rksc_bench.cli`` and ``rksc serve``
from ``rksc_serve.cli``; each module offers ``add_arguments(parser)`` (which sets ``args.func``) and
``run(args)``. This package sits above them so that none imports another: the engine never depends
on its benchmark or HTTP front-ends.
"""

from __future__ import annotations

import argparse

import rksc_bench.cli
import rksc_serve.cli

from . import ask

# What ``rksc --help`` says.
DESCRIPTION = """The ``rksc`` command line: ``rksc ask`` answers a question with self-consistency over
``--branches`` reasoning branches that share one computed prompt; ``rksc serve`` serves the model over
an OpenAI-compatible HTTP API."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rksc", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    ask.add_arguments(sub.add_parser("ask", help=ask.ASK_HELP))
    rksc_bench.cli.add_arguments(sub.add_parser("bench", help=rksc_bench.cli.BENCH_HELP))
    rksc_serve.cli.add_arguments(sub.add_parser("serve", help=rksc_serve.cli.SERVE_HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rksc`` console script; returns the exit status."""
    return ask.dispatch(build_parser(), argv)


__all__ = ["build_parser", "main"]
