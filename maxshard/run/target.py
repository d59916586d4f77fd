"""A run loaded for a target: the config as the trainer will see it on an XPK slice or GPU node we do not have, or
on this machine's simulated CPU devices (cpu-N); validated as the launcher validates it, mesh resolved,
`remat_policy: auto` decided against the target's memory, not this machine's accelerators'. The planner's command,
the layout search and the ahead-of-time compiles start here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from maxshard import config
from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.launch import xpk
from maxshard.launch.topologies import Target
from maxshard.planning import fit, hardware
from maxshard.planning.fit import Capacity
from maxshard.run import loading

__all__ = ["trainer_argv", "load_for_target", "target_capacity"]


def trainer_argv(config_argv: Sequence[str], target: Target) -> tuple[Config, list[str]]:
    """(the user's config as parsed, the trainer's command line on `target`): what XPK would launch there, or on
    cpu-N what runs here (`cpu_device_count=N`; one the config sets must be N)."""
    xpk.check_tokens(config_argv)
    parsed = config.parse(config_argv)
    argv = xpk.prepare_trainer_argv(config_argv, parsed, target, workload="plan")
    if target.accelerator != "cpu":
        return parsed, argv
    if parsed.cpu_device_count not in (0, target.num_devices):
        raise ConfigError(f"cpu_device_count={parsed.cpu_device_count} does not match the target's "
                          f"{target.num_devices} devices (--topology {target.name})")
    return parsed, (*argv, f"cpu_device_count={target.num_devices}")


def load_for_target(config_argv: Sequence[str], target: Target) -> Config:
    """`[CONFIG, key=value, ...]` finalized as the trainer will see it on `target` (mesh resolved, vocab set,
    `remat_policy: auto` decided against the target's device memory, not this machine's)."""
    _, argv = trainer_argv(config_argv, target)
    cfg = xpk.validate_for_target(argv, target)
    return loading.complete(cfg, capacity=target_capacity(cfg, target))


def target_capacity(cfg: Config, target: Target) -> Capacity:
    """One device's memory on `target`: `device_memory_gb` when set, else what JAX can allocate there
    (`hardware.device_memory`); and the host memory per device where its figure is known (`hardware.interconnect`).
    On cpu-N, what the trainer finds with `cpu_device_count=N` here: this host's available memory shared N ways."""
    configured = fit.configured_capacity(cfg)
    if target.accelerator == "cpu":
        return configured or fit.host_share(target.num_devices)
    memory, source = hardware.device_memory(target.name)
    host = hardware.interconnect(target.name).host
    host = None if host is None else int(host)
    return Capacity(int(memory), source, host) if configured is None else dataclasses.replace(configured, host=host)
