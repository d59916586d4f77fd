"""Logical axis rules -> PartitionSpecs and shardings, on a small Linen module of this file's own.

The module has the shapes of an MLP block: W_in [embed=64, mlp=256], W_out [mlp, embed] and a norm scale [embed].
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from maxshard import config
from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.parallel import axis_names as ax
from maxshard.parallel import mesh, sharding
from maxshard.planning.axes import rule_axes

BASE = str(Path(__file__).resolve().parent.parent / "configs" / "base.yml")
D, F = 64, 256  # embed, mlp


class Block(nn.Module):
    """x [batch, embed] -> x + W_out(relu(W_in(norm * x)))."""

    embed: int = D
    mlp: int = F

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        normal = nn.initializers.normal(0.02)
        w_in = self.param("w_in", nn.with_logical_partitioning(normal, ("embed", "mlp")), (self.embed, self.mlp))
        w_out = self.param("w_out", nn.with_logical_partitioning(normal, ("mlp", "embed")), (self.mlp, self.embed))
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("norm",)), (self.embed,))
        h = sharding.constrain(jax.nn.relu((x * scale) @ w_in), ("activation_batch", "activation_mlp"))
        return x + h @ w_out


def abstract_block(module: nn.Module | None = None) -> dict:
    module = module or Block()
    return jax.eval_shape(module.init, jax.random.key(0), jnp.zeros((8, module.embed)))


def setup(*overrides: str) -> tuple[Config, dict[str, int], sharding.FlaxRules]:
    cfg = config.load([BASE, *overrides], num_devices=8)
    return cfg, mesh.axis_sizes(cfg), sharding.flax_rules(cfg)


def layouts(*overrides: str, module: nn.Module | None = None) -> Mapping[str, sharding.ParamLayout]:
    _, sizes, rules = setup(*overrides)
    return {row.name: row for row in sharding.layout(abstract_block(module), rules, sizes)}


def split(entry: str | tuple[str, ...] | None) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else entry


# --------------------------------------------------------------------------------------------- rules -> specs


def test_flax_rules_turn_empty_axes_into_none() -> None:
    cfg, _, rules = setup()
    assert len(rules) == len(cfg.logical_axis_rules)
    assert ("norm", None) in rules and ("kv", None) in rules
    assert ("layers", ("stage",)) in rules


def test_embed_sharded_over_fsdp_and_sequence() -> None:
    rows = layouts("ici_fsdp_parallelism=4", "ici_sequence_parallelism=2")
    w_in = rows["params/w_in"]
    assert w_in.spec[0] == ("fsdp", "sequence", "context", "expert")  # mlp took fsdp_transpose first (table order)
    assert w_in.global_shape == (D, F) and w_in.local_shape == (D // 8, F)
    assert (w_in.replication, w_in.bytes_per_device) == (1, D // 8 * F * 4)
    w_out = rows["params/w_out"]
    assert w_out.local_shape == (F, D // 8) and w_out.replication == 1
    scale = rows["params/scale"]
    assert scale.spec == P(None) and scale.local_shape == (D,) and scale.replication == 8


def test_fallback_embed_rule_when_mlp_holds_fsdp_transpose() -> None:
    rows = layouts("ici_fsdp_parallelism=4", "ici_fsdp_transpose_parallelism=2")
    w_out = rows["params/w_out"]  # ("mlp", "embed")
    assert split(w_out.spec[0])[0] == "fsdp_transpose"
    assert w_out.spec[1] == ("fsdp", "sequence", "context", "expert")  # the second embed rule: the first needs fsdp_transpose
    assert w_out.local_shape == (F // 2, D // 4) and w_out.replication == 1


def test_first_embed_rule_when_its_axes_are_free() -> None:
    _, sizes, rules = setup("ici_fsdp_parallelism=4", "ici_fsdp_transpose_parallelism=2")
    spec = sharding.logical_to_spec(("embed",), rules, sizes, (D,), "bias")
    assert spec == P(("fsdp", "fsdp_transpose", "sequence", "context", "expert"))


def test_rule_order_decides_and_a_mesh_axis_is_used_once() -> None:
    rules = (("a", "x"), ("b", "x"), ("b", "y"))
    assert sharding.logical_to_spec(("a", "b"), rules) == P("x", "y")
    assert sharding.logical_to_spec(("b", "a"), rules) == P("y", "x")  # table order decides, not array order
    assert sharding.logical_to_spec((None, "b"), rules) == P(None, "x")


def test_mesh_axes_of_a_name_depend_on_its_array() -> None:
    rules = (("length", ("y",)), ("heads", ("x", "y")), ("heads", "x"), ("kv", None))
    assert sharding.mesh_axes(("heads", "kv"), rules) == (("x", "y"), ())  # alone: the first rule applies
    assert sharding.mesh_axes(("length", "heads", "kv"), rules) == (("y",), ("x",), ())  # y taken: the fallback
    assert sharding.axes_of("heads", ("length", "heads"), rules) == ("x",)
    assert sharding.mesh_axes(("heads",), rules, {"x": 1, "y": 4}) == (("y",),)  # size-1 axes left out
    assert sharding.partition_spec(sharding.mesh_axes(("length", "kv", "heads"), rules)) == P("y", None, "x")


def test_unknown_logical_name_is_a_config_error_naming_it() -> None:
    _, sizes, rules = setup()
    with pytest.raises(ConfigError, match=r"w_x: logical axis 'embedd' has no rule in logical_axis_rules"):
        sharding.logical_to_spec(("embedd", "mlp"), rules, sizes, (D, F), "w_x")


def test_logical_name_twice_in_one_array_is_a_config_error() -> None:
    _, sizes, rules = setup()
    with pytest.raises(ConfigError, match=r"^w_sq: .*embed"):
        sharding.logical_to_spec(("embed", "embed"), rules, sizes, (D, D), "w_sq")


def test_non_dividing_dimension_names_param_dim_size_and_axes() -> None:
    with pytest.raises(ConfigError) as info:
        layouts("ici_fsdp_parallelism=1", "ici_tensor_parallelism=8", module=Block(embed=64, mlp=36))
    message = str(info.value)
    assert message.startswith("params/w_in: dimension 1 (mlp) of size 36 is not divisible by 8")
    assert "tensor=8" in message


def test_unboxed_leaves_are_replicated() -> None:
    _, sizes, rules = setup()
    tree = {"count": jax.ShapeDtypeStruct((), jnp.int32), "table": jax.ShapeDtypeStruct((4, 3), jnp.float32)}
    rows = {r.name: r for r in sharding.layout(tree, rules, sizes)}
    assert rows["table"].replication == 8 and rows["table"].local_shape == (4, 3)
    assert sharding.tree_specs(tree, rules, sizes) == {"count": P(), "table": P()}


# --------------------------------------------------------------------------------------------- on the mesh


def test_tree_shardings_place_a_jitted_init() -> None:
    cfg, _, rules = setup("ici_tensor_parallelism=2")  # fsdp=4 x tensor=2
    m = mesh.build(cfg)
    module, x = Block(), jnp.ones((8, D))
    abstract = jax.eval_shape(module.init, jax.random.key(0), x)
    shardings = sharding.tree_shardings(abstract, m, rules)
    init = jax.jit(lambda key: nn.unbox(module.init(key, x)), out_shardings=shardings)
    with jax.set_mesh(m), nn.logical_axis_rules(rules):
        params = init(jax.random.key(0))["params"]
    w_in, w_out, scale = params["w_in"], params["w_out"], params["scale"]
    assert split(w_in.sharding.spec[0])[0] == "fsdp" and "tensor" in split(w_in.sharding.spec[1])
    assert {s.data.shape for s in w_in.addressable_shards} == {(D // 4, F // 2)}
    assert {s.data.shape for s in w_out.addressable_shards} == {(F // 2, D // 4)}
    assert {s.data.shape for s in scale.addressable_shards} == {(D,)} and len(scale.addressable_shards) == 8
    blocks = {tuple((i.start, i.stop) for i in s.index) for s in w_in.addressable_shards}
    assert len(blocks) == 8  # every device holds a different block
    np.testing.assert_allclose(scale, 1.0)


def test_constrain_refuses_an_unknown_name_inside_rules() -> None:
    cfg, _, rules = setup()
    m = mesh.build(cfg)
    with jax.set_mesh(m), nn.logical_axis_rules(rules):
        with pytest.raises(ConfigError, match="activation logical axis 'activation_bach' has no rule"):
            jax.jit(lambda x: sharding.constrain(x, ("activation_bach", None)))(jnp.ones((8, 4)))


def test_constrain_shards_an_activation() -> None:
    cfg, _, rules = setup("ici_tensor_parallelism=2")
    m = mesh.build(cfg)
    with jax.set_mesh(m), nn.logical_axis_rules(rules):
        y = jax.jit(lambda x: sharding.constrain(x * 2, ("activation_batch", "activation_mlp")))(jnp.ones((8, 4)))
    assert {s.data.shape for s in y.addressable_shards} == {(2, 2)}  # batch over fsdp=4, mlp over tensor=2


def test_planner_takes_the_rule_the_compiled_layout_takes() -> None:
    """A first activation_heads rule that wants `sequence`, which activation_length (earlier in the table) takes
    in the same array: Flax skips it for the next rule. The planner asks about the array, so it agrees with the
    compiled layout (heads 2 ways over tensor); asked alone, as it once did, the name gets sequence x tensor."""
    cfg, sizes, _ = setup("ici_fsdp_parallelism=2", "ici_sequence_parallelism=2", "ici_tensor_parallelism=2")
    at = next(i for i, (name, _) in enumerate(cfg.logical_axis_rules) if name == ax.ACT_HEADS)
    table = list(cfg.logical_axis_rules)
    table.insert(at, (ax.ACT_HEADS, ("sequence", "tensor")))
    cfg = dataclasses.replace(cfg, logical_axis_rules=tuple(table))
    rules = sharding.flax_rules(cfg)
    assert sharding.mesh_axes((ax.ACT_HEADS,), rules, sizes) == (("sequence", "tensor"),)
    assert rule_axes(cfg, ax.ACT_HEADS, sizes) == ("tensor",)
    with jax.set_mesh(mesh.build(cfg)), nn.logical_axis_rules(rules):
        q = jax.jit(lambda x: sharding.constrain(x * 2, ax.QUERY))(jnp.ones((8, 8, 4, 2)))  # [batch, length, heads, d]
    assert {s.data.shape for s in q.addressable_shards} == {(4, 4, 2, 2)}  # fsdp, sequence, tensor: 2 ways each


def test_constrain_without_rules_checks_nothing() -> None:
    x = jnp.arange(6.0).reshape(2, 3)  # outside nn.logical_axis_rules there is no table to check names against
    np.testing.assert_array_equal(sharding.constrain(x, ("no_such_name", None)), x)


def test_path_name() -> None:
    tree = {"params": {"decoder": [jnp.zeros(1)]}}
    (path, _), = jax.tree_util.tree_flatten_with_path(tree)[0]
    assert sharding.path_name(path) == "params/decoder/0"
