"""The replicated-bytes check: a layout that copies every parameter to every device warns, or fails on request."""

from __future__ import annotations

import dataclasses
import warnings

import pytest

from maxshard import train
from maxshard.errors import ConfigError
from maxshard.training.step import Trainer
from tests.helpers import layout_overrides, mesh_for, tiny_config


def test_data_parallel_warns_and_check_sharding_fails():
    cfg = tiny_config(*layout_overrides(["ici_data_parallelism=8"]))
    trainer = Trainer(cfg, mesh_for(cfg))
    with pytest.warns(UserWarning, match="replicated on every device"):
        report = train.check_layout(cfg, trainer)
    assert report.replicated_fraction == 1.0
    strict = dataclasses.replace(cfg, check_sharding=True)
    with pytest.raises(ConfigError, match="max_replicated_fraction=0.02"):
        train.check_layout(strict, Trainer(strict, trainer.mesh))


def test_fsdp_passes_the_check():
    cfg = dataclasses.replace(tiny_config("ici_fsdp_parallelism=8"), check_sharding=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        report = train.check_layout(cfg, Trainer(cfg, mesh_for(cfg)))
    assert report.replicated_fraction < 0.02  # only the RMSNorm scales stay whole
