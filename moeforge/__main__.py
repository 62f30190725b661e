"""Command line: ``python -m moeforge [--version] demo [options]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Optional

import torch

from moeforge import __version__, demo


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m moeforge",
        description="moeforge: Mixture-of-Experts forward passes assembled from typed, build-time-checked stages.",
    )
    top.add_argument("--version", action="version",
                     version=f"moeforge {__version__} (torch {torch.__version__})",
                     help="print moeforge's and PyTorch's versions and exit")
    commands = top.add_subparsers(dest="command", metavar="COMMAND", required=True)
    demo_parser = demo.add_arguments(commands.add_parser(
        "demo", help="build a Mixtral-shaped layer, print its pipeline, check it against the reference, time it"))
    # Each command reports option errors through its own parser (its usage line, exit status 2).
    demo_parser.set_defaults(command_main=lambda args: demo.main(args, demo_parser))
    return top


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Exit status: the command's (the demo: 0 ok, 1 check failed); 2 for bad options (argparse)."""
    args = parser().parse_args(argv)
    status: int = args.command_main(args)
    return status


if __name__ == "__main__":
    sys.exit(main())
