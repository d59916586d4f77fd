"""Multi-token prediction (DeepSeek-V3's MTP modules, `mtp_depth`): module k predicts the token k + 1 places after
the next one, trained beside the main head, never run by generation.

Module k (1-based) at position i combines what the head read one depth before (g^0: the main model's last hidden
state after its final norm; g^{k-1}: module k - 1's output after its head norm) with the embedding of token t_{i+k}:

    h'_i = eh_proj([RMSNorm_e(embed(t_{i+k})); RMSNorm_h(g_i^{k-1})])     ([2, embed] -> embed)
    h^k  = one decoder layer of the main stack's last kind (DeepSeek-V3: attention + MoE), under the remat policy
    g^k  = RMSNorm_head(h^k);  p(t_{i+k+1}) = softmax(head(g^k_i))          (the main head, shared)

That is transformers' `MtpModel` (and vLLM's DeepSeek MTP for k = 1): they feed the normalised last hidden state,
which differs from the raw residual stream by the final norm's weights; tests/test_mtp.py checks module 1 against
MtpModel on the released layout (tests/fixtures/hf/deepseek_v3_mtp).

Hugging Face checkpoints keep module k as decoder layer `num_layers + k - 1` with extra tensors (enorm, hnorm,
eh_proj, shared_head.norm; embed_tokens and shared_head.head are copies of the shared embedding and head:
convert/names.py). The loss (training/step.py, `mtp.loss_sums`) is module k's cross-entropy over the positions
whose target t_{i+k+1} lies in the same document, weighted by that target's loss weight; the run adds
`mtp_loss_weight / mtp_depth` x the summed cross-entropies of the modules to its summed objective, which the step
divides by the main head's token weight, as it does the MoE router losses.

Packed documents: position i near the end of a document combines a token of the next one; its prediction is not
counted, and under the causal, same-document mask only positions that are not counted either attend to it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from maxshard.spec import blocks
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import ring_attention
from maxshard.model.layers.decoder import DecoderLayer, norm, rematted
from maxshard.model.layers.linears import DenseGeneral
from maxshard.model.layers.norms import RMSNorm
from maxshard.parallel import axis_names as ax
from maxshard.parallel.sharding import constrain

__all__ = ["PredictionModule", "SUMS", "shifted", "loss_sums", "objective", "metrics"]

SUMS = ("mtp_nll_sum", "mtp_weight_sum")  # what `loss_sums` adds to the step's sums, [mtp_depth] each


def shifted(x: jax.Array, k: int, fill: int | float = 0) -> jax.Array:
    """[batch, length, ...] -> x[:, i + k] at position i, `fill` past the end."""
    if k == 0:
        return x
    pad = jnp.full((x.shape[0], k, *x.shape[2:]), fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


class PredictionModule(nn.Module):
    """MTP module `depth` (1-based; module docstring): (g^{k-1} in token order, the embedded inputs) -> g^k, what
    the shared head reads and the next module's input."""

    cfg: ModelConfig
    depth: int
    dtype: jnp.dtype
    weight_dtype: jnp.dtype

    @nn.compact
    def __call__(self, previous: jax.Array, embedded: jax.Array, segment_ids: jax.Array,
                 positions: jax.Array) -> jax.Array:
        cfg, dt, wdt = self.cfg, self.dtype, self.weight_dtype

        def rms(name: str) -> RMSNorm:
            return RMSNorm(cfg.norm_epsilon, dt, wdt, cfg.norm_unit_offset, name=name)

        ahead = shifted(embedded, self.depth)  # embed(t_{i+k}) at position i
        both = jnp.stack([rms("embed_norm")(ahead), rms("hidden_norm")(previous)], axis=-2)  # [b, l, 2, embed]
        x = DenseGeneral((cfg.emb_dim,), (None, ax.EMBED, ax.MLP), 2, dt, wdt, name="eh_proj")(both)
        x, segments, where = (ring_attention.to_balanced(a) for a in (x, segment_ids, positions))
        stack = blocks.main_stack(cfg)
        layer = rematted(cfg, DecoderLayer)(cfg, dt, wdt, stack.name, len(stack.unit) - 1, name="layer")
        x, _ = layer(x, segments, where)
        x = ring_attention.from_balanced(constrain(x, ax.RESIDUAL))
        return norm(rms("head_norm"), x)


def loss_sums(head: Callable[[jax.Array], jax.Array], hiddens: Sequence[jax.Array], batch: dict[str, jax.Array],
              token_logps: Callable[[Callable, jax.Array, jax.Array], jax.Array]) -> dict[str, jax.Array]:
    """{"mtp_nll_sum": [depth], "mtp_weight_sum": [depth]}: each module's summed cross-entropy over the positions
    whose target lies in the same document, weighted by that target's loss weight, and the summed weights.
    `token_logps(head, hidden, targets)` is the step's (chunked or whole) log-probability of the targets."""
    nll, weight = [], []
    for k, hidden in enumerate(hiddens, start=1):
        same_document = shifted(batch["segment_ids"], k, -1) == batch["segment_ids"]
        weights = shifted(batch["loss_weights"].astype(jnp.float32), k) * same_document
        logps = token_logps(head, hidden, shifted(batch["targets"], k))
        nll.append(jnp.sum(-logps * weights))
        weight.append(jnp.sum(weights))
    return {"mtp_nll_sum": jnp.stack(nll), "mtp_weight_sum": jnp.stack(weight)}


def objective(sums: dict[str, jax.Array], weight: float) -> jax.Array | float:
    """The modules' share of the summed training objective: weight / depth x their summed cross-entropies (0.0
    when the step trains none)."""
    if "mtp_nll_sum" not in sums:
        return 0.0
    return weight / sums["mtp_nll_sum"].shape[0] * jnp.sum(sums["mtp_nll_sum"])


def metrics(sums: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """`mtp/loss_<k>`: module k's token-weighted mean cross-entropy (k from 1)."""
    if "mtp_nll_sum" not in sums:
        return {}
    means = sums["mtp_nll_sum"] / jnp.maximum(sums["mtp_weight_sum"], 1.0)
    return {f"mtp/loss_{k + 1}": means[k] for k in range(means.shape[0])}
