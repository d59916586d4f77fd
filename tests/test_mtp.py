"""Multi-token prediction (maxshard/model/layers/mtp.py): module k's loss counts exactly the tokens k + 1 places
ahead in the same document, the main model and generation do not change, and layouts keep the function.
"""

from __future__ import annotations

import json
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from maxshard import data
from maxshard.checkpoint import format as checkpoint_format
from maxshard.convert import __main__ as cli
from maxshard.generation.decode import Engine
from maxshard.generation.sampling import allowed_tokens
from maxshard.model import flops, transformer
from maxshard.spec.model_config import ModelConfig
from maxshard.model.layers import pipeline
from maxshard.training.step import Trainer, mesh_context
from tests.helpers import max_relative_difference, mesh_for, tiny_config
from tests.test_convert import FIXTURES, apply, read_all, reference, start_from_converted
from tests.test_pipeline import SMALL, TOLERANCE, packed_batch, random_params, small_config, sums_and_grads

MTP = ("mtp_depth=2", "mtp_loss_weight=0.5", "num_layers=2")


def _reference_nll(cfg, params, batch) -> tuple[np.ndarray, np.ndarray]:
    """Each module's summed cross-entropy and weight, position by position in numpy: module k at position i
    predicts targets[i + k] (the token k + 1 after i's next), counted when i + k is in i's document."""
    model = transformer.Transformer(cfg.model)

    @jax.jit
    def module_logps(p, *inputs):
        _, predicted = model.apply({"params": p}, *inputs, method="hidden_with_mtp")
        return [jax.nn.log_softmax(model.apply({"params": p}, h, method="head"), axis=-1) for h in predicted]

    predicted = module_logps(params, batch["inputs"], batch["segment_ids"], batch["positions"])
    nll, weight = np.zeros(len(predicted)), np.zeros(len(predicted))
    segments, targets, weights = batch["segment_ids"], batch["targets"], batch["loss_weights"]
    rows, length = targets.shape
    for k, logps in enumerate(predicted, start=1):
        logps = np.asarray(logps)
        for b in range(rows):
            for i in range(length - k):
                if segments[b, i + k] == segments[b, i] and weights[b, i + k]:
                    nll[k - 1] -= weights[b, i + k] * logps[b, i, targets[b, i + k]]
                    weight[k - 1] += weights[b, i + k]
    return nll, weight


def test_each_module_learns_the_tokens_ahead_in_its_document_and_the_main_head_is_unchanged() -> None:
    """A fresh run's init and train step (one device): `mtp/loss_k` equals module k's cross-entropy computed
    position by position; the step's loss is the main head's alone, equal to the same model's without modules, and
    so is what greedy generation decodes from the state."""
    cfg = tiny_config(*SMALL, *MTP, num_devices=1, global_batch=2)
    trainer = Trainer(cfg, mesh_for(cfg))
    state = trainer.init_state()
    assert {"mtp_1", "mtp_2"} <= set(state.params)
    batch = packed_batch(cfg, trainer.mesh)
    params = jax.device_get(nn.unbox(state.params))
    nll, weight = _reference_nll(cfg, params, batch)
    assert 0 < weight[1] < weight[0] < batch["loss_weights"].sum()  # document ends drop k tokens each
    _, metrics = trainer.jit_train_step(data.batch_sharding(cfg, trainer.mesh))(state, batch)
    np.testing.assert_allclose([metrics["mtp/loss_1"], metrics["mtp/loss_2"]], nll / weight, rtol=1e-5)

    plain_cfg = tiny_config(*SMALL, "num_layers=2", num_devices=1, global_batch=2)
    # the main head's loss, from the model without modules (what generation and evaluation run)
    main = {k: v for k, v in params.items() if not k.startswith("mtp_")}
    plain = jax.jit(transformer.Transformer(plain_cfg.model).apply)
    logits = plain({"params": main}, batch["inputs"], batch["segment_ids"], batch["positions"])
    logps = np.take_along_axis(np.asarray(jax.nn.log_softmax(logits)), batch["targets"][..., None], -1)[..., 0]
    w = batch["loss_weights"]
    np.testing.assert_allclose(metrics["loss"], -(logps * w).sum() / w.sum(), rtol=1e-5)

    # generation skips the modules: greedy decoding from the whole state equals the plain model's, logit for logit
    prompts, allowed = [[1, 5, 9, 4], [1, 7]], allowed_tokens(cfg.model.vocab_size, 259, (0, 1))
    with_modules = Engine(cfg.model, trainer.mesh, trainer.rules, state.params, allowed)
    plain_engine = Engine(plain_cfg.model, trainer.mesh, trainer.rules, jax.device_put(main), allowed)
    ours, theirs = (e.generate(prompts, 4, 2, 0, keep_logits=True) for e in (with_modules, plain_engine))
    assert ours.tokens == theirs.tokens
    np.testing.assert_array_equal(np.asarray(ours.step_logits), np.asarray(theirs.step_logits))


def test_the_modules_keep_their_function_under_pipeline_tensor_and_fsdp() -> None:
    """pipeline=2 x tensor=2 x fsdp=2 (the modules after the pipeline on every stage) against fsdp=8: the loss
    with the modules' share and every gradient, theirs included."""
    reference_cfg = small_config(*MTP)
    trainer = Trainer(reference_cfg, mesh_for(reference_cfg))
    params, batch = random_params(trainer), packed_batch(reference_cfg, trainer.mesh)
    ref_sums, ref_grads = sums_and_grads(reference_cfg, params, batch)
    assert np.abs(ref_grads["mtp_2"]["eh_proj"]["kernel"]).max() > 0
    cfg = small_config(*MTP, "ici_pipeline_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2",
                       "num_layers_per_pipeline_stage=1")
    sums, grads = sums_and_grads(cfg, pipeline.from_scanned(params, cfg.model.pipeline), batch)
    for key in ("loss_sum", "mtp_nll_sum", "mtp_weight_sum"):
        np.testing.assert_allclose(sums[key], ref_sums[key], rtol=TOLERANCE)
    assert max_relative_difference(pipeline.to_scanned(grads), ref_grads) < TOLERANCE


def _logits_with_modules(trainer: Trainer, params, tokens: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """(the main logits, each module's logits) for `tokens`, one segment, on the trainer's mesh."""
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)

    def run(p, t, s, pos):
        main, predicted = trainer.model.apply({"params": p}, t, s, pos, method="hidden_with_mtp")
        return [trainer.model.apply({"params": p}, h, method="head") for h in (main, *predicted)]

    with mesh_context(trainer.mesh, trainer.rules):
        main, *modules = jax.jit(run)(params, jnp.asarray(tokens), jnp.ones_like(positions), positions)
    return np.asarray(main), [np.asarray(m) for m in modules]


def test_deepseek_mtp_layer_predicts_as_transformers_and_exports_bit_identical(tmp_path: Path) -> None:
    """The released layout (tests/fixtures/hf/deepseek_v3_mtp: layer num_layers with enorm, hnorm, eh_proj,
    shared_head.norm and copies of the embedding and head) imports into mtp_1, whose predictions of token i + 2
    equal those of transformers' own MTP module (MtpModel, loading the same files, fed the main model's normalised
    last hidden states as its use_mtp generation feeds them); the main logits stay transformers'; to_hf writes
    every tensor back bit for bit."""
    hf_dir = FIXTURES / "deepseek_v3_mtp"
    assert cli.main(["from_hf", str(hf_dir), str(tmp_path / "out")]) == 0
    step = tmp_path / "out" / "checkpoints" / "0"
    assert checkpoint_format.read_config(str(step))["mtp_depth"] == 1
    trainer, state = start_from_converted(tmp_path / "out", tmp_path / "run")
    tokens, logits = reference("deepseek_v3_mtp")
    main, (ahead,) = _logits_with_modules(trainer, state.params, tokens)
    np.testing.assert_allclose(main, logits, atol=1e-4, rtol=1e-4)
    want = np.load(hf_dir / "mtp_logits.npy")  # [batch, length - 1, vocab]: position i predicts token i + 2
    assert np.std(want) > 0.5
    np.testing.assert_allclose(ahead[:, :-1], want, atol=1e-4, rtol=1e-4)
    assert cli.main(["to_hf", str(step), str(tmp_path / "back")]) == 0
    source, back = read_all(hf_dir), read_all(tmp_path / "back")
    assert sorted(back) == sorted(source)
    assert all(back[name].tobytes() == array.tobytes() for name, array in source.items())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_the_flop_inventory_counts_the_modules_kernels() -> None:
    """Every kernel the model holds, the modules' included (their layer, eh_proj; the head is shared), is in the
    FLOP inventory, plus one head per module."""
    from tests.test_blocks import DENSE_FIRST, _kernels

    cfg = ModelConfig(**DENSE_FIRST, mtp_depth=2)
    params = nn.unbox(transformer.abstract_params(cfg))
    heads = cfg.mtp_depth * cfg.emb_dim * cfg.vocab_size
    assert flops.matmul_params(cfg) == _kernels(params) + heads
