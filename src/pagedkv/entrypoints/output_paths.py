"""Output files of the CLI: checked before the work starts, written without losing the results.

A command that runs for minutes (a simulation, a benchmark) checks every path it will write
first, so a typo fails in a blink with one line (``--out /proc/nope: cannot create the
directory``), not after the work with a traceback. If a write still fails at the end (the disk
filled, the folder was removed), the results go to stdout so they are not lost, and the error is
reported in one line.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from pagedkv.errors import ConfigError


def check_output_dir(path: str | Path, flag: str) -> Path:
    """Create ``path`` as a directory if needed and check that files can be written in it.

    Args:
        path: the directory.
        flag: the option that named it (``--out``), for the message.

    Raises:
        ConfigError: it names an existing file, cannot be created, or is not writable.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{flag} {path}: names an existing file, not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path}: cannot create the directory: {exc.strerror or exc}"
        ) from None
    try:
        # Creating a file is the only check that holds on every filesystem (os.access does not
        # know about read-only mounts or quotas).
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path}: cannot write files there: {exc.strerror or exc}"
        ) from None
    return path


def check_creatable_dir(path: str | Path, flag: str) -> Path:
    """Check that ``path`` is a directory files can be written in, or one that can be created
    (parents too): its nearest existing ancestor is a directory that takes new files. Unlike
    :func:`check_output_dir` nothing is created, so a command that fails before writing leaves
    nothing behind; ``write_text_or_print(..., make_parents=True)`` creates it when it writes
    (as vLLM's benchmarks create ``--result-dir``).

    Args:
        path: the directory.
        flag: the option that named it (``--result-dir``), for the message.

    Raises:
        ConfigError: ``path`` or one of its ancestors names an existing file, or the directory
            (or the nearest existing ancestor, when it is missing) takes no new files.
    """
    path = Path(path)
    existing = path
    try:
        while not existing.exists() and existing != existing.parent:
            existing = existing.parent
    except OSError as exc:  # an ancestor that cannot be looked into
        raise ConfigError(
            f"{flag} {path}: cannot create the directory: {exc.strerror or exc}"
        ) from None
    if existing == path and not path.is_dir():
        raise ConfigError(f"{flag} {path}: names an existing file, not a directory")
    if not existing.is_dir():
        raise ConfigError(
            f"{flag} {path}: cannot create the directory: {existing} is a file, not a directory"
        )
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as exc:
        what = "cannot write files there" if existing == path else "cannot create the directory"
        raise ConfigError(f"{flag} {path}: {what}: {existing}: {exc.strerror or exc}") from None
    return path


def check_output_file(path: str | Path, flag: str) -> Path:
    """Check that ``path`` can be written as a file (its folder exists and is writable; it is not
    a directory). Nothing is created.

    Raises:
        ConfigError: the path is a directory, its folder is missing, or it cannot be written.
    """
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: the folder {folder} does not exist")
    if path.exists():
        writable = os.access(path, os.W_OK)
    else:
        try:
            with tempfile.TemporaryFile(dir=folder):
                writable = True
        except OSError:
            writable = False
    if not writable:
        raise ConfigError(f"{flag} {path}: cannot write there (permission denied)")
    return path


def write_text_or_print(
    path: str | Path, text: str, flag: str, *, make_parents: bool = False
) -> bool:
    """Write ``text`` to ``path`` (with ``make_parents``, creating its folder and the folder's
    parents first); if that fails, print the text to stdout (results are never lost) and a
    one-line error to stderr. Returns whether the file was written."""
    try:
        if make_parents:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        print(
            f"pagedkv: error: {flag} {path}: {exc.strerror or exc}; the results are printed "
            "above instead",
            file=sys.stderr,
        )
        return False
    return True
