"""planning/buffer_dump.py reads XLA's buffer assignment and live ranges; a buffer a loop carries counts, once.

A while loop's carry is one buffer under several names (the loop's operand, its body's parameter, what the body
returns, the loop's result; "(phi)" values in the dump). Counted under none of them, the live set at the heap's
fullest instruction missed circular's kept stage inputs (1.44 GiB at Llama-3-70B widths); counted under each, it
would hold them several times. XLA:CPU writes the same dumps as XLA:TPU, so a small loop checks both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxshard.planning import buffer_dump


def train_step(carried: jax.Array, other: jax.Array) -> jax.Array:  # the dump keeps modules named train_step
    def body(_, c):
        a, b = c
        return a * 1.0001 + jnp.sin(b).sum(), b + 1.0

    a, b = jax.lax.fori_loop(0, 5, body, (carried, other))
    return a.sum() + b.sum()


def test_the_buffers_live_at_the_peak_fill_the_heap_and_a_carried_one_counts_once(tmp_path):
    carried, other = jnp.ones((1024, 1024)), jnp.ones((512, 1024))  # 4 MiB and 2 MiB, float32
    jax.jit(train_step).lower(carried, other).compile(buffer_dump.options(str(tmp_path)))
    _, live, heap = buffer_dump.live_at_peak(str(tmp_path))
    assert heap - sum(size for size, _, _ in live) < 1024, (heap, live)  # the loop's heap is all live at its peak
    assert [size for size, _, shape in live if shape.startswith("f32[1024,1024]")] == [carried.nbytes], live
