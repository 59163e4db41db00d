"""Lets the cluster tests import their helpers (``_cluster_helpers``) and the engine tests' tiny
model under pytest's importlib import mode; skips them without the ``cluster`` extra."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent
for folder in (_HERE, _HERE.parent / "engine"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

pytest.importorskip("zmq", reason="the cluster tests need pip install 'pagedkv[cluster]'")
pytest.importorskip("msgpack", reason="the cluster tests need pip install 'pagedkv[cluster]'")
