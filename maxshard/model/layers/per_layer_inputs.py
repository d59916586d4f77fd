"""Gemma 4's per-layer input embeddings and its per-layer output scalar.

Per-layer inputs (`per_layer_input_dim` P > 0) give every decoder layer a signal of its own about the tokens, as
transformers' Gemma4TextModel computes it:

    tokens   = second_embedding[ids] x sqrt(P)                 [batch, length, layers, P] (one table, layers x P wide;
                                                               0 for an id past its `per_layer_vocab_size` rows)
    context  = RMSNorm_P((x_embedded @ projection) / sqrt(embed))  the embedded tokens projected to [.., layers, P]
    inputs   = (tokens + context) / sqrt(2)

and layer i, after its MLP's residual add, adds norm(act(x @ gate) x inputs[:, :, i] @ out) to the stream (`act`:
the gated MLP's activation, `mlp_activation`). The inputs are computed once, before the stacks, and each stack reads
its layers' slice (layers/decoder.py): scanned with the stack's repeats, so a layer holds only its own P features.

`layer_scalar`: each layer's output is multiplied by a scalar of its own that no gradient or optimizer moves
(transformers keeps it as a buffer; model/trainable.py `FIXED_PARAMS`).
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.model.layers.embeddings import Embed
from maxshard.model.layers.linears import DenseGeneral
from maxshard.model.layers.mlp import activation
from maxshard.model.layers.norms import RMSNorm
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain
from maxshard.spec.model_config import ModelConfig

__all__ = ["LAYER_SCALAR", "PerLayerEmbed", "PerLayerInput", "scaled_by_layer"]

LAYER_SCALAR = "layer_scalar"  # the parameter of `layer_scalar`, fixed (model/trainable.py)
PER_LAYER_AXES = (ax.BATCH, ax.LENGTH, None, None)  # [batch, length, layers, P]


class PerLayerEmbed(nn.Module):
    """[batch, length] ids and their embedded (scaled) tokens [batch, length, embed] -> every layer's input
    [batch, length, layers, P] (module docstring)."""

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, ids: jax.Array, embedded: jax.Array) -> jax.Array:
        cfg, width = self.cfg, self.cfg.per_layer_input_dim
        rows = cfg.per_layer_vocab_size or cfg.vocab_size
        table = Embed(rows, cfg.num_layers * width, self.dtype, self.weight_dtype, name="table")
        known = (ids < rows)[..., None]  # ids past a shorter table have no per-layer token embedding
        tokens = table(jnp.minimum(ids, rows - 1)) * (known * math.sqrt(width)).astype(self.dtype)
        projection = DenseGeneral((cfg.num_layers * width,), (ax.EMBED, ax.MLP), 1, self.dtype, self.weight_dtype,
                                  name="projection")
        context = projection(embedded) * jnp.asarray(cfg.emb_dim**-0.5, self.dtype)
        shape = (*ids.shape, cfg.num_layers, width)
        context = RMSNorm(cfg.norm_epsilon, self.dtype, self.weight_dtype, cfg.norm_unit_offset, name="norm")(
            context.reshape(shape))
        inputs = (tokens.reshape(shape) + context) * jnp.asarray(2**-0.5, self.dtype)
        return constrain(inputs, PER_LAYER_AXES)  # whole per token: each stack slices its layers' rows


class PerLayerInput(nn.Module):
    """One layer's use of its input [batch, length, P]: x + norm(act(x @ gate) x input @ out)."""

    cfg: ModelConfig
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, x: jax.Array, layer_input: jax.Array) -> jax.Array:
        cfg, dt, wdt = self.cfg, self.dtype, self.weight_dtype
        gate = DenseGeneral((cfg.per_layer_input_dim,), (ax.EMBED, None), 1, dt, wdt, name="gate")(x)
        h = activation(cfg)(gate, jnp.asarray(layer_input, dt))
        h = DenseGeneral((cfg.emb_dim,), (None, ax.EMBED), 1, dt, wdt, name="out")(h)
        return x + RMSNorm(cfg.norm_epsilon, dt, wdt, cfg.norm_unit_offset, name="norm")(h)


def scaled_by_layer(module: nn.Module, x: jax.Array) -> jax.Array:
    """x times the layer's fixed scalar (a [1] parameter of `module`, 1 at init)."""
    init = nn.with_logical_partitioning(nn.initializers.ones, (None,))
    scalar = module.param(LAYER_SCALAR, init, (1,), module.weight_dtype)
    return x * jnp.asarray(jax.lax.stop_gradient(scalar), x.dtype)
