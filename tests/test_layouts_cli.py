"""Every mesh axis starts a fresh run through the real entry point and trains like one device.

Each layout runs `maxshard.train.main` in this process (8 simulated devices): config loading, the mesh, the
fresh-run init (`Trainer.init_state`, which once ran ring attention's shard_map on a one-row dummy batch and
crashed under context parallelism), the input pipeline and four train steps. Its losses, read back from
metrics.jsonl, must equal those of the same command on one device (a subprocess with `cpu_device_count=1`) within
1e-5 in float32: parallel runs sum the same numbers in another order, a sharding mistake moves them far more. Every
step after the first depends on the gradients and the optimizer update, so those are checked too.

The dense model has 8 layers and 8 heads so that every axis can take all 8 devices alone (the pipeline needs a
layer per stage, sequence and the tensor axes a head per device); the MoE model routes top-2 of 8 experts dropless,
which computes the same function under any expert layout; the 3:1 DeltaNet/attention hybrid (layer_types) has 8
layers, two units, so that a pipeline of two stages holds one unit each; Llama 4's unit (chunked and NoPE layers,
top-1 experts on the input) runs twice, as does Gemma 4's (its second unit reusing the first's keys and values);
Gemma 4's MoE block runs its experts beside each layer's dense MLP.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maxshard import train
from tests.helpers import run_losses
import cli_processes

REPO = Path(__file__).resolve().parent.parent
BASE = str(REPO / "configs" / "base.yml")
STEPS = 4
GLOBAL_BATCH = 8
RUN = (
    "dataset_type=synthetic", f"steps={STEPS}", "log_period=1", "eval_period=0", "enable_checkpointing=false",
    "enable_tensorboard=false", "warmup_steps_fraction=0", "learning_rate=1e-2", "max_target_length=32",
    "emb_dim=32", "num_heads=8", "num_kv_heads=8", "head_dim=4", "mlp_dim=64", "ici_fsdp_parallelism=1",
    "max_replicated_fraction=1",  # data parallelism replicates every parameter, as it should
)
MODELS = {
    "dense": ("num_layers=8",),
    "moe": ("num_layers=2", "num_experts=8", "num_experts_per_tok=2", "moe_layer_interval=2", "capacity_factor=-1"),
    # Qwen3-Next's unit from layer_types: 3 gated DeltaNet layers, then 1 full-attention layer; 2 units. Its float32
    # gradients at init move by orders of magnitude more under rounding than an attention model's (one device against
    # itself: tests/test_hybrid_deltanet.py), and Adam's first steps turn a near-zero gradient's rounding into a whole
    # learning rate; a smaller rate and a larger eps keep what rounding moves in the later losses within 1e-5
    "hybrid": ("num_layers=8", "layer_types=" + ",".join((["linear_attention"] * 3 + ["full_attention"]) * 2),
               "linear_num_key_heads=2", "linear_num_value_heads=4", "linear_key_head_dim=8",
               "linear_value_head_dim=8", "delta_chunk_size=8", "adam_eps=1e-3", "learning_rate=5e-4"),
    # Llama 4's unit twice: chunked RoPE layers with L2 q/k norms (chunks of 8 of the 32 tokens), a global NoPE layer
    # with the query temperature, every 2nd layer top-1 of 4 experts on the input beside a shared expert
    "llama4": ("num_layers=8", "layer_types=" + ",".join(["chunked_attention", "chunked_attention", "full_attention",
                                                          "chunked_attention"] * 2),
               "rope_layers=1,1,0,1,1,1,0,1", "attention_chunk_size=8", "nope_temperature_scale=0.5",
               "nope_temperature_floor=8", "qk_l2_norm=true", "num_experts=4", "num_experts_per_tok=1",
               "moe_layer_interval=2", "moe_router=sigmoid", "moe_renormalize_top_k=false",
               "moe_weights_on_input=true", "num_shared_experts=1", "capacity_factor=-1"),
    # Gemma 4's unit twice, the second reusing the first's keys and values (its MLPs twice as wide), each layer with
    # its per-layer input, its fixed scalar (1 at init), the value norm; the full layers with proportional RoPE on
    # heads of their own (twice as wide, half as many key/value heads)
    "gemma4": ("num_layers=4", "layer_types=" + ",".join(["sliding_attention", "full_attention"] * 2),
               "sliding_window=8", "kv_shared_layers=2", "per_layer_input_dim=16", "value_norm=true",
               "layer_scalar=true", "qk_norm=true", "post_norms=true", "embed_scale=true", "rope_proportion=0.5",
               "global_head_dim=8", "global_num_kv_heads=4", "kv_shared_mlp_dim=128"),
    # Gemma 4's MoE block (the 26B-A4B release): every layer's dense MLP with top-2 of 8 dropless experts beside it,
    # their own norms, the router's norm and the per-expert scale
    "gemma4_moe": ("num_layers=2", "num_experts=8", "num_experts_per_tok=2", "moe_mlp_dim=32", "capacity_factor=-1",
                   "moe_beside_mlp=true", "post_norms=true", "moe_layer_interval=1"),
}
# name -> (model, knobs); every knob not named is 1. Of the pairs, context x fsdp and expert x fsdp are held to one
# device in-process (tests/test_objectives.py context2_fsdp4, tests/test_parity.py expert2_fsdp4).
LAYOUTS = {
    "data": ("dense", ["ici_data_parallelism=8"]),
    "fsdp": ("dense", ["ici_fsdp_parallelism=8"]),
    "fsdp_transpose": ("dense", ["ici_fsdp_transpose_parallelism=8"]),
    "sequence": ("dense", ["ici_sequence_parallelism=8"]),
    "context": ("dense", ["ici_context_parallelism=8"]),
    "tensor": ("dense", ["ici_tensor_parallelism=8"]),
    "tensor_sequence": ("dense", ["ici_tensor_sequence_parallelism=8"]),
    "autoregressive": ("dense", ["ici_autoregressive_parallelism=8"]),
    "stage": ("dense", ["ici_pipeline_parallelism=8"]),
    "expert": ("moe", ["ici_expert_parallelism=8"]),
    "sequence x tensor": ("dense", ["ici_sequence_parallelism=2", "ici_tensor_parallelism=4"]),
    "context x tensor": ("dense", ["ici_context_parallelism=2", "ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"]),
    "pipeline x fsdp": ("dense", ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"]),
    "pipeline x tensor_sequence": ("dense", ["ici_pipeline_parallelism=2", "ici_tensor_sequence_parallelism=4"]),
    # a pipeline of one hybrid unit a stage (in-process parity with gradients, fsdp x tensor included:
    # tests/test_hybrid_deltanet.py, tests/test_hybrid_layouts.py)
    "hybrid pipeline x fsdp": ("hybrid", ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"]),
    # ring attention over the chunked layers' segments, the heads over tensor (in-process parity with gradients under
    # more layouts: tests/test_attention_chunked.py)
    "llama4 context x tensor x fsdp": ("llama4", ["ici_context_parallelism=2", "ici_tensor_parallelism=2",
                                                  "ici_fsdp_parallelism=2"]),
    # the shared layers' keys and values from the layer before, per-layer inputs sliced by stack (in-process parity
    # with gradients under more layouts: tests/test_kv_sharing.py)
    "gemma4 fsdp x tensor": ("gemma4", ["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2"]),
    # the experts split over expert beside the dense MLP over fsdp (in-process parity with gradients under expert x
    # fsdp x tensor and a pipeline: tests/test_moe_beside_mlp.py)
    "gemma4 moe block expert x fsdp": ("gemma4_moe", ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]),
}


def _keys(base: Path, name: str, model: str, devices: int, *layout: str) -> list[str]:
    """The command's key=value arguments; the layout's knobs replace RUN's (the CLI refuses a key given twice)."""
    per_device = f"per_device_batch_size={GLOBAL_BATCH // devices}"
    items = [*RUN, *MODELS[model], f"cpu_device_count={devices}", per_device, f"base_output_directory={base}",
             f"run_name={name}", *layout]
    return list({item.split("=")[0]: item for item in items}.values())


def _losses(base: Path, name: str) -> list[float]:
    return run_losses(base / name, STEPS)


@pytest.fixture(scope="module")
def one_device(env, tmp_path_factory) -> dict[str, list[float]]:
    """Each model's losses from the CLI on one device; both subprocesses run side by side."""
    base = tmp_path_factory.mktemp("one_device")
    procs = {model: cli_processes.popen([sys.executable, "-m", "maxshard.train", BASE, *_keys(base, model, model, 1)],
                                     cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for model in MODELS}
    try:
        outputs = {model: proc.communicate(timeout=300)[0] for model, proc in procs.items()}
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    for model, proc in procs.items():
        assert proc.returncode == 0, outputs[model][-3000:]
        assert "mesh: single device (1 device)" in outputs[model], outputs[model][:2000]
    losses = {model: _losses(base, model) for model in MODELS}
    for model, values in losses.items():
        assert values[-1] < values[0], (model, values)  # the steps really trained
    return losses


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_fresh_run_through_the_cli_trains_like_one_device(name, one_device, tmp_path, capsys):
    model, layout = LAYOUTS[name]
    assert train.main([BASE, *_keys(tmp_path, "run", model, 8, *layout)]) == 0
    out = capsys.readouterr().out
    assert "starting from step 0" in out, out
    for knob in layout:  # the mesh line names each axis the layout asked for, at its size
        axis, size = knob.removeprefix("ici_").removesuffix(f"_parallelism={knob.split('=')[1]}"), knob.split("=")[1]
        axis = "stage" if axis == "pipeline" else axis
        assert f"{axis}={size}" in out.splitlines()[1], out
    np.testing.assert_allclose(_losses(tmp_path, "run"), one_device[model], rtol=1e-5)
