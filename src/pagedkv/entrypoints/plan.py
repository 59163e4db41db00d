"""`pagedkv plan` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
    parser = subparsers.add_parser("plan", help="(not yet implemented)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `pagedkv plan`."""
    raise SystemExit("pagedkv plan: not implemented yet")
