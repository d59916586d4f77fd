"""`from_hf`: a Hugging Face directory of a supported family (families.py) -> OUT_DIR with config.yml,
checkpoints/0 and hf/.

    OUT_DIR/config.yml        a CONFIG for `python -m maxshard.train` (base_config, the model keys, tokenizer_path,
                              load_parameters_path), all paths absolute
    OUT_DIR/checkpoints/0/    the parameters as an orbax step directory (state/ + config/), in the source dtype
    OUT_DIR/hf/               the source's config.json, tokenizer and generation files, untouched: the tokenizer
                              that training uses, and the template `to_hf` exports back into

Memory: one block of rows of one tensor at a time, at most `orbax_io.CHUNK_BYTES` (4 MiB) or one row if a row is
larger: `safe_open(...).get_slice(name)[rows]` copies it out of the mapped file, it is rearranged as a view and
written as whole zarr chunks, which tensorstore compresses from a copy. So the process needs a few blocks above the
fixed cost of jax + orbax, whatever the size of the largest tensor; the pages of the mapped source it has read are
page cache on top (see safetensors_io.py); benchmarks/convert_memory.py measures both.
The checkpoint is built under OUT_DIR/.partial and renamed into place last, so an interrupted conversion never
leaves a checkpoint that looks complete.

With `--adapters PEFT_DIR` (convert/peft.py) the PEFT LoRA adapters also become OUT_DIR/adapters/0, a LoRA step on
the converted base, and config.yml carries their lora_rank, lora_alpha, lora_targets and names that step as
load_parameters_path: training continues from the adapters, generation and eval apply them. The base step's own
config has lora_rank 0 (it is a whole model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import yaml
from etils import epath

import maxshard
from maxshard import config
from maxshard.checkpoint import format as checkpoint_format
from maxshard.checkpoint import orbax_io
from maxshard.convert import hf_config, layout, multimodal, names, peft, safetensors_io
from maxshard.convert.families import Family
from maxshard.errors import ConfigError
from maxshard.spec.model_config import ModelConfig

__all__ = ["convert", "Result", "HF_FILES", "default_base_config"]

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "special_tokens_map.json", "tokenizer.model")
STEP = "0"


@dataclasses.dataclass(frozen=True)
class Result:
    config_path: str
    step_dir: str
    architecture: str
    num_params: int
    dtypes: tuple[str, ...]
    tokenizer_path: str
    adapters_dir: str = ""  # the imported PEFT adapters' LoRA step (--adapters), else ""


def default_base_config() -> str:
    """configs/base.yml of the repository this package runs from (a source checkout or an editable install)."""
    return str(epath.Path(maxshard.__file__).resolve().parent.parent / "configs" / "base.yml")


def _tensor_plan(cfg: ModelConfig, family: Family, tensors: Mapping[str, safetensors_io.TensorInfo], source: str
                 ) -> list[tuple[layout.Param, list[safetensors_io.TensorInfo]]]:
    """Each maxshard parameter with its Hugging Face tensors (one per layer, or per layer and expert, when
    stacked), every name and shape checked before anything is written."""
    plan, used = [], set()
    for param in layout.params_of(cfg, family):
        infos = []
        indices = param.indices()
        for index in indices:
            name = names.hf_name(param.entry, index)
            if name not in tensors:
                raise ConfigError(f"{source}: tensor {name} is missing (config.json describes a model that has it)")
            info, want = tensors[name], names.hf_shape(param.entry, param.layer_shape)
            if info.shape != want:
                raise ConfigError(f"{source}: tensor {name} has shape {list(info.shape)}; config.json implies "
                                  f"{list(want)}")
            first = names.hf_name(param.entry, indices[0])
            if info.dtype != tensors[first].dtype:
                raise ConfigError(f"{source}: tensor {name} is {info.dtype}, unlike {first}'s")
            infos.append(info)
            used.add(name)
        plan.append((param, infos))
    used |= {name for name, _ in names.mtp_copies(cfg, family)}  # copies of the shared embedding and head: kept once
    extra = sorted(n for n in tensors if n not in used and not names.IGNORED.fullmatch(n)
                   and not (cfg.logits_via_embedding and n == names.HEAD.hf))
    if extra:
        raise ConfigError(f"{source}: tensor {extra[0]} has no place in maxshard's model (biases and extra modules "
                          "do not convert)")
    return plan


def _qwen_mtp(keys: dict[str, Any], tensors: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """`keys` with mtp_depth 1 when the checkpoint holds Qwen3-Next's multi-token prediction module
    (`Family.mtp_prefix`: config.json does not say; vLLM reads the tensors), 0 without; its one fc shared by
    several layers (mtp.layers.1, ...) has no maxshard counterpart (one eh_proj per module), refused."""
    fc = names.QWEN_MTP[2].hf
    if fc not in tensors:
        return keys
    stem = f"{family.mtp_prefix}.layers."
    layers = {name[len(stem):].split(".")[0] for name in tensors if name.startswith(stem)}
    if layers != {"0"}:
        raise ConfigError(f"{fc} with layers {sorted(layers)} under {stem}*: maxshard converts Qwen3-Next's "
                          "multi-token prediction module with its one layer, mtp.layers.0")
    return {**keys, "mtp_depth": 1}


def _without_absent_mtp(keys: dict[str, Any], tensors: Mapping[str, Any], family: Family) -> dict[str, Any]:
    """`keys` with mtp_depth 0 when config.json names multi-token prediction layers (DeepSeek's
    num_nextn_predict_layers) that the checkpoint does not hold: transformers drops them when it loads, so a
    checkpoint it saved (a fine-tune, our fixtures) keeps the field and loses the layers. Noted on stderr. A family
    that keeps its module elsewhere (`Family.mtp_prefix`) has it when the checkpoint does (`_qwen_mtp`)."""
    if family.mtp_prefix:
        return _qwen_mtp(keys, tensors, family)
    depth = keys.get("mtp_depth", 0)
    if depth and names.hf_name(names.MTP[0], (keys["num_layers"],)) not in tensors:
        print(f"note: config.json names {depth} multi-token prediction layer(s) the checkpoint does not hold "
              "(transformers drops them on save): converted without them (mtp_depth 0)", file=sys.stderr)
        return {**keys, "mtp_depth": 0}
    return keys


def _without_left_out(tensors: Mapping[str, Any], family: Family) -> Mapping[str, Any]:
    """The tensors but those under a prefix the family's transformers model does not load (`Family.left_out`:
    Qwen3-Next's mtp.*), each prefix left out noted in one line on stderr."""
    kept = dict(tensors)
    for prefix, what in family.left_out.items():
        dropped = [name for name in kept if name.startswith(prefix)]
        if dropped:
            print(f"note: {family.architecture}: {len(dropped)} tensors under {prefix}* ({what}) are left out",
                  file=sys.stderr)
            kept = {name: info for name, info in kept.items() if not name.startswith(prefix)}
    return kept


def _scalar(value: Any) -> str:
    """One YAML scalar as training's config loader reads it back (floats keep their dot and exponent)."""
    return yaml.safe_dump(value, default_flow_style=True, default_style='"' if isinstance(value, str) else None
                          ).strip().removesuffix("...").strip()


def _config_text(keys: Mapping[str, Any], paths: Mapping[str, str], arch: str, hf_dir: str,
                 max_position: Any, lora: peft.PeftLora | None = None) -> str:
    """config.yml. Paths are absolute: tokenizer_path and load_parameters_path are read relative to the working
    directory and base_config relative to this file, so absolute ones work wherever training is started."""
    comments = {"max_target_length": f"training length; the model's max_position_embeddings is {max_position}",
                "capacity_factor": "dropless routing: every token reaches its k experts, as in transformers"}
    lines = [f"# Converted from {arch} in {hf_dir} by `python -m maxshard.convert from_hf`.",
             "# Fine-tune on your own text: python -m maxshard.train THIS_FILE dataset_path=DIR_OR_GLOB run_name=NAME",
             f"base_config: {_scalar(paths['base_config'])}", "", "# ---- model (from config.json)"]
    for key, value in keys.items():
        lines.append(f"{key}: {_scalar(value)}" + (f"  # {comments[key]}" if key in comments else ""))
    lines += ["scan_layers: true  # the converted parameters are stacked [layers, ...]", ""]
    if keys.get("score_head"):  # a reward model (objectives/reward.py) trains on preference pairs
        lines += ["# ---- a reward model: trained on preference records (dataset_path: a JSONL of prompt, chosen, "
                  "rejected)", "objective: reward_model", "dataset_type: preference", ""]
    lines += ["# ---- data and parameters"]
    tokenizer = paths["tokenizer_path"]
    lines.append(f"tokenizer_path: {_scalar(tokenizer)}" + ("" if tokenizer else
                                                            "  # the source has none: set one before training on text"))
    if lora is not None:
        lines += ["", f"# ---- LoRA (from {peft.ADAPTER_CONFIG} of {lora.directory}; a run must keep these to start "
                      "from the adapters)"]
        lines += [f"{key}: {_scalar(value)}" for key, value in lora.config_keys().items()]
        lines.append(f"load_parameters_path: {_scalar(paths['adapters'])}  # the adapters, on the base "
                     f"{paths['load_parameters_path']}")
    else:
        lines.append(f"load_parameters_path: {_scalar(paths['load_parameters_path'])}")
    return "\n".join(lines) + "\n"


def _copy_hf_files(hf_dir: str, dest: str) -> str:
    """Copies the non-weight files; returns the tokenizer path for config.yml ('' when the source has none)."""
    os.makedirs(dest, exist_ok=True)
    for name in HF_FILES:
        if os.path.isfile(os.path.join(hf_dir, name)):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(dest, name))
    for name in ("tokenizer.json", "tokenizer.model"):  # maxshard reads both kinds; the fast tokenizer first
        if os.path.isfile(os.path.join(dest, name)):
            return os.path.join(dest, name)
    return ""


def _write_params(state_dir: epath.Path, source: safetensors_io.Source,
                  plan: list[tuple[layout.Param, list[safetensors_io.TensorInfo]]]) -> None:
    """Pass 1 (orbax skeleton), then pass 2: each parameter filled one block of rows at a time, read from its file
    (rows are contiguous there), rearranged as a view and written as whole chunks."""
    leaves = [orbax_io.Leaf(p.path, p.shape, infos[0].dtype, p.lead, names.row_axis(p.entry))
              for p, infos in plan]
    orbax_io.write_skeleton(state_dir, leaves)
    for (param, infos), leaf in zip(plan, leaves):
        store = orbax_io.create_array(state_dir, leaf)
        axis, dims = leaf.row_axis, param.layer_shape
        size = dims[axis]
        whole = names.whole_rows(param.entry, dims)
        step = size if whole else orbax_io.rows_per_chunk(leaf)
        per_row = names.hf_rows_per_row(param.entry, dims)
        for index, info in zip(param.indices(), infos):
            for start in range(0, size, step):
                stop = min(start + step, size)
                rows = source.read(info) if whole else source.read(info, start * per_row, stop * per_row)
                block = names.to_maxshard(param.entry, rows, dims[:axis] + (stop - start,) + dims[axis + 1 :])
                orbax_io.write_rows(store, leaf, param.local(index), start, block)


def convert(hf_dir: str, out_dir: str, base_config: str | None = None, adapters: str | None = None) -> Result:
    """Converts (with `adapters`, a PEFT LoRA directory, also them); every problem with the source is a
    ConfigError before anything is written."""
    hf_dir, out_dir = os.path.abspath(hf_dir), os.path.abspath(out_dir)
    hf, wrapper = multimodal.text_model(hf_config.read(hf_dir))
    family, keys = hf_config.family(hf), hf_config.model_keys(hf)
    arch = family.architecture
    lora = peft.read(os.path.abspath(adapters)) if adapters else None
    with safetensors_io.Source(hf_dir) as source:
        tensors = source.tensors
        if wrapper is not None:
            tensors, left_out = multimodal.text_tensors(tensors, wrapper, hf_dir)
            print(f"note: {wrapper.architecture}: converting its language model as {arch}; {left_out} tensors of "
                  "the vision tower and projector are left out (maxshard trains text models)", file=sys.stderr)
        tensors = _without_left_out(tensors, family)
        keys = _without_absent_mtp(keys, tensors, family)
        plan = _tensor_plan(layout.model_config(keys), family, tensors, hf_dir)
        adapter_arrays = peft.adapter_arrays(lora, [p for p, _ in plan], family) if lora else []
        if lora and keys.get("moe_router_bias"):
            raise ConfigError(f"{arch} with moe_router_bias: a LoRA step holds the selection biases its run moved, "
                              "which imported adapters lack; import the model without --adapters")
        base = os.path.abspath(base_config or default_base_config())
        if not os.path.isfile(base):
            raise ConfigError(f"base config {base} not found; pass --base-config PATH_TO/configs/base.yml")
        step_dir = os.path.join(out_dir, "checkpoints", STEP)
        if os.path.exists(step_dir):
            raise ConfigError(f"{out_dir} already holds a converted model ({step_dir}); choose another OUT_DIR")

        adapters_dir = os.path.join(out_dir, peft.ADAPTERS_STEP)
        if lora and os.path.exists(adapters_dir):
            raise ConfigError(f"{out_dir} already holds imported adapters ({adapters_dir}); choose another OUT_DIR")

        tokenizer_path = _copy_hf_files(hf_dir, os.path.join(out_dir, "hf"))
        if wrapper is not None:  # the template to_hf exports into: the text model that was converted
            with open(os.path.join(out_dir, "hf", "config.json"), "w", encoding="utf-8") as f:
                json.dump(hf, f, indent=2, sort_keys=True)
        config_path = os.path.join(out_dir, "config.yml")
        with open(config_path, "w", encoding="utf-8") as f:
            paths = {"base_config": base, "tokenizer_path": tokenizer_path, "load_parameters_path": step_dir,
                     "adapters": adapters_dir}
            f.write(_config_text(keys, paths, arch, hf_dir, hf.get("max_position_embeddings"), lora))
        cfg = config.parse([config_path])  # the file must be one that training accepts
        if lora:  # the base step is a whole model; the adapters' step names it as their base
            lora_cfg = config.parse([config_path, f"load_parameters_path={step_dir}"])
            cfg = config.parse([config_path, "lora_rank=0", f"load_parameters_path={step_dir}"])

        partial = epath.Path(out_dir) / ".partial" / STEP
        if partial.exists():
            shutil.rmtree(partial)
        _write_params(partial / checkpoint_format.STATE, source, plan)
    checkpoint_format.write_config(partial, cfg)
    if lora:
        partial_adapters = partial.parent / "adapters"
        if partial_adapters.exists():
            shutil.rmtree(partial_adapters)
        peft.write(adapter_arrays, partial_adapters / checkpoint_format.STATE)
        checkpoint_format.write_config(partial_adapters, lora_cfg)
        os.makedirs(os.path.dirname(adapters_dir), exist_ok=True)
        os.rename(partial_adapters, adapters_dir)
    os.makedirs(os.path.dirname(step_dir), exist_ok=True)
    os.rename(partial, step_dir)
    shutil.rmtree(partial.parent, ignore_errors=True)
    num_params = sum(int(np.prod(p.shape)) for p, _ in plan)
    dtypes = tuple(sorted({infos[0].dtype.name for _, infos in plan}))
    return Result(config_path, step_dir, arch, num_params, dtypes, tokenizer_path, adapters_dir if lora else "")
