"""Gated DeltaNet with the sequence sharded (layers/delta_rule_context.py) equals one device.

The rule: `sharded_gated_delta_rule` on 8 simulated devices, the length over context = 4 (ring attention's balanced
order, two pieces a device), context = 2 x tensor = 2 (the heads split too), context = 2 x sequence = 2 and
sequence = 4 (token order, one piece a device), against `chunked_gated_delta_rule` on one device, both from a given
initial state: outputs, final state and the gradients of all five inputs within 1e-5 (float32), with one document
and with packed documents whose boundaries fall on a shard boundary, inside a shard, on a device's second piece, and
a segment id that returns after another (the conv compares ids, the rule adjacent tokens; both as one device does).
The conv: `sharded_causal_conv` equals `causal_conv` where a piece is shorter than the window (context = 8: two
tokens a piece, width 4), so a window reaches back two pieces. The layer: `GatedDeltaNet` on its balanced inputs
under context = 4 x fsdp = 2, output and parameter gradients within 1e-5 of one device. The model: a hybrid (a
DeltaNet layer, then an attention layer, from `layer_types`) under context = 4 x fsdp = 2 gives one device's loss
and gradients.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard.model.layers import delta_rule_context, ring_attention
from maxshard.model.layers.delta_rule import chunked_gated_delta_rule
from maxshard.model.layers.gated_deltanet import GatedDeltaNet, causal_conv
from maxshard.parallel import sharding
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import max_relative_difference, mesh_for, tiny_config
from tests.test_pipeline import loss_and_grads, packed_batch, random_params

TOLERANCE = 1e-5
BATCH, LENGTH, KEY_HEADS, VALUE_HEADS, DK, DV = 2, 32, 2, 4, 8, 8
# Under context = 4 a piece is 4 tokens (device c holds tokens 4c.. and 28-4c..): row 0's documents start at 8 (a
# piece's first token) and 13 (inside one), row 1's at 16 (device 3's second piece); row 1's id 1 returns at 28.
SEGMENTS = np.array([[1] * 8 + [2] * 5 + [3] * 19, [1] * 16 + [2] * 12 + [1] * 4], np.int32)
LAYOUTS = {
    "context4_fsdp2": ("ici_context_parallelism=4", "ici_fsdp_parallelism=2"),
    "context2_tensor2_fsdp2": ("ici_context_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"),
    "context2_sequence2_fsdp2": ("ici_context_parallelism=2", "ici_sequence_parallelism=2",
                                 "ici_fsdp_parallelism=2"),
    "sequence4_fsdp2": ("ici_sequence_parallelism=4", "ici_fsdp_parallelism=2"),
}


def _mesh_and_rules(*layout: str) -> tuple[jax.sharding.Mesh, sharding.FlaxRules]:
    cfg = tiny_config(*layout)
    return mesh_for(cfg), sharding.flax_rules(cfg)


def _rule_inputs() -> tuple[jax.Array, ...]:
    """q, k (L2-normalised), v, g (log decay), beta: float32, seeded."""
    rng = np.random.default_rng(0)
    q, k = (rng.normal(size=(BATCH, LENGTH, KEY_HEADS, DK)) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.normal(size=(BATCH, LENGTH, VALUE_HEADS, DV))
    g = -rng.uniform(0.01, 0.5, size=(BATCH, LENGTH, VALUE_HEADS))
    beta = rng.uniform(size=(BATCH, LENGTH, VALUE_HEADS))
    return tuple(jnp.asarray(x, jnp.float32) for x in (q, k, v, g, beta))


def _weights() -> tuple[jax.Array, jax.Array]:
    """Fixed cotangents of the outputs and the final state, so every output and state entry reaches the loss."""
    rng = np.random.default_rng(1)
    return (jnp.asarray(rng.normal(size=(BATCH, LENGTH, VALUE_HEADS, DV)), jnp.float32),
            jnp.asarray(rng.normal(size=(BATCH, VALUE_HEADS, DK, DV)), jnp.float32))


# an incoming state (a prefill's cache), continued by each row's first document
INITIAL = np.random.default_rng(4).normal(size=(BATCH, VALUE_HEADS, DK, DV)).astype(np.float32)


def _one_device_rule(q, k, v, g, beta, segments):
    return chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=4, segment_ids=segments, initial_state=INITIAL)


def _sharded_rule(q, k, v, g, beta, segments):
    """The sharded rule on token-order arrays: balanced (a no-op without context) in, back to token order out."""
    q, k, v, g, beta, segments = (ring_attention.to_balanced(x) for x in (q, k, v, g, beta, segments))
    out, state = delta_rule_context.sharded_gated_delta_rule(q, k, v, g, beta, chunk_size=4, segment_ids=segments,
                                                             initial_state=INITIAL)
    return ring_attention.from_balanced(out), state


def _results(rule, segments: jax.Array) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, ...]]:
    """(outputs and final state, gradients of the five inputs of a weighted sum of both), jitted."""
    w_out, w_state = _weights()

    def loss(*args):
        out, state = rule(*args, segments)
        return jnp.sum(out * w_out) + jnp.sum(state * w_state)

    args = _rule_inputs()
    return jax.jit(lambda *a: rule(*a, segments))(*args), jax.jit(jax.grad(loss, argnums=range(5)))(*args)


@functools.cache
def _reference(packed: bool):
    return _results(_one_device_rule, jnp.asarray(SEGMENTS if packed else np.zeros_like(SEGMENTS)))


# every layout with packed documents; one with a single document (no reset anywhere)
CASES = [(layout, True) for layout in sorted(LAYOUTS)] + [("context4_fsdp2", False)]


@pytest.mark.parametrize("layout, packed", CASES, ids=[f"{l}-{'packed' if p else 'one_document'}" for l, p in CASES])
def test_sharded_rule_equals_one_device(layout: str, packed: bool) -> None:
    segments = jnp.asarray(SEGMENTS if packed else np.zeros_like(SEGMENTS))
    mesh, rules = _mesh_and_rules(*LAYOUTS[layout])
    with mesh_context(mesh, rules):
        assert delta_rule_context.length_axes()  # the sharded path is the one under test
        (out, state), grads = _results(_sharded_rule, segments)
    (ref_out, ref_state), ref_grads = _reference(packed)
    assert max_relative_difference(out, ref_out) < TOLERANCE
    assert max_relative_difference(state, ref_state) < TOLERANCE
    for name, got, want in zip(("q", "k", "v", "g", "beta"), grads, ref_grads):
        assert max_relative_difference(got, want) < TOLERANCE, name


def test_piece_layout_follows_the_balanced_order() -> None:
    """context = 4 over 32 tokens: 8 pieces of 4, device c holding token chunks c and 7 - c."""
    piece, previous = delta_rule_context.piece_layout(32, 4, 4)
    assert piece == 4
    # pieces along the sharded array hold chunks 0, 7, 1, 6, 2, 5, 3, 4
    np.testing.assert_array_equal(previous, [-1, 3, 0, 5, 2, 7, 4, 6])
    piece, previous = delta_rule_context.piece_layout(32, 4, 1)  # token order (sequence = 4): one piece a device
    assert piece == 8
    np.testing.assert_array_equal(previous, [-1, 0, 1, 2])


def test_sharded_conv_reaches_back_over_pieces_shorter_than_its_window() -> None:
    """context = 8: pieces of 2 tokens, a window of 4 reads three inputs from the two pieces before."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.normal(size=(BATCH, LENGTH, VALUE_HEADS, DV)), jnp.float32)
    kernel = jnp.asarray(rng.normal(size=(4, VALUE_HEADS, DV)), jnp.float32)
    segments = jnp.asarray(SEGMENTS)
    history = jnp.zeros((BATCH, 3, VALUE_HEADS, DV), jnp.float32)
    want = jax.jit(lambda x: causal_conv(x, kernel, history, segments)[0])(x)
    mesh, rules = _mesh_and_rules("ici_context_parallelism=8", "ici_fsdp_parallelism=1")

    def sharded(x):
        conv = delta_rule_context.sharded_causal_conv
        out = conv(ring_attention.to_balanced(x), kernel, ring_attention.to_balanced(segments))
        return ring_attention.from_balanced(out)

    with mesh_context(mesh, rules):
        assert delta_rule_context.length_axes() == ("context",)
        got = jax.jit(sharded)(x)
    assert max_relative_difference(got, want) < TOLERANCE


# the hybrid's DeltaNet widths (tests/test_gated_deltanet.py's scale), chunks shorter than a device's piece
LAYER = ("emb_dim=32", "linear_num_key_heads=2", "linear_num_value_heads=4", "linear_key_head_dim=8",
         "linear_value_head_dim=8", "delta_chunk_size=2")


def _layer_loss(layer: GatedDeltaNet, x: jax.Array, segments: jax.Array, positions: jax.Array, w: jax.Array):
    """Loss of the layer on token-order inputs, balanced inside (as the model does), and its output."""

    def loss(params):
        args = (ring_attention.to_balanced(a) for a in (x, segments, positions))
        out = ring_attention.from_balanced(layer.apply({"params": params}, *args))
        return jnp.sum(out * w), out

    return loss


def test_layer_under_context_parallelism_equals_one_device() -> None:
    cfg = tiny_config(*LAYER, num_devices=1).model
    layer = GatedDeltaNet(cfg, jnp.float32, jnp.float32)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.normal(size=(BATCH, LENGTH, cfg.emb_dim)), jnp.float32)
    segments = jnp.asarray(SEGMENTS)
    positions = jnp.asarray(np.broadcast_to(np.arange(LENGTH), (BATCH, LENGTH)), jnp.int32)  # the layer reads none
    shapes = nn.unbox(jax.eval_shape(layer.init, jax.random.key(0), x, segments, positions)["params"])
    params = jax.tree.map(lambda p: jnp.asarray(rng.normal(0.0, 0.3, p.shape), jnp.float32), shapes)
    w = jnp.asarray(rng.normal(size=x.shape), jnp.float32)
    loss = _layer_loss(layer, x, segments, positions, w)
    (_, want), want_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    mesh, rules = _mesh_and_rules(*LAYOUTS["context4_fsdp2"], *LAYER)
    with mesh_context(mesh, rules):
        assert delta_rule_context.length_axes() == ("context",)
        (_, got), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    assert max_relative_difference(got, want) < TOLERANCE
    assert max_relative_difference(grads, want_grads) < TOLERANCE


# a hybrid read from `layer_types` at the tiny preset's widths: one DeltaNet layer, then one attention layer
HYBRID = ("emb_dim=64", "num_heads=4", "num_kv_heads=4", "head_dim=16", "mlp_dim=256", "num_layers=2",
          "layer_types=linear_attention,full_attention", "linear_num_key_heads=2", "linear_num_value_heads=4",
          "linear_key_head_dim=16", "linear_value_head_dim=16", "delta_chunk_size=2", "attention=dot_product")


def test_hybrid_model_under_context_parallelism_gives_one_devices_loss_and_gradients() -> None:
    """Packed rows (tests/test_pipeline.py's batch: a document boundary at a different place in every row, on and
    inside the 4-token pieces), float32, each gradient leaf within 1e-5 of its own largest value."""
    cfg = tiny_config(*HYBRID, num_devices=1)
    trainer = Trainer(cfg, mesh_for(cfg))
    params, batch = random_params(trainer), packed_batch(cfg, trainer.mesh)
    ref_loss, ref_grads = loss_and_grads(cfg, params, batch)
    loss, grads = loss_and_grads(tiny_config(*HYBRID, *LAYOUTS["context4_fsdp2"]), params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert max_relative_difference(grads, ref_grads) < TOLERANCE
    assert all(np.any(g) for g in jax.tree.leaves(ref_grads["decoder"]["layers"]["layer_0"]["linear_attention"]))
