"""Sample from a trained run: `python -m maxshard.generate CONFIG.yml key=value ...`.

The same command line that trained a run samples from it (plus `prompt=...`): the run's latest checkpoint (or
`load_parameters_path`) gives the model and its tokenizer (maxshard/generation/inference.py), the mesh knobs and
logical rules lay out parameters and KV cache as in training, and maxshard/generation/decode.py runs the jitted
prefill and decode steps. Every user mistake (no checkpoint, a prompt too long for the model, an unknown key) is one
line and exit code 2, before the parameters are read or anything is compiled.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence

from maxshard import cli
from maxshard.checkpoint import format as checkpoint_format
from maxshard.config import Config
from maxshard.data.tokenizer import Tokenizer, make_tokenizer
from maxshard.errors import ConfigError
from maxshard.generation import inference
from maxshard.generation.decode import Engine, Result
from maxshard.generation.sampling import Sampling, allowed_tokens
from maxshard.model.transformer import count_params
from maxshard.parallel import mesh, sharding
from maxshard.run import loading

__all__ = ["main", "run", "read_prompts", "encode_prompts", "completion_text", "USAGE"]

USAGE = """usage: python -m maxshard.generate CONFIG.yml [key=value ...]

Continues `prompt=TEXT` (or every line of `prompts_file=PATH`) with the latest checkpoint of
base_output_directory/run_name (or load_parameters_path), e.g. after training with the default command:
  python -m maxshard.generate configs/base.yml cpu_device_count=8 prompt="def " max_new_tokens=200
Keys: max_new_tokens, temperature (0: greedy), top_k, top_p, seed, generate_output (a JSONL file); the model keys
come from the checkpoint, the mesh knobs from the command line (as in training; no pipeline)."""


def read_prompts(cfg: Config) -> list[str]:
    """`prompt`, or the non-empty lines of `prompts_file`; exactly one of the two."""
    if bool(cfg.prompt) == bool(cfg.prompts_file):
        raise ConfigError("set exactly one of prompt=TEXT and prompts_file=PATH (one prompt per line)")
    if cfg.prompt:
        return [cfg.prompt]
    try:
        with open(cfg.prompts_file, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except OSError as e:
        raise ConfigError(f"prompts_file={cfg.prompts_file} cannot be read: {e.strerror}") from None
    if not prompts:
        raise ConfigError(f"prompts_file={cfg.prompts_file} holds no prompt (one per line)")
    return prompts


def encode_prompts(
    prompts: Sequence[str], tokenizer: Tokenizer, max_length: int, max_new_tokens: int
) -> list[list[int]]:
    """Each prompt as the tokenizer encodes it (`encode_prompt`: BOS first for byte-level and SentencePiece, the
    tokenizer.json's own template for Hugging Face ones); checks that each has a token (prefill predicts from the
    last one: a tokenizer that adds no BOS encodes an empty prompt as none) and that prompt + max_new_tokens fits in
    the model's `max_target_length`, the longest sequence its positions were trained on."""
    encoded = [tokenizer.encode_prompt(p) for p in prompts]
    empty = next((i for i, e in enumerate(encoded) if not e), None)
    if empty is not None:
        where = "" if len(encoded) == 1 else f" {empty + 1}"
        raise ConfigError(f"prompt{where} encodes to no tokens (this tokenizer adds no BOS): give it some text")
    longest = max(len(e) for e in encoded)
    if longest >= max_length:
        which = max(range(len(encoded)), key=lambda i: len(encoded[i]))
        where = "" if len(encoded) == 1 else f" (prompt {which + 1})"
        raise ConfigError(f"prompt{where} is {longest} tokens as encoded; the model's max_target_length is "
                          f"{max_length}: shorten it to at most {max_length - 1} tokens")
    if longest + max_new_tokens > max_length:
        raise ConfigError(f"max_new_tokens={max_new_tokens} runs past the model's max_target_length={max_length} "
                          f"after the longest prompt ({longest} tokens as encoded): at most {max_length - longest}")
    return encoded


def completion_text(tokenizer: Tokenizer, ids: Sequence[int]) -> str:
    """Generated ids -> text, without the stop token that ended them (`stop_ids` holds every tokenizer's EOS; a
    Hugging Face stop id need not be a special token that decoding drops)."""
    return tokenizer.decode([int(t) for t in ids if t not in tokenizer.stop_ids])


def _shown(path: str) -> str:
    """A local path below the working directory as a relative one (what the user typed), else unchanged."""
    if "://" in path:
        return path
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative


def _report(result: Result, real_rows: int) -> None:
    prefill_rate = result.prompt_tokens / max(result.prefill_seconds, 1e-9)
    decoded = result.decode_steps * real_rows
    decode_rate = decoded / max(result.decode_seconds, 1e-9)
    print(f"compiled prefill and decode in {result.compile_seconds:.1f}s", flush=True)
    print(f"prefill: {result.prompt_tokens} prompt tokens in {result.prefill_seconds * 1e3:.1f} ms "
          f"({prefill_rate:,.0f} tokens/s)", flush=True)
    rows = f"{real_rows} sequence{'s' if real_rows > 1 else ''}"
    print(f"decode: {result.decode_steps} steps x {rows} = {decoded} tokens in "
          f"{result.decode_seconds:.2f}s ({decode_rate:,.0f} tokens/s)", flush=True)


def _write_output(path: str, prompts: Sequence[str], completions: Sequence[str], tokens: Sequence[list[int]]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for prompt, completion, ids in zip(prompts, completions, tokens):
            f.write(json.dumps({"prompt": prompt, "completion": completion, "tokens": ids}) + "\n")
    print(f"wrote {len(prompts)} completions to {path}", flush=True)


def run(argv: Sequence[str]) -> int:
    cfg = loading.load_run(argv, join_processes=True, check_fit=False)  # inference: the train step never runs
    inference.refuse_pipeline(cfg)
    prompts = read_prompts(cfg)
    step_dir = inference.find_checkpoint(cfg)
    saved = checkpoint_format.read_config(step_dir)
    cfg = inference.with_saved_model(cfg, saved)
    tokenizer = make_tokenizer(cfg)
    encoded = encode_prompts(prompts, tokenizer, cfg.model.max_target_length, cfg.max_new_tokens)
    generation_mesh, rules = mesh.build(cfg), sharding.flax_rules(cfg)
    params = inference.restore_params(step_dir, cfg, generation_mesh, rules, saved.get("load_parameters_path", ""))
    print(f"checkpoint: {_shown(step_dir)} ({count_params(params) / 1e6:.2f}M parameters), mesh: "
          f"{mesh.describe(generation_mesh)}", flush=True)
    allowed = allowed_tokens(cfg.model.vocab_size, tokenizer.vocab_size, tokenizer.never_generated)
    engine = Engine(cfg.model, generation_mesh, rules, params, allowed)
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p)
    result = engine.generate(encoded, cfg.max_new_tokens, tokenizer.stop_ids, tokenizer.pad_id, sampling, cfg.seed)
    _report(result, len(prompts))
    completions = [completion_text(tokenizer, ids) for ids in result.tokens]
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        print(f"--- {i + 1}/{len(prompts)}\n{prompt}{completion}", flush=True)
    if cfg.generate_output:
        _write_output(cfg.generate_output, prompts, completions, result.tokens)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return cli.entry(argv, USAGE, run)


if __name__ == "__main__":
    sys.exit(main())
