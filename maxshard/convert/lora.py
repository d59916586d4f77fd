"""LoRA checkpoints out to Hugging Face: merged into the base's weights, or the adapters alone in PEFT's layout.

A LoRA run's checkpoint holds only its adapters (A [*in, rank], B [rank, *out] beside each targeted kernel); its
config names the frozen base (`load_parameters_path`) and the scale alpha / rank. So:

- merged (`to_hf` default): every tensor is read from the base, and a targeted projection's kernel gets
  scale * A @ B added in float32 before the cast to the output dtype; every other tensor is the base's, bit for bit.
- `--adapters-only`: `adapter_model.safetensors` + `adapter_config.json` as PEFT writes them, for
  `PeftModel.from_pretrained(base, dir)`. A Hugging Face linear is W[out, in] applied as x @ W.T and PEFT adds
  scale * (x @ lora_A.T) @ lora_B.T, so lora_A.weight = A flattened to [in, rank] and transposed, lora_B.weight
  = B's rows in the order the kernel's are written (`peft_pair`: a RoPE part reordered, as MLA's query): lora_B @
  lora_A is then exactly the merged update in Hugging Face's layout. Kernels cut from one Hugging Face tensor (MLA's
  kv_b_proj: keys and values) become one module whose ranks add up (`_joined_pair`, PEFT's rank_pattern).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
from etils import epath
from safetensors.numpy import save_file

from maxshard.checkpoint import orbax_io
from maxshard.checkpoint.format import whole_model_under
from maxshard.convert import layout, names
from maxshard.convert.families import Family
from maxshard.convert.locate import locate
from maxshard.errors import ConfigError
from maxshard.model.layers.lora import ADAPTER_PARAMS

__all__ = ["Adapters", "adapters_of", "export_adapters", "peft_pair", "ADAPTER_FILE", "ADAPTER_CONFIG", "PEFT_PREFIX"]

ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."  # PEFT's name for the wrapped causal LM


@dataclasses.dataclass
class Adapters:
    """A LoRA run's adapters (`reader` on its own step directory) and their scale."""

    reader: orbax_io.Reader
    rank: int
    alpha: float

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def has(self, param: layout.Param) -> bool:
        """True for a kernel with an adapter pair in the checkpoint (the head, norms, embeddings never have one)."""
        return param.path[-1] == "kernel" and self._pair_path(param, ADAPTER_PARAMS[0]) is not None

    def pair(self, param: layout.Param, at: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(A, B) of one layer's projection, as saved ([*in, rank], [rank, *out])."""
        a, b = (self._read(param, name, at) for name in ADAPTER_PARAMS)
        return a, b

    def delta(self, param: layout.Param, at: tuple[int, ...]) -> np.ndarray:
        """scale * A @ B of one layer, in float32 and the kernel's maxshard shape."""
        a, b = self.pair(param, at)
        return self.scale * np.tensordot(a.astype(np.float32), b.astype(np.float32), axes=1)

    def _read(self, param: layout.Param, name: str, at: tuple[int, ...]) -> np.ndarray:
        path, index = locate(self.reader, self._pair_param(param, name), at)
        return self.reader.read(path, index)

    def _pair_param(self, param: layout.Param, name: str) -> layout.Param:
        return dataclasses.replace(param, path=(*param.path[:-1], name))

    def _pair_path(self, param: layout.Param, name: str) -> tuple[str, ...] | None:
        try:
            path = locate(self.reader, self._pair_param(param, name), (0,) if param.stacked else ())[0]
        except ConfigError:
            return None
        return path if path in self.reader.arrays else None


def adapters_of(step_dir: str, saved: Mapping[str, Any]) -> tuple[Adapters | None, str]:
    """(the adapters of a LoRA run's step directory, the base step directory to read every other tensor from), or
    (None, step_dir) for a checkpoint that holds a whole model."""
    rank = int(saved.get("lora_rank") or 0)
    if not rank:
        return None, step_dir
    base = saved.get("load_parameters_path") or ""
    if not base or not (epath.Path(base) / "state").exists():
        raise ConfigError(f"{step_dir} holds LoRA adapters whose base load_parameters_path={base!r} is not a "
                          "checkpoint step directory here")
    # A run that started from other adapters (another run's, or PEFT's through from_hf --adapters) names their step.
    return Adapters(orbax_io.Reader(step_dir), rank, float(saved["lora_alpha"])), whole_model_under(base)


def merged(kernel: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """The base kernel with its adapters' update, computed in float32 and returned in the kernel's dtype."""
    return (kernel.astype(np.float32) + delta).astype(kernel.dtype)


def peft_pair(entry: names.Entry, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One projection's (lora_A [rank, in], lora_B [out, rank]) in Hugging Face's layout: A's inputs as the
    kernel's, B's outputs in the order `names.to_hf` writes the kernel's rows (a RoPE part reordered: MLA's query)."""
    rank = a.shape[-1]
    lora_b = names.to_hf(dataclasses.replace(entry, num_in=1), b)
    return a.reshape(-1, rank).T, lora_b


def _joined_pair(parts: list[tuple[names.Entry, np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Adapters of kernels cut from one Hugging Face tensor (MLA's kv_b_proj: each head's key rows, then its value
    rows; gated DeltaNet's in_proj_qkvz per key head, in_proj_qkv in one group) as one PEFT module of rank
    sum(ranks): A stacked, B block-diagonal across the parts' rows, so lora_B @ lora_A is each part's own update in
    its own rows. The tensor's groups of `width` rows are as many as a part's outputs make (names.py)."""
    width = parts[0][0].part[2]
    entry0, b0 = parts[0][0], parts[0][2]
    groups = int(np.prod(b0.shape[1:])) // (entry0.part[1] - entry0.part[0])
    ranks = [a.shape[-1] for _, a, _ in parts]
    lora_b = np.zeros((groups, width, sum(ranks)), b0.dtype)
    column = 0
    for (entry, _, b), rank in zip(parts, ranks):
        start, stop, _ = entry.part
        lora_b[:, start:stop, column:column + rank] = b.reshape(rank, groups, stop - start).transpose(1, 2, 0)
        column += rank
    lora_a = np.concatenate([a.reshape(-1, a.shape[-1]).T for _, a, _ in parts])
    return lora_a, lora_b.reshape(groups * width, -1)


def export_adapters(adapters: Adapters, params: list[layout.Param], family: Family, hf_dir: str, base_name: str,
                    dtype: np.dtype | None = None) -> tuple[str, int, str]:
    """Writes PEFT's adapter_model.safetensors and adapter_config.json in `dtype` (default: as saved);
    (file name, tensors written, dtype written). A module joined from several adapted kernels (`_joined_pair`) gets
    its own rank in `rank_pattern` and alpha in `alpha_pattern`, so PEFT scales it by alpha / rank as the rest."""
    tensors: dict[str, np.ndarray] = {}
    modules, joined = [], {}
    for param in params:
        if not (param.stacked and adapters.has(param)):
            continue
        entry = param.entry
        modules.append(entry.hf.split(".")[-2])
        for (layer,) in param.indices():
            a, b = adapters.pair(param, (layer,))
            stem = PEFT_PREFIX + names.hf_name(entry, (layer,)).removesuffix(".weight")
            if entry.part:
                joined.setdefault(stem, []).append((entry, a, b))
                continue
            lora_a, lora_b = peft_pair(entry, a, b)
            tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(lora_a, dtype or a.dtype)
            tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(lora_b, dtype or b.dtype)
    patterns = {}
    for stem, parts in joined.items():
        lora_a, lora_b = _joined_pair(parts)
        tensors[f"{stem}.lora_A.weight"] = np.ascontiguousarray(lora_a, dtype or lora_a.dtype)
        tensors[f"{stem}.lora_B.weight"] = np.ascontiguousarray(lora_b, dtype or lora_b.dtype)
        if lora_a.shape[0] != adapters.rank:
            patterns[stem.split(".")[-1]] = lora_a.shape[0]
    if not tensors:
        raise ConfigError("the checkpoint's adapters match no Hugging Face projection of "
                          f"{family.architecture}")
    os.makedirs(hf_dir, exist_ok=True)
    save_file(tensors, os.path.join(hf_dir, ADAPTER_FILE), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": adapters.rank, "lora_alpha": adapters.alpha,
        "target_modules": sorted(set(modules)), "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "use_rslora": False, "init_lora_weights": True, "inference_mode": True,
        "base_model_name_or_path": base_name, "modules_to_save": None,
        "rank_pattern": patterns, "alpha_pattern": {m: adapters.alpha * r / adapters.rank for m, r in patterns.items()},
    }
    with open(os.path.join(hf_dir, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    written = sorted({t.dtype.name for t in tensors.values()})
    return ADAPTER_FILE, len(tensors), "/".join(written)
