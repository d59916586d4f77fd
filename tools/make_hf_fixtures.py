"""Writes tests/fixtures/hf/: tiny random Hugging Face checkpoints and the logits transformers computes for them.

Run once, by hand, in a venv of its own: torch and transformers are never dependencies of maxshard or its CI.

    python3 -m venv /work/hfvenv && /work/hfvenv/bin/pip install torch==2.13.0 transformers safetensors tokenizers
    /work/hfvenv/bin/python tools/make_hf_fixtures.py

Each fixture directory holds what `save_pretrained` writes plus `tokens.npy` (int32 [2, 12], fixed ids) and
`logits.npy` (float32 [2, 12, vocab], transformers' forward pass in float32, positions 0..11, no padding):

  llama_gqa    LlamaForCausalLM, 4 query / 2 kv heads, head_dim 8 (not hidden / heads), Llama-3 RoPE scaling with
               a short original context (all three frequency bands are used), bfloat16 weights, sharded
               (model.safetensors.index.json), plus a tiny BPE tokenizer.json; config in transformers 5.x spelling
               (`rope_parameters`).
  mistral      MistralForCausalLM, grouped-query heads, no sliding window, float32, one file.
  llama_tied   LlamaForCausalLM with tied embeddings and Llama-3 scaling, bfloat16, with config.json rewritten into
               the transformers 4.x spelling (top-level `rope_theta` + `rope_scaling`) that published checkpoints
               carry; reloading it must give the same logits, which the script checks.

Weights are redrawn larger than transformers' default init (std 0.15, norms 1 +- 0.1), so attention patterns and
RoPE matter for the logits; bfloat16 fixtures are rounded to bfloat16 before the reference forward pass, so the
reference is exactly the stored model.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM
from transformers import PreTrainedTokenizerFast

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "hf"
VOCAB = 128
TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "a tiny llama reads a tiny book about sharded arrays",
    "rotary position embeddings rotate pairs of features",
    "grouped query attention shares keys and values between heads",
] * 4
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
              bos_token_id=1, eos_token_id=2)
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}


def redraw(model: torch.nn.Module, seed: int, bf16: bool) -> None:
    """Random weights of a useful scale; bfloat16-representable when the fixture is stored in bfloat16."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if name.endswith("norm.weight") else 0.15 * noise)
            if bf16:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))


def reference(model: torch.nn.Module, directory: pathlib.Path) -> np.ndarray:
    """Saves fixed token ids and transformers' float32 logits for them."""
    tokens = np.random.default_rng(0).integers(0, VOCAB, size=(2, 12)).astype(np.int32)
    with torch.no_grad():
        logits = model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy()
    np.save(directory / "tokens.npy", tokens)
    np.save(directory / "logits.npy", logits.astype(np.float32))
    return logits


def save(model: torch.nn.Module, name: str, seed: int, bf16: bool, **kwargs: object) -> pathlib.Path:
    directory = OUT / name
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    model.eval()
    redraw(model, seed, bf16)
    reference(model, directory)
    to_save = model.to(torch.bfloat16) if bf16 else model
    to_save.save_pretrained(directory, **kwargs)
    return directory


def tokenizer(directory: pathlib.Path) -> None:
    """A character-level BPE with <unk>, <s>, </s> and 128 ids, trained on a few sentences."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"])
    tok.train_from_iterator(TEXTS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)


def to_4x_spelling(directory: pathlib.Path) -> None:
    """config.json as transformers 4.x wrote it: top-level rope_theta, rope_scaling without rope_theta."""
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    params = cfg.pop("rope_parameters")
    cfg["rope_theta"] = params.pop("rope_theta")
    cfg["rope_scaling"] = params
    cfg["torch_dtype"] = cfg.pop("dtype", "bfloat16")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main() -> None:
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=96, num_key_value_heads=2, head_dim=8,
                                         rms_norm_eps=1e-5, rope_parameters=dict(LLAMA3)))
    gqa = save(llama, "llama_gqa", seed=1, bf16=True, max_shard_size="50KB")
    tokenizer(gqa)
    assert (gqa / "model.safetensors.index.json").exists(), "llama_gqa must be sharded"

    mistral = MistralForCausalLM(MistralConfig(**COMMON, intermediate_size=64, num_key_value_heads=2,
                                               sliding_window=None, rope_parameters={"rope_type": "default",
                                                                                     "rope_theta": 1e6}))
    save(mistral, "mistral", seed=2, bf16=False)

    tied_model = LlamaForCausalLM(LlamaConfig(**COMMON, intermediate_size=64, num_key_value_heads=4,
                                              tie_word_embeddings=True, rope_parameters=dict(LLAMA3)))
    tied = save(tied_model, "llama_tied", seed=3, bf16=True)
    to_4x_spelling(tied)
    reloaded = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32).eval()
    tokens = np.load(tied / "tokens.npy")
    with torch.no_grad():
        again = reloaded(torch.from_numpy(tokens.astype(np.int64))).logits.numpy()
    np.testing.assert_array_equal(again, np.load(tied / "logits.npy"))  # the 4.x spelling means the same model

    total = sum(p.stat().st_size for p in OUT.rglob("*") if p.is_file())
    print(f"wrote {OUT}: {total / 1024:.0f} KiB")


if __name__ == "__main__":
    main()
