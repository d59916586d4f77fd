"""Where the train step's time goes at maxtext_compare.py's shape: variants of the whole step, and its parts.

    python benchmarks/step_breakdown.py [--steps 3] [--rounds 5] [--variants full,none,...] [--parts] [key=value ...]

Every variant is a whole train step (as the trainer jits it) of the issue #21 model (emb 256, 4 layers, 4 heads x
64, mlp 1024, vocab 1024, length 256, per-device batch 2, fsdp=8, float32) with some keys changed; `--parts` adds,
for the first variant, the step cut into pieces, each jitted alone with the trainer's shardings:

    forward+loss   the eval step: forward pass and cross-entropy sums, no gradient
    grads          value_and_grad of the loss (the step without the optimizer and the metric norms)
    optimizer      clip + AdamW update + apply_updates on a gradient-shaped tree, the norms of the metrics
    loss head      final norm + logits matmul + cross-entropy, forward and backward, on a [batch, length, embed] input

As in layouts.py, everything is compiled and warmed up first, then `--rounds` rounds each time `--steps` calls of
every variant in turn; a variant's figure is its median round, so drift on the shared machine hits all alike.
Besides wall time it reports the process's CPU time (user + system, all threads) per call: the 8 simulated devices
are 8 threads on 2 cores, and CPU time counts the work done whatever share of the cores other jobs took, so it is
the steadier figure on a loaded machine (it also counts any time the device threads spin while waiting).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from maxshard import data
from maxshard.model.layers.linears import DenseGeneral
from maxshard.model.layers.norms import RMSNorm
from maxshard.parallel import mesh
from maxshard.training.loss import loss_sums
from maxshard.training.step import Trainer, mesh_context

SHAPE = (
    *common.STEP_ONLY, "emb_dim=256", "num_layers=4", "num_heads=4", "num_kv_heads=4", "head_dim=64", "mlp_dim=1024",
    "vocab_size=1024", "max_target_length=256", "per_device_batch_size=2", "ici_fsdp_parallelism=8",
    "dtype=float32", "weight_dtype=float32", "enable_tensorboard=false",
)  # fmt: skip

VARIANTS: dict[str, tuple[str, ...]] = {
    "full": ("remat_policy=full",),
    "none": ("remat_policy=none",),
    "minimal": ("remat_policy=minimal",),
    "none-blockwise": ("remat_policy=none", "attention=blockwise", "attention_block_q=128", "attention_block_kv=128"),
    "full-blockwise": ("remat_policy=full", "attention=blockwise", "attention_block_q=128", "attention_block_kv=128"),
    "none-unscanned": ("remat_policy=none", "scan_layers=false"),
    "full-unscanned": ("remat_policy=full", "scan_layers=false"),
}


class Timed:
    """A jitted function and its arguments; `run(n)` calls it n times and returns seconds per call."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], chain: bool = False) -> None:
        self.fn, self.args, self.chain = fn, args, chain

    def run(self, n: int) -> tuple[float, float]:
        """(wall seconds, process CPU seconds) per call."""
        start, cpu = time.perf_counter(), time.process_time()
        out = None
        for _ in range(n):
            out = self.fn(*self.args)
            if self.chain:  # a train step: its state is donated, feed the new one back
                self.args = (out[0], *self.args[1:])
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n


def whole_step(argv: Sequence[str]) -> tuple[Timed, Trainer, Any, dict[str, jax.Array]]:
    cfg = common.load(argv)
    trainer = Trainer(cfg, mesh.build(cfg))
    batch_sharding = data.batch_sharding(cfg, trainer.mesh)
    batch = next(data.make_input(cfg, trainer.mesh))
    step = trainer.jit_train_step(batch_sharding)
    return Timed(step, (trainer.init_state(), batch), chain=True), trainer, batch_sharding, batch


def parts(trainer: Trainer, batch_sharding: Any, batch: dict[str, jax.Array]) -> dict[str, Timed]:
    """The pieces of one train step, each jitted alone (module docstring)."""
    cfg, m = trainer.cfg, trainer.mesh
    params = trainer.init_state().params
    shards = trainer.batch_shardings(batch_sharding)
    param_shardings = trainer.state_shardings.params
    replicated = NamedSharding(m, PartitionSpec())

    def ctx(fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            with mesh_context(m, trainer.rules):
                return fn(*args)

        return call

    fwd = ctx(jax.jit(trainer._eval_step, in_shardings=(param_shardings, shards), out_shardings=replicated))
    grads = ctx(jax.jit(lambda p, b: trainer._grads(p, b)[0], in_shardings=(param_shardings, shards),
                        out_shardings=param_shardings))  # fmt: skip
    opt_state = trainer.init_state().opt_state

    def optimizer(p: Any, g: Any, o: Any) -> Any:
        updates, o = trainer.tx.update(g, o, p)
        p = optax.apply_updates(p, updates)
        return p, o, optax.tree.norm(g), optax.tree.norm(p)

    opt = ctx(jax.jit(optimizer, in_shardings=(param_shardings, param_shardings, trainer.state_shardings.opt_state),
                      out_shardings=(param_shardings, trainer.state_shardings.opt_state, replicated, replicated)))

    # the loss head alone: final norm, [embed, vocab] logits matmul, cross-entropy; forward + backward
    act = NamedSharding(m, PartitionSpec(batch_sharding.spec[0], None, None))  # the batch's rows, whole rows
    x = jax.device_put(jnp.ones((cfg.global_batch_size, cfg.max_target_length, cfg.emb_dim), jnp.float32), act)
    head_params = {"w": params["logits"]["kernel"], "s": params["final_norm"]["scale"]}

    def head_loss(hp: Any, x: jax.Array, b: dict[str, jax.Array]) -> jax.Array:
        h = RMSNorm(cfg.model.norm_epsilon).apply({"params": {"scale": hp["s"]}}, x)
        logits = DenseGeneral((cfg.vocab_size,), ("embed", "vocab"), 1).apply({"params": {"kernel": hp["w"]}}, h)
        return loss_sums(logits, b)[0]

    head = ctx(jax.jit(jax.grad(head_loss, argnums=(0, 1)), in_shardings=(
        {"w": param_shardings["logits"]["kernel"], "s": param_shardings["final_norm"]["scale"]}, act, shards)))
    return {
        "forward+loss": Timed(fwd, (params, batch)),
        "grads": Timed(grads, (params, batch)),
        "optimizer": Timed(opt, (params, params, opt_state)),
        "loss head": Timed(head, (head_params, x, batch)),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every variant")
    parser.add_argument("--steps", type=int, default=3, help="calls per variant per round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median is reported)")
    parser.add_argument("--variants", default="full,none", help="comma list of " + ",".join(VARIANTS))
    parser.add_argument("--parts", action="store_true", help="also time the first variant's step in pieces")
    args = parser.parse_args(argv)
    timed: dict[str, Timed] = {}
    for i, name in enumerate(args.variants.split(",")):
        step, trainer, batch_sharding, batch = whole_step([common.BASE, *SHAPE, *VARIANTS[name], *args.overrides])
        timed[f"step {name}"] = step
        if args.parts and i == 0:
            timed.update({f"{part} ({name})": t for part, t in parts(trainer, batch_sharding, batch).items()})
    for name, t in timed.items():
        start = time.perf_counter()
        t.run(1)
        t.run(1)
        print(f"compiled + warmed up {name}: {time.perf_counter() - start:.1f} s", flush=True)
    wall: dict[str, list[float]] = {name: [] for name in timed}
    cpu: dict[str, list[float]] = {name: [] for name in timed}
    for r in range(args.rounds):
        for name, t in timed.items():
            w, c = t.run(args.steps)
            wall[name].append(w)
            cpu[name].append(c)
        print(f"round {r + 1}/{args.rounds} (load {os.getloadavg()[0]:.1f}): "
              + ", ".join(f"{n} {s[-1] * 1e3:.0f}" for n, s in wall.items()), flush=True)  # fmt: skip
    first = next(iter(wall))
    med = statistics.median
    print(f"| what | wall ms (median round) | wall ms (fastest round) | CPU ms (median round) | wall vs {first} | "
          f"CPU vs {first} |\n|---|---:|---:|---:|---:|---:|")  # fmt: skip
    for name in wall:
        print(f"| {name} | {med(wall[name]) * 1e3:.0f} | {min(wall[name]) * 1e3:.0f} | {med(cpu[name]) * 1e3:.0f} | "
              f"{med(wall[name]) / med(wall[first]):.2f} | {med(cpu[name]) / med(cpu[first]):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
