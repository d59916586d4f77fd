"""What a run on CPU computes in place of an accelerator's op: one startup line for each (`stand_ins`).

The same config runs on a laptop and on a cluster. Where a config names something only a TPU or GPU has, a CPU run
computes it with a stand-in of the same contract (the same numbers, up to the order of float sums), slower or with
more memory, and says so in one line at startup instead of refusing the config:

    attention=splash|tokamax|cudnn   the row's `cpu_stand_in` (spec/attention_kinds.py): Pallas interpret mode,
                                     tokamax's XLA reference, jax.nn.dot_product_attention through XLA
    moe_exchange=ragged              the emulated ragged all-to-all (model/layers/ragged_all_to_all.py)
    moe_dropless_impl=ragged_dot     jax's dense lowering of ragged_dot, every expert masked
    remat_policy=offload_*           the policy it is `like` (spec/remat.py): XLA:CPU has one memory
    quantization=fp8                 XLA:CPU widens fp8 operands to float32 for each dot (int8 dots are native)

Only what the config explicitly asks for is named: `auto` resolves per platform (`loading.model_config`), and on
CPU it picks what XLA:CPU runs natively. A choice with no stand-in stays a one-line ConfigError at load time, naming
the key and what is allowed (those are the loader's, `attention_choice`'s, `quantization.check`'s and
`planning/fit.check_host_memory`'s).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from maxshard.config.schema import Config
from maxshard.model.attention_choice import platform_of
from maxshard.parallel import axis_names as ax
from maxshard.parallel import mesh, sharding
from maxshard.spec import attention_kinds, remat

__all__ = ["stand_ins"]


def stand_ins(cfg: Config) -> list[str]:
    """The startup lines of a complete config (`loading.complete`: its model resolved): one per accelerator-only
    choice that this CPU run computes through a stand-in; none for a TPU or GPU device kind (a TPU program
    compiled ahead of time on a CPU host keeps the real ops)."""
    if platform_of(cfg.device_kind or "cpu") != "cpu":
        return []
    return [line for check in _CHECKS if (line := check(cfg))]


def _attention(cfg: Config) -> str:
    """An accelerator's attention kernel: the stand-in its row names. Not under context parallelism, where ring
    attention runs blockwise steps instead of any kernel (attention_choice.py)."""
    stand_in = attention_kinds.kind(cfg.model.attention).cpu_stand_in
    if not stand_in or mesh.axis_sizes(cfg).get("context", 1) > 1:
        return ""
    return f"attention={cfg.model.attention}: {stand_in}"


def _dropless(cfg: Config) -> bool:
    """Whether the model has MoE layers whose experts compute dropless with grouped matmuls (layers/moe.py)."""
    m = cfg.model
    return m.is_moe and m.capacity_factor <= 0 and m.moe_dropless_impl != "dense"


def _expert_shards(cfg: Config) -> int:
    """How many ways the mesh splits the experts: the devices a dropless layer exchanges tokens between."""
    sizes = mesh.axis_sizes(cfg)
    axes = sharding.axes_of(ax.EXP, ax.EXPERT_KERNEL, sharding.flax_rules(cfg), sizes)
    return math.prod(sizes[a] for a in sharding.as_axes(axes))


def _moe_exchange(cfg: Config) -> str:
    """The ragged exchange, where tokens are exchanged at all (dropless experts split over devices)."""
    if cfg.model.moe_exchange != "ragged" or not _dropless(cfg) or _expert_shards(cfg) == 1:
        return ""
    return "moe_exchange=ragged: XLA:CPU has no ragged all-to-all; using its CPU stand-in (same contract, slower)"


def _ragged_dot(cfg: Config) -> str:
    """`ragged_dot` experts: jax lowers ragged_dot off TPU and GPU to a dense dot over every expert, masked."""
    if cfg.model.moe_dropless_impl != "ragged_dot" or not _dropless(cfg):
        return ""
    return ("moe_dropless_impl=ragged_dot: XLA:CPU has no grouped matmul; jax computes every expert on every row, "
            "masked (same numbers, slower)")


def _offload(cfg: Config) -> str:
    """An offload policy: JAX lowers the move to host memory to nothing on XLA:CPU (spec/remat.py)."""
    policy = remat.policy(cfg.remat_policy) if cfg.remat_policy in remat.NAMES else None
    if policy is None or not policy.offloads:
        return ""
    return (f"remat_policy={policy.name}: XLA:CPU has one memory; what it offloads stays there (the numbers of "
            f"{remat.on_device(policy).name}, nothing moved)")


def _fp8(cfg: Config) -> str:
    """fp8 training: XLA:CPU converts the fp8 operands of each dot to float32, which holds every fp8 value."""
    if cfg.quantization != "fp8":
        return ""
    return ("quantization=fp8: XLA:CPU has no fp8 matmul; it widens the fp8 operands to float32 for each dot "
            "(the same values, no speedup)")


_CHECKS: tuple[Callable[[Config], str], ...] = (_attention, _moe_exchange, _ragged_dot, _offload, _fp8)
