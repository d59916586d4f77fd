"""What each compiler does with a train step, as measured on its programs: the constants the memory plan takes
(`memory.py`), kept as data by compiler ("xla:cpu", "xla:tpu"; XLA:GPU takes XLA:CPU's), and which remat policies
a compiler really offloads.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import re
from collections.abc import Mapping

from maxshard.config import Config
from maxshard.spec import remat
from maxshard.model.attention_choice import platform_of

__all__ = ["OFFLOADING", "Fitted", "FITTED", "XLA_CPU_WORKING", "XLA_TPU_WORKING", "XLA_TPU_BY_LIBTPU", "compiler",
           "policies", "effective_policy", "fitted", "libtpu_release", "described"]

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
# F in the compute dtype: the gate and up projections' stacked [2, F] output and its slices). Fitted on XLA:CPU
# (jax 0.10.2) on the widths and lengths of tests/test_plan_memory.py. An offload policy takes the row of the policy
# it is `like`.
XLA_CPU_WORKING = {
    "none": (0.52, 10.0, 2.75),
    "minimal": (0.53, 9.3, 3.0),
    "save_qkv_out_proj": (0.79, 8.0, 1.5),
    "save_qkv_proj": (0.79, 13.3, 1.0),
    "save_out_proj": (0.84, 2.3, 1.5),
    "full": (0.79, 13.3, 1.0),
}
# XLA:TPU's rows: XLA:CPU's, but for save_out_proj, whose backward the 8b preset on v6e-256 (4 x 8192 tokens per chip)
# compiled to 1.46 x `dense` at 16 and at 32 layers (the 16 more layers added their saved bytes, 1.07x the plan's):
# 24.3 and 33.1 GiB where XLA:CPU's row planned 19.5 and 27.7. Measured on that one shape only.
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
    # gradients, so nothing is held for them but the adapters'). XLA:TPU: 0.54, the layer-backward peak of 125m on
    # v5e-8 under full at rank 16 on q, k, v, o (loss_chunks=8: 327 MiB of temporaries where the whole working set
    # planned 461); fitted on that one shape, held out in tests/test_plan_heldout_tpu.py
    frozen_working: float = 1.0
    # layer working sets live at the peak for every multi-token prediction module after the first (`mtp_depth` > 1),
    # beside the one `working` counts, where the policy recomputes the layer: XLA:CPU runs a module's recomputed layer
    # while the next one's backward is live. The depth-2 step of tests/test_plan_memory.py's wide widths holds 16
    # more [tokens, embed] and 3 more [tokens, mlp] float32 values at its peak than the depth-1 step, and each module
    # from the second on adds ~7.7 MB where its logits and their gradient are 2.1 (planned 0.76 and 0.65 at depths 2
    # and 3 without the term); under none nothing recomputes (1.08 without it, 1.22 with). XLA:TPU's modules add
    # about their logits (benchmarks/README.md, "Multi-token prediction modules").
    mtp_working_sets: int = 0
    # the share of a layer working set the first prediction module holds at the peak, by remat policy: under
    # save_out_proj XLA:CPU's first module adds 0.71 and 0.81 of one beyond its logits, its gradient and its saved
    # layer (tests/test_plan_memory.py's WIDE and NARROW widths, fsdp 8, vocabulary 1024: 0.824 and 0.902 planned
    # without it); fitted there (0.75), held out under fsdp 4 x tensor 2 (0.90 of one: 0.784 -> 1.03). Other
    # policies hold little (save_qkv_out_proj 0.24, minimal and full none) and keep the plan within 15% without it
    mtp_first_working: Mapping[str, float] = dataclasses.field(default_factory=dict)
    # the heap's gaps beside the MoE layers' stacked values, as a multiple of those layers' float32 weight gradient
    # and compute-dtype weights per device (planning/moe_memory.py `stack_bytes`). XLA:TPU (libtpu's own accounting,
    # its "Program hbm requirement" lines): a dense model's fragmentation stays flat with depth (125m, 12 and 24
    # layers: 54.9 and 55.9 MiB), an MoE model's grows with its MoE layers: 5.8 MiB per MoE layer from 6 to 12
    # layers of a DeepSeek-style shape whose MoE layer holds 1.14M parameters per device (6.5 MiB of float32
    # gradient and bfloat16 cast), 0.9 of them; fitted there, held out on Moonlight-16B at full depth and Mixtral
    # 8x7B (benchmarks/README.md, "DeepSeek-style on XLA:TPU")
    moe_stack_gaps: float = 0.0
    # a frozen head grouped over the token shards (`gather_memory.grouped_head_bytes`) is gathered in the compute
    # dtype: XLA:TPU casts the table before it gathers it where no float32 gradient is taken (every all-gather of the
    # table in that LoRA step is bf16[32000, 768]); XLA:CPU gathers it in float32 (a bfloat16 LoRA step's all-gathers
    # of its [128, 8192] table are f32)
    frozen_head_cast: bool = False
    # copies of that frozen head, gathered, live together in the loss: libtpu 0.0.52's loss holds three
    # bf16[32000, 768] at tests/test_plan_heldout_tpu.py's LoRA shape (heap 122.8 -> 212.2 MiB from 0.0.50.1's
    # program, whose peak holds none; benchmarks/README.md "libtpu 0.0.52: the same heap, reported once")
    frozen_head_copies: int = 1
    # what a layer keeps for its backward without remat, as (E-wide values in float32, E-wide in the compute dtype,
    # Q-wide, K-wide) per token beside its 6 F-wide (planning/widths.py `Widths.kept_bytes`), where the compiler keeps
    # other values than `dense` counts (None: `dense`, read off XLA:CPU). XLA:TPU (libtpu 0.0.42.1, remat none,
    # splash, v5e-8, the saved stacks of the layer scan in the buffer assignment): the norms' inputs in float32, six
    # [tokens, E] f32 a layer, five Q-wide values (q in two layouts) and four K-wide, (6, 2, 5, 4): 72,192 bytes
    # a token and layer at 125m (dense + the kernel's output: 55,344), 68,096 with 4 kv heads, 92,160 at emb 1024 /
    # 16 and 8 heads / mlp 4096, each to the byte (benchmarks/README.md, "libtpu 0.0.52: the same heap, reported
    # once")
    kept_without_remat: tuple[int, int, int, int] | None = None
    # the share of the terms fitted to the compiled totals that is the HBM heap (memory.py `on_the_heap`): libtpu
    # before 0.0.52 reports its temporaries as the heap plus what its log calls the heap's fragmentation, counted a
    # second time, and the constants above were fitted to that report (1.0); 0.0.52 reports the heap. The values
    # counted one by one (the saved stacks, a pipeline's kept stage inputs, the fused kernels' score blocks, the
    # output head's gathered table, the running gradient sum) are the heap's own and keep their bytes; the rest (the
    # backward working sets, the logits, the fsdp gathers, the cast weights, the MoE terms) take the share.
    # 0.0.52: 0.66, fitted on 125m at 2 x 2048 tokens per chip under full on v5e-8 (plan / heap 1.261 -> 1.002);
    # the 8b step on v6e-256 (4 x 8192, full: 1.312 -> 1.063) and the held-out shapes of
    # tests/test_plan_heldout_tpu.py and tests/test_tpu_aot.py check it (benchmarks/README.md, "libtpu 0.0.52: the
    # same heap, reported once")
    heap_share: float = 1.0


# By compiler. XLA:CPU: the additive model of memory.py's docstring, its constants fitted there. XLA:TPU (libtpu
# 0.0.42.1, ahead of time; benchmarks/README.md): XLA_TPU_WORKING (XLA:CPU's rows but one;
# under full its layer backward agreed within 3% at 125m on v5e-8 once the rest was right), and six things its
# programs do that XLA:CPU's do not: (1) the chunked loss and the decoder's backward run one after the other, never
# together (the peak of 125m on v5e-8 under full stayed at 782 MiB from loss_chunks 4 to 16, and a dumped buffer
# assignment put the peak inside the loss with no layer buffer live); (2) the stacked weights cast to bfloat16 once,
# before the layer loop, beside their float32 shards (convert ops of every layer's weights live at the peak; 24 layers
# instead of 12 added the state plus half the float32 weights plus the saved inputs); (3) the tiled layout pads a
# value's two minor dimensions to tiles of 8 rows x 128 lanes (fewer rows take T(2,128) or T(4,128) tiles): q, k, v
# [.., 12 heads, 64] of 125m are stored as [.., 16, 128], 2.7x their size (the host buffers of offload_qkv_out_proj:
# 720 MiB, this plan to the byte); (4) the layer being differentiated holds its gathered weights and their whole
# gradient (before the reduce-scatter): two copies of one layer's weights, of the largest layer of a stacked unit of
# several (`gathered_layers`). Seen in the buffers live at the gemma3_27b preset's layer backward (v6e-64, fsdp 64:
# the MLP's gathered bf16[5376, 2, 21504] and its gradient of the same shape, 441 MiB each, one layer of the 6-layer
# unit); for one-layer units the same count as the earlier two units (0.89-1.13x over the twenty compiled steps of
# benchmarks/README.md's XLA:TPU tables, one unit 0.78-1.03x), for the 6-layer unit 2 of 6 layers (two whole units
# planned 9.5 GiB of weights for it); (5) with tied embeddings the loss's backward holds the embedding table whole in
# the compute dtype twice (its gradient before and after the all-reduce XLA:TPU gives it: bf16[262208, 5376], 2.6 GiB
# each, at the 27B preset's peak, which is in the loss), `head_weights`; it took the 125m rows of
# benchmarks/README.md, whose peak is in the loss, from 0.90 and 0.93 to 0.99 and 1.04; (6) in a stacked unit of
# several layers rematerialised as one (a local/global pattern), each layer but the one being differentiated holds a
# share of what it re-runs (`unit_kept`). The buffers live at the 220M 6-layer unit's peak (benchmarks/README.md
# "Local/global": each re-run layer's [tokens, 2F] gate/up output and [tokens, F] product, a few [tokens, E]) are half
# of it, and so is that program's live peak (the plan at 0.5 was within 1% of it); but XLA:TPU's allocation
# (`memory_analysis`: temp_size) exceeds the live peak by 16% there and by more at 27B, so the share is fitted to the
# allocation: 0.8 brings the three local/global shapes (220M with units of 6 and 4 layers, the 27B preset) to 1.08,
# 0.96 and 1.11 (0.5: 0.86, 0.83, 0.95, once (4) and (5) were counted). XLA:CPU held all of it, units of 2 and 3
# layers. Two more, read off the 125m v5e-8 shapes and held out on others (tests/test_plan_heldout_tpu.py): a LoRA
# run's smaller layer backward (`frozen_working`); and the circular pipeline's loss before its gradients, left out of
# the loss's side (dropped 2026-11-29: with the grouped head that under-planned, memory.py). (The circular pipeline's
# bubble mask, a byte per kept stage-input element that the same dump held, is no longer kept: layers/pipeline.py
# zeroes the bubbles inside the iteration's checkpoint.)
# A compiler without an entry (XLA:GPU) takes XLA:CPU's (on an H100: within 25%, compile_check.py's
# docstring).
FITTED = {
    "xla:cpu": Fitted(XLA_CPU_WORKING, mtp_working_sets=1, mtp_first_working={"save_out_proj": 0.75}),
    "xla:tpu": Fitted(XLA_TPU_WORKING, head_apart=True, weight_cast=True, tile=(8, 128), gathered_layers=2,
                      head_weights=2, unit_kept=0.8, moe_rows={"dropping": (2, 6), "local": (2, 5), "exchange": (2, 6)},
                      frozen_working=0.54, moe_stack_gaps=0.9, frozen_head_cast=True,
                      kept_without_remat=(6, 2, 5, 4)),
}


# XLA:TPU's entries by the first libtpu release whose programs they were measured on, newest first; FITTED's holds
# before them (measured on 0.0.42.1 and 0.0.50.1). Each changes what that release's programs hold differently, and
# how it reports them (`Fitted.heap_share`).
XLA_TPU_BY_LIBTPU: tuple[tuple[tuple[int, ...], Fitted], ...] = (
    # its loss holds three copies of a frozen head; without remat a layer keeps one more Q-wide value ([tokens,
    # heads, head_dim] twice where 0.0.50.1 keeps it once: 69,696 bytes a token and layer at the test's shape of
    # tests/test_tpu_aot.py, 68,160 under 0.0.42.1 and 0.0.50.1); it reports the heap, once
    ((0, 0, 52), dataclasses.replace(FITTED["xla:tpu"], frozen_head_copies=3, kept_without_remat=(6, 2, 6, 4),
                                     heap_share=0.66)),
)


@functools.cache
def libtpu_release() -> tuple[int, ...] | None:
    """The installed libtpu's release as numbers ((0, 0, 52)), or None where libtpu is not installed: the
    compiler a TPU plan is for is the one this environment compiles with (on a TPU VM, the one that runs)."""
    try:
        version = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:4])


def described(compiler_name: str) -> str:
    """Whose programs the memory plan is for, for a person: the compiler and, for XLA:TPU, the libtpu release whose
    constants it takes (a plan made where libtpu is absent takes the releases' before the first entry, which may not
    be what the TPU will run)."""
    if compiler_name != "xla:tpu":
        return "XLA:CPU" if compiler_name == "xla:cpu" else f"{compiler_name.upper()}, with XLA:CPU's constants"
    release, dotted = libtpu_release(), lambda numbers: ".".join(map(str, numbers))  # noqa: E731
    if release is None:
        return f"XLA:TPU as libtpu before {dotted(XLA_TPU_BY_LIBTPU[-1][0])} compiles (libtpu is not installed here)"
    return f"XLA:TPU as the installed libtpu {dotted(release)} compiles"


def fitted(compiler_name: str) -> Fitted:
    """FITTED's entry for `compiler_name` (XLA:TPU's for the installed libtpu release: XLA_TPU_BY_LIBTPU), or
    XLA:CPU's."""
    if compiler_name == "xla:tpu":
        release = libtpu_release()
        for first, entry in XLA_TPU_BY_LIBTPU:
            if release is not None and release >= first:
                return entry
    return FITTED.get(compiler_name, FITTED["xla:cpu"])
