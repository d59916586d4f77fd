"""The remat policies (`remat_policy`): what each keeps for the backward pass, where it keeps it, and what the backward
pass runs again. One table, read by the decoder (the `jax.checkpoint` policy), the config schema (the allowed
names), the planner (bytes saved per layer on the device and in host memory, FLOPs recomputed, collectives a
recompute repeats), `remat_policy: auto` and the layout search, so a policy is added here once.

A policy keeps one of three things:

    everything  no remat at all: every intermediate of every layer stays for the backward pass (`none`)
    dots        every matmul output (`jax.checkpoint_policies.dots_saveable`), elementwise work is recomputed
    names       only the values named with `checkpoint_name` in `device` and `host`, besides each layer's input
                (the input of the checkpointed layer, which the scan keeps); everything else is recomputed

Names: a token mixer names its projections' outputs as its row's `remat_names` say (spec/mixer_kinds.py; the
attention kinds and gated DeltaNet: `query_proj`, `key_proj`, `value_proj` and `out_proj`, layers/attention.py), so
a policy that keeps a name keeps it in every layer whose mixer gives it; the decoder layer names its input
`layer_input` (layers/decoder.py). A name in `host` is
moved to host memory in the forward pass and back for the backward pass (`save_and_offload_only_these_names`,
device -> pinned_host): it frees device memory for PCIe traffic. An offload policy names the layer input too, so
the device keeps nothing per layer. Only accelerators move anything: JAX lowers the transfer to host as nothing on
XLA:CPU, where the named values stay in the one memory the CPU has (the planner counts them there).

`recomputes`: the parts of a layer's forward pass the backward runs again (of `PARTS`). A fused attention kernel
(ring attention, or a row of attention_kinds.py fused where it runs) is no matmul a policy keeps, so every policy but
`none` re-runs it (`estimate.remat_factors`).
"""

from __future__ import annotations

import dataclasses

__all__ = ["LAYER_INPUT", "PARTS", "Policy", "POLICIES", "NAMES", "policy", "on_device"]

LAYER_INPUT = "layer_input"
PARTS = ("qkv", "out", "attention", "mlp")  # q/k/v projections, output projection, attention, MLP
_QKV = ("query_proj", "key_proj", "value_proj")
_SAVED = "saved projections per layer + one layer's intermediates"
_OFFLOADED = "nothing per layer (host memory holds it) + one layer's intermediates"


@dataclasses.dataclass(frozen=True)
class Policy:
    """One remat policy (module docstring)."""

    name: str
    keeps: str  # "everything", "dots" or "names"
    recomputes: tuple[str, ...]  # of PARTS
    summary: str  # what a layer keeps, for the planner's printout
    device: tuple[str, ...] = ()  # checkpoint names kept in device memory
    host: tuple[str, ...] = ()  # checkpoint names moved to host memory
    like: str = ""  # an offload policy: the policy that keeps the same values on the device

    @property
    def offloads(self) -> bool:
        """Whether the policy moves saved activations to host memory."""
        return bool(self.host)

    @property
    def keeps_matmul_outputs(self) -> bool:
        """none and minimal: the backward re-runs no matmul, so no collective that feeds one either."""
        return self.keeps in ("everything", "dots")


# From the most device memory (least recomputation) to the least.
POLICIES = (
    Policy("none", "everything", (), "every intermediate of every layer"),
    Policy("minimal", "dots", (), "matmul outputs of every layer + one layer's intermediates"),
    Policy("save_qkv_out_proj", "names", ("attention", "mlp"), _SAVED, device=(*_QKV, "out_proj")),
    Policy("save_qkv_proj", "names", ("out", "attention", "mlp"), _SAVED, device=_QKV),
    Policy("save_out_proj", "names", ("qkv", "attention", "mlp"), _SAVED, device=("out_proj",)),
    Policy("full", "names", PARTS, "one [batch, length, embed] per layer + one layer's intermediates"),
    Policy("offload_qkv_out_proj", "names", ("attention", "mlp"), _OFFLOADED, host=(LAYER_INPUT, *_QKV, "out_proj"),
           like="save_qkv_out_proj"),
    Policy("offload_qkv_proj", "names", ("out", "attention", "mlp"), _OFFLOADED, host=(LAYER_INPUT, *_QKV),
           like="save_qkv_proj"),
    Policy("offload_full", "names", PARTS, _OFFLOADED, host=(LAYER_INPUT,), like="full"),
)
NAMES = tuple(p.name for p in POLICIES)
_BY_NAME = {p.name: p for p in POLICIES}


def policy(name: str) -> Policy:
    """The policy called `name` (KeyError for `auto`, which the loader resolves first)."""
    return _BY_NAME[name]


def on_device(p: Policy) -> Policy:
    """The policy that keeps on the device what `p` keeps anywhere (`p` itself when it moves nothing): what an
    offload policy amounts to on XLA:CPU, and the row whose measured constants it shares."""
    return policy(p.like) if p.like else p
