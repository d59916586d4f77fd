"""Decode tokens/s with the KV cache vs recomputing the whole prefix for every new token (greedy, same model).

    python benchmarks/decode.py [--new-tokens 256] [--batch 8] [--prompt-length 16] [--rounds 3] [--devices 8] [k=v ...]

"cache" is maxshard.generation.decode's Engine: one prefill, then one jitted decode step per token that writes one
slot of the cache and attends over it. "recompute" is what generation without a cache does: every new token runs the
training forward pass over a fixed [batch, prompt + new tokens] buffer (fixed so it compiles once; the causal mask
makes the unfilled tail irrelevant) and reads the logits at each sequence's last position. Both produce the same
tokens (checked). The model is base.yml's default (emb 128, 4 layers, 4 heads x 32, mlp 512, byte vocabulary) with
random weights and max_target_length = prompt + new tokens, on the default layout (fsdp over --devices CPU devices);
end of sequence is disabled so every round generates exactly --new-tokens tokens. Rounds alternate cache, recompute,
... so the drift of a shared machine hits both alike; each figure is the median round.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import flax.linen as nn  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from maxshard.generation.decode import Engine, decode_model  # noqa: E402
from maxshard.generation.sampling import allowed_tokens  # noqa: E402
from maxshard.model.transformer import Transformer, abstract_params  # noqa: E402
from maxshard.parallel import mesh, sharding
from maxshard.run import loading  # noqa: E402
from maxshard.training.step import mesh_context  # noqa: E402

BASE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "base.yml")
NO_EOS, PAD = -1, 0


def random_params(cfg, shardings) -> dict:
    rng = np.random.default_rng(0)
    shapes = nn.unbox(abstract_params(cfg.model))
    host = jax.tree.map(lambda s: (cfg.emb_dim**-0.5 * rng.standard_normal(s.shape)).astype(np.float32), shapes)
    return jax.device_put(host, shardings)


class Recompute:
    """Greedy generation without a cache: the full forward pass over the whole buffer for every new token."""

    def __init__(self, cfg, params, allowed: jax.Array, length: int, generation_mesh, rules) -> None:
        self.model, self.params, self.allowed = Transformer(decode_model(cfg.model)), params, allowed
        self.mesh, self.rules, self.length = generation_mesh, rules, length
        self.step = jax.jit(self._step, donate_argnums=1)

    def _step(self, params: dict, buffer: jax.Array, lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
        """buffer [batch, length] holding lengths[b] tokens per row -> (buffer with one more token, lengths + 1)."""
        positions = jnp.broadcast_to(jnp.arange(self.length, dtype=jnp.int32), buffer.shape)
        logits = self.model.apply({"params": params}, buffer, jnp.ones_like(buffer), positions)
        last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
        token = jnp.argmax(jnp.where(self.allowed[None], last, jnp.finfo(jnp.float32).min), axis=-1)
        slot = jnp.arange(self.length)[None, :] == lengths[:, None]
        return jnp.where(slot, token[:, None].astype(jnp.int32), buffer), lengths + 1

    def generate(self, prompts: list[list[int]], new_tokens: int) -> tuple[np.ndarray, float]:
        """(new tokens [batch, new_tokens], seconds of the whole loop)."""
        buffer = np.full((len(prompts), self.length), PAD, np.int32)
        for i, p in enumerate(prompts):
            buffer[i, : len(p)] = p
        lengths = np.array([len(p) for p in prompts], np.int32)
        start = time.perf_counter()
        with mesh_context(self.mesh, self.rules):
            buf, cur = jnp.asarray(buffer), jnp.asarray(lengths)
            for i in range(new_tokens):
                buf, cur = self.step(self.params, buf, cur)
                if i % 8 == 7:  # as the Engine's loop: the host waits every 8 steps (XLA:CPU's simulated devices
                    jax.block_until_ready(cur)  # have deadlocked with hundreds of collective programs in flight)
            buf = jax.block_until_ready(buf)
        seconds = time.perf_counter() - start
        out = np.asarray(buf)
        return np.stack([out[i, n : n + new_tokens] for i, n in enumerate(lengths)]), seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8, help="prompts decoded together")
    parser.add_argument("--prompt-length", type=int, default=16, help="tokens per prompt, BOS included")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8, help="CPU devices of the mesh (the knobs fill them)")
    args = parser.parse_args(argv)
    length = args.prompt_length + args.new_tokens
    cfg = loading.load_run([BASE, "dataset_type=synthetic", f"max_target_length={length}", *args.overrides],
                           num_devices=args.devices, check_fit=False)
    generation_mesh, rules = mesh.build(cfg, jax.devices()[: args.devices]), sharding.flax_rules(cfg)
    params = random_params(cfg, sharding.tree_shardings(abstract_params(cfg.model), generation_mesh, rules))
    allowed = allowed_tokens(cfg.model.vocab_size, 259, (PAD, 1))
    rng = np.random.default_rng(1)
    prompts = [[1, *rng.integers(3, 259, args.prompt_length - 1).tolist()] for _ in range(args.batch)]
    engine, recompute = Engine(cfg.model, generation_mesh, rules, params, allowed), Recompute(
        cfg, params, allowed, length, generation_mesh, rules)
    cached = engine.generate(prompts, args.new_tokens, NO_EOS, PAD)  # compiles; a first untimed round of both
    tokens, _ = recompute.generate(prompts, args.new_tokens)
    assert np.array_equal(np.array(cached.tokens), tokens), "the cache and the full forward pass disagree"
    print(f"model: emb {cfg.emb_dim}, {cfg.num_layers} layers, {cfg.num_heads} heads x {cfg.head_dim}, mlp "
          f"{cfg.mlp_dim}, vocab {cfg.vocab_size}; batch {args.batch} x prompt {args.prompt_length} + "
          f"{args.new_tokens} new tokens; mesh {mesh.describe(generation_mesh)}; {os.cpu_count()} cores", flush=True)
    times: dict[str, list[float]] = {"cache": [], "recompute": []}
    for r in range(args.rounds):
        result = engine.generate(prompts, args.new_tokens, NO_EOS, PAD)
        times["cache"].append(result.prefill_seconds + result.decode_seconds)
        times["recompute"].append(recompute.generate(prompts, args.new_tokens)[1])
        print(f"round {r + 1}/{args.rounds}: cache {times['cache'][-1]:.2f}s (prefill "
              f"{result.prefill_seconds * 1e3:.0f} ms), recompute {times['recompute'][-1]:.2f}s", flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens_made = args.batch * args.new_tokens
    print("| variant | per new token | median s | decode tokens/s |")
    print("|---|---|---:|---:|")
    print(f"| cache | one [batch, 1] step over the KV cache (+ one prefill) | {med['cache']:.2f} | "
          f"{tokens_made / med['cache']:,.0f} |")
    print(f"| recompute | full forward over [batch, {length}] | {med['recompute']:.2f} | "
          f"{tokens_made / med['recompute']:,.0f} |")
    print(f"\nspeedup cache / recompute: {med['recompute'] / med['cache']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
