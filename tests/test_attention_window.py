"""Sliding windows, attention-logit soft-capping and attention sinks in every attention kernel, against the
dot-product reference (layers/attention_ops.py `dot_product`), with packed documents and grouped-query heads.

One device: blockwise (window, soft-cap, sinks; forward and its custom VJP, including the sinks' gradient), the cudnn
mapping through XLA (window), tokamax's XLA path (window, soft-cap), splash in Pallas interpret mode (window, soft-cap,
sinks), and splash compiled for a v5e chip ahead of time. Eight simulated devices: ring attention under 4 context
shards, where a window shorter than a chunk skips a ring step whole; splash under fsdp x tensor, each device's heads
and sinks under shard_map; and the tiny model with a local layer (window, soft-cap, sinks from the model keys) under
context x tensor x fsdp against dot_product on one device. What a kernel cannot take is refused in one line, and
`attention: auto` / an explicit choice follow the model's options at load time. Marked gpu/tpu (skipped in CI): the
fused kernels themselves with their options. Tolerance 1e-5 relative (float32): the same sums in another order.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard.spec import attention_kinds
from maxshard.model.layers import attention_ops as ops
from maxshard.model.layers import ring_attention
from maxshard.parallel.sharding import flax_rules
from maxshard.training.step import mesh_context
from tests.helpers import layout_overrides, max_relative_difference, mesh_for, tiny_config

TOLERANCE = 1e-5
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}  # same numbers
ALL = {"window": 5, "softcap": 1.5, "sinks": True}


def _inputs(length: int, heads: int = 4, kv_heads: int = 2, dim: int = 8, batch: int = 2, seed: int = 0):
    """q, k, v, packed segment ids (several documents per row, ragged) and per-head sinks."""
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(batch, length, heads, dim)) * dim**-0.5 * 2, jnp.float32)
    k = jnp.asarray(rng.normal(size=(batch, length, kv_heads, dim)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(batch, length, kv_heads, dim)), jnp.float32)
    segments = jnp.asarray(np.sort(rng.integers(0, 4, size=(batch, length)), axis=1), jnp.int32)
    sinks = jnp.asarray(rng.normal(size=(heads,)), jnp.float32)
    return q, k, v, segments, sinks


def _value_and_grads(fn, q, k, v, segments, sinks, options: dict, compile_options=FAST_COMPILE):
    """Output and d(sum(out * cos(out)))/d(q, k, v[, sinks]) of `fn` with the window/soft-cap/sinks `options`.
    `compile_options`: XLA's (a GPU or TPU compile takes none)."""
    kwargs = {name: value for name, value in options.items() if name != "sinks"}
    with_sinks = options.get("sinks", False)

    def loss(q, k, v, sinks):
        out = fn(q, k, v, segments, segments, **kwargs, **({"sinks": sinks} if with_sinks else {}))
        return jnp.sum(out * jnp.cos(out)), out

    argnums = (0, 1, 2, 3) if with_sinks else (0, 1, 2)
    compiled = jax.jit(jax.value_and_grad(loss, argnums=argnums, has_aux=True)).lower(q, k, v, sinks)
    (_, out), grads = compiled.compile(compile_options)(q, k, v, sinks)
    return out, grads


def _assert_matches_reference(fn, inputs, options: dict) -> None:
    ref_out, ref_grads = _value_and_grads(ops.dot_product, *inputs, options)
    out, grads = _value_and_grads(fn, *inputs, options)
    assert max_relative_difference(out, ref_out) < TOLERANCE
    assert max_relative_difference(grads, ref_grads) < TOLERANCE


def test_the_options_change_the_reference() -> None:
    """Each option really changes dot_product's output on these inputs (else the parity below proves nothing)."""
    q, k, v, segments, sinks = _inputs(37)
    plain = ops.dot_product(q, k, v, segments, segments)
    for options in ({"window": 5}, {"softcap": 1.5}, {"sinks": sinks}):
        assert max_relative_difference(ops.dot_product(q, k, v, segments, segments, **options), plain) > 1e-2


@pytest.mark.parametrize("options,block_q,block_kv", [
    (ALL, 8, 4),  # length 37: not a multiple of the blocks; a window shorter than two key blocks
    ({"window": 9}, 4, 8),  # no sinks, no cap: the plain path with a window
])
def test_blockwise_matches_dot_product(options: dict, block_q: int, block_kv: int) -> None:
    _assert_matches_reference(lambda *a, **o: ops.blockwise(*a, block_q=block_q, block_kv=block_kv, **o),
                              _inputs(37), options)


def test_blockwise_visits_only_the_key_blocks_in_the_window() -> None:
    """The key loops span only the needed blocks: at 64 tokens in 4-token blocks with a 5-token window, query block
    i (tokens 4i..4i+3, seeing back to 4i-4) needs key blocks i-1 and i of the 16, against 1 + i causally."""
    from maxshard.model.layers import blockwise_attention as bw

    idx = jnp.arange(64, dtype=jnp.int32).reshape(16, 4)
    spans = [tuple(int(x) for x in bw._span(bw._needed(idx[i][None], idx, 5))) for i in range(16)]
    assert spans == [(max(i - 1, 0), i + 1) for i in range(16)]


def test_cudnn_window_through_xla_matches_dot_product() -> None:
    _assert_matches_reference(lambda *a, **o: ops.cudnn(*a, implementation="xla", **o), _inputs(24),
                              {"window": 5})


def test_tokamax_window_and_softcap_through_xla_match_dot_product() -> None:
    pytest.importorskip("tokamax")
    _assert_matches_reference(lambda *a, **o: ops.tokamax(*a, implementation="xla", **o), _inputs(24),
                              {"window": 5, "softcap": 1.5})


def test_splash_window_softcap_and_sinks_in_interpret_mode_match_dot_product() -> None:
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    inputs = _inputs(256, heads=2, kv_heads=1, batch=1, dim=128)
    _assert_matches_reference(lambda *a, **o: ops.splash(*a, block_q=128, block_kv=128, interpret=True, **o),
                              inputs, {"window": 100, "softcap": 1.5, "sinks": True})


@pytest.mark.parametrize("implementation,refused", [("cudnn", "softcap, sinks"), ("tokamax", "sinks")])
def test_a_kernel_without_an_option_refuses_it_in_one_line(implementation: str, refused: str) -> None:
    q, k, v, segments, sinks = _inputs(16)
    with pytest.raises(ValueError, match=f"attention={implementation} cannot take {refused} "):
        ops.attend(q, k, v, segments, segments, implementation=implementation, window=4, softcap=1.5, sinks=sinks)


def test_splash_with_window_softcap_and_sinks_compiles_for_a_v5e_chip() -> None:
    """XLA:TPU through Mosaic, ahead of time on libtpu's abstract v5e (no TPU): the kernel's local mask, soft-cap
    and sinks lower forward and backward (interpret mode above checks the numbers)."""
    from maxshard.launch import topologies
    from maxshard.planning.tpu_compile import abstract_devices

    chip = jax.sharding.Mesh(np.asarray(abstract_devices(topologies.parse("v5litepod-8")))[:1], ("chip",))
    whole = jax.sharding.NamedSharding(chip, jax.sharding.PartitionSpec())

    def shaped(*shape: int, dtype=jnp.bfloat16) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(shape, dtype, sharding=whole)

    def loss(q, k, v, segments, sinks):
        out = ops.splash(q, k, v, segments, segments, block_q=128, block_kv=128, interpret=False, window=100,
                         softcap=30.0, sinks=sinks)
        return jnp.sum(out.astype(jnp.float32))

    with jax.set_mesh(chip):
        lowered = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 4))).lower(
            shaped(1, 256, 4, 128), shaped(1, 256, 2, 128), shaped(1, 256, 2, 128), shaped(1, 256, dtype=jnp.int32),
            shaped(4, dtype=jnp.float32))
        assert "tpu_custom_call" in lowered.compile().as_text()


@pytest.mark.parametrize("kernel", [pytest.param("cudnn", marks=pytest.mark.gpu),
                                    pytest.param("tokamax", marks=pytest.mark.gpu),
                                    pytest.param("splash", marks=pytest.mark.tpu)])
def test_the_fused_kernel_takes_its_options_on_the_accelerator(kernel: str) -> None:
    """On a GPU or TPU (skipped elsewhere, see tests/conftest.py): the kernel itself, bfloat16, with a window and
    whichever of soft-cap and sinks its row takes, 8 packed documents per row, against float32 dot_product.
    Tolerance as tests/test_accelerators.py's for bfloat16 kernels."""
    from tests.test_attention import _many_documents

    q, k, v, _, sinks = _inputs(256, heads=4, kv_heads=2, dim=128, batch=2)
    segments = _many_documents(2, 256, 8)
    options = {name: value for name, value in {"window": 100, "softcap": 30.0, "sinks": True}.items()
               if name in attention_kinds.kind(kernel).options}
    inputs = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    with jax.default_matmul_precision("highest"):
        ref_out, ref_grads = _value_and_grads(ops.dot_product, *[x.astype(jnp.float32) for x in inputs], segments,
                                              sinks, options, {})

    def fused(*args, **kwargs):
        return ops.attend(*args, implementation=kernel, block_q=128, block_kv=128, **kwargs).astype(jnp.float32)

    out, grads = _value_and_grads(fused, *inputs, segments, sinks, options, {})
    assert max_relative_difference(out, ref_out) < 2e-2
    assert max_relative_difference(grads, ref_grads) < 2e-2


# --------------------------------------------------------------------------------------------- on 8 devices


def _on_mesh(layout: tuple[str, ...], implementation: str, inputs, options: dict, block: int = 4,
             num_devices: int = 8):
    """`attend` jitted on the mesh and rules of a tiny config with `layout` (what the model's attention layer runs):
    (output, gradients) as `_value_and_grads`, and whether ring attention was traced. Under context parallelism
    the model works in the balanced layout (ring_attention.py): the inputs go in and the output comes out as there."""
    cfg = tiny_config(*layout_overrides(layout), "max_target_length=64", num_devices=num_devices)
    rings = []
    ring = ring_attention.ring_attend

    def fn(q, k, v, q_seg, kv_seg, **kwargs):
        balanced = (ring_attention.to_balanced(x) for x in (q, k, v, q_seg, kv_seg))
        out = ops.attend(*balanced, implementation=implementation, block_q=block, block_kv=block, **kwargs)
        return ring_attention.from_balanced(out)

    with mesh_context(mesh_for(cfg), flax_rules(cfg)):
        try:
            ring_attention.ring_attend = lambda *a, **o: rings.append(1) or ring(*a, **o)
            out, grads = _value_and_grads(fn, *inputs, options)
        finally:
            ring_attention.ring_attend = ring
    return out, grads, bool(rings)


def test_ring_attention_with_window_softcap_and_sinks_matches_dot_product() -> None:
    """4 context shards of 16 tokens (8-token chunks): with a 5-token window ring step 2 is skipped whole."""
    inputs = _inputs(64)
    layout = ("ici_context_parallelism=4", "ici_fsdp_parallelism=2")
    assert ring_attention.needed_steps(4, 16, ALL["window"]) == (0, 1, 3)
    ref_out, ref_grads = _value_and_grads(ops.dot_product, *inputs, ALL)
    out, grads, ringed = _on_mesh(layout, "blockwise", inputs, ALL)
    assert ringed
    assert max_relative_difference(out, ref_out) < TOLERANCE
    assert max_relative_difference(grads, ref_grads) < TOLERANCE


# One local layer (a 5-token window) with soft-capped logits and sinks (Gemma 2's and GPT-OSS's options at once), on
# test_attention.py's tiny model (36 tokens, 9-token context chunks) and packed batch; its global layers are tested
# there.
LOCAL_MODEL = ("num_layers=1", "attention_pattern=[local]", "sliding_window=5", "attn_logit_softcapping=2.0",
                "attention_sinks=true")


def test_local_layer_model_under_context_parallelism_matches_dot_product_on_one_device() -> None:
    """Loss and gradients (the sinks' included) of the tiny local model, attention=blockwise under
    context2 x tensor2 x fsdp2 (ring attention, the sinks sharded with the heads), against dot_product on one
    device: the path a training step runs, from the model keys to the kernels."""
    import flax.linen as nn

    from maxshard import data
    from maxshard.training.step import Trainer, abstract_state
    from tests.test_attention import _loss_and_grads, _model_config, _packed_batch

    ref_cfg = _model_config(*LOCAL_MODEL, "ici_fsdp_parallelism=1", "attention=dot_product", num_devices=1)
    trainer = Trainer(ref_cfg, mesh_for(ref_cfg))
    # random parameters of the model's shapes (no init to compile); sinks of order 1, which weigh in the softmax
    rng = np.random.default_rng(2)
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: (rng.normal(size=x.shape) * (1.0 if "sinks" in jax.tree_util.keystr(path) else 0.2))
        .astype(x.dtype), nn.unbox(abstract_state(ref_cfg).params))
    batch = _packed_batch(ref_cfg.global_batch_size, ref_cfg.max_target_length)
    ref_loss, ref_grads = _loss_and_grads(trainer, params, batch)
    sinks = [g for path, g in jax.tree_util.tree_leaves_with_path(ref_grads) if "sinks" in jax.tree_util.keystr(path)]
    assert sinks and all(np.abs(g).max() > 0 for g in sinks)

    layout = ("ici_context_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2")
    cfg = _model_config(*LOCAL_MODEL, *layout_overrides(layout), "attention=blockwise")
    trainer = Trainer(cfg, mesh_for(cfg))
    params = jax.device_put(params, trainer.state_shardings.params)
    batch = jax.device_put(batch, trainer.batch_shardings(data.batch_sharding(cfg, trainer.mesh)))
    loss, grads = _loss_and_grads(trainer, params, batch)
    assert loss == pytest.approx(ref_loss, rel=TOLERANCE)
    assert max_relative_difference(grads, ref_grads) < TOLERANCE


def test_ring_steps_follow_the_window() -> None:
    """Every step without a window; with one, the steps some device's chunk needs (chunks of 8 tokens, 8 shards)."""
    assert ring_attention.needed_steps(8, 16, 0) == tuple(range(8))
    assert ring_attention.needed_steps(8, 16, 8) == (0, 1, 7)
    assert ring_attention.needed_steps(8, 16, 9) == (0, 1, 7)  # the query and 8 before it: one chunk back
    assert ring_attention.needed_steps(8, 16, 10) == (0, 1, 2, 6, 7)  # one token into the second chunk back
    assert ring_attention.needed_steps(8, 16, 10**6) == tuple(range(8))


def test_splash_sinks_go_sharded_with_the_heads_under_shard_map() -> None:
    """splash runs per device (shard_map): under fsdp2 x tensor2 (4 devices) each device holds half the heads, and
    its sinks must be those heads' (a closed-over [heads] array would not match the local q)."""
    pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
    inputs = _inputs(128, heads=4, kv_heads=2, batch=2, dim=128, seed=1)
    ref_out, ref_grads = _value_and_grads(ops.dot_product, *inputs, ALL)
    layout = ("ici_fsdp_parallelism=2", "ici_tensor_parallelism=2")
    out, grads, ringed = _on_mesh(layout, "splash", inputs, ALL, block=128, num_devices=4)
    assert not ringed
    assert max_relative_difference(out, ref_out) < TOLERANCE
    assert max_relative_difference(grads, ref_grads) < TOLERANCE


def test_every_kernel_declares_its_options() -> None:
    """The options table (what each kernel above is tested with; the rest refuse)."""
    assert {k.name: k.options for k in attention_kinds.KINDS} == {
        "dot_product": ("window", "softcap", "sinks"), "blockwise": ("window", "softcap", "sinks"),
        "cudnn": ("window",), "splash": ("window", "softcap", "sinks"), "tokamax": ("window", "softcap")}
    assert attention_kinds.RING_OPTIONS == ("window", "softcap", "sinks")


# --------------------------------------------------------------------------------------------- the choice


def _resolve(*overrides: str, device_kind: str = "cpu") -> str:
    """What `run.loading` resolves `attention` to for this config (bfloat16 compute) on 8 devices of `device_kind`."""
    from maxshard import config
    from maxshard.model import attention_choice
    from maxshard.parallel import mesh

    cfg = config.finalize(config.parse(["configs/base.yml", "dataset_type=synthetic", *overrides]), 8, device_kind)
    return attention_choice.resolve(cfg, "bfloat16", mesh.axis_sizes(cfg))


LOCAL = ("attention_pattern=[local,global]", "sliding_window=128")
GEMMA2 = (*LOCAL, "attn_logit_softcapping=50.0")
H100 = "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("device_kind,keys,expected", [
    (H100, LOCAL, "tokamax"),  # tokamax's window (Hopper, installed)
    (H100, GEMMA2, "tokamax"),  # and its soft-cap
    ("NVIDIA A100-SXM4-40GB", LOCAL, "cudnn"),  # cuDNN's own sliding window
    ("NVIDIA A100-SXM4-40GB", GEMMA2, "blockwise"),  # cuDNN has no soft-cap
    (H100, ("attention_sinks=true",), "blockwise"),  # neither fused GPU kernel takes sinks
    ("TPU v5 lite", (*GEMMA2, "attention_sinks=true"), "splash"),
    ("cpu", GEMMA2, "dot_product"),  # the reference takes them all: the choice stays
])
def test_auto_picks_a_kernel_that_takes_the_model_options(device_kind: str, keys: tuple, expected: str) -> None:
    assert _resolve(*keys, device_kind=device_kind) == expected


@pytest.mark.parametrize("kernel,keys,message", [
    ("cudnn", GEMMA2, "attention=cudnn cannot take attn_logit_softcapping "),
    ("tokamax", (*LOCAL, "attention_sinks=true"), "attention=tokamax cannot take attention_sinks "),
])
def test_an_explicit_kernel_without_a_model_option_is_one_config_error(kernel: str, keys: tuple, message: str):
    from maxshard.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        _resolve(f"attention={kernel}", *keys, device_kind=H100)
    assert _resolve(f"attention={kernel}", *LOCAL, device_kind=H100) == kernel  # a window alone: both take it


def test_a_local_layer_takes_blocks_that_keep_it_near_the_window_proportional_cost():
    """A 1k window: 128-token blocks (1.125x the ideal in benchmarks/attention_window.py, 1.5x with 512); a 4k
    window keeps 512; never below 128 (splash's smallest block)."""
    from maxshard.model.layers.attention import local_block

    assert (local_block(1024), local_block(4096), local_block(128), local_block(100_000)) == (128, 512, 128, 8192)
