"""`python -m maxshard.plan ... --topology <GPU node> --compile`: XLA:GPU compiles the run's real init and train step
for NVIDIA GPUs on this CPU-only machine (maxshard/planning/gpu_compile.py), through JAX's CUDA plugin.

The plugin lives in a directory only these tests' subprocesses see (tests/cuda_plugin.py says why).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from maxshard.devices import CHIPS, H100_PCIE
from maxshard.errors import ConfigError
from maxshard.launch import topologies
from maxshard.planning import gpu_compile
from tests.cuda_plugin import cuda_plugin, with_plugin  # noqa: F401 (cuda_plugin: a fixture)


SCRIPT = """
import contextlib, io, json
from maxshard import plan
from maxshard.launch import topologies
from maxshard.planning import gpu_compile
out = {"described": {}}
for name, nodes in (("h100-80gb-8", 2), ("h200-141gb-8", 1)):
    devices = gpu_compile.abstract_devices(topologies.parse(name, nodes))
    out["described"][name] = [len(devices), sorted({d.device_kind for d in devices}), sorted({d.platform for d in devices})]
TINY = ["configs/base.yml", "model_name=tiny", "--topology", "h100-80gb-8", "--json"]
for run, extra in (("blockwise", ["attention=blockwise"]), ("auto", ["--compile"]), ("auto, not asked", [])):
    printed, errors = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(errors):
        code = plan.main([*TINY, *extra])
    out[run] = {"code": code, "stdout": printed.getvalue(), "stderr": errors.getvalue()}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def planned(cuda_plugin: Path) -> dict:
    """What one process with the plugin printed: the devices it describes, then `maxshard.plan --compile --json`
    for the tiny preset on an H100 node with XLA's own attention and with `attention: auto`."""
    run = with_plugin(cuda_plugin, SCRIPT)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_the_cuda_plugin_describes_gpu_nodes_as_jax_sees_them(planned: dict) -> None:
    """Every node of the target, with the device kind the chip registry matches (so MFU and memory rows apply)."""
    assert planned["described"] == {"h100-80gb-8": [16, ["NVIDIA H100 80GB HBM3"], ["gpu"]],
                                    "h200-141gb-8": [8, ["NVIDIA H200"], ["gpu"]]}


def test_plan_compiles_the_train_step_for_an_h100_node(planned: dict) -> None:
    """Where the plugin is installed the CLI's verdict comes from XLA:GPU's program for the node, without --compile:
    its peak holds the state each device keeps (parameters, optimizer moments and step: the plan's exact bytes of
    named arrays, which the split's state rows are) and fits the H100."""
    run = planned["blockwise"]
    assert run["code"] == 0, run
    out = json.loads(run["stdout"])
    compiled, memory = out["compiled"], out["bytes_per_device"]
    assert out["answer"] == "compiled" and compiled["fits"] is True and compiled["init_peak"] > 0, compiled
    step = compiled["step"]
    assert (step["params"], step["optimizer"]) == (memory["params"], memory["optimizer"] + 4), step
    assert step["params"] + step["optimizer"] + step["batch"] + step["temporaries"] <= step["peak"], step
    assert step["peak"] == compiled["step_peak"] < compiled["usable_bytes"], out
    assert "compiling the train step for h100-80gb-8 with JAX's CUDA plugin" in run["stderr"], run["stderr"]


def test_cudnn_attention_without_the_cudnn_library_is_one_line(planned: dict) -> None:
    """`attention: auto` takes cuDNN's fused attention on an H100; with the plugin but not NVIDIA's wheels, tracing
    it fails, and the plan says why in one line instead of a traceback."""
    why = ("cannot compile attention=cudnn for h100-80gb-8 here: tracing cuDNN's fused attention needs the cuDNN "
           'library: pip install -e ".[gpu-aot]"')
    run = planned["auto"]
    assert run["code"] == 2, run
    assert run["stderr"].strip().splitlines()[-1] == f"plan: error: {why}", run["stderr"]
    # not asked to compile: the formula's answer, saying why it is not the compiler's
    run = planned["auto, not asked"]
    assert run["code"] == 0, run
    out = json.loads(run["stdout"])
    assert out["answer"] == "estimate" and out["estimate"]["reason"] == why and out["fit"]["fits"], out


def test_every_gpu_node_type_has_a_target_description() -> None:
    """A GPU node maxshard plans for can be compiled for: its chip has a row in SPECS, whose text names the device
    kind JAX will report."""
    for chip in CHIPS:
        for node in chip.nodes:
            if chip.accelerator == "gpu":
                text = gpu_compile.target_config(chip, chip.device_kinds[0])
                assert f'device_description_str: "{chip.device_kinds[0]}"' in text
                assert f"device_memory_size: {int(chip.hbm)}" in text, node


def test_a_gpu_without_a_target_description_is_one_line() -> None:
    with pytest.raises(ConfigError, match=r"compiling for a H100 PCIe without one needs its XLA:GPU target "
                                          r"description, which maxshard has for H100 80GB, "):
        gpu_compile.target_config(H100_PCIE, H100_PCIE.device_kinds[0])


def test_without_the_plugin_the_error_names_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_compile, "_installed", lambda module: False)
    with pytest.raises(ConfigError, match=r'needs JAX\'s CUDA plugin, which is not installed: pip install -e '
                                          r'"\.\[gpu-aot\]"'):
        gpu_compile.abstract_devices(topologies.parse("h100-80gb-8", 1))
