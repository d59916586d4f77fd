"""The loss over strided pieces of the sequence (`loss_chunks`) equals the whole loss, and frees the logits.

Parity in float32: loss and every gradient within 1e-6 of the unchunked step, on one device and under a layout
that shards the length (context) and the vocabulary (tensor), for a separate and a tied head. Memory: XLA's own
figure for the compiled step (`memory_analysis()`, exact on CPU) drops by about the logits and their gradient.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from maxshard import data
from maxshard.errors import ConfigError
from maxshard.planning import memory
from maxshard.planning.compiled import compile_train_step
from maxshard.run import loading
from maxshard.training.step import Trainer
from tests.helpers import loss_and_grads, max_relative_difference, mesh_for, tiny_config

LAYOUTS = {
    "one device": (1, ("ici_fsdp_parallelism=1",)),
    "fsdp2 context2 tensor2": (8, ("ici_fsdp_parallelism=2", "ici_context_parallelism=2", "ici_tensor_parallelism=2")),
}


def _loss_and_grads(chunks: int, num_devices: int, *overrides: str):
    cfg = tiny_config(*overrides, f"loss_chunks={chunks}", num_devices=num_devices)
    assert cfg.loss_chunks == chunks
    trainer = Trainer(cfg, mesh_for(cfg))
    state = trainer.init_state()
    batch = next(data.make_input(cfg, trainer.mesh))
    loss, grads = loss_and_grads(trainer, state.params, batch)
    return loss, jax.device_get(grads)


@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_chunked_loss_equals_the_whole_loss(layout, tied):
    num_devices, knobs = LAYOUTS[layout]
    overrides = (*knobs, f"logits_via_embedding={str(tied).lower()}")
    whole_loss, whole_grads = _loss_and_grads(1, num_devices, *overrides)
    chunked_loss, chunked_grads = _loss_and_grads(4, num_devices, *overrides)
    np.testing.assert_allclose(chunked_loss, whole_loss, rtol=1e-6)
    assert max_relative_difference(chunked_grads, whole_grads) < 1e-6


def test_chunks_free_the_logits_in_the_compiled_step():
    """A vocabulary-heavy tiny model: the step's temporaries shrink by most of the logits and their gradient."""
    overrides = ("vocab_size=8192", "max_target_length=128", "ici_fsdp_parallelism=1")
    peaks = {}
    for chunks in (1, 8):
        cfg = tiny_config(*overrides, f"loss_chunks={chunks}", num_devices=1)
        peaks[chunks] = compile_train_step(cfg, mesh_for(cfg)).memory_analysis().temp_size_in_bytes
    logits = memory.logits_bytes(cfg, {})  # [16 x 128 tokens, 8192] float32: 64 MiB
    print(f"temporaries: whole {peaks[1] / 2**20:.1f} MiB, 8 pieces {peaks[8] / 2**20:.1f} MiB, "
          f"logits {logits / 2**20:.1f} MiB")
    assert peaks[1] - peaks[8] >= 1.5 * logits * (1 - 1 / 8)


def test_auto_splits_only_logits_that_need_it():
    small = tiny_config("ici_fsdp_parallelism=1", num_devices=1)
    assert small.loss_chunks == 1  # 16 x 32 tokens x 384 vocab: nothing to split
    # 4 x 8192 tokens per device over a 128k vocabulary (Llama 3's): 16.8 GB whole, 64 pieces of 256 MiB or less
    big = tiny_config("vocab_size=128256", "max_target_length=8192", "ici_fsdp_parallelism=8", global_batch=32)
    whole = memory.logits_bytes(big, {"fsdp": 8})
    assert whole == 4 * 8192 * 128256 * 4
    assert big.loss_chunks == 64 and whole / 64 <= memory.LOSS_PIECE_BYTES < whole / 32


def test_chunks_that_do_not_divide_the_length_are_one_line():
    with pytest.raises(ConfigError, match=r"loss_chunks=3 must be 0 \(auto\) or divide max_target_length=32"):
        tiny_config("loss_chunks=3")
    with pytest.raises(ConfigError, match="loss_chunks=-1"):
        loading.complete(tiny_config("loss_chunks=-1"))


@pytest.mark.parametrize("tied", [False, True], ids=["head", "tied"])
def test_a_fresh_model_starts_near_a_uniform_guess(tied):
    """The first loss of a fresh run is near log(vocab) for a separate and a tied head (a tied table drawn at unit
    spread gave logits of spread sqrt(emb_dim): the 1b preset's first loss was 717 nats on an H200)."""
    loss, _ = _loss_and_grads(1, 1, "ici_fsdp_parallelism=1", f"logits_via_embedding={str(tied).lower()}",
                              "emb_dim=256", "head_dim=64")
    vocab = tiny_config(num_devices=1).model.vocab_size
    assert abs(float(loss) - np.log(vocab)) < 1.0, (float(loss), np.log(vocab))
