"""A plan for a config on a target: memory per device, collectives per mesh axis, pipeline bubble, roofline time.

Roofline. Compute time = hardware FLOPs per device / peak, where hardware FLOPs = (model FLOPs (`model/flops.py`,
forward + backward) + what token dropping pads and dispatches (`moe_dropping_flops`)) x (1 + the share of forward
FLOPs the remat policy recomputes / 3) (`remat_factors`: 4/3 for full, 1 for none, and for minimal unless it re-runs
a fused attention), divided by (1 - bubble) under a pipeline. The peak is the bf16 one, or for a quantized run
(`quantization: int8 | fp8`) the mix of the chip's 8-bit peak for the quantized share of the FLOPs and its bf16 peak
for the rest (`quantization.peak_flops`).
A collective over a group of n = n_ici x n_dcn devices (ici and dcn parts of its mesh axes) with full-buffer bytes
B moves, per device, with a ring inside each level:

    over ICI:  f x (n_ici - 1) / n_ici x B            at the ICI bandwidth of one device
    over DCN:  f x (n_dcn - 1) / n_dcn x B / n_ici    at the DCN bandwidth of one device (hierarchical: the ICI
                                                      level has already split B into n_ici pieces)

with f = 2 for all-reduce (reduce-scatter + all-gather) and 1 otherwise; a permute sends B once (over DCN if its
axis crosses slices). Times add up per group of axes; the step estimate is max(compute, slowest group), i.e.
perfect overlap, and the no-overlap bound compute + every group is printed beside it. Both ignore latency, link
contention and collective efficiency (`hardware.py`), so they are lower bounds on a real step.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from maxshard.config import Config
from maxshard.launch.topologies import Target
from maxshard.model import flops, quantization
from maxshard.spec import remat
from maxshard.model import transformer as model
from maxshard.model.layers import moe
from maxshard.observe.report import build_report
from maxshard.parallel import mesh
from maxshard.planning import gather_memory, hardware, memory, moe_memory, rollout_memory, traffic, widths
from maxshard.planning.traffic import Collective
from maxshard.training.step import abstract_state

__all__ = ["AxisTime", "Plan", "make_plan", "activations_under", "collective_seconds", "by_kind", "moe_dropping_flops"]


@dataclasses.dataclass(frozen=True)
class AxisTime:
    ici_s: float
    dcn_s: float

    @property
    def total_s(self) -> float:
        return self.ici_s + self.dcn_s


@dataclasses.dataclass(frozen=True)
class Plan:
    cfg: Config
    target: Target | None
    ici: dict[str, int]
    dcn: dict[str, int]
    param_count: int
    params: int  # bytes per device
    optimizer: int
    gradients: int
    activations: int
    collectives: list[Collective]
    bubble: float
    model_flops: float  # per device per step
    hardware_flops: float
    peak: float | None
    link: hardware.Interconnect | None
    axis_times: dict[str, AxisTime]  # "fsdp", "data", "fsdp+sequence", ...
    activation_terms: memory.ActivationTerms | None = None
    reference: int = 0  # bytes per device of DPO's frozen reference parameters (0: the objective keeps none)
    rollout_cache: int = 0  # bytes per device of GRPO's sampling KV cache (planning/rollout_memory.py)

    @property
    def peak_bytes(self) -> int:
        """Planned peak bytes per device: state, gradients and activations (what must fit the device); what an
        offload policy moves to host memory is not in it (`host_bytes`)."""
        return self.params + self.optimizer + self.reference + self.working(self.activations)

    def working(self, activations: int | float) -> int:
        """What the step holds beside the state: gradients and `activations`, or GRPO's sampling cache, which is
        never alive at the same time (planning/rollout_memory.py)."""
        return int(max(self.gradients + activations, self.rollout_cache))

    @property
    def host_bytes(self) -> int:
        """Host memory per device for the activations an offload policy moves there (0 for any other policy, and
        on a compiler that keeps them on the device)."""
        return 0 if self.activation_terms is None else int(self.activation_terms.host)

    @property
    def mesh(self) -> dict[str, int]:
        return {a: self.ici[a] * self.dcn[a] for a in self.ici}

    @property
    def compute_s(self) -> float | None:
        return None if self.peak is None else self.hardware_flops / self.peak / (1 - self.bubble)

    @property
    def step_s(self) -> float | None:
        """max(compute, slowest axis group): perfect overlap."""
        if self.compute_s is None:
            return None
        return max([self.compute_s, *(t.total_s for t in self.axis_times.values())])

    @property
    def serial_s(self) -> float | None:
        """compute + every axis group: no overlap."""
        if self.compute_s is None:
            return None
        return self.compute_s + sum(t.total_s for t in self.axis_times.values())


def by_kind(collectives: list[Collective]) -> dict[str, float]:
    """{kind: bytes} summed over axes: what `collectives.count_collectives` measures from HLO."""
    out: dict[str, float] = {}
    for c in collectives:
        out[c.kind] = out.get(c.kind, 0.0) + c.bytes
    return out


def collective_seconds(
    c: Collective, ici: dict[str, int], dcn: dict[str, int], link: hardware.Interconnect
) -> AxisTime:
    """Ring time of one collective, split into its ICI and DCN parts (module docstring)."""
    n_ici = math.prod(ici[a] for a in c.axes)
    n_dcn = math.prod(dcn[a] for a in c.axes)
    if c.kind == "collective-permute":
        return AxisTime(0.0, c.bytes / link.dcn_bw) if n_dcn > 1 else AxisTime(c.bytes / link.ici_bw, 0.0)
    f = 2 if c.kind == "all-reduce" else 1
    over_ici = f * (n_ici - 1) / n_ici * c.bytes
    over_dcn = f * (n_dcn - 1) / n_dcn * c.bytes / n_ici
    return AxisTime(over_ici / link.ici_bw, over_dcn / link.dcn_bw)


def _axis_times(collectives: list[Collective], ici: dict, dcn: dict, link: hardware.Interconnect | None) -> dict:
    if link is None:
        return {}
    times: dict[str, AxisTime] = {}
    for c in collectives:
        t, label = collective_seconds(c, ici, dcn, link), "+".join(c.axes)
        old = times.get(label, AxisTime(0.0, 0.0))
        times[label] = AxisTime(old.ici_s + t.ici_s, old.dcn_s + t.dcn_s)
    return times


def remat_factors(cfg: Config) -> dict[str, float]:
    """Hardware / model FLOPs of every remat policy: the backward pass re-runs the forward FLOPs a policy did not save,
    one third of training FLOPs if it re-ran all of them (full). The forward FLOPs of the decoder stack by part come
    from the model's one inventory (`flops.layer_flops`: q/k/v projections, output projection, attention, MLP with an
    MoE layer's routed and shared experts and router). Each policy recomputes the parts of the layer its row of
    maxshard/spec/remat.py names (`recomputes`), and every policy but none re-runs a fused attention kernel
    (`widths.Widths.fused`: not a matmul that a policy keeps):
        none                 nothing
        minimal              elementwise work only (it keeps every matmul output), and a fused attention
        save_qkv_out_proj    attention and MLP (offload_qkv_out_proj alike: where a value is kept costs no FLOPs)
        save_qkv_proj        attention, output projection and MLP (offload_qkv_proj alike)
        save_out_proj        q/k/v projections, attention and MLP
        full                 everything (offload_full alike)
    """
    parts = flops.layer_flops(cfg.model)
    fused = widths.widths(cfg, mesh.axis_sizes(cfg)).fused
    layer = sum(parts.values())
    factors = {}
    for p in remat.POLICIES:
        recomputed = set(p.recomputes) | ({"attention"} if fused and p.keeps != "everything" else set())
        factors[p.name] = 1 + sum(parts[part] for part in recomputed) / layer / 3
    return factors


def moe_dropping_flops(cfg: Config) -> float:
    """FLOPs per device that token dropping executes beyond the model's (`moe.py`'s dispatch and combine). Each group
    of g tokens fills experts x C slots, C = capacity(g), padded or not: the expert MLPs run on experts x C / g rows
    per token where the model counts k (k x capacity_factor vs k), and the dispatch and combine einsums with the
    one-hot [g, experts, C] masks cost 2 x experts x C x E each per token forward. The backward differentiates the
    dispatch only for its tokens (its mask is made of integers: 2x the forward in all), the combine also for its
    router weights (3x).
    For Mixtral 8x7B at 4k tokens, whole-sequence groups, capacity_factor 1.25, this is +38% of the model's FLOPs."""
    m = cfg.model
    if not m.is_moe or m.capacity_factor <= 0:
        return 0.0
    g = moe.group_size(cfg.max_target_length, m.moe_group_size)
    slots = m.num_experts * moe.capacity(g, m.num_experts_per_tok, m.num_experts, m.capacity_factor)  # per group
    padding = (slots / g - m.num_experts_per_tok) * 6 * 3 * m.emb_dim * m.expert_dim  # per token, training
    dispatch_combine = (2 + 3) * 2 * slots * m.emb_dim
    tokens = cfg.global_batch_size * cfg.max_target_length / cfg.num_devices
    return m.num_moe_layers * tokens * (padding + dispatch_combine)


def loss_recompute_flops(cfg: Config) -> float:
    """FLOPs per device that a chunked loss adds: each piece's head matmul (2 E V per token) runs again in the
    backward pass (maxshard/training/loss.py)."""
    if cfg.loss_chunks <= 1:
        return 0.0
    return 2.0 * cfg.emb_dim * cfg.vocab_size * cfg.global_batch_size * cfg.max_target_length / cfg.num_devices


def make_plan(cfg: Config, target: Target | None = None) -> Plan:
    """The plan of a finalized config (vocab resolved) on `target` (None: memory and bytes only, no times)."""
    shape = mesh.resolve_shape(cfg)
    ici = dict(zip(shape.sizes, shape.ici))
    dcn = dict(zip(shape.sizes, shape.dcn))
    sizes = shape.sizes
    state = abstract_state(cfg)
    report = build_report(cfg, sizes, state=state)
    itemsize = np.dtype(cfg.model.compute_dtype).itemsize
    geo = traffic.geometry(cfg, sizes, itemsize)
    collectives = traffic.planned_collectives(cfg, report, sizes, geo)
    link = hardware.target_link(target)
    gathered = memory.gathered_bytes(cfg, gather_memory.gathered_unit_bytes(cfg, report, sizes, geo),
                                     gather_memory.gathered_unit_bytes(cfg, report, sizes, geo, largest_layer=True))
    grouped_head = gather_memory.grouped_head_bytes(cfg, report, sizes, geo)
    head_weights = 0.0 if any(grouped_head) else gather_memory.gathered_head_bytes(cfg, report, sizes, geo)
    terms = memory.activation_terms(cfg, sizes, geo, gathered, report.gradient_bytes_per_device,
                                    report.param_bytes_per_device, head_weights, grouped_head,
                                    moe_memory.stack_bytes(cfg, report, itemsize))
    model_flops = flops.flops_per_token(cfg.model) * cfg.global_batch_size * cfg.max_target_length / cfg.num_devices
    return Plan(
        cfg=cfg,
        target=target,
        ici=ici,
        dcn=dcn,
        param_count=model.count_params(state.params),
        params=report.param_bytes_per_device,
        optimizer=report.optimizer_bytes_per_device,
        reference=report.reference_bytes_per_device,
        rollout_cache=rollout_memory.rollout_cache_bytes(cfg, sizes),
        gradients=report.gradient_bytes_per_device,
        activations=terms.total,
        activation_terms=terms,
        collectives=collectives,
        bubble=geo.bubble_fraction,
        model_flops=model_flops,
        hardware_flops=(model_flops + moe_dropping_flops(cfg)) * remat_factors(cfg)[cfg.remat_policy]
        + loss_recompute_flops(cfg),
        peak=quantization.peak_flops(cfg),
        link=link,
        axis_times=_axis_times(collectives, ici, dcn, link),
    )


def activations_under(plan: Plan, policy: str) -> memory.ActivationTerms:
    """`plan`'s activation terms had the run used remat `policy`: only the per-layer terms change."""
    cfg = dataclasses.replace(plan.cfg, remat_policy=policy)
    geo = traffic.geometry(cfg, plan.mesh, np.dtype(cfg.model.compute_dtype).itemsize)
    terms = plan.activation_terms
    gathered, table, grouped, moe_stack = ((terms.gathered, terms.head_table, terms.head_grouped, terms.moe_stack)
                                           if terms is not None else (0.0, 0.0, (0.0, 0.0), 0.0))
    return memory.activation_terms(cfg, plan.mesh, geo, gathered, plan.gradients, plan.params, table, grouped,
                                   moe_stack)
