"""The XLA:GPU option tables (`parallel/xla_options.py`, the run's `xla_gpu_options`): chosen by the config, refused
in one line when unknown, passed only to GPU programs, and every option one that XLA:GPU knows, checked by compiling
the tiny preset's real train step for an H100 without a GPU (JAX's CUDA plugin in a directory only the subprocess
sees, as tests/test_gpu_aot.py installs it).
"""

from __future__ import annotations

import json
import typing
from pathlib import Path

import jax
import pytest

from maxshard import config
from maxshard.config.schema import Config
from maxshard.errors import ConfigError
from maxshard.parallel import xla_options
from tests.cuda_plugin import cuda_plugin, with_plugin  # noqa: F401 (cuda_plugin: a fixture)


def test_the_config_names_the_tables_and_refuses_others_in_one_line() -> None:
    assert typing.get_args(typing.get_type_hints(Config)["xla_gpu_options"]) == xla_options.GPU_CHOICES
    assert config.load(["configs/base.yml"]).xla_gpu_options == xla_options.DEFAULT_GPU
    with pytest.raises(ConfigError, match=r"^xla_gpu_options expects one of 'default', 'tuned', got 'fast'"):
        config.load(["configs/base.yml", "xla_gpu_options=fast"])


def test_the_default_table_is_empty_and_cpu_programs_get_no_options() -> None:
    """Nothing changes for a run that does not ask: XLA:GPU's own defaults, and none of the GPU options on CPU."""
    assert xla_options.GPU[xla_options.DEFAULT_GPU] == {}
    cpu = jax.sharding.Mesh(jax.devices()[:1], ("x",))
    assert all(xla_options.for_mesh(cpu, name) is None for name in xla_options.GPU_CHOICES)


SCRIPT = """
import json
from maxshard.launch import topologies
from maxshard.parallel import mesh as meshes, xla_options
from maxshard.planning import gpu_compile
from maxshard.planning.compiled import compile_train_step
from maxshard.run.target import load_for_target
target = topologies.parse("h100-80gb-8", 1)
cfg = load_for_target(["configs/base.yml", "model_name=tiny", "attention=blockwise", "xla_gpu_options=tuned"], target)
mesh = meshes.build(cfg, gpu_compile.abstract_devices(target))
out = {"tuned": xla_options.for_mesh(mesh, cfg.xla_gpu_options), "default": xla_options.for_mesh(mesh)}
out["compiled"] = "while" in compile_train_step(cfg, mesh).as_text()  # the trainer's own jit options
xla_options.GPU["tuned"] = {**xla_options.GPU["tuned"], "xla_gpu_no_such_option": True}
try:  # the run's table reaches the train step's jit: an option XLA does not know there fails its compile
    compile_train_step(cfg, mesh)
    out["unknown"] = "compiled"
except Exception as e:
    out["unknown"] = str(e).splitlines()[0]
print(json.dumps(out))
"""


def test_xla_gpu_compiles_the_train_step_with_the_tuned_table(cuda_plugin: Path) -> None:  # noqa: F811
    """`xla_gpu_options=tuned` reaches the trainer's train step on a GPU mesh, and XLA:GPU accepts every option in
    the table, where it refuses one it does not know: the table holds no name that a jax upgrade dropped."""
    run = with_plugin(cuda_plugin, SCRIPT)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["tuned"] == xla_options.GPU["tuned"] and out["default"] is None, out
    assert out["compiled"] is True, out
    assert "No such compile option: 'xla_gpu_no_such_option'" in out["unknown"], out
