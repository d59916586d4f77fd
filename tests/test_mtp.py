"""Multi-token prediction (maxshard/model/layers/mtp.py): module k's loss counts exactly the tokens k + 1 places
ahead in the same document, the main model and generation do not change, and layouts keep the function.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
from safetensors.numpy import load_file, save_file

from maxshard import data
from maxshard.checkpoint import format as checkpoint_format
from maxshard.checkpoint import orbax_io
from maxshard.convert import __main__ as cli
from maxshard.model import flops, transformer
from maxshard.model.config import ModelConfig
from maxshard.model.layers import pipeline
from maxshard.training.step import Trainer
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
    position by position; the step's loss is the main head's alone, equal to the same model's without modules."""
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


def _with_mtp_module(source: Path, dest: Path) -> dict[str, np.ndarray]:
    """The DeepSeek-V3 fixture plus one MTP module as DeepSeek's checkpoints keep it (layer num_layers: a layer like
    the last, enorm, hnorm, eh_proj, shared_head.norm, copies of the embedding and head) and
    num_nextn_predict_layers 1. transformers skips that layer when it loads (so the fixture's logits stand); the
    added tensors are random. Returns the added tensors."""
    shutil.copytree(source, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    hf = json.loads((dest / "config.json").read_text())
    last, new = hf["num_hidden_layers"] - 1, hf["num_hidden_layers"]
    rng = np.random.default_rng(0)
    added = {name.replace(f"layers.{last}.", f"layers.{new}."): rng.normal(0, 0.05, a.shape).astype(a.dtype)
             for name, a in tensors.items() if name.startswith(f"model.layers.{last}.")}
    width = hf["hidden_size"]
    added.update({f"model.layers.{new}.{name}": rng.normal(0, 0.05, shape).astype(np.float32) for name, shape in (
        ("enorm.weight", (width,)), ("hnorm.weight", (width,)), ("eh_proj.weight", (width, 2 * width)),
        ("shared_head.norm.weight", (width,)))})
    added[f"model.layers.{new}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"]
    added[f"model.layers.{new}.shared_head.head.weight"] = tensors["lm_head.weight"]
    save_file({**tensors, **added}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps({**hf, "num_nextn_predict_layers": 1}, indent=2))
    return added


def test_deepseek_mtp_layer_imports_into_the_module_and_exports_bit_identical(tmp_path: Path) -> None:
    """from_hf puts layer num_layers into mtp_1 (eh_proj's input halves: [enorm(embedding); hnorm(hidden)]), the
    logits stay transformers' (the module is not in the forward pass), to_hf writes every tensor back bit for bit,
    the copies of the embedding and head included."""
    hf_dir = tmp_path / "hf"
    added = _with_mtp_module(FIXTURES / "deepseek_v3", hf_dir)
    assert cli.main(["from_hf", str(hf_dir), str(tmp_path / "out")]) == 0
    step = tmp_path / "out" / "checkpoints" / "0"
    reader = orbax_io.Reader(str(step))
    saved = checkpoint_format.read_config(str(step))
    assert saved["mtp_depth"] == 1
    width, new = saved["emb_dim"], saved["num_layers"]
    eh = added[f"model.layers.{new}.eh_proj.weight"]
    np.testing.assert_array_equal(reader.read(("mtp_1", "eh_proj", "kernel"), ()), eh.T.reshape(2, width, width))
    np.testing.assert_array_equal(reader.read(("mtp_1", "hidden_norm", "scale"), ()),
                                  added[f"model.layers.{new}.hnorm.weight"])
    trainer, state = start_from_converted(tmp_path / "out", tmp_path / "run")
    tokens, logits = reference("deepseek_v3")
    np.testing.assert_allclose(apply(trainer, state.params, tokens), logits, atol=1e-4, rtol=1e-4)
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
