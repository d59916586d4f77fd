"""A new layer kind needs no planner code: a token mixer defined and registered only in this file (a module with its
own parameters and its own saved projections, and one `spec/mixer_kinds.py` row) is planned by `maxshard.plan`, the
formula estimate and the compiled answer both, with no file of maxshard/planning/ naming it.

The estimate's parameter and optimizer bytes come from the model's abstract parameters, so the toy's are counted
as they are; its activations are what the remat policy keeps of a layer and what the backward re-runs, which the
planner traces from the model, not from the kind. Checked here against XLA:CPU on 8 simulated devices (within
TOY_BOUND, for the toy and for gated DeltaNet, a kind of maxshard's own that planning/ does not name either) and,
through the CLI, compiled for a v5e 2x4 slice with libtpu.
"""

from __future__ import annotations

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax.ad_checkpoint import checkpoint_name

from maxshard import plan as plan_cli
from maxshard.model.layers.linears import DenseGeneral
from maxshard.parallel import axis_names as ax
from maxshard.planning import compiled, estimate
from maxshard.spec import mixer_kinds
from maxshard.spec.model_config import ModelConfig
from tests.helpers import mesh_for, tiny_config


class GatedShift(nn.Module):
    """Each token mixes in its predecessor within its document: y_t = W_out (g_t * x_{t-1} + (1 - g_t) * x_t), the
    gate g_t = sigmoid(W_gate x_t). Its two projections are named as attention's are (`query_proj`, `out_proj`), so
    the policies that keep those keep them here too."""

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        width = x.shape[-1]
        gate = DenseGeneral((width,), (ax.EMBED, ax.MLP), 1, self.dtype, self.weight_dtype, name="gate")(x)
        gate = jax.nn.sigmoid(checkpoint_name(gate, "query_proj"))
        previous = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        same = jnp.pad(segment_ids, ((0, 0), (1, 0)), constant_values=-1)[:, :-1] == segment_ids
        mixed = jnp.where(same[..., None], gate * previous + (1 - gate) * x, x)
        out = DenseGeneral((width,), (ax.MLP, ax.EMBED), 1, self.dtype, self.weight_dtype, name="out")(mixed)
        return checkpoint_name(out, "out_proj")


ROW = mixer_kinds.Mixer(
    "gated_shift", f"{__name__}:GatedShift", "shift_mixer", "recurrent",
    params=lambda cfg: {"qkv": cfg.emb_dim * cfg.emb_dim, "out": cfg.emb_dim * cfg.emb_dim},
    flops=lambda cfg, window: 6 * cfg.emb_dim,
    summary="a test's toy: a gated shift by one token and a projection", remat_names=("query_proj", "out_proj"))
TYPES = "layer_types=gated_shift,full_attention"  # a unit of the toy and an attention layer
ONLY_THE_TOY = "layer_types=gated_shift,gated_shift"  # every layer the toy: units of one
# The most the estimate is over XLA:CPU's compile for a model of a kind the formula does not count: one layer's
# backward working set is the standard layer's (planning/memory.py: fitted to attention and SwiGLU layers), with what
# the kind re-runs instead of attention traced from the kind itself (`_recomputed_option_bytes`). Measured in
# benchmarks/README.md ("A new layer kind in the plan").
TOY_BOUND = 1.35
# Gated DeltaNet alone, two layers at 1024 tokens (chunks of 16): no attention scores, whose bytes grow with the
# length in the standard working set, and a chunked delta rule that re-runs in the backward
DELTANET = ("emb_dim=64", "num_heads=4", "num_kv_heads=4", "head_dim=16", "mlp_dim=256", "linear_num_key_heads=2",
            "linear_num_value_heads=4", "linear_key_head_dim=16", "linear_value_head_dim=16", "delta_chunk_size=16",
            "num_layers=2", "layer_types=linear_attention,linear_attention", "max_target_length=1024",
            "ici_fsdp_parallelism=8", "attention=dot_product")


@pytest.fixture(scope="module", autouse=True)
def registered():
    mixer_kinds.register(ROW)
    yield
    mixer_kinds.unregister(ROW.name)


@pytest.mark.parametrize("policy", ["none", "save_qkv_out_proj", "full"])
def test_the_estimate_of_a_toy_kind_is_exact_in_its_state_and_safe_in_its_peak(policy: str) -> None:
    """fsdp=4 x tensor=2 on the simulated devices, compiled by XLA:CPU: the state's bytes are exact (the toy's
    parameters are the model's), the saved term follows what the toy keeps (traced from the layer,
    model/residuals.py), and the planned peak is never below the compiled one (a plan that says it fits, fits),
    and over it by at most TOY_BOUND, under a policy that saves everything, one that keeps the toy's named
    projections and one that keeps each layer's input."""
    cfg = tiny_config("num_layers=2", ONLY_THE_TOY, "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2",
                      f"remat_policy={policy}")
    plan = estimate.make_plan(cfg)
    _, step = compiled.compile_step_memory(cfg, mesh_for(cfg))
    assert (step.params, step.optimizer) == (plan.params, plan.optimizer + 4)  # + the int32 step counter
    attention = estimate.make_plan(tiny_config("num_layers=2", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2",
                                               f"remat_policy={policy}"))
    assert plan.activation_terms.saved != attention.activation_terms.saved  # the toy's own residuals, not attention's
    assert 1 <= plan.peak_bytes / step.peak <= TOY_BOUND, (plan.peak_bytes, step)


@pytest.mark.parametrize("policy", ["minimal", "full"])
def test_a_kind_without_scores_leaves_them_out_of_the_working_set(policy: str) -> None:
    """Gated DeltaNet, a kind of maxshard's own that planning/ names nowhere, under the policies that re-run it in
    the backward: its estimate is not below its XLA:CPU compile and over it by at most TOY_BOUND. Counting the
    standard layer's [length, length] scores for it, as the estimate did, planned 2.1x (minimal) and 2.8x (full)
    its compiled peak at this length."""
    cfg = tiny_config(*DELTANET, f"remat_policy={policy}")
    _, step = compiled.compile_step_memory(cfg, mesh_for(cfg))
    assert 1 <= estimate.make_plan(cfg).peak_bytes / step.peak <= TOY_BOUND, step


def test_maxshard_plan_plans_a_toy_kind_by_estimate_and_by_compile(capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI on a v5e 2x4 slice, a toy layer and an attention layer: --estimate gives the formula's verdict and
    says it is one; the default compiles the real init and train step with libtpu (the toy's Flax module through
    XLA:TPU), and the compiled state's bytes are the plan's."""
    argv = ["configs/base.yml", "model_name=tiny", TYPES, "--topology", "v5litepod-8"]
    assert plan_cli.main([*argv, "--estimate"]) == 0
    notice, last = capsys.readouterr().out.strip().splitlines()[-2:]
    assert notice.startswith("estimate: the formula plan") and last.startswith("fit: yes, "), (notice, last)
    assert plan_cli.main([*argv, "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    step, planned = printed["compiled"]["step"], printed["bytes_per_device"]
    assert printed["answer"] == "compiled" and printed["compiled"]["fits"], printed["compiled"]
    assert (step["params"], step["optimizer"]) == (planned["params"], planned["optimizer"] + 4)
    # the parameters the plan counts are the model's: one layer's q, k, v and output kernels (4 x 64 x 64 in the
    # tiny preset) replaced by the toy's gate and out (2 x 64 x 64)
    attention_only = plan_cli.plan_for(argv[:2], "v5litepod-8").param_count
    assert printed["param_count"] == attention_only - 4 * 64 * 64 + 2 * 64 * 64
