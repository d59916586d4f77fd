"""`maxshard/model/layers/ragged_all_to_all.py`: the collective XLA:CPU lacks, emulated, against its contract.

On hand-made offsets and sizes (jax's docstring example; random slices with empty ones, gaps on both sides, a
non-zero `output` that must keep what is not written), on the 8 CPU devices: the result equals a numpy reading of
`jax.lax.ragged_all_to_all`'s docstring (`tests/helpers.ragged_all_to_all_reference`), and its gradients equal what
jax's transpose rule for the real op computes (the exchange with the roles swapped; `output`'s cotangent with the
received rows zeroed). On a CPU mesh the program holds the emulation, not XLA's op.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from maxshard.model.layers.ragged_all_to_all import ragged_all_to_all
from tests.helpers import ragged_all_to_all_reference

MESH_AXES = ("a", "x")  # 4 x 2: an exchange over x alone is four separate pairs
SPEC = PartitionSpec(MESH_AXES)


def _mesh() -> jax.sharding.Mesh:
    return jax.make_mesh((4, 2), MESH_AXES, devices=jax.devices()[:8])


def _exchange(axis: tuple[str, ...]):
    """jit(shard_map) of (result, operand's cotangent, output's cotangent) per device, stacked on a leading axis."""

    def body(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, cotangent):
        def exchange(operand, output):
            return ragged_all_to_all(operand, output, input_offsets[0], send_sizes[0], output_offsets[0],
                                     recv_sizes[0], axis_name=axis)

        result, vjp = jax.vjp(exchange, operand[0], output[0])
        return jax.tree.map(lambda a: a[None], (result, *vjp(cotangent[0])))

    return jax.jit(jax.shard_map(body, mesh=_mesh(), in_specs=SPEC, out_specs=SPEC))


def _all_to_all(per_device: np.ndarray) -> np.ndarray:
    """numpy's tiled all_to_all of [P devices, P x S]: device d gets every device's d-th block of S."""
    p = per_device.shape[0]
    return per_device.reshape(p, p, -1).transpose(1, 0, 2).reshape(p, -1)


def _expected(operand, output, slices, cotangent):
    """(result, operand's cotangent, output's cotangent) as the real op and its transpose rule define them."""
    per_device = [tuple(s[d] for s in slices) for d in range(operand.shape[0])]
    result = ragged_all_to_all_reference(operand, output, per_device)
    input_offsets, send_sizes, output_offsets, recv_sizes = slices
    swapped = (_all_to_all(output_offsets), recv_sizes, _all_to_all(input_offsets), send_sizes)
    operand_ct = ragged_all_to_all_reference(cotangent, np.zeros_like(operand),
                                             [tuple(s[d] for s in swapped) for d in range(operand.shape[0])])
    received = ragged_all_to_all_reference(np.ones_like(operand), np.zeros_like(cotangent), per_device)
    output_ct = np.where(np.stack(received) != 0, 0, cotangent)
    return np.stack(result), np.stack(operand_ct), output_ct


def _layout(sizes: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """sizes [slices] placed in a random order with gaps of 0-2 rows: (offsets, rows used)."""
    offsets, at = np.zeros_like(sizes), 0
    for i in rng.permutation(len(sizes)):
        at += int(rng.integers(0, 3))
        offsets[i], at = at, at + sizes[i]
    return offsets, at


def _random_case(rng: np.random.Generator, p: int, s: int) -> tuple:
    """`p` devices, `s` slices per peer of 0-3 rows, laid out with gaps in operands and outputs."""
    sizes = rng.integers(0, 4, (p, p, s)).astype(np.int32)  # [source, receiver, j]
    sizes[0, 1] = 0  # an empty pair
    sent = [_layout(sizes[d].ravel(), rng) for d in range(p)]
    arrived = [_layout(sizes[:, d].ravel(), rng) for d in range(p)]  # [source, j] at receiver d
    n, m = max(end for _, end in sent) + 1, max(end for _, end in arrived) + 2
    input_offsets = np.stack([o for o, _ in sent])
    landing = np.stack([o.reshape(p, s) for o, _ in arrived])  # [receiver, source, j]
    output_offsets = landing.transpose(1, 0, 2).reshape(p, -1)  # sender's: where its slices land
    recv_sizes = sizes.transpose(1, 0, 2).reshape(p, -1)
    slices = (input_offsets, sizes.reshape(p, -1), output_offsets, recv_sizes)
    operand = rng.normal(size=(p, n, 3)).astype(np.float32)
    output = rng.normal(size=(p, m, 3)).astype(np.float32)  # not zeros: what is not written must stay
    return operand, output, slices


def _docstring_case() -> tuple:
    """jax's docstring example (axis of size 2), on every pair of the 4 x 2 mesh, values offset per pair."""
    operand = np.array([[1, 2, 2], [3, 4, 0]], np.float32)[..., None]
    slices = ([[0, 1], [0, 1]], [[1, 2], [1, 1]], [[0, 0], [1, 2]], [[1, 1], [2, 1]])
    tile = lambda a: np.tile(np.asarray(a), (4,) + (1,) * (np.ndim(a) - 1))  # noqa: E731
    operand = tile(operand) + np.repeat(np.arange(4) * 10, 2)[:, None, None].astype(np.float32)
    return operand, np.zeros((8, 4, 1), np.float32), tuple(tile(s).astype(np.int32) for s in slices)


def _run(axis, operand, output, slices, cotangent):
    sharded = jax.device_put((operand, output, *slices, cotangent), NamedSharding(_mesh(), SPEC))
    return jax.device_get(_exchange(axis)(*sharded))


def test_the_docstring_example_on_every_pair():
    operand, output, slices = _docstring_case()
    cotangent = np.arange(8 * 4, dtype=np.float32).reshape(8, 4, 1)
    got = _run(("x",), operand, output, slices, cotangent)
    np.testing.assert_array_equal(got[0][:2, :, 0], [[1, 3, 0, 0], [2, 2, 4, 0]])  # as jax's docstring says
    np.testing.assert_array_equal(got[0][6:, :, 0], [[31, 33, 0, 0], [32, 32, 34, 0]])  # the last pair's own
    for pair in range(4):  # the reference sees one pair at a time
        rows = slice(2 * pair, 2 * pair + 2)
        expected = _expected(operand[rows], output[rows], tuple(s[rows] for s in slices), cotangent[rows])
        for g, e in zip(got, expected):
            np.testing.assert_array_equal(g[rows], e)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_slices_over_eight_devices_and_their_gradients(seed):
    rng = np.random.default_rng(seed)
    operand, output, slices = _random_case(rng, 8, 2)
    cotangent = rng.normal(size=output.shape).astype(np.float32)
    got = _run(MESH_AXES, operand, output, slices, cotangent)
    for name, g, e in zip(("result", "operand cotangent", "output cotangent"), got,
                          _expected(operand, output, slices, cotangent)):
        np.testing.assert_array_equal(g, e, err_msg=name)


def test_on_a_cpu_mesh_it_is_the_emulation():
    """The mesh's platform decides: CPU devices get the emulation (an all_to_all of the data blocks), never XLA's
    op; a mesh of TPU devices keeps the op (tests/test_tpu_aot.py finds it in the compiled program)."""
    operand, output, slices = _docstring_case()
    args = jax.device_put((operand, output, *slices, output), NamedSharding(_mesh(), SPEC))
    text = _exchange(("x",)).lower(*args).as_text()
    assert "ragged_all_to_all" not in text and re.search(r"stablehlo\.all_to_all.*xf32>", text)


@pytest.mark.parametrize("op, summed", [(ragged_all_to_all, False), (jax.lax.ragged_all_to_all, True)],
                         ids=["maxshard", "jax"])
def test_an_output_of_zeros_made_in_the_body_keeps_the_gradient_per_device(op, summed):
    """`moe_ragged.exchange` writes into zeros made inside shard_map. jax types the real op's result as that
    `output`, invariant: where the result then meets a varying value, the cotangent is summed over the devices
    (psum_invariant) before the way back, a wrong gradient on TPU and GPU. The wrapper makes `output` varying."""
    operand, _, slices = _docstring_case()

    def body(operand, weight, *slices):
        zeros = jnp.zeros((4, 1), operand.dtype)
        y = op(operand[0], zeros, *(s[0] for s in slices), axis_name="x")
        return jnp.sum(y * weight[0])[None]

    loss = jax.shard_map(body, mesh=_mesh(), in_specs=SPEC, out_specs=SPEC)
    args = jax.device_put((operand, np.ones((8, 4, 1), np.float32), *slices), NamedSharding(_mesh(), SPEC))
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(loss(*a))))(*args))
    assert ("psum" in jaxpr) == summed
