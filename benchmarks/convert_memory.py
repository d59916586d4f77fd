"""Peak host memory of `maxshard.convert` on a synthetic Llama-shaped checkpoint of a few hundred MB.

    python benchmarks/convert_memory.py [--vocab 16000 --hidden 1024 --mlp 2816 --layers 4] [--workdir DIR]

Writes a random float32 Llama checkpoint with `safetensors.numpy.save_file` (no torch; in a child process, so
this one stays small), then runs each of these as its own `python ...` child and takes its peak resident set
size from `os.wait4` (Linux counts a child's peak from its fork, so the parent must be smaller than any child):

  imports    python -c "import jax, orbax.checkpoint, maxshard.convert.from_hf, maxshard.convert.to_hf"
  constant   python -m maxshard.convert from_hf of the tiny tests/fixtures/hf/llama_tied (0.13 MB): every fixed cost
             of a conversion (imports, tracing the model's shapes, orbax, tensorstore's threads), no data to speak of
  from_hf    python -m maxshard.convert from_hf on the synthetic checkpoint
  to_hf      python -m maxshard.convert to_hf of that, back to safetensors

and checks  peak - constant <= 1.5 x the largest tensor  for both directions. Loading the model would cost its
whole size instead.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPORTS = "import jax, orbax.checkpoint, maxshard.convert.from_hf, maxshard.convert.to_hf"


def llama_tensors(vocab: int, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int) -> dict[str, tuple]:
    """{name: shape} of an untied LlamaForCausalLM."""
    head_dim = hidden // heads
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                       p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
                       p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
                       p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
                       p + "mlp.gate_proj.weight": (mlp, hidden), p + "mlp.up_proj.weight": (mlp, hidden),
                       p + "mlp.down_proj.weight": (hidden, mlp)})
    return shapes


def write_synthetic(directory: str, args: argparse.Namespace) -> tuple[int, int]:
    """The checkpoint and its config.json; returns (total bytes, largest tensor bytes)."""
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(0)
    shapes = llama_tensors(args.vocab, args.hidden, args.mlp, args.layers, args.heads, args.kv_heads)
    tensors = {name: rng.standard_normal(shape, dtype=np.float32) * 0.02 for name, shape in shapes.items()}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    sizes = [t.nbytes for t in tensors.values()]
    del tensors
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab,
              "hidden_size": args.hidden, "intermediate_size": args.mlp, "num_hidden_layers": args.layers,
              "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "rms_norm_eps": 1e-5,
              "max_position_embeddings": 4096, "rope_theta": 500000.0, "tie_word_embeddings": False,
              "hidden_act": "silu", "torch_dtype": "float32"}
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    return sum(sizes), max(sizes)


def child(*argv: str) -> dict:
    """Runs `python ARGV` and returns its exit code, seconds and peak RSS (MiB) from the kernel's accounting."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *argv], env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "seconds": time.perf_counter() - start, "peak_mb": usage.ru_maxrss / 1024}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--mlp", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--workdir", default=None, help="where to write (default: a temporary directory, removed)")
    p.add_argument("--make", default=None, help=argparse.SUPPRESS)  # child mode: write the checkpoint there
    args = p.parse_args()
    if args.make:
        print(json.dumps(write_synthetic(args.make, args)))
        return 0
    work = args.workdir or tempfile.mkdtemp(prefix="convert_memory_")
    try:
        hf_dir = os.path.join(work, "hf")
        start = time.perf_counter()
        sizes = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("workdir", "make")]
        made = subprocess.run([sys.executable, __file__, "--make", hf_dir, *sizes], check=True, capture_output=True,
                              text=True)
        total, largest = json.loads(made.stdout)
        print(f"synthetic Llama: {total / 1e6:.0f} MB float32, largest tensor {largest / 1e6:.1f} MB "
              f"(written in {time.perf_counter() - start:.0f} s)")
        cli = ("-m", "maxshard.convert")
        runs = {
            "imports": child("-c", IMPORTS),
            "constant": child(*cli, "from_hf", os.path.join(REPO, "tests/fixtures/hf/llama_tied"),
                              os.path.join(work, "t")),
            "from_hf": child(*cli, "from_hf", hf_dir, os.path.join(work, "out")),
            "to_hf": child(*cli, "to_hf", os.path.join(work, "out", "checkpoints", "0"), os.path.join(work, "back")),
        }
        constant = runs["constant"]["peak_mb"]
        print("| run | peak RSS MB | above constant MB | / largest tensor | seconds |")
        print("|---|---:|---:|---:|---:|")
        ok = True
        for name, r in runs.items():
            above = r["peak_mb"] - constant
            ratio = above / (largest / 2**20)
            if name in ("from_hf", "to_hf"):
                ok &= r["rc"] == 0 and ratio <= 1.5
            shown = f"{above:.0f} | {ratio:.2f}" if name in ("from_hf", "to_hf") else "- | -"
            print(f"| {name} | {r['peak_mb']:.0f} | {shown} | {r['seconds']:.1f} |")
        print(f"model {total / 2**20:.0f} MiB, largest tensor {largest / 2**20:.1f} MiB; target: peak - constant <= "
              f"1.5 x largest = {1.5 * largest / 2**20:.0f} MiB: {'met' if ok else 'NOT met'}")
        return 0 if ok else 1
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
