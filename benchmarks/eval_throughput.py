"""Log-likelihood requests per second: `maxshard.eval`'s LM vs lm-eval's own Hugging Face backend, same model, CPU.

    python benchmarks/eval_throughput.py [--requests 256] [--batch 16] [--rounds 3] [--devices 1]
                                         [--hf-python /work/trlvenv/bin/python]

The model is a random Llama (emb 256, 4 layers, 8 query / 4 kv heads, mlp 1024, float32) with the tiny BPE
tokenizer of tests/fixtures/hf/llama_gqa, written by transformers in the venv of `--hf-python` (torch and
transformers live there, never in maxshard's) and converted with `python -m maxshard.convert from_hf`. The requests
are multiple-choice-like (context, continuation) pairs of 20-80 and 2-10 words, the same for both. maxshard's side
runs in this process (`maxshard.eval.load`: the CLI's loading, `eval_batch_size=--batch`, on `--devices` of the 8
simulated CPU devices); the Hugging Face backend runs in a child process of `--hf-python` (`HFLM`, float32,
batch_size=--batch). Each side is warmed up (maxshard compiles its buckets) before its timed rounds; maxshard runs
its rounds before and after the backend's, so drift of a shared machine shows; figures are median rounds. The two
sides' log-likelihoods are compared (max |difference|).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER = os.path.join(os.path.dirname(HERE), "tests", "fixtures", "hf", "llama_gqa")
WORDS = ("the quick brown fox jumps over lazy dog a tiny llama reads book about sharded arrays rotary position "
         "embeddings rotate pairs of features grouped query attention shares keys and values between heads").split()


def requests(count: int) -> list[tuple[str, str]]:
    rng = random.Random(0)
    return [(" ".join(rng.choices(WORDS, k=rng.randint(20, 80))), " " + " ".join(rng.choices(WORDS, k=rng.randint(2, 10))))
            for _ in range(count)]


def make_model(directory: str) -> None:
    """(in the --hf-python venv) the random Llama, saved with the fixture's tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256, bos_token_id=1,
                         eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(TOKENIZER, name), os.path.join(directory, name))


def instances(pairs: list[tuple[str, str]]) -> list:
    from lm_eval.api.instance import Instance

    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


def timed_rounds(lm, pairs: list[tuple[str, str]], rounds: int) -> tuple[list[float], list[float]]:
    """(seconds per round, the log-likelihoods of the last round) after one untimed warm-up round."""
    lm.loglikelihood(instances(pairs), disable_tqdm=True)
    seconds, answers = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        answers = lm.loglikelihood(instances(pairs), disable_tqdm=True)
        seconds.append(time.perf_counter() - started)
    return seconds, [a[0] for a in answers]


def hf_side(directory: str, pairs_file: str, batch: int, rounds: int) -> None:
    """(in the --hf-python venv) the Hugging Face backend's rounds, as one JSON line on stdout."""
    import torch
    from lm_eval.models.huggingface import HFLM

    with open(pairs_file) as f:
        pairs = [tuple(p) for p in json.load(f)]
    lm = HFLM(pretrained=directory, dtype="float32", batch_size=batch, device="cpu")
    seconds, answers = timed_rounds(lm, pairs, rounds)
    print(json.dumps({"seconds": seconds, "answers": answers, "threads": torch.get_num_threads()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--hf-python", default="/work/trlvenv/bin/python")
    parser.add_argument("--make-model", help=argparse.SUPPRESS)
    parser.add_argument("--hf-side", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.make_model:
        return make_model(args.make_model)
    if args.hf_side:
        return hf_side(*args.hf_side, args.batch, args.rounds)

    import common  # noqa: F401  (8 simulated CPU devices, the repository on sys.path)
    import jax

    from maxshard import eval as eval_cli
    from maxshard.convert import __main__ as convert_cli

    pairs = requests(args.requests)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, out = os.path.join(tmp, "hf"), os.path.join(tmp, "maxshard")
        subprocess.run([args.hf_python, __file__, "--make-model", hf_dir], check=True)
        assert convert_cli.main(["from_hf", hf_dir, out]) == 0
        pairs_file = os.path.join(tmp, "pairs.json")
        with open(pairs_file, "w") as f:
            json.dump(pairs, f)
        argv = [os.path.join(out, "config.yml"), "tasks=local_choice", f"eval_tasks_dir={common.REPO}/configs/eval_tasks",
                f"eval_batch_size={args.batch}", f"base_output_directory={tmp}"]
        _, _, _, lm = eval_cli.load(argv, jax.devices()[: args.devices])
        before, ours = timed_rounds(lm, pairs, args.rounds)
        child = subprocess.run([args.hf_python, __file__, "--hf-side", hf_dir, pairs_file, "--batch", str(args.batch),
                                "--rounds", str(args.rounds)], check=True, capture_output=True, text=True)
        theirs = json.loads(child.stdout.strip().splitlines()[-1])
        after, _ = timed_rounds(lm, pairs, args.rounds)
    n = len(pairs)
    diff = max(abs(a - b) for a, b in zip(ours, theirs["answers"]))
    print(f"{n} log-likelihood requests, batch {args.batch}, median of {args.rounds} rounds")
    print("| backend | requests/s | s per round |")
    print("|---|---:|---:|")
    for name, seconds in [(f"maxshard.eval, {args.devices} device(s), before", before),
                          (f"lm-eval HFLM, torch {theirs['threads']} threads", theirs["seconds"]),
                          (f"maxshard.eval, {args.devices} device(s), after", after)]:
        median = statistics.median(seconds)
        print(f"| {name} | {n / median:,.0f} | {median:.2f} |")
    print(f"max |log-likelihood difference| between the two: {diff:.2e}")


if __name__ == "__main__":
    sys.exit(main())
