"""The sharded train state and the jitted train/eval steps.

The state is never materialised whole on one device: its shardings come from `jax.eval_shape` of the boxed init
plus the logical rules, and the init itself runs under `jax.jit(out_shardings=...)`, so every parameter and
optimizer moment is born in its final layout.

Loss: the run's objective (`maxshard/objectives`: next-token cross-entropy for `lm`, DPO/SimPO/ORPO on preference
pairs, GRPO on sampled completions) from the model's float32 per-token log-probabilities of the targets, of the
logits divided by the objective's temperature (`_tempered`: GRPO's sampling temperature, else 1). Gradient accumulation splits the batch
into k microbatches (by rows, so a preference pair stays whole) and sums losses, gradients and the objective's sums
before one division by the total weight, so k microbatches give exactly the gradient of the whole batch.
MoE models add their router losses (weighted by `load_balance_loss_weight` / `router_z_loss_weight` /
`moe_seq_balance_loss_weight`, scaled by each microbatch's loss weight so the division yields weighted means) and
report them with drop and load metrics; with `moe_bias_update_rate` the step then moves each layer's selection bias
toward equal load, from the loads of all its microbatches (`moe.move_bias`; the bias takes no gradient).

A reference model (DPO, KTO, GRPO) is a frozen copy of the starting parameters kept in the state (`reference`:
sharded like `params`, no gradient, no optimizer moments, saved in checkpoints), with LoRA the base with its
adapters off (`lora_base`: nothing kept), or log-probabilities scored in a first pass (`precomputed`:
training/precomputed.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from maxshard import objectives
from maxshard.config import MESH_AXES, Config, knob_name
from maxshard.errors import ConfigError
from maxshard.model import quantization, trainable
from maxshard.model.layers import moe, mtp
from maxshard.model.transformer import Transformer, apply_with_stats, init_params
from maxshard.objectives import kinds as objective_kinds
from maxshard.parallel import axis_names as ax
from maxshard.parallel import sharding, xla_options
from maxshard.training import pipelined
from maxshard.parallel.token_groups import TokenGroups
from maxshard.training.loss import GroupedHead, head_token_logps, token_logps
from maxshard.training.optim import learning_rate_schedule, make_optimizer

__all__ = ["TrainState", "Trainer", "mesh_context", "boxed_state", "abstract_state", "reference_kind"]

Batch = dict[str, jax.Array]


@struct.dataclass
class TrainState:
    """Everything a step changes. The model and optimizer are not stored here: they are code, not state.

    `params` is the whole network; `opt_state` holds moments for its trainable subset only (`trainable.py`: every
    parameter, or LoRA's adapters)."""

    step: jax.Array
    params: Any
    opt_state: Any
    reference: Any = None  # the frozen reference parameters (DPO, KTO, GRPO: `reference_kind` "frozen"), else None


@contextlib.contextmanager
def mesh_context(mesh: Mesh, rules: sharding.FlaxRules) -> Iterator[None]:
    """The mesh and logical rules every trace needs, so `nn.with_logical_constraint` takes effect."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def reference_kind(cfg: Config) -> str:
    """Where the run's reference log-probabilities come from: "" (its objective needs none), "frozen" (a copy of
    the starting parameters in the state), "lora_base" (the LoRA base, adapters off) or "precomputed" (the batch's
    `reference_logps`, written by a first pass: training/precomputed.py)."""
    source = objective_kinds.reference_source(cfg)
    if source != "auto":
        return source
    return "frozen" if trainable.trains_everything(cfg.model) else "lora_base"


def boxed_state(cfg: Config, rng: jax.Array) -> TrainState:
    """A fresh train state whose leaves are still boxed with their logical axis names."""
    params = init_params(cfg.model, rng)
    opt_state = make_optimizer(cfg).init(trainable.trainable_subset(params, cfg.model))
    reference = _copy(params) if reference_kind(cfg) == "frozen" else None
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=opt_state, reference=reference)


def _copy(params: Any) -> Any:
    """A second set of buffers with the same values (and boxes): the reference must not alias what trains."""
    return jax.tree.map(jnp.copy, params)


def abstract_state(cfg: Config) -> TrainState:
    """Shapes, dtypes and logical names of the whole train state; allocates nothing, needs no devices.

    Memoised on the config without its mesh knobs and its remat policy: they decide where the state lives and what
    the backward pass recomputes, never the state's shapes (a pipeline's stage count reaches the shapes through
    `cfg.model`, which stays in the key). The planner's layout search (`maxshard/run/search.py`) asks for one model's
    state once per layout, and `remat_policy: auto` plans the run under `full` before the trainer asks for the chosen
    policy's: tracing the init of the 8B model takes ~0.3 s each time.
    """
    model = cfg.model and dataclasses.replace(cfg.model, remat_policy="full")
    key = dataclasses.replace(cfg, explicit_keys=(), mesh_rule_applied="", remat_policy="full", memory_fit=None,
                              model=model, **{k: 1 for k in _MESH_KNOBS})
    try:
        hash(key)
    except TypeError:  # an unhashable value in some key: no memo
        return _eval_state.__wrapped__(cfg)
    return _eval_state(key)


_MESH_KNOBS = tuple(knob_name(family, axis) for family in ("ici", "dcn") for axis in MESH_AXES)


@functools.lru_cache(maxsize=32)
def _eval_state(cfg: Config) -> TrainState:
    return jax.eval_shape(lambda: boxed_state(cfg, jax.random.key(0)))


@dataclasses.dataclass
class Trainer:
    """Model + optimizer + mesh: builds the sharded state and the jitted steps."""

    cfg: Config
    mesh: Mesh

    def __post_init__(self) -> None:
        if self.cfg.model is None:
            raise ValueError("Trainer needs a complete config with its model derived (maxshard.run.loading.load_run)")
        self.rules = sharding.flax_rules(self.cfg)
        self.model = quantization.quantize(Transformer(self.cfg.model), self.cfg.quantization)
        self.objective = objectives.of(self.cfg)
        self.reference_kind = reference_kind(self.cfg)
        self.tx = make_optimizer(self.cfg)
        self.schedule = learning_rate_schedule(self.cfg)
        self.abstract_state = abstract_state(self.cfg)
        self.state_shardings = sharding.tree_shardings(self.abstract_state, self.mesh, self.rules)

    # ------------------------------------------------------------------ state

    def jit_init(self) -> Callable[[jax.Array], TrainState]:
        """key -> a fresh state, every leaf created in its sharding (the model is traced without a layout:
        `model.init_params`)."""
        return jax.jit(lambda r: nn.unbox(boxed_state(self.cfg, r)), out_shardings=self.state_shardings)

    def init_state(self, seed: int | None = None) -> TrainState:
        """A fresh state, created directly in its sharded layout."""
        return self.jit_init()(jax.random.key(self.cfg.seed if seed is None else seed))

    def state_from(self, params: Any, seed: int | None = None) -> TrainState:
        """Step 0 with `params` (sharded like the state's): every parameter, or with LoRA the frozen base, whose
        adapters are then drawn fresh from `seed` (the random base the same init would draw is never computed:
        only the adapters leave the jitted function) unless `params` holds them (a LoRA step's). Fresh optimizer
        moments for what trains."""
        model = self.cfg.model

        def fresh(loaded: Any, rng: jax.Array) -> TrainState:
            drawn, _ = trainable.split(nn.unbox(init_params(model, rng)), model)
            whole = loaded if trainable.trains_everything(model) else trainable.merge(loaded, drawn)  # loaded's win
            trained = trainable.trainable_subset(whole, model)
            reference = _copy(whole) if self.reference_kind == "frozen" else None
            return TrainState(jnp.zeros((), jnp.int32), whole, self.tx.init(trained), reference)

        rng = jax.random.key(self.cfg.seed if seed is None else seed)
        return jax.jit(fresh, out_shardings=self.state_shardings)(params, rng)

    # ------------------------------------------------------------------ steps

    @property
    def trains_mtp(self) -> bool:
        """Whether the step trains the multi-token prediction modules (layers/mtp.py): a model with some, a weight
        for their loss and the lm objective (the preference and GRPO objectives read the main head only)."""
        return objective_kinds.trains_mtp(self.cfg.objective, self.cfg.model.mtp_depth, self.cfg.mtp_loss_weight)

    def _token_logps(self, params: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(float32 log-probabilities of the targets [batch, length], MoE router statistics and, when the step
        trains them, the prediction modules' sums `mtp.loss_sums`)."""
        inputs = (batch["inputs"], batch["segment_ids"], batch["positions"])
        if self.objective.kind.scores:  # a reward model: one score per token (objectives/reward.py)
            hidden, stats = apply_with_stats(self.model, params, *inputs, method="hidden")
            return self.model.apply({"params": params}, hidden, method="scores"), stats
        if self.cfg.loss_chunks > 1 or self.trains_mtp:  # the head over pieces of the sequence (training/loss.py)
            method = "hidden_with_mtp" if self.trains_mtp else "hidden"
            out, stats = apply_with_stats(self.model, params, *inputs, method=method)
            hidden, predicted = out if self.trains_mtp else (out, [])
            head = self._head(params, batch["inputs"].shape[0])
            logps_of = functools.partial(head_token_logps, chunks=max(self.cfg.loss_chunks, 1))

            if predicted:
                stats = {**stats, **mtp.loss_sums(head, predicted, batch, logps_of)}
            return logps_of(head, hidden, batch["targets"]), stats
        logits, stats = apply_with_stats(self.model, params, *inputs)
        return token_logps(self._tempered(logits), batch["targets"]), stats

    def _tempered(self, logits: jax.Array) -> jax.Array:
        """The logits every log-probability of the loss is taken from: divided by the objective's temperature (GRPO
        samples its rollouts at `grpo_temperature`, and TRL scores the policy, the rollout policy and the reference
        at it too); the same array at 1."""
        temperature = self.objective.temperature
        return logits if temperature == 1 else logits / temperature

    def _head(self, params: Any, rows: int, groups: TokenGroups | None = None
              ) -> GroupedHead | Callable[[jax.Array], jax.Array]:
        """The output head as the loss pieces call it: grouped (training/loss.py `grouped_token_logps`: its weights
        gathered once and their gradient reduced once, not at every piece) where the loss has pieces, their tokens
        (`rows` x the piece's length) split over devices in whole groups (parallel/token_groups.py) and `params` is
        the state's tree; else the plain `head(x)` (one piece; one device's tokens; fewer rows than batch shards,
        which XLA pads; LoRA's reference without its adapters). `groups`: the token groups where the caller's mesh
        and rules are not the step's (a pipeline stage's, training/pipelined.py)."""
        key = "token_embed" if self.cfg.model.logits_via_embedding else "logits"
        head = functools.partial(self.model.apply, {"params": params}, method="head")
        plain = head if self.objective.temperature == 1 else lambda x: self._tempered(head(x))
        shardings = self.state_shardings.params
        if groups is None:
            dims = sharding.mesh_axes(ax.LOGITS, self.rules, dict(self.mesh.shape))
            groups = TokenGroups(self.mesh, self.rules, dims[0], dims[1])
        if (self.cfg.loss_chunks <= 1 or groups.size == 1 or key not in params
                or jax.tree.structure(params[key]) != jax.tree.structure(shardings[key])
                or not groups.fits(rows, self.cfg.max_target_length // self.cfg.loss_chunks)):
            return plain

        def apply(weights: Any, x: jax.Array) -> jax.Array:  # the head reads its own weights only
            return self._tempered(self.model.apply({"params": {key: weights}}, x, method="head"))

        return GroupedHead(apply, params[key], shardings[key], groups)

    def _reference_logps(self, params: Any, reference: Any, batch: Batch) -> jax.Array | None:
        """The reference model's log-probabilities (no gradient), or None when the objective needs none."""
        if not self.reference_kind:
            return None
        if self.reference_kind == "precomputed":
            return batch[objective_kinds.REFERENCE_FIELD]
        if self.reference_kind == "lora_base":
            reference = trainable.without_adapters(params)
        return jax.lax.stop_gradient(self._token_logps(reference, batch)[0])

    def _loss(self, trained: Any, batch: Batch, frozen: Any = None, reference: Any = None,
              totals: dict[str, jax.Array] | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(objective, sums) of the parameters `trained` + `frozen` (`trainable.split`): sums hold loss_sum and
        weight_sum, the objective's own sums (+ MoE sums); the objective adds router losses. `totals` are the
        objective's normalisers over the whole batch (this one's when None)."""
        params = trainable.merge(trained, frozen or {})
        logps, stats = self._token_logps(params, batch)
        predicted = {key: stats.pop(key) for key in mtp.SUMS if key in stats}
        totals = self.objective.totals(batch) if totals is None else totals
        loss_sum, sums = self.objective.sums(logps, batch, totals, self._reference_logps(params, reference, batch))
        sums = {**sums, **moe.loss_sums(stats, sums["weight_sum"]), **predicted}
        balance, z = self.cfg.load_balance_loss_weight, self.cfg.router_z_loss_weight
        extra = mtp.objective(sums, self.cfg.mtp_loss_weight)
        return loss_sum + moe.objective(sums, balance, z, self.cfg.moe_seq_balance_loss_weight) + extra, sums

    def _grads(self, trained: Any, batch: Batch, frozen: Any = None,
               reference: Any = None) -> tuple[Any, dict[str, jax.Array]]:
        """(sum of gradients of `trained`, sums of `_loss`) over the batch, in `gradient_accumulation_steps`
        pieces; `frozen` and `reference` get none."""
        grad_fn = jax.value_and_grad(self._loss, has_aux=True)
        if pipelined.runs(self.cfg):  # a table pipeline schedule: its runner computes the backward per stage
            grad_fn = pipelined.value_and_grad(self)
        k = self.cfg.gradient_accumulation_steps
        totals = self.objective.totals(batch)
        if k == 1:
            (_, sums), grads = grad_fn(trained, batch, frozen, reference, totals)
            return grads, sums

        def micro(carry: tuple[Any, Any], mb: Batch) -> tuple[tuple[Any, Any], None]:
            mb = {key: sharding.constrain(v, ax.INPUT_AXES) for key, v in mb.items()}
            (_, sums), grads = grad_fn(trained, mb, frozen, reference, totals)
            return jax.tree.map(jnp.add, carry, (grads, sums)), None

        # Row r of microbatch i is row r*k + i of the batch: every microbatch stays spread over all devices.
        micro_batches = {key: v.reshape(-1, k, *v.shape[1:]).swapaxes(0, 1) for key, v in batch.items()}
        first = jax.tree.map(lambda v: v[0], micro_batches)
        sums_shape = jax.eval_shape(self._loss, trained, first, frozen, reference, totals)[1]
        zeros = jax.tree.map(jnp.zeros_like, (trained, sums_shape))
        (grads, sums), _ = jax.lax.scan(micro, zeros, micro_batches)
        return grads, sums

    def _train_step(self, state: TrainState, batch: Batch) -> tuple[TrainState, dict[str, jax.Array]]:
        trained, frozen = trainable.split(state.params, self.cfg.model)
        grads, sums = self._grads(trained, batch, frozen, state.reference)
        loss_sum, weight_sum = sums["loss_sum"], sums["weight_sum"]
        grads = jax.tree.map(lambda g: g / jnp.maximum(weight_sum, 1.0), grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, trained)
        params = trainable.merge(optax.apply_updates(trained, updates), frozen)
        params = moe.move_bias(params, sums, self.cfg.moe_bias_update_rate)
        new_state = TrainState(state.step + 1, params, opt_state, state.reference)
        metrics = {
            "loss": loss_sum / jnp.maximum(weight_sum, 1.0),
            "tokens": sums["tokens"],
            "grad_norm": optax.tree.norm(grads),
            "param_norm": optax.tree.norm(new_state.params),
            "learning_rate": self.schedule(state.step),
            **moe.metrics(sums, weight_sum),
            **mtp.metrics(sums),
            **self.objective.metrics(sums),
        }
        return new_state, metrics

    def _eval_step(self, params: Any, batch: Batch, reference: Any = None) -> dict[str, jax.Array]:
        _, sums = self._loss(params, batch, reference=reference)
        return {"loss_sum": sums["loss_sum"], "weight_sum": sums["weight_sum"]}

    def batch_shardings(self, batch_sharding: NamedSharding) -> dict[str, NamedSharding]:
        return {k: batch_sharding for k in self.batch_fields}

    @property
    def batch_fields(self) -> dict[str, str]:
        """name -> dtype of every field of this run's batch: its objective's, and a precomputed reference's."""
        extra = {objective_kinds.REFERENCE_FIELD: "float32"} if self.reference_kind == "precomputed" else {}
        return {**objective_kinds.fields(self.cfg.objective), **extra}

    def jit_train_step(self, batch_sharding: NamedSharding) -> Callable[[TrainState, Batch], Any]:
        """The train step, jitted with explicit shardings and the state donated."""
        if self.cfg.global_batch_size % self.cfg.gradient_accumulation_steps:
            raise ConfigError(
                f"gradient_accumulation_steps={self.cfg.gradient_accumulation_steps} does not divide "
                f"the global batch of {self.cfg.global_batch_size}"
            )
        replicated = NamedSharding(self.mesh, PartitionSpec())
        step = jax.jit(
            self._train_step,
            in_shardings=(self.state_shardings, self.batch_shardings(batch_sharding)),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=0,
            compiler_options=xla_options.for_mesh(self.mesh, self.cfg.xla_gpu_options),
        )
        return self._in_context(step)

    def jit_eval_step(self, batch_sharding: NamedSharding) -> Callable[[Any, Batch, Any], Any]:
        """(params, batch, reference) -> loss and weight sums; `reference` is the state's (None unless frozen)."""
        replicated = NamedSharding(self.mesh, PartitionSpec())
        step = jax.jit(
            self._eval_step,
            in_shardings=(self.state_shardings.params, self.batch_shardings(batch_sharding),
                          self.state_shardings.reference),
            out_shardings=replicated,
            compiler_options=xla_options.for_mesh(self.mesh, self.cfg.xla_gpu_options),
        )
        return self._in_context(step)

    def _in_context(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            with mesh_context(self.mesh, self.rules):
                return fn(*args)

        call.lower = lambda *args: self._lower(fn, *args)  # type: ignore[attr-defined]
        return call

    def _lower(self, fn: Any, *args: Any) -> Any:
        with mesh_context(self.mesh, self.rules):
            return fn.lower(*args)
