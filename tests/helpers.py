"""Shared test helpers: tiny configs, meshes over a subset of devices, and tree comparisons."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from maxshard import config
from maxshard.parallel import mesh
from maxshard.run import loading

# A model small enough to compile in seconds, with 8 heads so tensor=8 divides them.
TINY = (
    "dataset_type=synthetic",
    "emb_dim=64",
    "num_layers=2",
    "num_heads=8",
    "num_kv_heads=8",
    "head_dim=8",
    "mlp_dim=128",
    "max_target_length=32",
    "warmup_steps_fraction=0.0",
    "learning_rate=1e-2",
    "eval_period=0",
    "weight_decay=0.1",
    "remat_policy=full",  # pinned: `auto` plans the run first; the tests of auto ask for it
)


def tiny_config(*overrides: str, num_devices: int = 8, global_batch: int = 16,
                device_kind: str = "cpu") -> config.Config:
    """A finalized tiny config for `num_devices` with a fixed global batch, whatever the device count. `device_kind`
    (jax's, e.g. 'NVIDIA H100 80GB HBM3') resolves what depends on the chip (dtype, attention, the MoE exchange) as
    a run there would: the accelerator tests (tests/test_accelerators.py) pass their device's."""
    per_device = f"per_device_batch_size={global_batch / num_devices}"
    merged = {item.split("=", 1)[0]: item for item in (*TINY, per_device, *overrides)}  # later wins
    parsed = config.parse(["configs/base.yml", *merged.values()])
    return loading.complete(config.finalize(parsed, num_devices, device_kind))


def mesh_for(cfg: config.Config) -> jax.sharding.Mesh:
    return mesh.build(cfg, jax.devices()[: cfg.num_devices])


def max_relative_difference(a: Any, b: Any) -> float:
    """Largest, over leaves, of max|a - b| / max|b|: the error relative to each array's own scale."""

    def leaf(x: Any, y: Any) -> float:
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        return float(np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-12))

    return max(jax.tree.leaves(jax.tree.map(leaf, jax.device_get(a), jax.device_get(b))))


def gradient_agreement(grads: Any, reference: Any) -> tuple[float, float]:
    """(cosine similarity, relative error ||g - r|| / ||r||) of two gradient trees, each flattened whole into one
    float64 vector: one figure for the whole step, so a leaf that is small in the sum weighs little (unlike
    `max_relative_difference`, which holds each leaf to its own scale)."""

    def flat(tree: Any) -> np.ndarray:
        return np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(jax.device_get(tree))])

    g, r = flat(grads), flat(reference)
    cosine = float(g @ r / (np.linalg.norm(g) * np.linalg.norm(r)))
    return cosine, float(np.linalg.norm(g - r) / np.linalg.norm(r))


def layout_overrides(layout: Sequence[str]) -> tuple[str, ...]:
    """A layout's knobs with every other ici knob pinned to 1 (base.yml fills fsdp with -1)."""
    explicit = {item.split("=")[0] for item in layout}
    fsdp = () if "ici_fsdp_parallelism" in explicit else ("ici_fsdp_parallelism=1",)
    return tuple(layout) + fsdp


def loss_and_grads(trainer: Any, params: Any, batch: Any) -> tuple[float, Any]:
    """(mean loss, gradient sums) of one batch, jitted on the trainer's mesh; gradients stay un-normalised."""
    from maxshard.training.step import mesh_context

    with mesh_context(trainer.mesh, trainer.rules):
        grads, sums = jax.jit(trainer._grads)(params, batch)
    return float(sums["loss_sum"] / sums["weight_sum"]), jax.device_get(grads)


def ragged_all_to_all_reference(operands: Sequence[np.ndarray], outputs: Sequence[np.ndarray],
                                slices: Sequence[Sequence[np.ndarray]]) -> list[np.ndarray]:
    """`jax.lax.ragged_all_to_all` over the devices of one axis, in numpy, as its docstring's pseudocode says:
    device d's slice i, operand[input_offsets[i]:][:send_sizes[i]], is received by peer i // S (S slices per peer)
    and written there at the SENDER's output_offsets[i], recv_sizes[...] rows (the receiver's count of it); the
    rest of each output stays. `slices[d]`: device d's (input_offsets, send_sizes, output_offsets, recv_sizes)."""
    results = [np.array(out) for out in outputs]
    per_peer = len(slices[0][0]) // len(operands)
    for receiver, result in enumerate(results):
        recv_sizes = slices[receiver][3]
        for source, (input_offsets, _, output_offsets, _) in enumerate(slices):
            for j in range(per_peer):
                sent, size = receiver * per_peer + j, recv_sizes[source * per_peer + j]
                at, start = output_offsets[sent], input_offsets[sent]
                result[at:at + size] = operands[source][start:start + size]
    return results


def finished(procs: list[subprocess.Popen], timeout: float = 240) -> list[str]:
    """Each process's output once all exited 0 (any left running is killed, so no test leaves one behind)."""
    try:
        outputs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outputs):
        assert p.returncode == 0, out[-3000:]
    return outputs


def run_losses(run_dir: Path, steps: int) -> list[float]:
    """The training losses of steps 1..steps from a run's metrics.jsonl (every step logged exactly once)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in records if "loss" in r}
    assert sorted(losses) == list(range(1, steps + 1)), losses
    return [losses[s] for s in sorted(losses)]


def process_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of a training process that sets its own CPU device count (`cpu_device_count`): conftest's
    `env` less a device count forced in XLA_FLAGS (`--xla_force_host_platform_device_count`), which is not the
    process's to inherit. The rest of XLA_FLAGS stays, conftest's optimization level among it: multi-process runs
    compile like every other test (the bulk of their CPU time), and runs compared with each other compile alike."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", "")).split()
    return {**{k: v for k, v in env.items() if k != "XLA_FLAGS"}, **({"XLA_FLAGS": " ".join(flags)} if flags else {})}
