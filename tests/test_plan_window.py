"""The planner on local/global (sliding-window) models: attention FLOPs count the keys a local layer sees,
`maxshard.plan` names the local layers' share, and GRPO's sampling cache keeps a window in local layers. (Their
training memory is in the grid of tests/test_plan_memory.py; against XLA:TPU, benchmarks/local_global_plan.py.)"""

from __future__ import annotations

import dataclasses

import pytest
from helpers import tiny_config

from maxshard import plan as plan_cli
from maxshard.model import flops
from maxshard.spec import mixer_kinds
from maxshard.spec.model_config import ModelConfig
from maxshard.planning import estimate
from maxshard.planning.printout import format_plan

# 3 layers (local, local, global), 2 heads of 8, window 4 at 16 tokens
PATTERN = ModelConfig(num_layers=3, emb_dim=16, num_heads=2, num_kv_heads=2, head_dim=8, mlp_dim=32, vocab_size=64,
                      max_target_length=16, sliding_window=4, attention_pattern=("local", "local", "global"))


def test_a_local_layer_counts_the_keys_inside_its_window() -> None:
    """Per query, min(position + 1, window) keys, its own counted half as for causal global layers (length / 2):
    at 16 tokens with window 4, (0.5 + 1.5 + 2.5 + 3.5 + 12 x 4) / 16 = 3.5 keys, a global layer 8."""
    assert flops.keys_seen(16, 4) == 3.5
    assert flops.keys_seen(16) == flops.keys_seen(16, 16) == flops.keys_seen(16, 64) == 8
    per_key = 2 * 2 * (8 + 8)  # q.k and p.v: 2 FLOPs x heads x (qk + v head widths)
    assert flops.attention_flops(PATTERN) == per_key * (3.5 + 3.5 + 8) == 960
    m = flops.matmul_params(PATTERN)
    assert flops.flops_per_token(PATTERN) == 6 * m + 3 * 960  # what MFU divides by (observe/console.py)


def test_a_global_only_model_counts_as_before() -> None:
    """length x heads x (qk + v) per layer (the causal half of 2 x length x ...), the count before windows."""
    global_only = dataclasses.replace(PATTERN, sliding_window=0, attention_pattern=("global",))
    assert flops.attention_flops(global_only) == 3 * 16 * 2 * (8 + 8) == 1536
    wide_window = dataclasses.replace(PATTERN, sliding_window=16)  # a window of the whole length is global
    assert flops.attention_flops(wide_window) == 1536


def test_the_plan_counts_local_layers_in_model_flops_and_prints_their_share(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Through `maxshard.plan` on a TPU target: the model FLOPs per device (and so the roofline and its MFU) drop by
    the local layers' attention, and the printout says how many layers are local and what they see."""
    keys = ("model_name=tiny", "override_model_config=true", "num_layers=4", "max_target_length=256",
            "attention=dot_product", "attention_pattern=[local,local,local,global]", "sliding_window=32")
    local = plan_cli.plan_for(["configs/base.yml", *keys], "v5litepod-8")
    full = plan_cli.plan_for(["configs/base.yml", *keys[:-2]], "v5litepod-8")
    m, tokens = local.cfg.model, local.cfg.global_batch_size * 256 / 8
    saved = 3 * 3 * 2 * (flops.keys_seen(256) - flops.keys_seen(256, 32)) * m.num_heads * 2 * m.head_dim
    assert full.model_flops - local.model_flops == pytest.approx(saved * tokens)
    assert local.compute_s < full.compute_s
    assert plan_cli.main(["configs/base.yml", *keys, "--topology", "v5litepod-8", "--estimate"]) == 0
    out = capsys.readouterr().out
    assert ("attention: 3 local layers (window 32 of 256 tokens: 23% of a global layer's score and value FLOPs) "
            "+ 1 global\n") in out, out
    assert "local layer" not in format_plan(full)


def test_grpos_sampling_cache_keeps_a_window_of_keys_in_local_layers() -> None:
    """The plan's KV cache of GRPO's sampling (planning/rollout_memory.py, traced from the model): a global layer
    keeps prompt + new tokens (32 here) per sequence, a local one a ring of its window (8), per device as the engine
    shards it (batch over fsdp, kv heads over tensor)."""
    cfg = tiny_config("objective=grpo", "dataset_type=prompts", "grpo_max_prompt_length=24", "grpo_max_new_tokens=8",
                      "grpo_group_size=4", "ici_fsdp_parallelism=4", "ici_tensor_parallelism=2",
                      "attention=dot_product", "attention_pattern=[local,global]", "sliding_window=8")
    plan = estimate.make_plan(cfg)
    per_slot = 2 * (cfg.global_batch_size // 4) * (cfg.num_kv_heads // 2) * cfg.head_dim * 4  # k and v, float32
    assert cfg.num_layers == 2 and plan.rollout_cache == per_slot * (8 + 32)


def test_on_xla_tpu_a_pattern_unit_gathers_one_layer_and_the_loss_holds_the_tied_table() -> None:
    """On a TPU target the layer being differentiated holds its gathered weights and their whole gradient: two copies
    of one layer's weights in bfloat16, not of the whole 4-layer unit (fitted.py, seen in the gemma3_27b preset's
    buffers); and the loss holds the tied embedding table whole twice, so `head` is the logits plus 2 x the table."""
    keys = ("model_name=tiny", "override_model_config=true", "num_layers=4", "max_target_length=256", "vocab_size=512",
            "logits_via_embedding=true", "attention=dot_product", "attention_pattern=[local,local,local,global]",
            "sliding_window=32")
    plan = plan_cli.plan_for(["configs/base.yml", *keys], "v5litepod-8")
    m = plan.cfg.model
    layer = m.emb_dim * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim + m.num_heads * m.head_dim * m.emb_dim
    layer += 3 * m.emb_dim * m.mlp_dim  # SwiGLU's gate, up and down
    terms = plan.activation_terms
    assert terms.gathered == pytest.approx(2 * layer * 2, rel=0.01)  # norm scales aside; a whole unit is 4x this
    tokens = plan.cfg.global_batch_size * 256 // 8
    logits = 2 * tokens * 512 * 4 / max(plan.cfg.loss_chunks, 1)
    assert terms.head == pytest.approx(logits + 2 * 512 * m.emb_dim * 2)


def test_the_plan_counts_chunked_layers_by_their_chunk_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """Llama 4's chunked layers (layer_types, attention_chunk_size): the model FLOPs drop by what a query does not
    see beyond its chunk (`keys_in_chunk`), and the printout names the chunks."""
    types = "layer_types=chunked_attention,chunked_attention,chunked_attention,full_attention"
    keys = ("model_name=tiny", "override_model_config=true", "num_layers=4", "max_target_length=256",
            "attention=dot_product", types, "attention_chunk_size=64")
    chunked = plan_cli.plan_for(["configs/base.yml", *keys], "v5litepod-8")
    full = plan_cli.plan_for(["configs/base.yml", *keys[:-2]], "v5litepod-8")
    m, tokens = chunked.cfg.model, chunked.cfg.global_batch_size * 256 / 8
    saved = 3 * 3 * 2 * (flops.keys_seen(256) - mixer_kinds.keys_in_chunk(256, 64)) * m.num_heads * 2 * m.head_dim
    assert full.model_flops - chunked.model_flops == pytest.approx(saved * tokens)
    assert plan_cli.main(["configs/base.yml", *keys, "--topology", "v5litepod-8", "--estimate"]) == 0
    out = capsys.readouterr().out
    assert ("attention: 3 local layers (chunks of 64 of 256 tokens: 25% of a global layer's score and value FLOPs) "
            "+ 1 global\n") in out, out
