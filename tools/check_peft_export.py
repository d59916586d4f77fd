"""Loads a LoRA run's two exports with transformers and PEFT and checks that they are the same model.

Run by hand in the fixture venv (torch, transformers and peft are never maxshard dependencies):

    python -m maxshard.convert to_hf runs/lora/checkpoints/30 /tmp/lora_merged
    python -m maxshard.convert to_hf runs/lora/checkpoints/30 /tmp/lora_peft --adapters-only
    /work/hfvenv/bin/python tools/check_peft_export.py tests/fixtures/hf/qwen3 /tmp/lora_peft /tmp/lora_merged

`PeftModel.from_pretrained(base, ADAPTERS_DIR)` (the base Hugging Face model with PEFT's LoRA layers, not merged)
must give the logits of `from_pretrained(MERGED_DIR)` within 1e-4 (float32), and differ from the base's own: the
adapters are applied, by PEFT's reading of adapter_config.json (r, lora_alpha, target_modules).
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()


def main(base_dir: str, adapters_dir: str, merged_dir: str) -> None:
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).eval()
    tokens = np.random.default_rng(0).integers(0, base.config.vocab_size, (2, 12))
    plain = logits(base, tokens)
    peft = PeftModel.from_pretrained(base, adapters_dir).eval()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with_adapters, merged_logits = logits(peft, tokens), logits(merged, tokens)
    diff, moved = float(np.max(np.abs(with_adapters - merged_logits))), float(np.max(np.abs(plain - merged_logits)))
    assert diff <= 1e-4 and moved > 1e-2, (diff, moved)
    print(f"PEFT adapters on {base_dir} = merged export within {diff:.2e} (the adapters move logits by {moved:.2f})")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
