"""`pagedkv bench` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `bench` subcommand."""
    parser = subparsers.add_parser("bench", help="(not yet implemented)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `pagedkv bench`."""
    raise SystemExit("pagedkv bench: not implemented yet")
