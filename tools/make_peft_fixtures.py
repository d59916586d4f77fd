"""Writes tests/fixtures/peft/qwen3_lora/: a LoRA adapter made by PEFT itself on the qwen3 fixture, and its logits.

Run once, by hand, in the fixture venv (torch, transformers and peft are never dependencies of maxshard or its CI):

    /work/trlvenv/bin/pip install peft
    /work/trlvenv/bin/python tools/make_peft_fixtures.py

PEFT wraps tests/fixtures/hf/qwen3 (Qwen3ForCausalLM, float32) in a LoraConfig of rank 4, alpha 8 (scale 2) on
every projection maxshard can adapt (q/k/v/o, gate/up/down, named as `lora_targets` maps them). A fresh PEFT
adapter has B = 0 and would change nothing, so A and B are redrawn from a fixed seed (std 0.2), large enough that
the adapters move the logits by about one. The directory holds:

  adapter_model.safetensors, adapter_config.json   what `PeftModel.save_pretrained` writes (its README.md model card
                                                   is dropped), base_model_name_or_path relative to the repository
  tokens.npy    int32 [2, 12], the qwen3 fixture's own token ids
  logits.npy    float32 [2, 12, vocab]: `PeftModel.from_pretrained(base, dir)` on those tokens, the adapters applied
                as PEFT applies them (not merged); the script checks that `merge_and_unload()` gives the same within
                1e-5 and that they differ from the base's logits.

tests/test_peft.py imports this directory with `python -m maxshard.convert from_hf tests/fixtures/hf/qwen3 OUT
--adapters tests/fixtures/peft/qwen3_lora` and compares maxshard's logits and `to_hf --adapters-only` with these files.
Written with peft 0.21.2, transformers 5.24, torch 2.14.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM

REPO = pathlib.Path(__file__).resolve().parent.parent
BASE = "tests/fixtures/hf/qwen3"  # relative: it is what adapter_config.json records as the base
OUT = REPO / "tests" / "fixtures" / "peft" / "qwen3_lora"
RANK, ALPHA, SEED = 4, 8, 0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()


def base_model() -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(BASE, dtype=torch.float32).eval()


def main() -> None:
    os.chdir(REPO)
    tokens = np.load(REPO / BASE / "tokens.npy")
    config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0, bias="none",
                        task_type="CAUSAL_LM")
    model = get_peft_model(base_model(), config)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.2)
    OUT.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(OUT)
    (OUT / "README.md").unlink(missing_ok=True)

    plain = logits(base_model(), tokens)
    loaded = PeftModel.from_pretrained(base_model(), OUT).eval()  # read back as users load it
    with_adapters = logits(loaded, tokens)
    merged = logits(loaded.merge_and_unload(), tokens)
    diff, moved = float(np.max(np.abs(merged - with_adapters))), float(np.max(np.abs(with_adapters - plain)))
    assert diff < 1e-5 and moved > 0.1, (diff, moved)
    np.save(OUT / "tokens.npy", tokens)
    np.save(OUT / "logits.npy", with_adapters.astype(np.float32))
    size = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {OUT} ({size / 1024:.0f} KiB): merged = unmerged within {diff:.1e}, adapters move logits by "
          f"{moved:.2f}")


if __name__ == "__main__":
    main()
