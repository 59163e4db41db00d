"""Lets the cluster tests import their helpers (``_cluster_helpers``) and the engine tests' tiny
model under pytest's importlib import mode. The modules that need the ``cluster`` extra skip
themselves without it; the prefix index's tests are pure Python and always run."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for folder in (_HERE, _HERE.parent / "engine"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))
