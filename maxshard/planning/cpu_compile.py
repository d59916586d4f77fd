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

from maxshard.launch.topologies import Target

__all__ = ["INSTALL", "missing", "abstract_devices"]

INSTALL = None  # nothing to install: XLA:CPU is jaxlib's


def missing() -> str | None:
    """Why this machine cannot compile for cpu-N: never (None)."""
    return None


def abstract_devices(target: Target) -> list[Any]:
    """This process's `target.num_devices` CPU devices, simulated as `cpu_device_count` makes them
    (`config.loader.simulate_cpu_devices`: ConfigError, one line, where JAX already started with another count)."""
    import jax

    from maxshard.config.loader import simulate_cpu_devices

    simulate_cpu_devices(jax, target.num_devices)
    return jax.devices("cpu")
