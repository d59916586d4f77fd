"""`jax.lax.ragged_all_to_all` where XLA has it, and an emulation from fixed-size collectives where it does not.

Why. The ragged MoE exchange (`moe_ragged.py`) moves only the rows routed, with XLA's ragged-all-to-all. XLA:TPU and
XLA:GPU compile it; XLA:CPU does not ("UNIMPLEMENTED: HLO opcode ragged-all-to-all"), so without an
emulation the ragged path never computes a number on CPU, where the tests run. The emulation has the collective's
contract, argument for argument, so the code around it is the code that runs on the accelerators.

The contract (jax's docstring). Per device, K = len(input_offsets) slices, S = K / P per peer (P devices on the
axis). Slice i, rows operand[input_offsets[i] : + send_sizes[i]], goes to peer i // S and is written there at
output_offsets[i]: the SENDER's output_offsets say where its rows land. The receiver takes recv_sizes[i] rows from
peer i // S, at the offsets that peer sent (an all_to_all of output_offsets); everything else of `output` stays.
recv_sizes must be the all_to_all of send_sizes.

The emulation, one all_to_all of padded blocks [P, B, ...]: each device packs, per peer, its S slices one after
the other (slice order) into a block of B rows; after the all_to_all each receiver unpacks block s with recv_sizes
(the same packing, seen from its side) and the all_to_all'd output_offsets, and scatters the rows into `output`.
B = min(M, S x N) (M output rows, N operand rows) holds what one peer can send a receiver whose slices do not
overlap there (XLA's op asks the same); rows past M are dropped, as out-of-range writes. It moves P x B rows where
the real op moves the routed ones: a CPU stand-in for correctness, not for speed.

Differentiation. The real op's gradient is its transpose rule (`jax._src.lax.parallel._ragged_all_to_all_transpose`):
the same exchange with the roles swapped for the operand (the cotangent's received rows go back where they came
from), and for `output` the cotangent with the received rows zeroed. The emulation is differentiated by jax itself,
and its pieces transpose to exactly that: the scatter into `output` to a gather of the received rows' cotangent and
`output`'s cotangent with those rows zeroed, the all_to_all to the all_to_all back, the sender's gather to a
scatter-add into the rows it read (tests/test_ragged_all_to_all.py checks it against the rule). No custom_vjp: one
whose backward is traced apart from its forward loses, under the pipeline's stage vmap (spmd_axis_name), the stage
axis of the values it makes itself (jax: "Primitive ge requires varying manual axes to match"), so pipeline x
expert with the ragged exchange would not run on CPU; plain autodiff traces the backward with the forward's values.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ragged_all_to_all", "emulated_ragged_all_to_all"]

AxisName = str | tuple[str, ...]


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: AxisName) -> jax.Array:
    """`jax.lax.ragged_all_to_all` on TPU and GPU, `emulated_ragged_all_to_all` on CPU (XLA:CPU has no such op)."""
    args = (operand, _varying(output, operand, axis_name), input_offsets, send_sizes, output_offsets, recv_sizes)
    return _for_the_platform(*args, axis_name=axis_name)


def _for_the_platform(*args: jax.Array, axis_name: AxisName) -> jax.Array:
    """The real collective or the emulation, by the platform of the mesh the program runs on.

    The mesh's devices, not the backend the Python process runs: a TPU program compiled ahead of time on a CPU host
    (tests/test_tpu_aot.py) has a mesh of abstract TPU devices and keeps the real op, and only the branch taken is
    traced (a TPU program holds no emulation). A mesh without devices (an AbstractMesh made by hand) leaves the
    choice to lowering, `lax.platform_dependent`."""
    device = jax.sharding.get_abstract_mesh().abstract_device
    real = lambda *a: jax.lax.ragged_all_to_all(*a, axis_name=axis_name)  # noqa: E731
    emulated = lambda *a: emulated_ragged_all_to_all(*a, axis_name=axis_name)  # noqa: E731
    if device is None:
        return jax.lax.platform_dependent(*args, cpu=emulated, default=real)
    return (emulated if device.platform == "cpu" else real)(*args)


def _varying(output: jax.Array, operand: jax.Array, axis_name: AxisName) -> jax.Array:
    """`output` typed as varying over the exchange's axes and the operand's, as the result is.

    jax types the real op's result as its `output` argument. Zeros made inside shard_map are invariant, so
    the result would claim to be the same on every device; where it then meets a varying value, jax inserts a
    pvary, whose transpose sums the cotangent over the axes (psum_invariant): every device would send back the
    sum of all devices' cotangents, a wrong gradient. The emulation's result is varying anyway (it comes out of an
    all_to_all), and `platform_dependent` needs both branches to agree."""
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    varying = jax.typeof(output).mat.varying
    axes = tuple(a for a in dict.fromkeys((*names, *sorted(jax.typeof(operand).mat.varying))) if a not in varying)
    return jax.lax.pcast(output, axes, to="varying") if axes else output


def _packed(sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """sizes [P, S] of slices packed one after the other in blocks of `rows` rows -> per block row [P, rows]: its
    slice (clipped to S - 1), its row within that slice, and whether it holds a slice's row at all."""
    ends = jnp.cumsum(sizes, axis=1)  # [P, S]
    row = jnp.arange(rows, dtype=sizes.dtype)
    slice_ = jnp.sum(row[None, :, None] >= ends[:, None, :], axis=-1)  # [P, rows]; S past the last slice
    valid = slice_ < sizes.shape[1]
    slice_ = jnp.minimum(slice_, sizes.shape[1] - 1)
    within = row[None, :] - jnp.take_along_axis(ends - sizes, slice_, axis=1)
    return slice_, within, valid


def _pack(operand: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array, peers: int, rows: int) -> jax.Array:
    """The sender's side: [P, rows, ...], block r its slices for peer r in slice order, zero past them."""
    starts, sizes = input_offsets.reshape(peers, -1), send_sizes.reshape(peers, -1)
    slice_, within, valid = _packed(sizes, rows)
    source = jnp.take_along_axis(starts, slice_, axis=1) + within
    source = jnp.where(valid, source, operand.shape[0])  # out of range: filled with zeros
    return operand.at[source.ravel()].get(mode="fill", fill_value=0).reshape(peers, rows, *operand.shape[1:])


def _landing(at: jax.Array, recv_sizes: jax.Array, peers: int, rows: int, size: int) -> jax.Array:
    """The receiver's side: where each row of the received blocks [P, rows] goes in an output of `size` rows, at
    the offsets `at` [K] its sender chose, recv_sizes [K] rows per slice; padding rows go to distinct rows past the
    end (dropped). -> [P x rows]"""
    slice_, within, valid = _packed(recv_sizes.reshape(peers, -1), rows)
    dest = jnp.take_along_axis(at.reshape(peers, -1), slice_, axis=1) + within
    return jnp.where(valid, dest, size + jnp.arange(peers * rows, dtype=dest.dtype).reshape(dest.shape)).ravel()


def _exchange(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
              output_offsets: jax.Array, recv_sizes: jax.Array, axis_name: AxisName) -> jax.Array:
    """The emulation: pack, one all_to_all of the blocks (and one of the offsets), scatter."""
    peers = jax.lax.axis_size(axis_name)
    slices = input_offsets.shape[0]
    if slices % peers:
        raise ValueError(f"ragged_all_to_all: {slices} slices do not split over {peers} devices of {axis_name}")
    rows = min(output.shape[0], slices // peers * operand.shape[0])
    send = _pack(operand, input_offsets, send_sizes, peers, rows)
    received = jax.lax.all_to_all(send, axis_name, 0, 0, tiled=True)  # [P sources, rows, ...]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source's slices land here
    dest = _landing(at, recv_sizes, peers, rows, output.shape[0])
    return output.at[dest].set(received.reshape(peers * rows, *received.shape[2:]), mode="drop", unique_indices=True)


def emulated_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                               send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                               axis_name: AxisName) -> jax.Array:
    """`jax.lax.ragged_all_to_all`'s result from an all_to_all of padded blocks (module docstring), for backends
    without the op. Inside shard_map (or another mapped context over `axis_name`), as the real one. Differentiated
    by jax through its gather, all_to_all and scatter, whose transposes are the real op's rule (module docstring)."""
    return _exchange(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name)
