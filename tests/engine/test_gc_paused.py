"""``gc_paused``: the engine's build runs with Python's cyclic collector off and leaves it as
it found it, whatever the build raises."""

from __future__ import annotations

import gc

import pytest

from pagedkv.engine.llm_engine import gc_paused


@pytest.fixture
def restore_gc():
    enabled = gc.isenabled()
    yield
    (gc.enable if enabled else gc.disable)()


def test_paused_inside_enabled_after(restore_gc):
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_enabled_again_after_an_error(restore_gc):
    gc.enable()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("build failed")
    assert gc.isenabled()


def test_left_disabled_where_it_was(restore_gc):
    gc.disable()
    with gc_paused():
        assert not gc.isenabled()
    assert not gc.isenabled()
