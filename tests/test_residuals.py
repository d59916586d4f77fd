"""The layer options' residuals (maxshard/model/residuals.py): every ModelConfig field is classified, and the
classification is what tracing the layers shows; what qk_norm adds is what its norms keep. Traces only: nothing
is compiled or computed.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import pytest

from maxshard.model import residuals
from maxshard.spec.model_config import ModelConfig

TINY = dict(vocab_size=8, emb_dim=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64, max_target_length=16,
            remat_policy="none")
MOE = {"num_experts": 4, "num_experts_per_tok": 2}
LLAMA3 = {"rope_scaling_type": "llama3"}
MLA = {"attention_type": "mla"}
YARN = {"rope_scaling_type": "yarn"}
HYBRID = {"layer_types": ("linear_attention", "full_attention") * 2}

# Every field that is not COUNTED: (what it needs besides TINY, a value other than its default). A field added to
# ModelConfig fails test_every_field_is_classified until it is named here, and the test below then says whether it
# changes what a layer keeps (an option, traced) or not (one of VALUES).
PROBES = {
    "qk_norm": ({}, True),
    "num_shared_experts": (MOE, 1),
    "moe_renormalize_top_k": (MOE, False),
    "moe_router": (MOE, "sigmoid"),
    "moe_n_group": (MOE, 2),
    "moe_topk_group": ({**MOE, "moe_n_group": 4, "num_experts": 8}, 2),
    "moe_router_bias": (MOE, True),
    "moe_routed_scaling_factor": (MOE, 2.5),
    "lora_rank": ({}, 4),
    "lora_targets": ({"lora_rank": 4}, ("gate",)),
    "norm_epsilon": ({}, 1e-5),
    "rope_max_timescale": ({}, 500000.0),
    "rope_scaling_type": ({}, "llama3"),
    "rope_scaling_factor": (LLAMA3, 4.0),
    "rope_low_freq_factor": (LLAMA3, 2.0),
    "rope_high_freq_factor": (LLAMA3, 8.0),
    "rope_original_max_position": (LLAMA3, 16),
    "lora_alpha": ({"lora_rank": 4}, 32.0),
    "attention_type": ({}, "mla"),
    "q_lora_rank": (MLA, 16),
    "kv_lora_rank": (MLA, 16),
    "qk_nope_head_dim": (MLA, 16),
    "qk_rope_head_dim": (MLA, 16),
    "v_head_dim": (MLA, 16),
    "yarn_beta_fast": (YARN, 16.0),
    "yarn_beta_slow": (YARN, 2.0),
    "yarn_mscale": ({**YARN, "yarn_mscale_all_dim": 1.0}, 0.707),
    "yarn_mscale_all_dim": (YARN, 1.0),
    "yarn_truncate": (YARN, False),
    "moe_routed_scaling_factor": (MOE, 2.5),
    "rope_local_max_timescale": ({"sliding_window": 4, "attention_pattern": ("local",)}, 10000.0),
    "attn_logit_softcapping": ({}, 50.0),
    "final_logit_softcapping": ({}, 30.0),
    "query_pre_attn_scalar": ({}, 64.0),
    "attention_sinks": ({}, True),
    "attention_bias": ({}, True),
    "qkv_bias": ({}, True),
    "norm_unit_offset": ({}, True),
    "post_norms": ({}, True),
    "pre_norms": ({"post_norms": True}, False),  # OLMo 3: the norms before attention and the MLP, and what they keep
    "qk_norm_all_heads": ({"qk_norm": True}, True),  # one norm's statistics over all heads instead of one a head
    "mlp_activation": ({}, "gelu_tanh"),
    "swiglu_limit": ({"mlp_activation": "clamped_swiglu"}, 5.0),
    "swiglu_alpha": ({"mlp_activation": "clamped_swiglu"}, 1.5),
    "embed_scale": ({}, True),
    "moe_bias": (MOE, True),
    "mtp_depth": ({}, 1),
    "layer_types": ({}, ("linear_attention", "full_attention") * 2),  # gated DeltaNet's layers keep their own
    "attention_output_gate": ({}, True),  # the gate's half of the query projection and its sigmoid
    "partial_rotary_factor": ({}, 0.5),  # the rotated part and the part passed through
    "shared_expert_gate": ({**MOE, "num_shared_experts": 1}, True),
    # gated DeltaNet's widths, in a model that has its layers
    "linear_num_key_heads": (HYBRID, 2),
    "linear_num_value_heads": (HYBRID, 8),
    "linear_key_head_dim": (HYBRID, 16),
    "linear_value_head_dim": (HYBRID, 16),
    "linear_conv_kernel_dim": (HYBRID, 2),
    "delta_chunk_size": (HYBRID, 8),
    # Llama 4's: chunked local layers, NoPE layers and their temperature, the L2 q/k norm, the router on the input
    "attention_chunk_size": ({"layer_types": ("chunked_attention", "full_attention") * 2}, 4),
    "rope_layers": ({}, (1, 0, 1, 0)),
    "nope_temperature_scale": ({"rope_layers": (1, 0, 1, 0)}, 0.5),
    "nope_temperature_floor": ({"rope_layers": (1, 0, 1, 0), "nope_temperature_scale": 0.5}, 4),
    "qk_l2_norm": ({}, True),
    "moe_weights_on_input": ({**MOE, "num_experts_per_tok": 1}, True),
    "moe_beside_mlp": (MOE, True),  # Gemma 4: the dense MLP beside the experts, their norms, the router's norm
    # Gemma 4's: the value norm, each layer's per-layer input, its table's rows, the fixed scalar, proportional RoPE
    "value_norm": ({}, True),
    "per_layer_input_dim": ({}, 8),
    "per_layer_vocab_size": ({"per_layer_input_dim": 8}, 4),
    "layer_scalar": ({}, True),
    "rope_proportion": ({}, 0.5),
    "global_head_dim": ({"sliding_window": 4, "attention_pattern": ("local", "global")}, 16),
    "global_num_kv_heads": ({"sliding_window": 4, "attention_pattern": ("local", "global")}, 4),
    "global_values_from_keys": ({"sliding_window": 4, "attention_pattern": ("local", "global")}, True),
}


def test_every_field_is_classified() -> None:
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert residuals.COUNTED <= fields and residuals.VALUES <= fields
    assert not residuals.COUNTED & residuals.VALUES
    assert set(residuals.OPTIONS) == fields - residuals.COUNTED - residuals.VALUES
    unprobed = fields - residuals.COUNTED - set(PROBES)
    assert not unprobed, f"new ModelConfig fields {sorted(unprobed)}: give each a probe in tests/test_residuals.py"
    # an option is compared with its default: one without a plain default (MISSING, a default_factory) has none
    plain = {f.name for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
    assert set(residuals.OPTIONS) | residuals.VALUES <= plain


@pytest.mark.parametrize("name", sorted(PROBES))
def test_options_change_what_a_layer_keeps_and_values_do_not(name: str) -> None:
    needs, value = PROBES[name]
    base = ModelConfig(**TINY, **needs)
    probe = dataclasses.replace(base, **{name: value})
    changed = residuals.traced_bytes(probe) != residuals.traced_bytes(base)
    assert changed == (name in residuals.OPTIONS), (
        f"{name} {'changes' if changed else 'does not change'} what a layer keeps: it belongs "
        f"{'in OPTIONS (out of VALUES)' if changed else 'in VALUES'} of maxshard/model/residuals.py")


def test_qk_norm_adds_what_its_norms_keep() -> None:
    """Per normalised width W (Q or K) of n heads: the projection (the norm's input), x / rms and the scaled output
    (3W), the rsqrt and its product (2n), float32; under none only: minimal keeps matmul outputs, full the input."""
    for length in (16, 32):
        plain = ModelConfig(**{**TINY, "max_target_length": length})
        q, kv, heads, kv_heads = 32, 16, 4, 2
        assert residuals.option_bytes(dataclasses.replace(plain, qk_norm=True)) == 4 * (3 * (q + kv)
                                                                                      + 2 * (heads + kv_heads))
    for policy in ("minimal", "save_qkv_out_proj", "full"):
        assert residuals.option_bytes(ModelConfig(**{**TINY, "remat_policy": policy}, qk_norm=True)) == 0


def test_options_at_their_defaults_trace_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object) -> None:
        raise AssertionError("traced")

    monkeypatch.setattr(residuals, "saved_residuals", refuse)
    model = ModelConfig(**TINY, norm_epsilon=1e-5, **LLAMA3)  # values other than their defaults: no option
    assert residuals.at_defaults(model) and residuals.option_bytes(model) == 0
    assert not residuals.at_defaults(dataclasses.replace(model, qk_norm=True))


def test_the_trace_ignores_the_callers_mesh_and_rules() -> None:
    """Planned from inside a run's layout (mesh and logical rules in context), the options add what they add
    outside it: the trace runs the whole-array layers either way, so a cached answer fits every caller."""
    model = ModelConfig(**{**TINY, "qk_norm": True})
    residuals._sequence_bytes.cache_clear()
    mesh = jax.sharding.Mesh(jax.devices()[:2], ("tensor",))
    with jax.set_mesh(mesh), nn.logical_axis_rules((("heads", "tensor"), ("activation_heads", "tensor"))):
        inside = residuals.option_bytes(model)
    residuals._sequence_bytes.cache_clear()
    assert inside == residuals.option_bytes(model) > 0
