"""Gemma 4's layer pieces at the model's seams: KV-shared layers, per-layer input embeddings, the value norm, the
fixed layer scalar, proportional RoPE and the global layers' own head shape (their numbers against transformers:
tests/test_convert_gemma4.py).

A tiny model of them (`GEMMA4`: 3 units of a sliding and a full layer, the full layers' heads twice as wide and
half as many key/value heads and their values from the key projection, the last unit reusing the keys and values
of the unit before it, its MLPs twice as wide) has one device's loss and gradients under fsdp x tensor, context x
fsdp and sequence x fsdp on a packed batch, and unrolled as scanned; the shared layers hold no key/value parameters
and no cache; the FLOP inventory is the real model's kernels; the keys refuse what they cannot mean in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
from flax import traverse_util
import flax.linen as nn

from maxshard.errors import ConfigError
from maxshard.model import flops as model_flops
from maxshard.model import transformer as model
from maxshard.model.layers import rope
from maxshard.spec import blocks
from tests.helpers import max_relative_difference, tiny_config
from tests.test_pipeline import TOLERANCE, loss_and_grads, one_device_run

GEMMA4 = ("num_layers=6", "layer_types=" + ",".join(["sliding_attention", "full_attention"] * 3), "sliding_window=8",
          "kv_shared_layers=2", "per_layer_input_dim=32", "value_norm=true", "layer_scalar=true", "qk_norm=true",
          "post_norms=true", "embed_scale=true", "rope_proportion=0.5",
          "rope_local_max_timescale=10000", "rope_max_timescale=1000000", "mlp_activation=gelu_tanh",
          "global_head_dim=16", "global_num_kv_heads=4", "kv_shared_mlp_dim=256", "global_values_from_keys=true",
          "attention=dot_product")


@pytest.fixture(scope="module")
def one_device():
    return one_device_run(*GEMMA4, adjust=with_unit_scalars)


def with_unit_scalars(params: dict) -> dict:
    """params with each layer scalar 1 + its draw (random_params draws it as a kernel, near 0, which would shrink
    the stream by ~10x a layer and leave the norms dividing rounding by nothing)."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: v + 1.0 if k[-1] == "layer_scalar" else v for k, v in flat.items()})


@pytest.mark.parametrize("layout", [
    ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
    ("ici_context_parallelism=2", "ici_fsdp_parallelism=4", "attention=blockwise"),
    ("ici_sequence_parallelism=2", "ici_fsdp_parallelism=4"),
])
def test_the_gemma4_layers_under_a_layout_give_one_devices_loss_and_gradients(one_device, layout) -> None:
    _, params, batch, ref_loss, ref_grads = one_device
    loss, grads = loss_and_grads(tiny_config(*GEMMA4, *layout), params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert max_relative_difference(grads, ref_grads) < TOLERANCE


def test_unrolled_layers_equal_scanned_and_the_shared_ones_get_the_keys_gradient(one_device) -> None:
    """scan_layers=false runs the same stacks unrolled: the same loss and gradients. The layers whose keys and
    values the shared layers reuse get gradient through them: their key projection's differs from what it is when
    the shared layers' attention is cut off from them (the loss without them)."""
    cfg, params, batch, ref_loss, ref_grads = one_device
    unrolled = tiny_config(*GEMMA4, "scan_layers=false", num_devices=1)
    flat = traverse_util.flatten_dict(params)
    unstacked = {}
    for path, leaf in flat.items():
        if path[0] == "decoder":
            stack = blocks.stack_named(cfg.model, path[1])
            for i in range(stack.repeats):
                unstacked[(path[0], f"{path[1]}_{i}", *path[2:])] = leaf[i]
        else:
            unstacked[path] = leaf
    loss, grads = loss_and_grads(unrolled, traverse_util.unflatten_dict(unstacked), batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    key = ref_grads["decoder"]["kv_layers"]["layer_1"]["attention"]["key"]["kernel"]
    np.testing.assert_allclose(grads["decoder"]["kv_layers_0"]["layer_1"]["attention"]["key"]["kernel"], key[0],
                               rtol=0, atol=TOLERANCE * np.abs(key).max())
    assert np.abs(key).max() > 0


def test_shared_layers_have_no_key_value_parameters_or_cache(one_device) -> None:
    cfg = one_device[0].model
    assert [(s.name, s.repeats, s.gives_kv, s.reuses_kv) for s in blocks.stacks(cfg)] == [
        ("layers", 1, False, False), ("kv_layers", 1, True, False), ("shared_layers", 1, False, True)]
    shared = one_device[1]["decoder"]["shared_layers"]
    for layer in ("layer_0", "layer_1"):
        assert sorted(shared[layer]["attention"]) == ["out", "query", "query_norm"]
    own = one_device[1]["decoder"]["kv_layers"]  # [repeats, embed, kv heads, head width]: the global layer's own
    assert [own[f"layer_{i}"]["attention"]["key"]["kernel"].shape[-2:] for i in (0, 1)] == [(8, 8), (4, 16)]
    assert "value" in own["layer_0"]["attention"] and "value" not in own["layer_1"]["attention"]  # values from keys
    assert shared["layer_1"]["attention"]["query"]["kernel"].shape[-2:] == (8, 16)
    wide, plain = (stack["layer_0"]["mlp"]["wo"]["kernel"].shape[-2] for stack in (shared, own))
    assert (wide, plain) == (256, 128)  # the shared layers' MLP, kv_shared_mlp_dim
    params = model.abstract_params(cfg)
    cache = model.abstract_cache(cfg, params, batch=2, length=16)
    assert sorted(cache["decoder"]) == ["kv_layers", "layers"]


def test_matmul_params_are_the_kernels_of_the_real_model(one_device) -> None:
    """The FLOP inventory (model/flops.py) counts every kernel a token meets: the shared layers' queries and
    outputs only, each layer's per-layer gate and projection and the embedded tokens' projection; the rest of the
    tree is embeddings, norm scales and the layer scalars."""
    cfg = one_device[0].model
    flat = traverse_util.flatten_dict(nn.unbox(model.abstract_params(cfg)))
    lookups = sum(int(np.prod(v.shape)) for k, v in flat.items() if k[-1] in ("embedding", "scale", "layer_scalar"))
    assert model.param_count(cfg) == model_flops.matmul_params(cfg) + lookups


def test_proportional_rope_turns_the_first_share_of_the_pairs_at_whole_head_frequencies(one_device) -> None:
    """In the global layers, at their own head width (global_head_dim=16, the local layers' 8)."""
    cfg = blocks.layer_config(one_device[0].model, blocks.layers(one_device[0].model)[1])
    assert (cfg.head_dim, cfg.num_kv_heads) == (16, 4)
    freqs = rope.frequencies_for(cfg)
    half = cfg.head_dim // 2
    np.testing.assert_allclose(freqs[:half // 2], rope.inverse_frequencies(cfg.head_dim, 1e6)[:half // 2])
    assert np.all(freqs[half // 2:] == 0)


@pytest.mark.parametrize("keys,message", [
    (("kv_shared_layers=3",), "kv_shared_layers=3 must leave"),
    (("kv_shared_layers=6",), "kv_shared_layers=6 must leave"),
    (("num_experts=4",), "runs with dense layers"),
    (("per_layer_vocab_size=100000",), r"per_layer_vocab_size in \[0, vocab_size"),
    (("rope_proportion=1.5",), r"rope_proportion must be in \(0, 1\]"),
    (("kv_shared_layers=0", "kv_shared_mlp_dim=64"), "kv_shared_mlp_dim=64 widens"),
    (("rope_proportion=0.5", "partial_rotary_factor=0.5"), "set partial_rotary_factor=1"),
    (("mtp_depth=1", "kv_shared_layers=0", "kv_shared_mlp_dim=0"), "per_layer_input_dim=32 with mtp_depth=1"),
])
def test_the_gemma4_keys_refuse_what_they_cannot_mean_in_one_line(keys, message) -> None:
    with pytest.raises(ConfigError, match=message):
        tiny_config(*GEMMA4, *keys, num_devices=1)


@pytest.mark.parametrize("tied", [("kv_shared_layers=2",), ("kv_shared_layers=0", "kv_shared_mlp_dim=0")])
def test_a_pipeline_is_refused_in_one_line(tied) -> None:
    with pytest.raises(ConfigError, match="pipeline parallelism with (kv_shared_layers=2|per_layer_input_dim=32)"):
        tiny_config(*GEMMA4, *tied, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4")
