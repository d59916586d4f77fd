"""The planner's printout: a few fixed-width blocks a person reads top to bottom, and the same as JSON; the compiled
train step's peak split beside it (`format_compiled`), or the note that says the plan is an estimate
(`estimate_notice`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maxshard.model import flops, quantization
from maxshard.spec import blocks, mixer_kinds, pipeline_schedule, remat
from maxshard.planning.estimate import AxisTime, Plan
from maxshard.planning.fit import configured_capacity
from maxshard.planning.fitted import described
from maxshard.planning.memory import ActivationTerms, compiler, effective_policy
from maxshard.planning.widths import Widths, widths
from maxshard.units import format_bytes

if TYPE_CHECKING:
    from maxshard.planning.tpu_compile import CompiledRun

__all__ = ["format_plan", "plan_json", "format_compiled", "estimate_notice"]

_NAME_TEXT = {remat.LAYER_INPUT: "input", "query_proj": "q", "key_proj": "k", "value_proj": "v",
              "out_proj": "output projection"}


def _mesh_line(plan: Plan) -> str:
    parts = []
    for axis, size in plan.mesh.items():
        if size > 1:
            where = [f"{n} {level}" for n, level in ((plan.ici[axis], "ici"), (plan.dcn[axis], "dcn")) if n > 1]
            parts.append(f"{axis}={size} ({' x '.join(where)})")
    return "mesh: " + (" ".join(parts) or "single device")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' if n != 1 else ''}"


def _count(n: int) -> str:
    """8.03B, 125.1M, 181,504."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n:,}"


def _header(plan: Plan) -> list[str]:
    cfg, t = plan.cfg, plan.target
    where = "no target (memory and bytes only)"
    if t is not None and t.accelerator == "cpu":
        where = f"{t.name} = {_plural(t.num_devices, 'simulated CPU device')} of this machine (cpu_device_count)"
    elif t is not None:
        unit = "slice" if t.accelerator == "tpu" else "node"
        where = (f"{t.name} x {_plural(t.num_slices, unit)} = {t.num_devices} devices ({t.device_kind!r}, "
                 f"{t.chips_per_slice} per {unit}, {_plural(t.num_hosts, 'host')})")
    return [
        f"target: {where}",
        _mesh_line(plan),
        f"model: {_count(plan.param_count)} parameters; batch {cfg.global_batch_size} x {cfg.max_target_length} "
        f"tokens; remat_policy={cfg.remat_policy}; gradient_accumulation_steps={cfg.gradient_accumulation_steps}",
        *_layers_line(cfg.model),
    ]


def _layers_line(model: Any) -> list[str]:
    """A local/global model's attention: how many layers are local, what they see (a window or a chunk), and what
    that saves."""
    local = sum(layer.local for layer in blocks.layers(model))
    if not local:
        return []
    length = model.max_target_length
    share = mixer_kinds.local_keys_seen(model, True) / flops.keys_seen(length)
    sees = f"chunks of {model.attention_chunk_size}" if model.attention_chunk_size else f"window {model.sliding_window}"
    return [f"attention: {_plural(local, 'local layer')} ({sees} of {length} tokens: {share:.0%} of a global "
            f"layer's score and value FLOPs) + {model.num_layers - local} global"]


def _share_of_memory(plan: Plan) -> str:
    """" of <memory> (<share>)" for the total: of device_memory_gb where it is set (the memory the verdict checks
    against), else of the chip's HBM; "" where neither is known (CPU)."""
    configured = configured_capacity(plan.cfg)
    if configured is not None:
        return f" of {format_bytes(configured.bytes)} ({configured.source}; {plan.peak_bytes / configured.bytes:.0%})"
    hbm = plan.link.hbm if plan.link is not None else None
    return "" if hbm is None else f" of {format_bytes(hbm)} HBM ({plan.peak_bytes / hbm:.0%})"


def _memory(plan: Plan) -> list[str]:
    total = plan.peak_bytes
    fits = _share_of_memory(plan)
    rule = effective_policy(plan.cfg.remat_policy, compiler(plan.cfg)).summary
    w = widths(plan.cfg, plan.mesh)
    lines = [
        "memory per device:",
        f"  parameters       {format_bytes(plan.params):>11}",
        f"  optimizer state  {format_bytes(plan.optimizer):>11}",
        f"  gradients        {format_bytes(plan.gradients):>11}",
        *([f"  reference model  {format_bytes(plan.reference):>11}  (a frozen copy of the parameters)"]
          if plan.reference else []),
        *([f"  sampling cache   {format_bytes(plan.rollout_cache):>11}  (GRPO's KV cache, not alive with the "
           "gradients and activations: the total counts the larger)"] if plan.rollout_cache else []),
        f"  activations      {format_bytes(plan.activations):>11}  estimate: {rule},",
        f"  {'':>28}  logits and their gradient; {_attention_text(w)}",
    ]
    if plan.activation_terms is not None:
        lines.append(f"  {'':>28}  = {_terms_text(plan.activation_terms)}")
    lines.append(f"  total            {format_bytes(total):>11}{fits}")
    lines += _host(plan)
    fit = plan.cfg.memory_fit
    if fit is not None:
        chosen = f"auto chose {fit.policy}" if fit.requested == "auto" else f"{fit.policy} as set"
        verdict = "fits" if fit.fits else "does NOT fit"
        lines.append(f"  remat_policy: {chosen}; {verdict} the {format_bytes(fit.usable_bytes)} usable "
                     f"({fit.capacity_source}, memory_headroom={plan.cfg.memory_headroom:g})")
    lines.append(f"  planned for {described(compiler(plan.cfg))}")
    return lines


def _terms_text(terms: ActivationTerms) -> str:
    """'saved 1 GiB + working ...' adding up to the activations; where the compiler never holds the logits and one
    layer's backward together (`head_apart`), the larger of the two: 'max(head ..., working ... + block ...) + ...'."""
    values = {k: v for k, v in terms.as_json().items() if v and k != "host"}
    apart = [k for k in ("head", "working", "block") if k in values] if terms.head_apart else []
    text = [f"{k} {format_bytes(v)}" for k, v in values.items() if k not in apart]
    if apart:
        layer = " + ".join(f"{k} {format_bytes(values[k])}" for k in apart if k != "head")
        head = f"head {format_bytes(values['head'])}, " if "head" in values else ""
        text.insert(0, f"max({head}{layer})")
    return " + ".join(text)


def _host(plan: Plan) -> list[str]:
    """The host memory line of an offload policy: apart from the device total, and where it stays on the device."""
    policy = remat.policy(plan.cfg.remat_policy)
    if not policy.offloads:
        return []
    if not plan.host_bytes:
        return [f"  host memory      {'none':>11}  {compiler(plan.cfg)} keeps what {policy.name} offloads on the "
                f"device, as {policy.like} (counted above)"]
    names = ", ".join(_NAME_TEXT[n] for n in policy.host)
    return [f"  host memory      {format_bytes(plan.host_bytes):>11}  {policy.name} moves every layer's {names} there "
            "(not in the total)"]


def _attention_text(w: Widths) -> str:
    if not w.fused:
        return f"attention=dot_product: scores [{w.heads} heads, length, length] are materialised"
    ring = f", ring over {w.context} context shards" if w.context > 1 else ""
    return f"attention={w.attention}: blockwise working set, linear in length{ring}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _time_text(t: AxisTime | None) -> str:
    if t is None:
        return ""
    parts = [f"ICI {_ms(t.ici_s)}" if t.ici_s else "", f"DCN {_ms(t.dcn_s)}" if t.dcn_s else ""]
    return ", ".join(p for p in parts if p) or "0 ms"


def _collectives(plan: Plan) -> list[str]:
    sizes: dict[tuple[str, str], float] = {}
    whats: dict[tuple[str, str], set[str]] = {}
    for c in plan.collectives:
        key = ("+".join(c.axes), c.kind)
        sizes[key] = sizes.get(key, 0.0) + c.bytes
        whats.setdefault(key, set()).add(c.what)
    lines = ["collectives per device per step (full-buffer bytes; ring time at peak bandwidth):"]
    if not sizes:
        lines.append("  none (a single device, or nothing sharded)")
    for (axes, kind), size in sorted(sizes.items()):
        lines.append(f"  {axes:<16} {kind:<19} {format_bytes(size):>11}   {'; '.join(sorted(whats[axes, kind]))}")
    for axes, t in sorted(plan.axis_times.items()):
        lines.append(f"  time on {axes}: {_time_text(t)}")
    return lines


def _roofline(plan: Plan) -> list[str]:
    cfg = plan.cfg
    stages, pipe = plan.mesh.get("stage", 1), cfg.model.pipeline
    lines = [f"pipeline bubble: {plan.bubble:.1%} ({pipe.schedule} {pipeline_schedule.of(pipe).bubble_formula}, "
             f"S={stages}; {pipeline_schedule.of(pipe).in_flight} microbatch stage inputs in flight)"
             if stages > 1 else "pipeline bubble: none (stage=1)"]
    if plan.peak is None or plan.compute_s is None:
        return lines + [f"roofline: no peak FLOP/s known for device kind {cfg.device_kind!r}"]
    slowest = max(plan.axis_times.items(), key=lambda kv: kv[1].total_s, default=None)
    comm = "no communication" if slowest is None else f"slowest axis {slowest[0]} {_ms(slowest[1].total_s)}"
    mfu = plan.model_flops / plan.step_s / plan.peak  # type: ignore[operator]
    precision = "" if cfg.quantization == "none" else f" {quantization.peak_precision(cfg)}"
    lines += [
        f"roofline: compute {plan.compute_s:.4g} s ({plan.hardware_flops:.3g} FLOPs per device at "
        f"{plan.peak / 1e12:.0f} TFLOP/s{precision}; model FLOPs x {plan.hardware_flops / plan.model_flops:.3g} for "
        f"recompute); {comm}",
        f"step time >= {plan.step_s:.4g} s (perfect overlap), {plan.serial_s:.4g} s without overlap; "
        f"MFU <= {mfu:.1%}; {cfg.global_batch_size * cfg.max_target_length / plan.step_s:,.0f} tokens/s at best",
    ]
    if plan.link is not None:
        lines.append(f"bandwidths: ICI {plan.link.ici_bw / 1e9:.0f} GB/s, DCN {plan.link.dcn_bw / 1e9:.2f} GB/s per "
                     f"device ({plan.link.source}; see maxshard/devices.py)")
    return lines


def format_plan(plan: Plan) -> str:
    return "\n".join(_header(plan) + _memory(plan) + _collectives(plan) + _roofline(plan))


def plan_json(plan: Plan) -> dict[str, Any]:
    """Every number of the printout, machine-readable."""
    return {
        "target": None if plan.target is None else plan.target.name,
        "num_slices": None if plan.target is None else plan.target.num_slices,
        "mesh": plan.mesh,
        "ici": plan.ici,
        "dcn": plan.dcn,
        "param_count": plan.param_count,
        "bytes_per_device": {"params": plan.params, "optimizer": plan.optimizer, "gradients": plan.gradients,
                             "reference": plan.reference, "rollout_cache": plan.rollout_cache,
                             "activations": plan.activations, "peak": plan.peak_bytes, "host": plan.host_bytes},
        "activation_terms": None if plan.activation_terms is None else plan.activation_terms.as_json(),
        "remat_policy": plan.cfg.remat_policy,
        "memory_fit": None if plan.cfg.memory_fit is None else plan.cfg.memory_fit.as_json(),
        "planned_for": described(compiler(plan.cfg)),
        "collectives": [{"kind": c.kind, "axes": list(c.axes), "bytes": c.bytes, "what": c.what}
                        for c in plan.collectives],
        "bubble": plan.bubble,
        "flops_per_device": {"model": plan.model_flops, "hardware": plan.hardware_flops},
        "peak_flops": plan.peak,
        "seconds": {"compute": plan.compute_s, "step": plan.step_s, "serial": plan.serial_s,
                    "axes": {k: {"ici": v.ici_s, "dcn": v.dcn_s} for k, v in plan.axis_times.items()}},
    }


def format_compiled(plan: Plan, run: CompiledRun, xla: str, usable: int, source: str) -> list[str]:
    """The compiled programs' peaks beside the plan, and the train step's peak per device split into what holds it
    (`compiled.StepMemory`): the state and the batch by their shards' bytes, XLA's temporaries, the rest."""
    step = run.step
    host = (f"; host memory {format_bytes(step.host)} per device, planned {format_bytes(plan.host_bytes)}"
            if step.host or plan.host_bytes else "")
    rows = [("parameters", step.params, ""), ("optimizer state", step.optimizer, "moments and the step counter"),
            *([("reference model", step.reference, "a frozen copy of the parameters")] if step.reference else []),
            ("batch", step.batch, ""),
            ("temporaries", step.temporaries, f"gradients ({format_bytes(plan.gradients)} as arrays), activations "
                                              "and working buffers, as XLA overlaps them"),
            ("other", step.other, "outputs not donated to the state, layout padding of the arguments"),
            ("peak", step.peak, f"of {format_bytes(usable)} usable ({source})")]
    return [f"compiled with {xla} for {plan.target.name}: init peak {format_bytes(run.init_peak)} per device "
            f"({run.init_seconds:.0f}s), train step peak {format_bytes(step.peak)} per device "
            f"({run.step_seconds:.0f}s); planned {format_bytes(plan.peak_bytes)}, "
            f"{step.peak / plan.peak_bytes:.2f}x the plan{host}",
            f"compiled train step per device ({xla}'s memory_analysis(); state and batch: their shards' bytes):",
            *(f"  {name:<16} {format_bytes(size):>11}{'  ' + what if what else ''}" for name, size, what in rows)]


def estimate_notice(reason: str, exact: str | None, error: float) -> str:
    """The line that says the plan is the formula estimate, why it is not a compile, how close the estimate is
    checked to be, and `exact`: what gives the compiler's answer (an install line, or the command without
    --estimate; None where `reason` says it)."""
    then = "" if exact is None else f"; the exact answer: {exact}"
    return (f"estimate: the formula plan, checked within {error:.0%} of XLA's compiled peaks on the tests' shapes, "
            f"not a compile ({reason}){then}")
