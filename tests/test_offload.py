"""Offload remat policies (maxshard/spec/remat.py) on CPU: one table read everywhere, what XLA:CPU makes of an offload
policy, the planner's device and host bytes, `auto`'s last resort, and the error on devices without host memory.

What XLA:TPU makes of them (the host buffers in `memory_analysis()`) is tests/test_plan_heldout_tpu.py's (its LoRA shape).
"""

from __future__ import annotations

import dataclasses
import json
import types

import pytest

from maxshard.errors import ConfigError
from maxshard.launch import topologies
from maxshard.spec import remat
from maxshard.planning import estimate, fit, memory, traffic
from maxshard.planning.compiled import peak_bytes
from maxshard.planning.printout import format_plan, plan_json
from maxshard.run import search
from maxshard.run import target as run_target
from maxshard.run.target import load_for_target
from maxshard.units import format_bytes
from tests.helpers import tiny_config
from tests.test_plan import _compile

V5E_8 = topologies.parse("v5litepod-8")
PRESET = ("configs/base.yml", "model_name=125m", "per_device_batch_size=2", "loss_chunks=8")


def test_the_table_gives_the_existing_policies_their_old_figures():
    """Read from one table, every consumer gives the six device policies what it hard-coded before, and an offload
    policy what the policy it is `like` gets (where a value is kept changes no FLOP and no collective)."""
    recompute = {"none": 0, "minimal": 0, "save_out_proj": 1, "save_qkv_out_proj": 1, "save_qkv_proj": 2, "full": 2}
    sp_counts = {"save_qkv_proj": (5, 6), "full": (5, 9)}
    for name, count in recompute.items():
        assert traffic._recompute_count(name) == count
        assert traffic._sp_counts(name) == sp_counts.get(name, (4, 6))
    cfg = tiny_config("emb_dim=64", "num_heads=4", "num_kv_heads=2", "head_dim=16", "mlp_dim=128")
    e, q, kv, f, length = 64, 64, 32, 128, cfg.max_target_length
    qkv, out, attention, mlp = 2 * e * (q + 2 * kv), 2 * q * e, 2 * length * q, 6 * e * f
    layer = qkv + out + attention + mlp
    old = {"none": 0, "minimal": 0, "save_qkv_out_proj": attention + mlp, "save_qkv_proj": attention + out + mlp,
           "save_out_proj": qkv + attention + mlp, "full": layer}
    factors = estimate.remat_factors(cfg)
    assert {p: factors[p] for p in old} == {p: 1 + share / layer / 3 for p, share in old.items()}
    for p in remat.POLICIES:
        if p.offloads:
            like = remat.on_device(p).name
            assert factors[p.name] == factors[like] and traffic._sp_counts(p.name) == traffic._sp_counts(like)
            assert traffic._recompute_count(p.name) == traffic._recompute_count(like)


def test_xla_cpu_keeps_what_an_offload_policy_offloads_where_it_was():
    """JAX lowers the transfer to host as nothing on CPU: offload_full compiles to full's program, host buffers 0.
    The plan says so: the same device peak as full, no host bytes, and auto never takes an offload policy there."""
    stats = {}
    for policy in ("full", "offload_full"):
        cfg = tiny_config(f"remat_policy={policy}")
        stats[policy] = _compile(cfg).memory_analysis()
        assert stats[policy].host_temp_size_in_bytes == 0
    assert peak_bytes(stats["offload_full"]) == peak_bytes(stats["full"])
    offload, full = (estimate.make_plan(tiny_config(f"remat_policy={p}")) for p in ("offload_full", "full"))
    assert offload.peak_bytes == full.peak_bytes and offload.host_bytes == full.host_bytes == 0
    assert "xla:cpu keeps what offload_full offloads on the device, as full" in format_plan(offload)
    assert memory.policies("xla:cpu") == ("none", "minimal", "save_qkv_out_proj", "save_qkv_proj", "save_out_proj",
                                          "full")
    assert tuple(fit.peaks_by_policy(tiny_config())) == memory.policies("xla:cpu")
    assert tiny_config("remat_policy=auto", "device_memory_gb=1e-4").remat_policy == "full"  # nothing fits


def test_the_plan_counts_host_bytes_apart_from_the_device_peak():
    """On a TPU target offload_full keeps no layer input on the device (full's `saved`) but the same bytes in host
    memory, reported beside the peak, in the printout and the JSON."""
    plans = {p: estimate.make_plan(load_for_target([*PRESET, f"remat_policy={p}"], V5E_8), V5E_8)
             for p in ("full", "offload_full", "offload_qkv_proj")}
    full, offload = plans["full"], plans["offload_full"]
    layer_inputs = 12 * 2 * 2048 * 768 * 2  # layers x sequences x length x embed x bfloat16, per chip
    assert full.activation_terms.saved == offload.host_bytes == layer_inputs and full.host_bytes == 0
    assert offload.activation_terms.saved == 0 and offload.peak_bytes < full.peak_bytes
    padded = 16 * 128  # q, k, v [.., 12 heads, 64] as XLA:TPU stores them (fitted.FITTED; no LoRA adapter)
    assert plans["offload_qkv_proj"].host_bytes == 12 * 2 * 2048 * (768 + 3 * padded) * 2
    # with LoRA adapters on q, k and v their heads are not padded to the tile's rows: [.., 12, 128] (widths.py)
    lora = load_for_target([*PRESET, "remat_policy=offload_qkv_proj", "lora_rank=8"], V5E_8)
    assert estimate.make_plan(lora, V5E_8).host_bytes == 12 * 2 * 2048 * (768 + 3 * 12 * 128) * 2
    text = format_plan(offload)
    assert "host memory         72.0 MiB  offload_full moves every layer's input there (not in the total)" in text
    as_json = plan_json(offload)
    assert as_json["bytes_per_device"]["host"] == layer_inputs
    assert json.loads(json.dumps(as_json))["bytes_per_device"]["peak"] == offload.peak_bytes


def test_auto_offloads_only_when_nothing_that_keeps_everything_on_the_device_fits():
    base = dataclasses.replace(load_for_target([*PRESET, "remat_policy=auto"], V5E_8), remat_policy="auto")
    peaks = fit.peaks_by_policy(base)
    assert set(peaks) == set(remat.NAMES)  # a TPU target runs every policy as written
    roomy = fit.decide(base, fit.Capacity(int(peaks["none"] / 0.9) + 1, "test"))
    assert roomy.policy in ("none", "minimal")
    between = (peaks["offload_full"] + min(peaks[p] for p in memory.policies("xla:cpu"))) / 2
    tight = fit.decide(base, fit.Capacity(int(between / 0.9), "test"))
    assert remat.policy(tight.policy).offloads and tight.fits
    nothing = fit.Capacity(int(peaks["offload_full"] / 0.9 / 2), "test")
    assert fit.decide(base, nothing, strict=False).policy == "offload_full"
    with pytest.raises(ConfigError, match="even remat_policy=offload_full needs"):
        fit.decide(base, nothing)


def _device(*kinds: str) -> types.SimpleNamespace:
    memories = [types.SimpleNamespace(kind=k) for k in kinds]
    return types.SimpleNamespace(platform="gpu", addressable_memories=lambda: memories)


def test_devices_without_host_memory_refuse_an_offload_policy_in_one_line():
    cfg = tiny_config("remat_policy=offload_qkv_proj")
    fit.check_host_memory(cfg, [_device("device", "pinned_host", "unpinned_host")])  # XLA:CPU's and GPUs' kinds
    fit.check_host_memory(tiny_config("remat_policy=full"), [_device("device")])  # nothing to offload
    with pytest.raises(ConfigError) as error:
        fit.check_host_memory(cfg, [_device("device")])
    message = str(error.value)
    assert "\n" not in message and message.startswith("remat_policy=offload_qkv_proj moves saved activations to "
                                                      "host memory ('pinned_host'), which the gpu devices here")
    assert message.endswith("use one of none, minimal, save_qkv_out_proj, save_qkv_proj, save_out_proj, full")


def test_an_offload_policy_needs_its_host_bytes_in_host_memory():
    """Host memory per device (hardware.interconnect: v5e 512 GiB per host of 8 chips) bounds what an offload policy
    may move there: auto passes over one whose host bytes do not fit, an explicit one is refused in one line."""
    explicit = load_for_target([*PRESET, "remat_policy=offload_qkv_proj"], V5E_8)
    assert run_target.target_capacity(explicit, V5E_8).host == 64 * 2**30
    host = estimate.make_plan(explicit, V5E_8).host_bytes
    peaks = fit.peaks_by_policy(explicit)
    room = fit.Capacity(int(peaks["offload_full"] / 0.9 * 1.05), "test", host=int(host / 0.9 / 2))
    with pytest.raises(ConfigError) as error:
        fit.decide(explicit, room)
    assert str(error.value).startswith(f"remat_policy=offload_qkv_proj moves {format_bytes(host)} per device to host "
                                       "memory, ") and "\n" not in str(error.value)
    fits, line = fit.verdict(explicit, room)
    assert not fits and line.startswith("fit: no, ") and "of host memory usable per device" in line
    assert fit.decide(dataclasses.replace(explicit, remat_policy="auto"), room).policy == "offload_full"


def test_the_layout_search_turns_to_offload_policies_only_when_nothing_else_fits():
    """The search's last pass (maxshard/run/search.py): with room for a policy that keeps everything on the device it
    suggests none that offloads; with room only below every such policy's peak it runs the offload policies and
    suggests them. The mesh is pinned on the command line, so each pass plans a handful of layouts."""
    pinned = [*PRESET, "ici_fsdp_parallelism=8", "ici_data_parallelism=1", "ici_tensor_parallelism=1",
              "ici_sequence_parallelism=1", "ici_context_parallelism=1", "ici_tensor_sequence_parallelism=1",
              "ici_pipeline_parallelism=1"]
    peaks = fit.peaks_by_policy(load_for_target([*pinned, "remat_policy=auto"], V5E_8))
    on_device = min(peak for name, peak in peaks.items() if not remat.policy(name).offloads)
    hbm = search.capacity_bytes(V5E_8, headroom=0.0)

    roomy = search.search(pinned, V5E_8, headroom=0.1)
    assert roomy.fitting and not any(remat.policy(c.layout.remat_policy).offloads for c in roomy.fitting)

    between = (peaks["offload_full"] + on_device) / 2
    tight = search.search(pinned, V5E_8, headroom=1 - between / hbm)
    assert tight.fitting and all(remat.policy(c.layout.remat_policy).offloads for c in tight.fitting)
    assert {c.layout.remat_policy for c in tight.fitting} >= {"offload_full"}
    assert all(c.plan.host_bytes > 0 and c.peak <= tight.capacity for c in tight.fitting)
