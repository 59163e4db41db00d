"""Fixtures the ops tests share."""

from __future__ import annotations

import pytest
from backend_cases import make_backend


@pytest.fixture(scope="module")
def native():
    """The native attention backend (pagedkv's C kernels); skips where it does not build."""
    made = make_backend("native")
    if isinstance(made, str):
        pytest.skip(made)
    return made
