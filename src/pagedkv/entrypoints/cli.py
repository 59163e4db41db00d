"""The ``pagedkv`` command: one subcommand per module in this package.

Each subcommand module defines ``register(subparsers)``, which adds its parser and sets
``func`` to the function that runs it. Modules keep heavy imports (torch, the model) inside that
function, so ``pagedkv plan --help`` starts in a blink.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from pagedkv.errors import PagedKVError, WorkerError

SUBCOMMAND_MODULES = ("generate", "serve", "bench", "simulate", "plan")


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="pagedkv",
        description="PagedAttention KV-cache manager and inference engine.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"pagedkv.entrypoints.{name}").register(subparsers)
    for subparser in subparsers.choices.values():
        # The subcommand's own parser reports arguments it does not know (its usage line).
        subparser.set_defaults(subcommand_parser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the process exit code after printing any error: 2 for a pagedkv error
    (bad input or configuration), 1 for a tensor-parallel worker that failed while running.

    Raises:
        SystemExit: 2 for a usage error (argparse's, from the subcommand's parser), 0 for --help.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        args.subcommand_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.func(args) or 0)
    except WorkerError as exc:  # a failure while running, not a bad command line
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except PagedKVError as exc:
        print(f"pagedkv {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (`pagedkv plan --json | head`): not an error of ours.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
