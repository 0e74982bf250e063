"""The ``rksc`` command: the subcommands of the layers below it, under one name.

``rksc ask`` comes from ``rksc_engine.cli`` and ``rksc bench`` from ``rksc_bench.cli``; each module
offers ``add_arguments(parser)`` (which sets ``args.func``) and ``run(args)``. This package sits above
both so that neither imports the other: the engine never depends on its benchmark front-end.
"""

from __future__ import annotations

import argparse

import rksc_bench.cli
import rksc_engine.cli

# What ``rksc --help`` says.
DESCRIPTION = """The ``rksc`` command line: ``rksc ask`` answers a question with self-consistency over
``--branches`` reasoning branches that share one computed prompt."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rksc", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    rksc_engine.cli.add_arguments(sub.add_parser("ask", help=rksc_engine.cli.ASK_HELP))
    rksc_bench.cli.add_arguments(sub.add_parser("bench", help=rksc_bench.cli.BENCH_HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``rksc`` console script; returns the exit status."""
    return rksc_engine.cli.dispatch(build_parser(), argv)


__all__ = ["build_parser", "main"]
