"""The XLA options every program that runs the model is compiled with, by the mesh's platform.

Why. XLA:TPU lowers `jax.lax.ragged_dot` (the dropless MoE's grouped matmul on TPU, `moe_dropless_impl: ragged_dot`)
either to its Mosaic ragged-dot kernel, which computes each row against its own group's weights only, or to a dense
convolution over every group, which computes every row against every expert and holds a [groups, rows, width]
product: groups x the FLOPs and the memory. Which one a program gets by default depends on the libtpu release and
the chip, so it is not left to the default: `xla_tpu_enable_ragged_dot_kernel` asks for the kernel, and every release
the project meets knows the option and compiles the kernel with it (the releases and chips compared:
benchmarks/README.md, "The ragged-dot kernel").

XLA:GPU gets a table the config chooses (`xla_gpu_options`): `default` passes no options (XLA's own defaults), and
`tuned` is the set the field sets for GPU training (MaxText's and JAX's GPU performance guides): the latency-hiding
scheduler, which orders async collectives and compute to overlap them; the scanned layers' loop double-buffered, so
one layer's gathers run under the previous layer's compute; all-gathers, reduce-scatters and all-reduces pipelined
out of that loop; collectives on the highest-priority stream; and command buffers (CUDA graphs) for fusions, cuBLAS
and cuDNN calls, which cut the launch cost of a step's many small kernels. `tuned` is not the default: no measurement
shows it pays on this code yet (`benchmarks/gpu_suite.py` measures both where a GPU is lent). Every option is one that
the XLA:GPU of the installed jax knows (XLA refuses unknown options; tests/test_xla_options_gpu.py compiles a train
step with the table, without a GPU).

Other platforms get no options (XLA:CPU and XLA:GPU refuse options they do not know).
"""

from __future__ import annotations

from typing import Any

import jax

__all__ = ["TPU", "GPU", "GPU_CHOICES", "DEFAULT_GPU", "for_mesh"]

TPU = {"xla_tpu_enable_ragged_dot_kernel": True}

# `xla_gpu_options` -> the options of a GPU program; the config's Literal (config/schema.py) lists the same names.
GPU: dict[str, dict[str, Any]] = {
    "default": {},
    "tuned": {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
        "xla_gpu_enable_highest_priority_async_stream": True,
        "xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUDNN",
    },
}
GPU_CHOICES = tuple(GPU)
DEFAULT_GPU = "default"


def for_mesh(mesh: jax.sharding.Mesh, gpu: str = DEFAULT_GPU) -> dict[str, Any] | None:
    """The options of a program over `mesh` (`jax.jit(..., compiler_options=...)`): TPU's on a TPU mesh (real or
    libtpu's abstract devices), the `gpu` table (a run's `xla_gpu_options`) on a GPU mesh, else None."""
    platform = mesh.devices.flat[0].platform
    if platform == "tpu":
        return dict(TPU)
    if platform == "gpu" and GPU[gpu]:
        return dict(GPU[gpu])
    return None
