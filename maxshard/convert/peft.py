"""PEFT LoRA adapters in: `from_hf HF_DIR OUT_DIR --adapters PEFT_DIR` -> a LoRA step a run starts from.

PEFT's `save_pretrained` writes `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` with, per adapted linear, `base_model.model.<module>.lora_A.weight` [r, in] and
`.lora_B.weight` [out, r]; PEFT adds (lora_alpha / r) * x @ A.T @ B.T to the base's output. maxshard's pair beside
a kernel [*in, *out] is A [*in, r] and B [r, *out] with the same scale (layers/lora.py), so A = lora_A.T reshaped
and B = lora_B.T reshaped: the inverse of `--adapters-only` (convert/lora.py), and tensordot(A, B) is the merged
update in maxshard's layout exactly as B_hf @ A_hf is in Hugging Face's.

The adapters become OUT_DIR/adapters/0: a step directory like a LoRA run's own checkpoint (params holds the
adapters only; its config names the converted base, OUT_DIR/checkpoints/0, as load_parameters_path, and carries
lora_rank, lora_alpha, lora_targets from adapter_config.json). config.yml points load_parameters_path at it, so
training starts from these adapters on that base, and generation, eval and to_hf read them as a LoRA run's step.

Only what maxshard's LoRA computes is accepted; every other PEFT option that changes the function is one line
naming the adapter_config.json key (rsLoRA's alpha / sqrt(r), DoRA, per-module ranks, trained biases, extra
trained modules, layer subsets).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath
from safetensors.numpy import load_file

from maxshard.checkpoint import orbax_io
from maxshard.convert import layout, names
from maxshard.convert.families import Family
from maxshard.convert.lora import ADAPTER_CONFIG, ADAPTER_FILE, PEFT_PREFIX
from maxshard.errors import ConfigError
from maxshard.spec.model_config import LORA_TARGETS
from maxshard.model.layers.lora import ADAPTER_PARAMS

__all__ = ["PeftLora", "read", "adapter_arrays", "write", "HF_MODULES", "ADAPTERS_STEP"]

ADAPTERS_STEP = os.path.join("adapters", "0")  # below OUT_DIR
# Hugging Face's module name of each `lora_targets` projection (names.ATTENTION and names.MLP).
HF_MODULES = {"q_proj": "q", "k_proj": "k", "v_proj": "v", "o_proj": "o", "gate_proj": "gate", "up_proj": "up",
              "down_proj": "down"}
# adapter_config.json keys whose non-default values change what the adapters compute, and the value maxshard has.
_MUST_BE = {"use_rslora": False, "use_dora": False, "bias": "none", "lora_bias": False, "fan_in_fan_out": False,
            "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "layers_to_transform": None,
            "layer_replication": None, "target_parameters": None, "trainable_token_indices": None,
            "use_qalora": False, "alora_invocation_tokens": None}
_EMPTY = (None, {}, [], False)


@dataclasses.dataclass(frozen=True)
class PeftLora:
    """A PEFT LoRA directory, read and checked: its rank, alpha, maxshard targets and tensors by name."""

    directory: str
    rank: int
    alpha: float
    targets: tuple[str, ...]  # in LORA_TARGETS order
    tensors: Mapping[str, np.ndarray]

    def config_keys(self) -> dict[str, Any]:
        """The run keys these adapters need (config.yml's LoRA section)."""
        return {"lora_rank": self.rank, "lora_alpha": self.alpha, "lora_targets": list(self.targets)}


def _targets(config: Mapping[str, Any], where: str) -> tuple[str, ...]:
    modules = config.get("target_modules")
    if modules == "all-linear":  # PEFT: every linear but the head, which here is each of the seven projections
        modules = list(HF_MODULES)
    if isinstance(modules, str) or not modules:
        raise ConfigError(f"{where}: target_modules={modules!r}: list the projections by name (from "
                          f"{', '.join(HF_MODULES)}); a pattern does not import")
    unknown = sorted(m for m in modules if m not in HF_MODULES)
    if unknown:
        raise ConfigError(f"{where}: target_modules names {unknown[0]}; maxshard's LoRA adapts "
                          f"{', '.join(HF_MODULES)} (lora_targets {', '.join(LORA_TARGETS)})")
    wanted = {HF_MODULES[m] for m in modules}
    return tuple(t for t in LORA_TARGETS if t in wanted)


def read(directory: str) -> PeftLora:
    """adapter_config.json and adapter_model.safetensors of a PEFT LoRA directory, checked before anything is
    written; one ConfigError line naming the key or file otherwise."""
    config_path, tensors_path = os.path.join(directory, ADAPTER_CONFIG), os.path.join(directory, ADAPTER_FILE)
    if not os.path.isfile(config_path):
        raise ConfigError(f"--adapters {directory}: no {ADAPTER_CONFIG} (a directory PEFT's save_pretrained wrote)")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    where = f"{config_path}"
    if config.get("peft_type") != "LORA":
        raise ConfigError(f"{where}: peft_type={config.get('peft_type')!r}; only LORA adapters import")
    for key, allowed in _MUST_BE.items():
        value = config.get(key, allowed)
        if value != allowed and not (allowed in _EMPTY and value in _EMPTY):
            raise ConfigError(f"{where}: {key}={value!r} changes what the adapters compute and maxshard's LoRA "
                              f"has no such option (it needs {key}={allowed!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise ConfigError(f"{where}: r={rank!r} and lora_alpha={alpha!r} must be a positive integer and number")
    dropout = config.get("lora_dropout") or 0.0
    if dropout:  # a training option, not part of what the adapters compute: the import is right, the run differs
        print(f"note: {where}: lora_dropout={dropout} is not applied: maxshard's LoRA trains without dropout")
    if not os.path.isfile(tensors_path):
        raise ConfigError(f"--adapters {directory}: no {ADAPTER_FILE} (adapter_model.bin, PEFT's pickle format, "
                          "does not import: save with safe_serialization)")
    return PeftLora(directory, rank, float(alpha), _targets(config, where), load_file(tensors_path))


def _adapted(params: list[layout.Param], lora: PeftLora) -> list[layout.Param]:
    """The stacked kernels these adapters correct: the targeted projections of every decoder layer."""
    out = []
    for param in params:
        module = param.entry.hf.split(".")[-2]
        if (param.stacked and param.entry.layout == "linear" and not param.entry.per_expert
                and HF_MODULES.get(module) in lora.targets):
            out.append(param)
    return out


def _stem(param: layout.Param, layer: int) -> str:
    return PEFT_PREFIX + names.hf_name(param.entry, (layer,)).removesuffix(".weight")


def adapter_arrays(lora: PeftLora, params: list[layout.Param], family: Family
                   ) -> list[tuple[orbax_io.Leaf, np.ndarray]]:
    """(leaf, whole stacked array) of every maxshard adapter, A [units, *in, r] and B [units, r, *out]; every
    tensor of the file must be used and every targeted projection of every layer present, with PEFT's shapes."""
    adapted = _adapted(params, lora)
    if not adapted:
        raise ConfigError(f"{lora.directory}: target_modules match no projection of {family.architecture}")
    used, out, r = set(), [], lora.rank
    for param in adapted:
        num_in = param.entry.num_in
        in_dims, out_dims = param.layer_shape[:num_in], param.layer_shape[num_in:]
        stacked = {name: np.zeros((param.shape[0], *shape), np.float32)
                   for name, shape in zip(ADAPTER_PARAMS, ((*in_dims, r), (r, *out_dims)))}
        for (layer,) in param.indices():
            pair = []
            for side, want in (("lora_A", (r, int(np.prod(in_dims)))), ("lora_B", (int(np.prod(out_dims)), r))):
                name = f"{_stem(param, layer)}.{side}.weight"
                if name not in lora.tensors:
                    raise ConfigError(f"{lora.directory}/{ADAPTER_FILE}: tensor {name} is missing (target_modules "
                                      f"names {param.entry.hf.split('.')[-2]})")
                tensor = lora.tensors[name]
                if tensor.shape != want:
                    raise ConfigError(f"{lora.directory}/{ADAPTER_FILE}: tensor {name} has shape {list(tensor.shape)};"
                                      f" r={r} and the base's config.json imply {list(want)}")
                used.add(name)
                pair.append(tensor)
            unit = param.local((layer,))[0]
            stacked[ADAPTER_PARAMS[0]][unit] = pair[0].T.reshape(*in_dims, r)
            # B's rows as the kernel's are read (a RoPE part reordered): the inverse of lora.peft_pair
            stacked[ADAPTER_PARAMS[1]][unit] = names.to_maxshard(dataclasses.replace(param.entry, num_in=1), pair[1],
                                                                 (r, *out_dims))
        dtype = lora.tensors[f"{_stem(param, param.indices()[0][0])}.lora_A.weight"].dtype
        for name, array in stacked.items():
            leaf = orbax_io.Leaf((*param.path[:-1], name), array.shape, np.dtype(dtype), 1, 0)
            out.append((leaf, array.astype(dtype)))
    extra = sorted(set(lora.tensors) - used)
    if extra:
        raise ConfigError(f"{lora.directory}/{ADAPTER_FILE}: tensor {extra[0]} has no place in maxshard's LoRA "
                          f"of {family.architecture}")
    return out


def write(arrays: list[tuple[orbax_io.Leaf, np.ndarray]], state_dir: epath.Path) -> int:
    """`adapter_arrays` as the params of an orbax state item (a LoRA step's); returns how many values it holds."""
    orbax_io.write_skeleton(state_dir, [leaf for leaf, _ in arrays])
    for leaf, array in arrays:
        store = orbax_io.create_array(state_dir, leaf)
        for unit in range(array.shape[0]):
            orbax_io.write_rows(store, leaf, (unit,), 0, array[unit])
    return sum(array.size for _, array in arrays)
