"""What the circular pipeline's backward keeps per iteration is what its schedule says: one stage input.

The schedule (`spec/pipeline_schedule.Circular.kept_inputs`) and the planner count M*R + S - 1 kept stage inputs,
one per iteration (each iteration's stage computation is one checkpoint). The gradient's jaxpr shows what really
crosses from the forward loop to the backward one: the backward scan's per-iteration inputs (the residuals, stacked
over iterations). Each must be small beside a stage input except that one stage input: the bubble mask once
travelled as well, a bool per stage-input element and iteration (half a bf16 stage input per iteration, 0.7 GiB
per device at Llama-3-70B widths; benchmarks/README.md, pipeline schedules), and a residual like it fails here.
Tracing only, no compile.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.model.layers import pipeline
from maxshard.model.layers.decoder import DecoderLayer
from maxshard.parallel import sharding
from maxshard.spec import pipeline_schedule
from maxshard.training.step import mesh_context
from tests.helpers import mesh_for
from tests.test_pipeline import small_config


def _backward_scan_inputs(jaxpr, iterations: int) -> list:
    """The per-iteration inputs (xs) of the reverse scans of `iterations` steps at the jaxpr's top level."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan" and eqn.params["reverse"] and eqn.params["length"] == iterations:
            found += [v.aval for v in eqn.invars[_consts_and_carry(eqn.params):]]
    return found


def _consts_and_carry(params: dict) -> int:
    """How many of a scan's inputs come before its xs: jax 0.10 counts them in `num_consts` and `num_carry`;
    jax 0.12 keeps the tree of its inputs as `ft_in` (a flat tree of (consts, carry, xs)), one leaf an input."""
    if "num_consts" in params:
        return params["num_consts"] + params["num_carry"]
    consts, carry, _ = params["ft_in"].tree.children()
    return consts.num_leaves + carry.num_leaves


def test_the_circular_backward_keeps_one_stage_input_per_iteration_and_no_mask():
    cfg = small_config("num_layers=4", "ici_pipeline_parallelism=2", "num_pipeline_microbatches=4")  # R=2
    schedule = pipeline_schedule.of(cfg.model.pipeline)
    batch, length, emb = 16, 16, cfg.emb_dim
    x = jnp.zeros((batch, length, emb), jnp.float32)
    segment_ids, positions = jnp.ones((batch, length), jnp.int32), jnp.broadcast_to(jnp.arange(length), x.shape[:2])
    module = pipeline.Pipeline(cfg.model, DecoderLayer, jnp.float32, jnp.float32)
    stage_input = schedule.stages * (batch // schedule.microbatches) * length * emb  # elements, all stages

    with mesh_context(mesh_for(cfg), sharding.flax_rules(cfg)):
        params = jax.eval_shape(lambda: nn.unbox(module.init(jax.random.key(0), x, segment_ids, positions)))
        objective = lambda p, x: jnp.sum(module.apply(p, x, segment_ids, positions))  # noqa: E731
        jaxpr = jax.make_jaxpr(jax.grad(objective, argnums=(0, 1)))(params, x).jaxpr

    residuals = _backward_scan_inputs(jaxpr, schedule.iterations)
    per_iteration = [math.prod(a.shape[1:]) for a in residuals]
    large = [a for a, n in zip(residuals, per_iteration) if n >= stage_input // 8]
    assert [(a.shape[1:], a.dtype) for a in large] == [((schedule.stages, batch // schedule.microbatches, length, emb),
                                                         jnp.dtype(jnp.float32))], large
    assert schedule.kept_inputs == schedule.iterations == residuals[0].shape[0]
    assert sum(per_iteration) < stage_input * 1.05  # the rest: indices and the [stages] bubble flags
