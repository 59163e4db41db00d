"""How ``pagedkv serve --data-parallel-size`` runs Ray in its process: a local Ray on loopback
(an environment variable, set only around the start and never for a joined cluster), and
SIGTERM turned into the KeyboardInterrupt that stops the cluster cleanly."""

from __future__ import annotations

import os
import signal

import pytest

from pagedkv.entrypoints.cluster.ray_process import (
    RAY_LOOPBACK_ENV,
    SigtermAsInterrupt,
    loopback_ray,
)


def test_a_local_ray_gets_the_loopback_variable_only_while_it_starts(monkeypatch):
    monkeypatch.delenv(RAY_LOOPBACK_ENV, raising=False)
    with loopback_ray(None):
        assert os.environ[RAY_LOOPBACK_ENV] == "0"
    assert RAY_LOOPBACK_ENV not in os.environ
    with loopback_ray("auto") as loopback:  # a joined cluster keeps Ray's address
        assert RAY_LOOPBACK_ENV not in os.environ and loopback is False


def test_the_users_setting_wins(monkeypatch):
    monkeypatch.setenv(RAY_LOOPBACK_ENV, "1")
    with loopback_ray(None) as loopback:
        assert os.environ[RAY_LOOPBACK_ENV] == "1" and loopback is False
    assert os.environ[RAY_LOOPBACK_ENV] == "1"


def test_sigterm_raises_keyboard_interrupt_once_then_the_handler_is_restored():
    before = signal.getsignal(signal.SIGTERM)
    with SigtermAsInterrupt() as sigterm:
        sigterm.install()  # again, as after ray.init: still restores the first one
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)  # runs the Python handler before returning
        # One-shot: a second SIGTERM would end the process as by default.
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGTERM) == before
