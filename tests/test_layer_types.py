"""The per-layer seam (spec/mixer_kinds.py, `layer_types`): each layer's token mixer is a row, the decoder builds the
row's module, the stacks repeat the shortest unit, and what the rest of the code reads about a kind (its FLOPs,
LoRA widths, remat names) is the row's. Without layer_types every model is what it was: the same stacks and
parameter paths. Traces and abstract shapes only: nothing here compiles a step.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

from maxshard import config
from maxshard.errors import ConfigError
from maxshard.model import flops, transformer
from maxshard.model.layers.decoder import DecoderLayer, mixer_module
from maxshard.spec import blocks, mixer_kinds
from maxshard.spec.blocks import Layer, Stack
from maxshard.spec.model_config import ModelConfig

SMALL = dict(vocab_size=8, emb_dim=16, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32, max_target_length=16,
             linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
             delta_chunk_size=8)
HYBRID = ("linear_attention",) * 3 + ("full_attention",)  # Qwen3-Next's unit: three DeltaNet layers, one attention


def _paths(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    flat = jax.tree_util.tree_flatten_with_path(nn.unbox(transformer.abstract_params(cfg)))[0]
    return {jax.tree_util.keystr(path): leaf.shape for path, leaf in flat}


def test_layer_types_make_the_repeating_unit_of_a_hybrid() -> None:
    """Qwen3-Next (48 layers, 3:1, MoE in every layer): 12 scanned units of 4; a list that repeats with a tail left
    over (Gemma 3's shape in HF spelling) gives the same stacks as its attention_pattern."""
    qwen3_next = ModelConfig(**SMALL, num_layers=48, num_experts=4, layer_types=HYBRID * 12)
    delta, full = Layer("gated_deltanet", "moe"), Layer("gqa", "moe")
    assert blocks.stacks(qwen3_next) == (Stack("layers", (delta,) * 3 + (full,), 12),)
    assert qwen3_next.num_units == 12 and qwen3_next.num_moe_layers == 48
    local = ("sliding_attention",) * 5 + ("full_attention",)
    gemma = ModelConfig(**SMALL, num_layers=8, sliding_window=4, layer_types=(local * 2)[:8])
    pattern = ModelConfig(**SMALL, num_layers=8, sliding_window=4, attention_pattern=("local",) * 5 + ("global",))
    assert blocks.stacks(gemma) == blocks.stacks(pattern)
    assert [s.name for s in blocks.stacks(gemma)] == ["layers", "last_layers"] and gemma.num_units == 1
    irregular = ModelConfig(**SMALL, num_layers=3, layer_types=("linear_attention", "full_attention", "full_attention"))
    assert blocks.stacks(irregular) == (Stack("layers", (Layer("gated_deltanet", "dense"), Layer("gqa", "dense"),
                                                         Layer("gqa", "dense")), 1),)


@pytest.mark.parametrize("keys", [dict(), dict(num_experts=4, moe_layer_interval=2),
                                  dict(sliding_window=4, attention_pattern=("local", "global"))],
                         ids=["llama", "moe_every_2nd", "local_global"])
def test_layer_types_of_todays_kinds_keep_the_parameter_paths(keys) -> None:
    """A checkpoint written before layer_types loads unchanged: the list that says what attention_type and the
    pattern say builds the same stacks and the same parameter tree."""
    before = ModelConfig(**SMALL, num_layers=4, **keys)
    spelled = tuple("sliding_attention" if layer.local else "full_attention" for layer in blocks.layers(before))
    after = ModelConfig(**{**SMALL, **keys, "attention_pattern": ("global",)}, num_layers=4, layer_types=spelled)
    assert blocks.stacks(after) == blocks.stacks(before)
    assert _paths(after) == _paths(before)


def test_the_hybrids_parameters_live_under_each_rows_scope_and_its_flops_are_the_rows() -> None:
    """Gated DeltaNet's parameters sit under "linear_attention" (its row's scope), attention's under "attention";
    the FLOP inventory counts exactly the kernels the model holds, LoRA's count exactly the adapters it holds, and
    the length-dependent FLOPs are attention's alone (DeltaNet's per token do not grow with the sequence)."""
    cfg = ModelConfig(**SMALL, num_layers=4, layer_types=HYBRID, lora_rank=2, lora_targets=("q", "k", "v", "o", "up"))
    paths = _paths(cfg)
    assert "['decoder']['layers']['layer_0']['linear_attention']['query']['kernel']" in paths
    assert "['decoder']['layers']['layer_3']['attention']['query']['kernel']" in paths
    not_matmuls = ("embedding", "scale", "conv", "A_log", "dt_bias", "lora_")
    kernels = sum(math.prod(s) for p, s in paths.items() if not any(n in p for n in not_matmuls))
    assert flops.matmul_params(cfg) == kernels
    assert flops.lora_matmul_params(cfg) == sum(math.prod(s) for p, s in paths.items() if "lora_" in p)
    longer = ModelConfig(**{**SMALL, "max_target_length": 32}, num_layers=4, layer_types=HYBRID, lora_rank=2)
    attention = mixer_kinds.kind("gqa").flops
    assert flops.attention_flops(longer) - flops.attention_flops(cfg) == round(attention(longer, 0) - attention(cfg, 0))
    assert mixer_kinds.kind("gated_deltanet").flops(cfg, 0) > 0


@pytest.mark.parametrize("row", mixer_kinds.KINDS, ids=lambda row: row.name)
def test_each_rows_module_names_the_remat_names_its_row_declares(row) -> None:
    """The checkpoint names one layer of the row's kind gives (what the remat policies keep) are its row's."""
    cfg = ModelConfig(**SMALL, num_layers=1, attention_type="mla" if row.name == "mla" else "gqa",
                      layer_types=(row.name,), kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    assert blocks.layers(cfg)[0].mixer is row and issubclass(mixer_module(row), nn.Module)
    layer = DecoderLayer(cfg, jnp.float32, jnp.float32)
    x, ids = jnp.zeros((1, 16, 16)), jnp.ones((1, 16), jnp.int32)
    params = jax.eval_shape(layer.init, jax.random.key(0), x, ids, ids)
    assert set(nn.unbox(params)["params"]) >= {row.scope, "mlp"}
    jaxpr = jax.make_jaxpr(lambda p: layer.apply(p, x, ids, ids))(params)
    assert _names(jaxpr.jaxpr) - {"layer_input"} == set(row.remat_names)


def _names(jaxpr) -> set[str]:
    """The `checkpoint_name`s in a jaxpr and its sub-jaxprs."""
    found = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            found.add(eqn.params["name"])
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", None)
            if inner is not None:
                found |= _names(getattr(inner, "jaxpr", inner))
    return found


HYBRID_KEYS = ["num_layers=4", f"layer_types={','.join(HYBRID)}"]


@pytest.mark.parametrize("keys, message", [
    (["num_layers=3", f"layer_types={','.join(HYBRID)}"], "layer_types has 4 entries and num_layers=3: one a layer, "
                                                          "each one of full_attention, sliding_attention, "
                                                          "chunked_attention, gqa,"),
    (["num_layers=2", "layer_types=full_attention,windowed_attention"],
     "layer_types[1]='windowed_attention': expected one of full_attention, sliding_attention, chunked_attention, "
     "gqa, mla, linear_attention, gated_deltanet"),
    (["num_layers=2", "layer_types=mla,full_attention"], "layer_types[0]='mla' is mla attention with "
                                                         "attention_type=gqa: set attention_type=mla"),
    ([*HYBRID_KEYS, "attention_pattern=local,global", "sliding_window=4"], "attention_pattern=['local', 'global'] "
                                                                            "with layer_types: layer_types says"),
    (["num_layers=2", "layer_types=sliding_attention,full_attention"], "layer_types[0]='sliding_attention' needs "
                                                                       "sliding_window > 0"),
])
def test_a_layer_types_mistake_is_one_line_naming_the_key(keys, message) -> None:
    with pytest.raises(ConfigError) as e:
        config.load(["configs/base.yml", "dataset_type=synthetic", *keys], num_devices=1)
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_registered_row_is_refused_a_name_another_row_has() -> None:
    row = mixer_kinds.kind("gated_deltanet")
    with pytest.raises(ValueError, match="linear_attention already name a row"):
        mixer_kinds.register(mixer_kinds.Mixer("other", row.module, "x", "kv", row.params, row.flops, "",
                                               hf=("linear_attention",)))
    with pytest.raises(ValueError, match="built in"):
        mixer_kinds.unregister("gqa")
