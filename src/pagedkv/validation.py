"""Checks of counts and numbers, with one message style for the whole project.

::

    check_int("block_size", 0, 1)                      block_size must be an int >= 1, got 0
    check_int("num_blocks", 1, 2, why="block 0 is the null block")
                            num_blocks must be an int >= 2 (block 0 is the null block), got 1
    check_int("max_tokens", 0, 1, optional=True, error=InvalidRequestError)
                            max_tokens must be an int >= 1 or None, got 0
    check_int("lora_id", x, -(2**63), maximum=2**63 - 1)
                            lora_id must be an int in [-9223372036854775808, ...], got ...
    check_number("arrival_time", -1, 0)                arrival_time must be a number >= 0, got -1

An int is a Python ``int`` that is not a ``bool`` (``True`` is an int in Python, never a count
here); numpy integers are refused, so convert them with ``int()``. A number is an int or a
float, not a bool and not NaN. Each check raises the exception class the caller gives, so a
setting stays a ``ConfigError``, a request field an ``InvalidRequestError``, an op input an
``OpsInputError``: the call sites keep their error types, only the wording is shared.

Also the one home of two rules more than one layer checks: a seed's range (:data:`SEED_MIN`,
:data:`SEED_MAX`) and valid Unicode text (:func:`utf8_error`).

Imports nothing but :mod:`pagedkv.errors`, so every layer (the core too) can use it.
"""

from __future__ import annotations

import argparse
import math

from pagedkv.errors import ConfigError

#: The range of a random seed: ``torch.Generator`` takes 64-bit seeds in [-2**63, 2**64).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


def utf8_error(value: str) -> str | None:
    """Why ``value`` is not valid Unicode text ("surrogates not allowed at index 3"), or None
    when it is. A lone surrogate (``"\\ud800"``, which JSON can carry) cannot be encoded as
    UTF-8, so neither the tokenizer nor the block hash can take it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"{e.reason} at index {e.start}"
    return None


def is_int(value: object) -> bool:
    """True for an ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """True for an ``int`` or ``float`` that is not a ``bool`` and not NaN."""
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _requirement(
    kind: str,
    minimum: float | None,
    maximum: float | None,
    why: str | None,
    optional: bool,
) -> str:
    if minimum is not None and maximum is not None:
        text = f"{kind} in [{minimum}, {maximum}]"
    elif minimum is not None:
        text = f"{kind} >= {minimum}"
    elif maximum is not None:
        text = f"{kind} <= {maximum}"
    else:
        text = kind
    if why:
        text += f" ({why})"
    if optional:
        text += " or None"
    return text


def check_int(
    name: str,
    value: object,
    minimum: int | None = None,
    *,
    maximum: int | None = None,
    optional: bool = False,
    why: str | None = None,
    error: type[Exception] = ConfigError,
) -> None:
    """Raise ``error`` unless ``value`` is an int in ``[minimum, maximum]`` (or None when
    ``optional``).

    Args:
        name: what the message calls the value (``"block_size"``, ``"--num-blocks"``, or
            ``"request 'a': num_computed_tokens"``).
        minimum, maximum: inclusive bounds; None = unbounded.
        optional: None is allowed.
        why: a reason added to the message (``"block 0 is the null block"``).
        error: the exception class to raise (default :class:`~pagedkv.errors.ConfigError`).

    Raises:
        ``error``: ``"{name} must be an int >= {minimum}[ ({why})][ or None], got {value!r}"``.
    """
    if value is None and optional:
        return
    if (
        not is_int(value)
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        need = _requirement("an int", minimum, maximum, why, optional)
        raise error(f"{name} must be {need}, got {value!r}")


def check_number(
    name: str,
    value: object,
    minimum: float | None = None,
    *,
    maximum: float | None = None,
    finite: bool = False,
    optional: bool = False,
    why: str | None = None,
    error: type[Exception] = ConfigError,
) -> None:
    """Raise ``error`` unless ``value`` is a number in ``[minimum, maximum]`` (finite when
    ``finite``; None allowed when ``optional``). Arguments and message as :func:`check_int`,
    with "a number" (or "a finite number")."""
    if value is None and optional:
        return
    if (
        not is_number(value)
        or (finite and not math.isfinite(value))
        or (minimum is not None and value < minimum)
        or (maximum is not None and value > maximum)
    ):
        kind = "a finite number" if finite else "a number"
        need = _requirement(kind, minimum, maximum, why, optional)
        raise error(f"{name} must be {need}, got {value!r}")


__all__ = ["check_int", "check_number", "is_int", "is_number"]


def positive_int_arg(text: str) -> int:
    """argparse ``type=`` of the command lines' count flags: an int >= 1, so a bad count fails
    at parsing, before any model loads (``argument --block-size: must be an int >= 1, got 0``).

    Raises:
        argparse.ArgumentTypeError: not an int, or < 1.
    """
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value
