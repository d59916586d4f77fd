"""Refilled rows against rounds: N prompts generated R rows at a time, each finished row taking the next prompt
(`Engine.generate(..., rows=R)`, generation/refill.py; GRPO's `grpo_rollout_rows`), against ceil(N / R) rounds of
R prompts each, and against all N in one batch.

    python benchmarks/refill.py [--prompts 64] [--rows 16] [--new-tokens 64] [--stops 3] [--repeats 3] [k=v ...]

The model is base.yml's default with random weights on 8 CPU devices (fsdp), greedy, so all three produce the same
tokens (checked). Completions end unevenly: the stop ids are the `--stops` tokens a first run without stops chose
most often, so some sequences end after a few tokens and others run to --new-tokens. Figures: the wall time of
prefill and decode without compiles (`Result.prefill_seconds + decode_seconds`, the median of --repeats, the three
ways interleaved), the decode steps, and the decode step's compiled memory (`memory_analysis()`: its arguments
and outputs hold the cache of the rows it decodes), which is what R rows save against N.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
from collections.abc import Sequence

import common  # first: 8 simulated CPU devices before any device query; the repo on sys.path
import flax.linen as nn
import jax
import numpy as np

from maxshard.generation.decode import Engine, Result
from maxshard.generation.sampling import allowed_tokens
from maxshard.model.transformer import abstract_params
from maxshard.parallel import mesh, sharding

PAD = 0


def engine_for(overrides: Sequence[str]) -> tuple[Engine, int]:
    cfg = common.load([common.BASE, *overrides])
    generation_mesh, rules = mesh.build(cfg), sharding.flax_rules(cfg)
    shapes = abstract_params(cfg.model)
    rng = np.random.default_rng(0)
    host = jax.tree.map(lambda s: (cfg.emb_dim**-0.5 * rng.standard_normal(s.shape)).astype(np.float32),
                        nn.unbox(shapes))
    params = jax.device_put(host, sharding.tree_shardings(shapes, generation_mesh, rules))
    allowed = allowed_tokens(cfg.model.vocab_size, 259, (PAD, 1))
    return Engine(cfg.model, generation_mesh, rules, params, allowed), cfg.model.vocab_size


def seconds(result: Result) -> float:
    return result.prefill_seconds + result.decode_seconds


def rounds(engine: Engine, prompts: list[list[int]], new: int, stops: tuple[int, ...], rows: int,
           length: int) -> tuple[list[list[int]], float, int]:
    """(tokens, seconds, decode steps) of ceil(N / rows) generations of `rows` prompts each."""
    tokens, wall, steps = [], 0.0, 0
    for start in range(0, len(prompts), rows):
        part = engine.generate(prompts[start: start + rows], new, stops, PAD, prompt_length=length)
        tokens += part.tokens
        wall, steps = wall + seconds(part), steps + part.decode_steps
    return tokens, wall, steps


def decode_bytes(engine: Engine, rows: int, cache_length: int) -> int:
    memory = engine.compile_decode(rows, cache_length)[1].memory_analysis()
    return memory.argument_size_in_bytes + memory.output_size_in_bytes - memory.alias_size_in_bytes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--stops", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    engine, vocab = engine_for(args.overrides)
    rng = np.random.default_rng(1)
    prompts = [[1, *rng.integers(3, 259, int(n)).tolist()] for n in rng.integers(4, 16, args.prompts)]
    length, new = 16, args.new_tokens
    free = engine.generate(prompts, new, (vocab + 1,), PAD, prompt_length=length)  # an id never sampled: no stop
    counts = collections.Counter(t for row in free.tokens for t in row[1:])
    stops = tuple(t for t, _ in counts.most_common(args.stops))
    ways = {
        "one batch": lambda: (lambda r: (r.tokens, seconds(r), r.decode_steps))(
            engine.generate(prompts, new, stops, PAD, prompt_length=length)),
        "rounds": lambda: rounds(engine, prompts, new, stops, args.rows, length),
        "refill": lambda: (lambda r: (r.tokens, seconds(r), r.decode_steps))(
            engine.generate(prompts, new, stops, PAD, prompt_length=length, rows=args.rows)),
    }
    for way in ways.values():
        way()  # compile
    timed: dict[str, list[float]] = {name: [] for name in ways}
    outputs = {}
    for _ in range(args.repeats):
        for name, way in ways.items():
            outputs[name] = way()
            timed[name].append(outputs[name][1])
    reference = outputs["one batch"][0]
    assert all(out[0] == reference for out in outputs.values()), "the three ways gave different tokens"
    lengths = sorted(len(t) for t in reference)
    print(f"{args.prompts} prompts, {new} new tokens at most, stops {stops}: completion lengths min {lengths[0]}, "
          f"median {lengths[len(lengths) // 2]}, max {lengths[-1]}")
    print("| way | rows | seconds | decode steps | decode step memory (MiB) |")
    print("|---|---|---|---|---|")
    for name in ways:
        rows = args.prompts if name == "one batch" else args.rows
        rows = -(-rows // 8) * 8 if rows % 8 else rows
        mib = decode_bytes(engine, rows, length + new) / 2**20
        print(f"| {name} | {rows} | {statistics.median(timed[name]):.3f} | {outputs[name][2]} | {mib:.2f} |")
    print(f"refill / rounds: {statistics.median(timed['refill']) / statistics.median(timed['rounds']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
