"""The torch backend's own paths (:class:`~pagedkv.ops.backends.TorchBackend`). Private: only the
torch backend imports them (``.importlinter`` checks it), and the tests and benchmarks of a path.

- ``metadata.py``: the step's index work, built once per step for every layer.
- ``reference.py``: plain per-request attention, the one the other paths are tested against.
- ``cpu_attention.py`` and ``gather_plan.py``: the fast path (chunked block gathers, grouped
  bmm-softmax and ``embedding_bag`` over the values for decodes, SDPA per prefill).
- ``write.py``: the slot-mapped write.
"""
