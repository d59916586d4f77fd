"""Checks of a run's inputs made before the model is built, so a bad path or file fails in one line before
anything is allocated or compiled (`maxshard.train` calls `check` right after loading the config).

Only what is cheap to check without reading documents: that every local source a config names exists. Reading
the documents themselves stays with the readers, which skip and count a bad record (`sources.BadRecord`).
"""

from __future__ import annotations

import os

from maxshard import dataset_types
from maxshard.config import Config
from maxshard.data import catalog, files
from maxshard.errors import ConfigError

__all__ = ["check"]


def check(cfg: Config) -> None:
    """ConfigError (one line naming the key) for a local source of `cfg` that does not exist."""
    if cfg.dataset_type == "synthetic" and not cfg.dataset_mixture:
        return
    for spec in catalog.source_specs(cfg):
        _check_exists(spec)


def _check_exists(spec: catalog.SourceSpec) -> None:
    prefix = dataset_types.reader(spec.kind).prefix
    if not spec.path or prefix or files.is_remote(spec.path) or files.has_magic(spec.path):
        return  # the stdlib corpus, a hub name, a remote path or a glob: its reader lists it
    if not os.path.exists(spec.path):
        raise ConfigError(f"{spec.key}={spec.path}: no such file or directory")
