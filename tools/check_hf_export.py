"""Loads directories written by `python -m maxshard.convert to_hf` with transformers and checks their logits.

Run by hand in the fixture venv (torch and transformers are never maxshard dependencies):

    python -m maxshard.convert from_hf tests/fixtures/hf/llama_gqa /tmp/ms && \\
    python -m maxshard.convert to_hf /tmp/ms/checkpoints/0 /tmp/hf_back
    /work/hfvenv/bin/python tools/check_hf_export.py /tmp/hf_back tests/fixtures/hf/llama_gqa

For each EXPORT_DIR FIXTURE_DIR pair: AutoModelForCausalLM.from_pretrained(EXPORT_DIR) in float32 must reproduce the
fixture's logits.npy for its tokens.npy (within 1e-5), and AutoTokenizer must load when the export has a tokenizer.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def check(export: pathlib.Path, fixture: pathlib.Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    tokens = np.load(fixture / "tokens.npy")
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    diff = float(np.max(np.abs(logits - np.load(fixture / "logits.npy"))))
    assert diff <= 1e-5, f"{export}: logits differ by {diff}"
    note = ""
    if (export / "tokenizer.json").exists():
        tok = AutoTokenizer.from_pretrained(export)
        note = f", tokenizer {type(tok).__name__} bos={tok.bos_token_id} eos={tok.eos_token_id}"
    print(f"{export}: {type(model).__name__} loads, logits max |diff| {diff:.2e}{note}")


if __name__ == "__main__":
    pairs = sys.argv[1:]
    if not pairs or len(pairs) % 2:
        sys.exit(__doc__)
    for i in range(0, len(pairs), 2):
        check(pathlib.Path(pairs[i]), pathlib.Path(pairs[i + 1]))
