"""What one MoE layer holds on XLA:TPU per token: a Mixtral 8x7B MoE layer (emb 4096, 8 experts of 14336, top-2),
rematerialised as remat does, forward and backward, compiled ahead of time for one v6e chip (libtpu, no TPU) at 1 and
2 sequences of 4096 tokens; the temporaries' slope per token. Not what a train step holds: the loss here is the
`sum` of the output, a constant output gradient XLA folds into the backward, so the slope (2E + F per routed row
dropping) is far below the whole step's (2E + 6F, benchmarks/live_buffers.py); the planner takes the step's
(`maxshard/planning/fitted.py` `Fitted.moe_rows`, benchmarks/README.md "Mixtral 8x7B").

    python benchmarks/moe_layer_tpu.py [--batches 1,2] [capacity_factor=1.25] [moe_group_size=0] [emb_dim=...]

One layer on one chip, not the whole step: the step's other terms (fsdp gathers, the attention, the loss) are the
planner's own; `python -m maxshard.plan ... --compile` checks the sum (benchmarks/README.md, "Mixtral 8x7B").
Each compile takes 3-7 minutes on 2 busy cores.
"""

from __future__ import annotations

import argparse
import time

import common  # noqa: F401 - the repository on sys.path, JAX on CPU before anything queries it
import jax
import jax.numpy as jnp

from maxshard.launch import topologies
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import moe
from maxshard.planning.compiled import _FAST
from maxshard.planning.tpu_compile import abstract_devices

MIXTRAL = dict(vocab_size=32000, emb_dim=4096, mlp_dim=14336, num_experts=8, num_experts_per_tok=2,
               capacity_factor=1.25, moe_dropless_impl="ragged_dot")
LENGTH = 4096


def temporaries(cfg: ModelConfig, batch: int, device: object) -> int:
    """Temporary bytes of the layer's rematerialised forward + backward (gradients of weights and input)."""
    block = moe.MoEBlock(cfg, jnp.bfloat16, jnp.float32)
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.ShapeDtypeStruct((batch, LENGTH, cfg.emb_dim), jnp.bfloat16)
    segments = jax.ShapeDtypeStruct((batch, LENGTH), jnp.int32)
    params = jax.eval_shape(lambda: block.init(jax.random.key(0), jnp.zeros((1, LENGTH, cfg.emb_dim), jnp.bfloat16),
                                               jnp.ones((1, LENGTH), jnp.int32)))

    def loss(p, x, seg):
        layer = jax.checkpoint(lambda p, x: block.apply(p, x, seg, mutable=["intermediates"])[0])
        return jnp.sum(layer(p, x).astype(jnp.float32))

    shardings = (jax.tree.map(lambda _: sharding, params), sharding, sharding)
    step = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=shardings)
    return step.lower(params, x, segments).compile(_FAST).memory_analysis().temp_size_in_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2", help="sequences of 4096 per compile (two or more: a slope)")
    parser.add_argument("overrides", nargs="*", help="ModelConfig fields, key=value")
    args = parser.parse_args()
    fields = dict(MIXTRAL)
    for item in args.overrides:
        key, value = item.split("=", 1)
        fields[key] = type(fields[key])(value) if key in fields else int(value)
    cfg = ModelConfig(**fields)
    device = abstract_devices(topologies.parse("v6e-1"))[0]
    batches = [int(b) for b in args.batches.split(",")]
    temps = []
    for b in batches:
        started = time.perf_counter()
        temps.append(temporaries(cfg, b, device))
        print(f"{b} x {LENGTH} tokens: temporaries {temps[-1]:,} B ({time.perf_counter() - started:.0f} s)", flush=True)
    if len(batches) > 1:
        slope = (temps[-1] - temps[0]) / ((batches[-1] - batches[0]) * LENGTH)
        print(f"per token {slope:,.0f} B; constant {temps[0] - slope * batches[0] * LENGTH:,.0f} B")


if __name__ == "__main__":
    main()
