"""Checkpoint faults: the preemption sync point."""

from __future__ import annotations

import inspect
import threading

import jax
import pytest
from jax.experimental import multihost_utils

from maxshard import checkpoint


# --------------------------------------------------------------------------------------------- preemption


def test_preemption_sync_point_ignores_only_the_service_being_off(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    source = inspect.getsource(multihost_utils.reached_preemption_sync_point)
    assert checkpoint._PREEMPTION_SERVICE_OFF in source  # the wording matched below is JAX's own

    def service_off(step: int) -> bool:
        raise RuntimeError(f"{checkpoint._PREEMPTION_SERVICE_OFF}. Make sure the 'jax_enable_preemption_service' "
                           "config is enabled.")

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", service_off)
    assert checkpoint.preemption_reached(7, threading.Event()) is False

    def coordination_lost(step: int) -> bool:
        raise RuntimeError("UNAVAILABLE: failed to connect to the coordination service")

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", coordination_lost)
    with pytest.raises(RuntimeError, match="UNAVAILABLE"):
        checkpoint.preemption_reached(7, threading.Event())
