"""The decoder-only Transformer, assembled from layers, plus its parameter and FLOP counts.

    inputs [batch, length] -> embed [batch, length, embed] (x sqrt(embed) with `embed_scale`) -> decoder blocks
        (with Gemma 4's per-layer inputs beside them, layers/per_layer_inputs.py) -> final RMSNorm
        -> logits [batch, length, vocab] (float32), through a separate head or the tied embedding, soft-capped
        with `final_logit_softcapping`.

A reward model (`score_head`) ends in one score per token instead, [batch, length] (float32), through a [embed, 1]
kernel `score` (Hugging Face's ForSequenceClassification head with one label); it has no logits head of its own.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import kv_cache, moe, mtp, pipeline, ring_attention
from maxshard.model.layers.decoder import Decoder
from maxshard.model.layers.embeddings import Embed
from maxshard.model.layers.linears import DenseGeneral
from maxshard.model.layers.norms import RMSNorm
from maxshard.model.layers.per_layer_inputs import PerLayerEmbed
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain

__all__ = ["Transformer", "init_params", "count_params", "param_count", "abstract_params", "apply_with_stats",
           "abstract_cache"]


def scale_embedded(x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Token embeddings as the stack reads them: Gemma (`embed_scale`) multiplies them by sqrt(width), rounded to
    the compute dtype as transformers does; other families read them as looked up. The one home of that rule
    (the table pipeline's stage-0 lookup, training/pipelined.py, applies it too)."""
    return x * jnp.asarray(math.sqrt(cfg.emb_dim), x.dtype) if cfg.embed_scale else x


class Transformer(nn.Module):
    """The whole network, built from a `ModelConfig` alone.

    Calling it gives the logits; `hidden` and `head` are its two halves, so a loss can run the output head over
    pieces of the sequence (`maxshard/training/loss.py`) instead of holding [batch, length, vocab] float32 logits at
    once.
    """

    cfg: ModelConfig

    def setup(self) -> None:
        cfg = self.cfg
        dt, wdt = cfg.compute_dtype, cfg.param_dtype
        self.token_embed = Embed(cfg.vocab_size, cfg.emb_dim, dt, wdt,
                                 init_stddev=cfg.emb_dim**-0.5 if cfg.logits_via_embedding else 1.0)
        if cfg.per_layer_input_dim:  # Gemma 4
            self.per_layer_embed = PerLayerEmbed(cfg, dt, wdt)
        self.decoder = Decoder(cfg, dt, wdt)
        self.final_norm = RMSNorm(cfg.norm_epsilon, dt, wdt, cfg.norm_unit_offset)
        self.mtp = [mtp.PredictionModule(cfg, k, dt, wdt, name=f"mtp_{k}") for k in range(1, cfg.mtp_depth + 1)]
        if cfg.score_head:
            self.score = DenseGeneral((1,), (ax.EMBED, ax.NORM), 1, dt, wdt)
        elif not cfg.logits_via_embedding:
            self.logits = DenseGeneral((cfg.vocab_size,), (ax.EMBED, ax.VOCAB), 1, dt, wdt)

    def __call__(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """[batch, length] ids -> logits [batch, length, vocab] (float32)."""
        return self.head(self.hidden(inputs, segment_ids, positions))

    def hidden(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """[batch, length] ids -> the normalised last residual stream [batch, length, embed] the head reads."""
        return self.final_norm(self._stream(inputs, segment_ids, positions)[1])

    def hidden_with_mtp(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array
                        ) -> tuple[jax.Array, list[jax.Array]]:
        """`hidden`, and what the head reads of each multi-token prediction module (layers/mtp.py), in order."""
        embedded, last = self._stream(inputs, segment_ids, positions)
        return self.after_stack(last, embedded, segment_ids, positions)

    def after_stack(self, last: jax.Array, embedded: jax.Array, segment_ids: jax.Array, positions: jax.Array
                    ) -> tuple[jax.Array, list[jax.Array]]:
        """From the last residual stream (and the embedded tokens): the final norm, then each prediction module on
        what the head read one depth before (layers/mtp.py). Also the table pipelines' last part."""
        hidden = x = self.final_norm(last)
        predicted = []
        for module in self.mtp:
            x = module(x, embedded, segment_ids, positions)
            predicted.append(x)
        return hidden, predicted

    def everything(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array) -> jax.Array:
        """The logits (a reward model's scores), having run every module once (the prediction modules too): what
        init traces, so every parameter is created."""
        hidden = self.hidden_with_mtp(inputs, segment_ids, positions)[0]
        return self.scores(hidden) if self.cfg.score_head else self.head(hidden)

    def scores(self, x: jax.Array) -> jax.Array:
        """A reward model's head: [batch, tokens, embed] -> one score per token [batch, tokens] (float32)."""
        return jnp.asarray(self.score(x)[..., 0], jnp.float32)

    def _stream(self, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, jax.Array]:
        """(the token embeddings, the last residual stream before the final norm), both in token order."""
        embedded = constrain(scale_embedded(self.token_embed(inputs), self.cfg), ax.EMBEDDED)
        per_layer = self.per_layer_embed(inputs, embedded) if self.cfg.per_layer_input_dim else None
        # context parallelism: one early and one late chunk of the sequence per device (layers/ring_attention.py)
        x, segment_ids, positions = (ring_attention.to_balanced(a) for a in (embedded, segment_ids, positions))
        if per_layer is None:
            x = self.decoder(x, segment_ids, positions)
        else:
            x = self.decoder(x, segment_ids, positions, ring_attention.to_balanced(per_layer))
        return embedded, ring_attention.from_balanced(x)

    def head(self, x: jax.Array) -> jax.Array:
        """[batch, tokens, embed] -> logits [batch, tokens, vocab] (float32), through the head or the tied embedding."""
        logits = self.token_embed.attend(x) if self.cfg.logits_via_embedding else self.logits(x)
        logits = jnp.asarray(constrain(logits, ax.LOGITS), jnp.float32)
        cap = self.cfg.final_logit_softcapping  # Gemma 2
        return cap * jnp.tanh(logits / cap) if cap else logits


def apply_with_stats(
    model: Transformer, params: Any, inputs: jax.Array, segment_ids: jax.Array, positions: jax.Array,
    method: str = "__call__",
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(the output of the method named `method`, default the logits; MoE router statistics per MoE layer); a dense
    model runs the plain apply and returns {}. The method is named, not passed as `Transformer.hidden`: a name is
    looked up on the model's own class, so a model that `quantization.quantize` wrapped runs its wrapped method."""
    if not model.cfg.is_moe:
        return model.apply({"params": params}, inputs, segment_ids, positions, method=method), {}
    out, state = model.apply({"params": params}, inputs, segment_ids, positions, method=method,
                             mutable=[moe.STATS_COLLECTION])
    return out, moe.collect_stats(state.get(moe.STATS_COLLECTION, {}))


def dummy_batch(cfg: ModelConfig, batch: int = 1) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Shapes for init: (inputs, segment_ids, positions) of [batch, max_target_length]."""
    shape = (batch, cfg.max_target_length)
    return jnp.zeros(shape, jnp.int32), jnp.ones(shape, jnp.int32), jnp.zeros(shape, jnp.int32)


@contextlib.contextmanager
def without_layout() -> Iterator[None]:
    """No mesh and no logical rules in context: every layer takes its plain whole-array path.

    The layout's kernels (ring attention, splash, the dropless MoE exchange) run in `jax.shard_map`, which needs
    every dimension it splits to divide evenly; init's dummy batch of one row does not, and need not: parameters
    depend on shapes alone. Inside, activation constraints are no-ops and no kernel sees a mesh.
    """
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())), nn.logical_axis_rules(()):
        yield


def init_params(cfg: ModelConfig, rng: jax.Array) -> Any:
    """Boxed parameters drawn from `rng`, the same values in every layout.

    The model is traced without a layout (`without_layout`), so init never runs a layout's kernels; the caller
    places the result (`jax.jit(..., out_shardings=...)`, as `step.Trainer.init_state` does). A pipelined model is
    initialised as the scanned model (one stack of `num_units`) and regrouped into its [repeats, stages, layers per
    stage, ...] layout, so a seed gives the same network with or without a pipeline; sharding never changes values
    (threefry random bits do not depend on how an array is partitioned).
    """
    canonical = dataclasses.replace(cfg, pipeline=None)
    with without_layout():
        params = Transformer(canonical).init(rng, *dummy_batch(canonical), method="everything")["params"]
    return params if cfg.pipeline is None else pipeline.from_scanned(params, cfg.pipeline)


def abstract_params(cfg: ModelConfig) -> Any:
    """Boxed (nn.Partitioned) parameter shapes without allocating anything."""
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def abstract_cache(cfg: ModelConfig, params: Any, batch: int, length: int) -> Any:
    """The boxed KV cache generation keeps for `batch` sequences of `length` slots (a local layer keeps a ring of
    min(window, length); layers/kv_cache.py): shapes and logical names from the model itself, nothing allocated.
    `params` may be abstract. Call it inside the mesh and rules it is to be laid out by."""
    tokens = jnp.zeros((batch, length), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
    model = Transformer(cfg)

    def apply(p: Any) -> Any:
        return model.apply({"params": p}, tokens, tokens + 1, positions, mutable=[kv_cache.COLLECTION])[1]

    return jax.eval_shape(apply, params)[kv_cache.COLLECTION]


def count_params(params: Any) -> int:
    """Number of parameters in a (boxed or plain, abstract or concrete) parameter tree."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(nn.unbox(params)))


def param_count(cfg: ModelConfig) -> int:
    """Total number of parameters of the model (traces it; a run counts the abstract state it already holds)."""
    return count_params(abstract_params(cfg))
