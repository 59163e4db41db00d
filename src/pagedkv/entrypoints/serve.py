"""`pagedkv serve` (placeholder until its issue lands)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `serve` subcommand."""
    parser = subparsers.add_parser("serve", help="(not yet implemented)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run `pagedkv serve`."""
    raise SystemExit("pagedkv serve: not implemented yet")
