"""XLA:CPU programs for the planner's cpu-N target: N simulated CPU devices of this process, the devices the trainer
makes with `cpu_device_count=N` on this machine.

XLA:CPU ships with jaxlib, so a cpu-N plan is always the compiler's answer: the run's fresh-run init and train step
compile on a mesh of those devices (`tpu_compile.compile_run`, which takes any compile devices), and
`memory_analysis()` is the program's own, the step `maxshard.train` compiles and checks before its first step
(`run/compile_check.py`). Simulated devices must be asked for before JAX starts its CPU backend, so
`abstract_devices` (named as the other targets' compile modules name it; here the devices are real) is called
before anything else of the plan touches JAX.
"""

from __future__ import annotations

from typing import Any

from maxshard.errors import ConfigError
from maxshard.launch.topologies import Target

__all__ = ["INSTALL", "missing", "abstract_devices"]

INSTALL = None  # nothing to install: XLA:CPU is jaxlib's


def missing() -> str | None:
    """Why this machine cannot compile for cpu-N: never (None)."""
    return None


def abstract_devices(target: Target) -> list[Any]:
    """The first `target.num_devices` CPU devices of this process, simulated now if JAX has not started its
    backend; ConfigError (one line) where it started with fewer."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", target.num_devices)
    except RuntimeError:  # the backend is up: its devices are the ones there are
        pass
    cpus = jax.devices("cpu")
    if len(cpus) < target.num_devices:
        raise ConfigError(f"--topology {target.name} needs {target.num_devices} CPU devices, but JAX started this "
                          f"process with {len(cpus)}; plan it in a process of its own")
    return cpus[:target.num_devices]

