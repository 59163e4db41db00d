"""`pagedkv generate` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `generate` subcommand."""
    parser = subparsers.add_parser("generate", help="(not yet implemented)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `pagedkv generate`."""
    raise SystemExit("pagedkv generate: not implemented yet")
