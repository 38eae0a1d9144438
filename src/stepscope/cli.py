"""The ``stepscope`` command: one sub-command per job."""

from __future__ import annotations

import argparse
import sys

from stepscope import __version__
from stepscope.summary import RunSummary, SummaryError


def _show(args: argparse.Namespace) -> int:
    from stepscope.report.terminal import print_summary

    print_summary(RunSummary.from_json(args.summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="stepscope", description="Where does my PyTorch training step time go, and what to fix first."
    )
    parser.add_argument("--version", action="version", version=f"stepscope {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    show = commands.add_parser("show", help="print the phase table of a saved summary JSON")
    show.add_argument("summary", help="path to a summary written by Scope.summary().to_json() or --json")
    show.set_defaults(func=_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code (2 for bad input)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except SummaryError as error:
        print(f"stepscope: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
