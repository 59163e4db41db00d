"""`pagedkv simulate` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `simulate` subcommand."""
    parser = subparsers.add_parser("simulate", help="(not yet implemented)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `pagedkv simulate`."""
    raise SystemExit("pagedkv simulate: not implemented yet")
