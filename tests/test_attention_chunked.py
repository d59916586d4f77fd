"""Llama 4's pieces of attention and routing, at the model's seams, against references that do not share their code.

Chunked attention (a local layer with `attention_chunk_size`): every kernel (dot_product, blockwise, the cudnn
mapping through XLA, tokamax's XLA path, splash in Pallas interpret mode) given `chunked_segments`, alone and with
the chunk-sized window the layer adds so the kernels skip the blocks before it, computes a softmax over exactly the
keys of the query's document and chunk, causal (a numpy reference written from that rule); packed documents are
chunked from their own first position. A model of chunked RoPE layers with L2 q/k norms, NoPE
layers with the query temperature and a top-1 MoE with the weight on the expert's input (`LLAMA4`) has one device's
loss and gradients under fsdp x tensor, context x fsdp (ring attention over the chunked segments), sequence x
fsdp and a 2-stage pipeline of its 4-layer units, on a packed batch. The config keys refuse what they cannot mean in one line.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard import config
from maxshard.errors import ConfigError
from maxshard.model.layers import attention_ops as ops
from maxshard.model.layers import pipeline
from maxshard.model.layers.attention import chunked_segments, nope_temperature
from tests.helpers import max_relative_difference, tiny_config
from tests.test_pipeline import TOLERANCE, loss_and_grads, packed_batch, random_params

CHUNK = 8


def _inputs(length: int, heads: int = 4, kv_heads: int = 2, dim: int = 8, batch: int = 2):
    """q, k, v, segment ids of two documents a row (the second starting mid-chunk) and per-document positions."""
    rng = np.random.default_rng(0)
    q = rng.normal(size=(batch, length, heads, dim)).astype(np.float32)
    k = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
    v = rng.normal(size=(batch, length, kv_heads, dim)).astype(np.float32)
    t = np.arange(length)[None, :]
    split = np.array([[length // 2 + 3], [length // 3 + 1]])[:batch]
    segments = np.where(t < split, 1, 2).astype(np.int32)
    positions = np.where(t < split, t, t - split).astype(np.int32)
    return q, k, v, segments, positions


def _reference(q, k, v, segments, positions) -> np.ndarray:
    """Softmax attention over the keys j <= i of query i's document and chunk (position // CHUNK), in numpy."""
    batch, length, heads, _ = q.shape
    group = heads // k.shape[2]
    out = np.zeros_like(q)
    for b in range(batch):
        for i in range(length):
            seen = [j for j in range(i + 1) if segments[b, j] == segments[b, i]
                    and positions[b, j] // CHUNK == positions[b, i] // CHUNK]
            for h in range(heads):
                logits = k[b, seen, h // group] @ q[b, i, h]
                w = np.exp(logits - logits.max())
                out[b, i, h] = (w / w.sum()) @ v[b, seen, h // group]
    return out


KERNELS = {
    "dot_product": lambda *a, **o: ops.dot_product(*a, **o),
    "blockwise": lambda *a, **o: ops.blockwise(*a, block_q=8, block_kv=16, **o),
    "cudnn": lambda *a, **o: ops.cudnn(*a, implementation="xla", **o),
    "tokamax": lambda *a, **o: ops.tokamax(*a, implementation="xla", **o),
}


@pytest.mark.parametrize("kernel", [*KERNELS, "splash"])
def test_every_kernel_attends_within_the_chunk_given_chunked_segments(kernel: str) -> None:
    if kernel == "tokamax":
        pytest.importorskip("tokamax")
    if kernel == "splash":
        pytest.importorskip("jax.experimental.pallas.ops.tpu.splash_attention")
        q, k, v, segments, positions = _inputs(256, heads=2, kv_heads=1, batch=1, dim=128)
        run = lambda *a, **o: ops.splash(*a, block_q=128, block_kv=128, interpret=True, **o)  # noqa: E731
    else:
        q, k, v, segments, positions = _inputs(40)
        run = KERNELS[kernel]
    ids = chunked_segments(jnp.asarray(segments), jnp.asarray(positions), CHUNK)
    scaled = jnp.asarray(q) * q.shape[-1] ** -0.5
    want = _reference(q * q.shape[-1] ** -0.5, k, v, segments, positions)
    for window in (0, CHUNK):  # the cut segments alone, and with the chunk-sized window the layer adds for skipping
        got = jax.jit(lambda *a: run(*a, window=window))(scaled, k, v, ids, ids)
        assert max_relative_difference(np.asarray(got), want) < TOLERANCE, window
    whole = jax.jit(run)(scaled, k, v, segments, segments)
    assert max_relative_difference(np.asarray(whole), want) > 1e-2  # the chunks are what made it so


def test_the_temperature_is_one_until_the_first_floor_then_grows_as_a_log() -> None:
    got = np.asarray(nope_temperature(jnp.arange(12)[None], 0.5, 4))[0, :, 0, 0]
    want = np.log(np.floor((np.arange(12) + 1) / 4) + 1) * 0.5 + 1
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[2] == 1.0 and got[3] > 1.0


# configs/models/tiny.yml's widths, two of Llama 4's layer units at a chunk shorter than the packed documents:
# chunked RoPE layers (dense, then MoE), a global NoPE layer (dense), a chunked MoE layer
UNIT = ["chunked_attention", "chunked_attention", "full_attention", "chunked_attention"]
LLAMA4 = ("num_layers=8", "layer_types=" + ",".join(UNIT * 2),
          "rope_layers=1,1,0,1,1,1,0,1", f"attention_chunk_size={CHUNK}", "nope_temperature_scale=0.5",
          "nope_temperature_floor=8", "qk_l2_norm=true", "num_experts=4", "num_experts_per_tok=1",
          "moe_layer_interval=2", "moe_router=sigmoid", "moe_renormalize_top_k=false", "moe_weights_on_input=true",
          "num_shared_experts=1", "moe_mlp_dim=64", "capacity_factor=-1", "attention=dot_product",
          "load_balance_loss_weight=0")  # a batch's balance, not a sum over the pipeline's microbatches


@pytest.fixture(scope="module")
def one_device():
    cfg = tiny_config(*LLAMA4, num_devices=1)
    from maxshard.training.step import Trainer
    from tests.helpers import mesh_for
    trainer = Trainer(cfg, mesh_for(cfg))
    params, batch = random_params(trainer), packed_batch(cfg, trainer.mesh)
    return params, batch, *loss_and_grads(cfg, params, batch)


@pytest.mark.parametrize("layout", [
    ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"),
    ("ici_context_parallelism=2", "ici_fsdp_parallelism=4", "attention=blockwise"),
    ("ici_sequence_parallelism=2", "ici_fsdp_parallelism=4"),
    ("ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "num_pipeline_microbatches=4"),
])
def test_the_llama4_layers_under_a_layout_give_one_devices_loss_and_gradients(one_device, layout) -> None:
    params, batch, ref_loss, ref_grads = one_device
    cfg = tiny_config(*LLAMA4, *layout)
    shape = cfg.model.pipeline
    if shape is not None:  # one 4-layer unit a stage, its parameters in the pipeline's layout
        assert (shape.stages, shape.layers_per_stage, shape.repeats) == (2, 1, 1)
        params = pipeline.from_scanned(params, shape)
    loss, grads = loss_and_grads(cfg, params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=TOLERANCE)
    assert max_relative_difference(pipeline.to_scanned(grads) if shape else grads, ref_grads) < TOLERANCE


@pytest.mark.parametrize("keys,message", [
    (("sliding_window=4", f"attention_chunk_size={CHUNK}", "attention_pattern=[local]"), "set one of them to 0"),
    (("layer_types=chunked_attention,full_attention",), "needs attention_chunk_size > 0"),
    (("rope_layers=1,0,1",), "rope_layers has 3 entries"),
    (("rope_layers=1,2",), "rope_layers expects a list of 0 and 1"),
    (("nope_temperature_scale=0.1",), "rope_layers has no 0"),
    (("qk_l2_norm=true", "qk_norm=true"), "qk_l2_norm normalises"),
    (("num_experts=4", "num_experts_per_tok=2", "moe_weights_on_input=true"), "set num_experts_per_tok=1"),
])
def test_the_llama4_keys_refuse_what_they_cannot_mean_in_one_line(keys, message) -> None:
    with pytest.raises(ConfigError, match=message):
        config.parse(["configs/base.yml", "num_layers=2", *keys])


@pytest.mark.parametrize("length,chunk", [(12, 4), (13, 4), (8192, 8192), (1000, 2048)])
def test_a_chunked_layer_counts_the_keys_of_its_chunk(length: int, chunk: int) -> None:
    """Model FLOPs (MFU's count) of a chunked layer: a query at p sees p mod chunk + 1 keys, its own counted half as
    the causal convention does; a chunk as long as the sequence is a global layer."""
    from maxshard.spec import mixer_kinds

    brute = sum(p % chunk + 0.5 for p in range(length)) / length
    assert mixer_kinds.keys_in_chunk(length, chunk) == pytest.approx(brute)
    if chunk >= length:
        assert mixer_kinds.keys_in_chunk(length, chunk) == pytest.approx(mixer_kinds.keys_seen(length))
