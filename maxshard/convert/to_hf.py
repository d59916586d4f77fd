"""`to_hf`: a maxshard checkpoint step directory -> a Hugging Face directory transformers loads.

    HF_DIR/config.json                      model keys from the checkpoint's own saved config; everything else
                                            (max_position_embeddings, token ids, ...) from the template config.json
    HF_DIR/model.safetensors                or model-0000i-of-0000n.safetensors + model.safetensors.index.json
                                            above --max-shard-size
    HF_DIR/tokenizer.json, ...              the tokenizer files of the template directory

A LoRA run's checkpoint (its adapters) is written merged into its base's weights, or with --adapters-only as PEFT's
adapter_model.safetensors + adapter_config.json (`convert/lora.py`).

The template is `--template`, else the `hf/` directory `from_hf` kept beside the converted checkpoint, beside the one a
run started from (its load_parameters_path), or beside its tokenizer.
Tensors are written in the checkpoint's dtype unless --dtype says otherwise, so a converted model goes back bit for
bit. Memory: each output file is one `safetensors.numpy.save_file` of its tensors, assembled in memory from blocks
of rows of at most `orbax_io.CHUNK_BYTES`; so the peak is one shard (--max-shard-size, or the largest tensor when
that is larger) plus a block. Reading a block decodes the zarr chunks it touches: just that block for a converted
checkpoint (from_hf chunks the same way), but a whole stacked array for a checkpoint the trainer saved (orbax
stores an array as one chunk per shard), which is then added to the bound.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from maxshard.checkpoint import format as checkpoint_format
from maxshard.checkpoint import orbax_io
from maxshard.convert import hf_config, layout, lora, names, safetensors_io
from maxshard.convert.families import Family
from maxshard.convert.locate import locate
from maxshard.data import tokenizer as tokenizers
from maxshard.errors import ConfigError
from maxshard.spec import blocks
from maxshard.spec.model_config import ModelConfig

__all__ = ["export", "Result", "DTYPES"]

DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "generation_config.json")


@dataclasses.dataclass(frozen=True)
class Result:
    files: tuple[str, ...]
    num_tensors: int
    dtype: str
    template: str
    tokenizer_files: tuple[str, ...]


def _blocks(reader: orbax_io.Reader, path: tuple[str, ...], index: tuple, entry: names.Entry,
            layer_shape: tuple[int, ...], target: np.dtype) -> Iterator[np.ndarray]:
    """One Hugging Face tensor as blocks of its rows, each read from the checkpoint on its own.

    Hugging Face's rows run along maxshard's first output dim (dim 0 for a "same" layout): a block of heads of
    q_proj, of embed rows of o_proj, of vocab rows of lm_head. So memory is one block, not the tensor."""
    axis = names.row_axis(entry)
    if not layer_shape:
        yield reader.read(path, index).astype(target)
        return
    size = layer_shape[axis]
    row_bytes = int(np.prod(layer_shape)) // size * target.itemsize
    step = size if names.whole_rows(entry, layer_shape) else max(1, orbax_io.CHUNK_BYTES // max(row_bytes, 1))
    for start in range(0, size, step):
        window = index + (slice(None),) * axis + (slice(start, min(start + step, size)),)
        yield names.to_hf(entry, reader.read(path, window)).astype(target, copy=False)


def _order(params: list[layout.Param], family: Family, cfg: ModelConfig
           ) -> list[tuple[layout.Param, tuple[int, ...]]]:
    """Every Hugging Face tensor as (parameter, index), in Hugging Face's usual order: embeddings, each layer's
    tensors (each expert's inside its layer), final norm, head."""
    by_entry = {(p.stack, p.first, p.entry): p for p in params}
    rows = names.global_rows(cfg)
    order = [(by_entry["", 0, e], ()) for e in rows[:-1]]
    i = 0
    for stack in blocks.stacks(cfg):
        for r in range(stack.repeats):
            for j, layer in enumerate(stack.unit):  # layer_j of the unit: its parameters' first layer is i - r * period
                for entry in names.per_layer(family, cfg, layer):
                    if entry.part and entry.part[0]:
                        continue  # written with the tensor's first part (`_joined`)
                    param = by_entry[stack.name, i - r * len(stack.unit), entry]
                    order += ([(param, (i, e)) for e in range(param.shape[1])] if entry.per_expert
                              else [(param, (i,))])
                i += 1
    for k in range(1, cfg.mtp_depth + 1):  # multi-token prediction modules: layers after the last (names.mtp_rows)
        module = f"mtp_{k}"
        at = names.mtp_layer(cfg, module, family)
        for _, entry in names.mtp_rows(family, cfg):
            if not (entry.part and entry.part[0]):
                param = by_entry[module, at, entry]
                order += [(param, (at, e)) for e in range(param.shape[0])] if entry.per_expert else [(param, (at,))]
    return order + [(by_entry["", 0, e], ()) for e in (rows[-1], names.HEAD, names.SCORE)
                   if ("", 0, e) in by_entry]


def _merged(reader: orbax_io.Reader, adapters: lora.Adapters, param: layout.Param, at: tuple[int, ...],
            target: np.dtype) -> Iterator[np.ndarray]:
    """One targeted projection of one layer with its LoRA update merged, read whole (one layer's tensor)."""
    path, index = locate(reader, param, at)
    kernel = lora.merged(reader.read(path, index), adapters.delta(param, at))
    yield names.to_hf(param.entry, kernel).astype(target, copy=False)


def _joined(reader: orbax_io.Reader, parts: list[layout.Param], at: tuple[int, ...], target: np.dtype,
            adapters: lora.Adapters | None = None) -> Iterator[np.ndarray]:
    """One Hugging Face tensor cut into maxshard `part`s (MLA's kv_b_proj: each head's key, then value rows; gated
    DeltaNet's in_proj_qkvz), read whole: one layer's projection, each adapted part with its LoRA update merged."""
    ordered = sorted(parts, key=lambda p: p.entry.part)
    arrays = [reader.read(*locate(reader, p, at)) for p in ordered]
    if adapters is not None:
        arrays = [lora.merged(a, adapters.delta(p, at)) if adapters.has(p) else a for p, a in zip(ordered, arrays)]
    yield names.join_parts(ordered[0].entry, arrays, [p.entry for p in ordered]).astype(target, copy=False)


def _tensors(reader: orbax_io.Reader, params: list[layout.Param], family: Family, dtype: str | None,
             cfg: ModelConfig, adapters: lora.Adapters | None = None
             ) -> list[tuple[safetensors_io.TensorSpec, Callable[[], Iterator[np.ndarray]]]]:
    """Every Hugging Face tensor, in Hugging Face's usual order, with a function that reads it when it is due;
    with `adapters` (a LoRA run) the targeted projections carry their merged update."""
    out = []
    for param, at in _order(params, family, cfg):
        entry = param.entry
        path, index = locate(reader, param, at)
        target = DTYPES[dtype] if dtype else np.dtype(reader.arrays[path].dtype)
        spec = safetensors_io.TensorSpec(names.hf_name(entry, at), names.hf_shape(entry, param.layer_shape), target)
        if entry.part:
            parts = [p for p in params if (p.stack, p.first, p.entry.hf) == (param.stack, param.first, entry.hf)]
            produce = functools.partial(_joined, reader, parts, at, target, adapters)
        elif adapters is not None and adapters.has(param):
            produce = functools.partial(_merged, reader, adapters, param, at, target)
        else:
            produce = functools.partial(_blocks, reader, path, index, entry, param.layer_shape, target)
        out.append((spec, produce))
    shared = {p.entry: p for p in params if not p.stacked and p.layer is None}
    for name, entry in names.mtp_copies(cfg, family):  # the MTP modules' copies of the shared embedding and head
        param = shared[entry]
        target = DTYPES[dtype] if dtype else np.dtype(reader.arrays[param.path].dtype)
        spec = safetensors_io.TensorSpec(name, names.hf_shape(entry, param.layer_shape), target)
        out.append((spec, functools.partial(_blocks, reader, param.path, (), entry, param.layer_shape, target)))
    return out


def _template_dir(step_dir: str, saved: Mapping[str, Any], template: str | None) -> str:
    """The Hugging Face directory whose config.json and tokenizer to reuse: --template, else the hf/ that from_hf
    wrote beside this checkpoint (a converted model), beside the checkpoint this run started from
    (load_parameters_path: a fine-tuned model), or beside the tokenizer; '' when there is none."""
    if template:
        if not os.path.isfile(os.path.join(template, "config.json")):
            raise ConfigError(f"--template={template} has no config.json")
        return template
    candidates = [os.path.join(step_dir, os.pardir, os.pardir, "hf")]
    if saved.get("load_parameters_path"):
        candidates.append(os.path.join(saved["load_parameters_path"], os.pardir, os.pardir, "hf"))
    if saved.get("tokenizer_path"):
        candidates.append(os.path.dirname(saved["tokenizer_path"]))
    found = [c for c in candidates if os.path.isfile(os.path.join(c, "config.json"))]
    return os.path.normpath(found[0]) if found else ""


def _copy_tokenizer(saved: Mapping[str, Any], template: str, hf_dir: str) -> tuple[str, ...]:
    """The tokenizer files of the template, else the checkpoint's own tokenizer file; () for the byte tokenizer."""
    source = template or os.path.dirname(saved.get("tokenizer_path") or "")
    copied = []
    for name in TOKENIZER_FILES:
        if source and os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(hf_dir, name))
            copied.append(name)
    tok = saved.get("tokenizer_path") or ""
    if not copied and tok and os.path.isfile(tok):
        name = "tokenizer.json" if tok.endswith(".json") else "tokenizer.model"
        shutil.copyfile(tok, os.path.join(hf_dir, name))
        copied.append(name)
    return tuple(copied)


def _token_ids(saved: Mapping[str, Any]) -> dict[str, int]:
    """bos/eos/pad ids of the checkpoint's tokenizer, for a config.json without a template."""
    path = saved.get("tokenizer_path") or ""
    if path and not os.path.isfile(path):
        return {}
    tok = tokenizers.make_tokenizer(_TokenizerKeys(path))
    return {"bos_token_id": getattr(tok, "bos_token_id", tok.bos_id), "eos_token_id": tok.eos_id,
            "pad_token_id": tok.pad_id}


@dataclasses.dataclass(frozen=True)
class _TokenizerKeys:
    tokenizer_path: str


def export(step_dir: str, hf_dir: str, max_shard_size: str = "5GB", dtype: str | None = None,
           template: str | None = None, max_position_embeddings: int | None = None,
           adapters_only: bool = False) -> Result:
    """Writes HF_DIR from a checkpoint step directory (converted or trained). A LoRA run's step is exported with
    its adapters merged into the base's weights, or with `adapters_only` as PEFT's adapter files."""
    saved = checkpoint_format.read_config(step_dir)
    adapters, weights_dir = lora.adapters_of(step_dir, saved)
    if adapters_only and adapters is None:
        raise ConfigError(f"--adapters-only: {step_dir} is not a LoRA run's checkpoint (its lora_rank is 0)")
    keys = {k: saved[k] for k in layout.MODEL_KEYS if k in saved}
    missing = [k for k in ("vocab_size", "emb_dim", "num_layers") if k not in keys]
    if missing:
        raise ConfigError(f"{step_dir}/config has no {missing[0]}: not a maxshard model config")
    cfg = layout.model_config(keys)
    template = _template_dir(step_dir, saved, template)
    base = hf_config.read(template) if template else None
    reader = orbax_io.Reader(weights_dir)
    # Every parameter is written (params_of refuses one the family has no tensor for), so the dtypes written are
    # --dtype or the parameters' own, known before the family is; config.json, which picks the family, comes first
    # and every refusal of it is raised before anything is written.
    written = sorted({DTYPES[dtype].name} if dtype else {np.dtype(a.dtype).name for a in reader.arrays.values()})
    config_json = hf_config.to_hf(keys, written[0] if len(written) == 1 else "float32", base,
                                  None if base else _token_ids(saved))
    if max_position_embeddings:
        config_json["max_position_embeddings"] = max_position_embeddings
    family = hf_config.family(config_json)
    params = layout.params_of(cfg, family)
    if adapters_only:
        name, count, written_dtype = lora.export_adapters(adapters, params, family, hf_dir, template,
                                                          DTYPES[dtype] if dtype else None)
        copied = _copy_tokenizer(saved, template, hf_dir)
        return Result((name, lora.ADAPTER_CONFIG), count, written_dtype, template, copied)
    tensors = _tensors(reader, params, family, dtype, cfg, adapters)
    if cfg.num_experts > 1 and cfg.capacity_factor > 0:
        print(f"note: trained with capacity_factor={cfg.capacity_factor} (tokens over an expert's capacity dropped);"
              f" {family.architecture} routes dropless, so the export computes dropless routing", file=sys.stderr)
    produce = {spec.name: fn for spec, fn in tensors}
    os.makedirs(hf_dir, exist_ok=True)
    files = safetensors_io.write_checkpoint(hf_dir, [spec for spec, _ in tensors], lambda s: produce[s.name](),
                                            safetensors_io.parse_size(max_shard_size))
    with open(os.path.join(hf_dir, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config_json, f, indent=2, sort_keys=True)
        f.write("\n")
    copied = _copy_tokenizer(saved, template, hf_dir)
    return Result(tuple(files), len(tensors), "/".join(written), template, copied)
