"""Command line: ``python -m moeforge demo [options]``."""

from __future__ import annotations

import sys

from moeforge.demo import run


def main() -> int:
    args = sys.argv[1:]
    if not args or args[0] in ("-h", "--help"):
        print("usage: python -m moeforge demo [--help | options]")
        return 0 if args else 2
    if args[0] != "demo":
        print(f"unknown command {args[0]!r}; the only command is 'demo'", file=sys.stderr)
        return 2
    return run(args[1:])


if __name__ == "__main__":
    sys.exit(main())
