"""The one validator of counts and numbers: its message style and the caller's error type."""

from __future__ import annotations

import math

import pytest

from pagedkv.errors import ConfigError, InvalidRequestError, OpsInputError
from pagedkv.validation import check_int, check_number, is_int, is_number


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(value=0, minimum=1), "x must be an int >= 1, got 0"),
        (dict(value=True, minimum=0), "x must be an int >= 0, got True"),
        (dict(value=2.0, minimum=1), "x must be an int >= 1, got 2.0"),
        (dict(value="3", minimum=1), "x must be an int >= 1, got '3'"),
        (
            dict(value=1, minimum=2, why="block 0 is the null block"),
            "x must be an int >= 2 (block 0 is the null block), got 1",
        ),
        (dict(value=0, minimum=1, optional=True), "x must be an int >= 1 or None, got 0"),
        (dict(value=9, minimum=0, maximum=8), "x must be an int in [0, 8], got 9"),
        (dict(value=9, maximum=8), "x must be an int <= 8, got 9"),
        (dict(value=None), "x must be an int, got None"),
    ],
)
def test_check_int_messages(kwargs, message):
    value = kwargs.pop("value")
    with pytest.raises(ConfigError) as info:
        check_int("x", value, **kwargs)
    assert str(info.value) == message


def test_check_int_accepts_and_keeps_the_callers_error_type():
    check_int("x", 5, 1)
    check_int("x", None, 1, optional=True)
    check_int("x", -(2**63), -(2**63), maximum=2**63 - 1)
    for error in (InvalidRequestError, OpsInputError, ValueError):
        with pytest.raises(error, match="x must be an int >= 1"):
            check_int("x", 0, 1, error=error)


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (-1, dict(minimum=0), "t must be a number >= 0, got -1"),
        (math.inf, dict(minimum=0, finite=True), "t must be a finite number >= 0, got inf"),
        (math.nan, dict(minimum=0), "t must be a number >= 0, got nan"),
        (False, dict(), "t must be a number, got False"),
        (3, dict(minimum=-2, maximum=2), "t must be a number in [-2, 2], got 3"),
    ],
)
def test_check_number_messages(value, kwargs, message):
    with pytest.raises(InvalidRequestError) as info:
        check_number("t", value, error=InvalidRequestError, **kwargs)
    assert str(info.value) == message


def test_predicates():
    assert is_int(3) and not is_int(True) and not is_int(3.0) and not is_int(None)
    assert is_number(0.5) and is_number(2) and not is_number(False) and not is_number(math.nan)
    check_number("t", 0.0, 0, finite=True)
