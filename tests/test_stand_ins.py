"""`maxshard/run/stand_ins.py`: a TPU or GPU config's accelerator-only choices load on CPU and are named there, one
startup line each, as the stand-in that computes them.

Each choice alone (tiny configs, nothing compiled): it loads on the 8 simulated CPU devices as asked (no refusal, no
silent substitute) and gives exactly its one line; together they give one line each; a TPU device kind, `auto` and
the defaults give none, and so does a ragged exchange that exchanges nothing (experts not split). That the stand-ins
compute their accelerator's numbers is tested where each lives: the ragged all-to-all in tests/test_ragged_all_to_all.py
and tests/test_moe_ragged.py (a whole step against the fixed exchange), splash interpreted, tokamax's reference and
cudnn's call through XLA against dot_product in tests/test_attention.py, and below the cudnn call as a CPU run makes
it (no implementation named).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxshard.model.layers import attention_ops as ops
from maxshard.run.stand_ins import stand_ins
from maxshard.spec import attention_kinds
from tests.helpers import layout_overrides, max_relative_difference, tiny_config

DROPLESS = ("num_experts=8", "num_experts_per_tok=2", "capacity_factor=-1")
EXPERT4 = layout_overrides(["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"])
SPLASH_BLOCKS = ("max_target_length=128", "attention_block_q=128", "attention_block_kv=128")  # the kernel's needs
CASES = {  # name: (overrides, (the key it resolves, its value), the start of its line)
    "splash": (("attention=splash", *SPLASH_BLOCKS), ("attention", "splash"),
               "attention=splash: a TPU kernel; on CPU Pallas interprets it"),
    "tokamax": (("attention=tokamax",), ("attention", "tokamax"),
                "attention=tokamax: a GPU kernel; on CPU tokamax's XLA reference runs instead"),
    "cudnn": (("attention=cudnn",), ("attention", "cudnn"),
              "attention=cudnn: a GPU kernel; on CPU jax.nn.dot_product_attention computes the same call"),
    "ragged_exchange": ((*DROPLESS, "moe_exchange=ragged", *EXPERT4), ("moe_exchange", "ragged"),
                        "moe_exchange=ragged: XLA:CPU has no ragged all-to-all; using its CPU stand-in"),
    "ragged_dot": ((*DROPLESS, "moe_dropless_impl=ragged_dot"), ("moe_dropless_impl", "ragged_dot"),
                   "moe_dropless_impl=ragged_dot: XLA:CPU has no grouped matmul"),
    "offload": (("remat_policy=offload_qkv_proj",), ("remat_policy", "offload_qkv_proj"),
                "remat_policy=offload_qkv_proj: XLA:CPU has one memory; what it offloads stays there (the numbers "
                "of save_qkv_proj"),
    "fp8": (("quantization=fp8",), ("quantization", "fp8"), "quantization=fp8: XLA:CPU has no fp8 matmul"),
}


def _resolved(cfg, key: str) -> str:
    """The value a run uses: the model's where the loader resolves the key, else the run config's."""
    return getattr(cfg.model, key, None) or getattr(cfg, key)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_choice_loads_on_cpu_as_asked_and_names_its_stand_in_in_one_line(name):
    overrides, (key, value), start = CASES[name]
    cfg = tiny_config(*overrides)
    assert _resolved(cfg, key) == value
    lines = stand_ins(cfg)
    assert len(lines) == 1 and lines[0].startswith(start) and "\n" not in lines[0], lines


def test_together_one_line_each():
    overrides = ("attention=splash", *SPLASH_BLOCKS, *DROPLESS, "moe_exchange=ragged", "moe_dropless_impl=ragged_dot",
                 *EXPERT4, "remat_policy=offload_full", "quantization=fp8")
    lines = stand_ins(tiny_config(*overrides))
    assert [line.split("=")[0] for line in lines] == ["attention", "moe_exchange", "moe_dropless_impl",
                                                     "remat_policy", "quantization"], lines


def test_an_accelerator_auto_and_the_defaults_name_nothing():
    tpu = ("attention=splash", *SPLASH_BLOCKS, *DROPLESS, "moe_exchange=ragged", "moe_dropless_impl=ragged_dot",
           *EXPERT4, "remat_policy=offload_full", "quantization=fp8")
    assert stand_ins(tiny_config(*tpu, device_kind="TPU v5p")) == []  # the real kernels and collective run there
    assert stand_ins(tiny_config()) == []
    auto = tiny_config(*DROPLESS, *EXPERT4)  # auto: the fixed exchange and tiled experts on CPU
    assert (auto.model.moe_exchange, auto.model.moe_dropless_impl) == ("all_to_all", "tiled") and not stand_ins(auto)
    unsplit = tiny_config(*DROPLESS, "moe_exchange=ragged")  # fsdp=8, experts whole on every device: no exchange
    assert unsplit.model.moe_exchange == "ragged" and stand_ins(unsplit) == []


def test_every_attention_implementation_loads_on_cpu():
    """So the attention of any TPU or GPU config loads on a laptop: each row runs on CPU, its kernel or its
    stand-in, and the stand-ins are exactly the accelerators' kernels."""
    assert all("cpu" in kind.platforms for kind in attention_kinds.KINDS)
    with_stand_in = {kind.name for kind in attention_kinds.KINDS if kind.cpu_stand_in}
    assert with_stand_in == {"splash", "tokamax", "cudnn"}


def test_cudnn_on_cpu_is_the_reference_attention():
    """The cudnn call as a CPU run makes it (no implementation named: XLA's) computes dot_product's output."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, 16, heads, 8)), jnp.float32) for heads in (4, 2, 2))
    segments = jnp.asarray(np.where(np.arange(16) < 9, 1, 2)[None].repeat(2, 0), jnp.int32)  # two documents
    out = jax.jit(ops.cudnn)(q, k, v, segments, segments)
    assert max_relative_difference(out, jax.jit(ops.dot_product)(q, k, v, segments, segments)) < 1e-5
