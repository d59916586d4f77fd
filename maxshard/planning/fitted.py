"""What each compiler does with a train step, as measured on its programs: the constants the memory estimate takes
(`memory.py`), kept as data by compiler ("xla:cpu", "xla:tpu"; XLA:GPU takes XLA:CPU's), and which remat policies
a compiler really offloads.

One entry per compiler, whichever release is installed: the estimate only ranks layouts and policies, and where the
target's compiler is installed the plan is its compile (planning/compiled.py), so no release's report needs
constants of its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from maxshard.config import Config
from maxshard.spec import remat
from maxshard.model.attention_choice import platform_of

__all__ = ["OFFLOADING", "Fitted", "FITTED", "XLA_CPU_WORKING", "XLA_TPU_WORKING", "compiler", "policies",
           "effective_policy", "fitted", "described"]

# The compiler of a device kind (attention_choice.platform_of), whose measured constants the plan uses.
_COMPILERS = {"tpu": "xla:tpu", "nvidia": "xla:gpu", "cpu": "xla:cpu"}
# Compilers that move an offload policy's values to host memory. JAX lowers the transfer as nothing on XLA:CPU.
OFFLOADING = ("xla:tpu", "xla:gpu")


def compiler(cfg: Config) -> str:
    """'xla:tpu', 'xla:gpu' or 'xla:cpu': the compiler the config was finalized for (its device kind)."""
    return _COMPILERS[platform_of(cfg.device_kind or "cpu")]


def policies(compiler_name: str) -> tuple[str, ...]:
    """Remat policies from the most device memory (least recomputation) to the least, as `compiler_name` runs them:
    the offload policies only where it moves values to host memory (elsewhere each is its `like` policy)."""
    return tuple(p.name for p in remat.POLICIES if compiler_name in OFFLOADING or not p.offloads)


def effective_policy(name: str, compiler_name: str) -> remat.Policy:
    """The policy `name` as `compiler_name` runs it: an offload policy keeps everything on the device where the
    compiler moves nothing."""
    p = remat.policy(name)
    return p if compiler_name in OFFLOADING else remat.on_device(p)


# One layer's backward working set per token, by policy: (fraction of `dense`, bytes per dot-product score, mlp widths
# F in the compute dtype: the gate and up projections' stacked [2, F] output and its slices). Fitted on XLA:CPU on the
# widths and lengths of tests/test_plan_memory.py, which holds the plan to the compiled step there. An offload policy
# takes the row of the policy it is `like`.
XLA_CPU_WORKING = {
    "none": (0.52, 10.0, 2.75),
    "minimal": (0.53, 9.3, 3.0),
    "save_qkv_out_proj": (0.79, 8.0, 1.5),
    "save_qkv_proj": (0.79, 13.3, 1.0),
    "save_out_proj": (0.84, 2.3, 1.5),
    "full": (0.79, 13.3, 1.0),
}
# XLA:TPU's rows: XLA:CPU's, but for save_out_proj, whose layer backward XLA:TPU holds at a larger share of `dense`
# than XLA:CPU does; with XLA:CPU's row `auto` would pick a policy whose compiled step does not fit the chip. Read off
# one shape only, the 8b preset on v6e-256 (benchmarks/README.md, "The planner against XLA:TPU at mid-size shapes").
XLA_TPU_WORKING = {**XLA_CPU_WORKING, "save_out_proj": (1.46, 2.3, 1.5)}


@dataclasses.dataclass(frozen=True)
class Fitted:
    """What the plan takes from one compiler's programs, as measured there (`FITTED`)."""

    working: Mapping[str, tuple[float, float, float]]  # WORKING rows by policy
    head_apart: bool = False  # the logits and one layer's backward are never live together: the peak has the larger
    weight_cast: bool = False  # the sharded weights are also held cast to the compute dtype (the cast hoisted)
    tile: tuple[int, int] | None = None  # (rows, lanes) a value's two minor dimensions are padded to
    gathered_units: int = 1  # stacked units' gathered weights live at the peak (the one computed)
    # if > 0, instead of `gathered_units`: this many copies of the largest layer of a unit gathered whole at the peak
    # (XLA:TPU: 2, the layer being differentiated holds its gathered weights and their whole gradient)
    gathered_layers: int = 0
    # copies of the tied embedding table whole in the compute dtype beside the logits at the loss (XLA:TPU: 2)
    head_weights: int = 0
    # of what a layer re-runs in a multi-layer unit's backward (memory.py `unit`), the share held for every layer
    # but the one being differentiated
    unit_kept: float = 1.0
    # what the MoE layer being differentiated holds per routed row, in (embed, expert width) elements of the compute
    # dtype, by path ("dropping" with the experts unsplit; dropless: "local" with them unsplit, "exchange" with them
    # split over an expert axis), as a phase of its own: the unit holds the larger of these rows and its layer's
    # working set less the dense MLP's share (planning/moe_memory.py `working_bytes`, which says where each was
    # measured); None, a path missing or dropping under an expert axis: memory.py's counts
    moe_rows: Mapping[str, tuple[int, int]] | None = None
    # the share of a layer's backward working set held where the layer's base weights are frozen (LoRA: no weight
    # gradients are formed, so nothing is held for them but the adapters'). Fitted on one LoRA shape of 125m on v5e-8,
    # held out in tests/test_plan_heldout_tpu.py (benchmarks/README.md, "Held-out shapes", the LoRA finding)
    frozen_working: float = 1.0
    # layer working sets live at the peak for every multi-token prediction module after the first (`mtp_depth` > 1),
    # beside the one `working` counts, where the policy recomputes the layer: XLA:CPU runs a module's recomputed layer
    # while the next one's backward is live. Under none nothing recomputes, so nothing is added; XLA:TPU's modules add
    # about their logits only (benchmarks/README.md, "Multi-token prediction modules and the one-piece head")
    mtp_working_sets: int = 0
    # the share of a layer working set the first prediction module holds at the peak beyond its logits, their
    # gradient and its saved layer, by remat policy (a policy missing: none). Fitted on XLA:CPU under save_out_proj,
    # the one policy whose first module holds most of a layer working set; held out under another mesh (the same
    # section of benchmarks/README.md)
    mtp_first_working: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # the heap's gaps beside the MoE layers' stacked values, as a multiple of those layers' float32 weight gradient
    # and compute-dtype weights per device (planning/moe_memory.py `stack_bytes`). XLA:TPU's own accounting shows a
    # dense model's fragmentation flat with depth and an MoE model's growing with its MoE layers, by about these
    # bytes; fitted on a DeepSeek-style shape, held out on Moonlight-16B and Mixtral 8x7B (benchmarks/README.md,
    # "DeepSeek-style on XLA:TPU")
    moe_stack_gaps: float = 0.0
    # a frozen head grouped over the token shards (`gather_memory.grouped_head_bytes`) is gathered in the compute
    # dtype: XLA:TPU casts the table before it gathers it where no float32 gradient is taken; XLA:CPU gathers it in
    # float32 (read off the all-gathers of a LoRA step on each; benchmarks/README.md, "Held-out shapes")
    frozen_head_cast: bool = False
    # what a layer keeps for its backward without remat, as (E-wide values in float32, E-wide in the compute dtype,
    # Q-wide, K-wide) per token beside its 6 F-wide (planning/widths.py `Widths.kept_bytes`), where the compiler keeps
    # other values than `dense` counts (None: `dense`, read off XLA:CPU, whose deduplication is not XLA:TPU's).
    # XLA:TPU keeps the norms' inputs in float32, q in two layouts and four K-wide values: counted from the saved
    # stacks of the layer scan in its buffer assignment, to the byte at three widths (benchmarks/README.md, "The same
    # heap, reported once")
    kept_without_remat: tuple[int, int, int, int] | None = None


# By compiler. XLA:CPU: the additive model of memory.py's docstring, its constants fitted there. XLA:TPU:
# XLA_TPU_WORKING (XLA:CPU's rows but one), and what its programs do that XLA:CPU's do not, each found term by term
# in its buffer assignment (benchmarks/README.md, "The planner against XLA:TPU at mid-size shapes" and "Local/global
# models on XLA:TPU"):
#   head_apart          the chunked loss and the decoder's backward run one after the other, never together: the peak
#                       stops falling with the logits once they are in pieces, and it lies inside the loss
#   weight_cast         the stacked weights are cast to the compute dtype once, before the layer loop, and live
#                       beside their float32 shards
#   tile                the tiled layout pads a value's two minor dimensions to tiles of 8 rows x 128 lanes (fewer
#                       rows take smaller tiles), so narrow heads are stored wider than they are
#   gathered_layers     the layer being differentiated holds its gathered weights and their whole gradient before the
#                       reduce-scatter: two copies of one layer's weights, of the largest layer of a stacked unit
#   head_weights        with tied embeddings the loss's backward holds the table whole in the compute dtype twice
#                       (its gradient before and after the all-reduce XLA:TPU gives it)
#   unit_kept           in a stacked unit of several layers rematerialised as one (a local/global pattern), each layer
#                       but the one being differentiated holds a share of what it re-runs; fitted to the allocation,
#                       which exceeds the live peak (XLA:CPU holds all of it)
# and a LoRA run's smaller layer backward (`frozen_working`), read off a 125m v5e-8 shape and held out on others
# (tests/test_plan_heldout_tpu.py; benchmarks/README.md, "Held-out shapes"); the MoE terms are planning/moe_memory.py's.
# A term the circular pipeline once took (its loss planned before its gradients) and the bubble mask it once kept are
# gone: with the grouped head the first under-planned (memory.py), and layers/pipeline.py zeroes the bubbles inside
# the iteration's checkpoint.
# A compiler without an entry (XLA:GPU) takes XLA:CPU's, which an H100 showed conservative for most policies
# (benchmarks/README.md, "Remat policies: planned vs compiled vs allocator peak, and their cost").
FITTED = {
    "xla:cpu": Fitted(XLA_CPU_WORKING, mtp_working_sets=1, mtp_first_working={"save_out_proj": 0.75}),
    "xla:tpu": Fitted(XLA_TPU_WORKING, head_apart=True, weight_cast=True, tile=(8, 128), gathered_layers=2,
                      head_weights=2, unit_kept=0.8, moe_rows={"dropping": (2, 6), "local": (2, 5), "exchange": (2, 6)},
                      frozen_working=0.54, moe_stack_gaps=0.9, frozen_head_cast=True,
                      kept_without_remat=(6, 2, 5, 4)),
}



def described(compiler_name: str) -> str:
    """Whose programs the memory estimate's constants were measured on, for a person."""
    if compiler_name in FITTED:
        return compiler_name.upper()
    return f"{compiler_name.upper()}, with XLA:CPU's constants"


def fitted(compiler_name: str) -> Fitted:
    """FITTED's entry for `compiler_name`, or XLA:CPU's."""
    return FITTED.get(compiler_name, FITTED["xla:cpu"])
