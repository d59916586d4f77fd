"""The XLA options every program that runs the model is compiled with, by the mesh's platform.

Why. XLA:TPU lowers `jax.lax.ragged_dot` (the dropless MoE's grouped matmul on TPU, `moe_dropless_impl: ragged_dot`)
either to its Mosaic ragged-dot kernel, which computes each row against its own group's weights only, or to a dense
convolution over every group, which computes every row against every expert and holds a [groups, rows, width]
product: groups x the FLOPs and the memory. Which one a program gets by default depends on the libtpu release and
the chip, so it is not left to the default: `xla_tpu_enable_ragged_dot_kernel` asks for the kernel, and every release
the project meets knows the option and compiles the kernel with it (the releases and chips compared:
benchmarks/README.md, "The ragged-dot kernel").

Other platforms get no options (XLA:CPU and XLA:GPU refuse options they do not know).
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["TPU", "for_mesh"]

TPU = {"xla_tpu_enable_ragged_dot_kernel": True}


def for_mesh(mesh: jax.sharding.Mesh) -> dict[str, Any] | None:
    """The options of a program over `mesh` (`jax.jit(..., compiler_options=...)`): TPU's on a TPU mesh (real or
    libtpu's abstract devices), else None."""
    return dict(TPU) if mesh.devices.flat[0].platform == "tpu" else None
