"""Peak host memory of `maxshard.convert` on a synthetic Llama-shaped checkpoint of a few hundred MB.

    python benchmarks/convert_memory.py [--vocab 16000 --hidden 1024 --mlp 2816 --layers 4] [--workdir DIR]

Writes a random float32 Llama checkpoint with `safetensors.numpy.save_file` (no torch; in a child process, so
this one stays small), then runs each of these as its own `python ...` child:

  imports    python -c "import jax, orbax.checkpoint, maxshard.convert.from_hf, maxshard.convert.to_hf"
  constant   python -m maxshard.convert from_hf of the tiny tests/fixtures/hf/llama_tied (0.13 MB): every fixed cost
             of a conversion (imports, tracing the model's shapes, orbax, tensorstore's threads), no data to speak of
  from_hf    python -m maxshard.convert from_hf on the synthetic checkpoint
  to_hf      python -m maxshard.convert to_hf of that, back to safetensors, --max-shard-size = the largest tensor
  to_hf 5GB  the same with the default --max-shard-size (one shard: the whole model), for information

What is measured: the peak of the child's anonymous resident memory (`RssAnon` in /proc/PID/status, sampled every
`--sample-ms` ms; heap, numpy buffers, tensorstore's caches): the memory the process needs. Its resident total
(`ru_maxrss` from os.wait4, the kernel's VmHWM) also counts file-backed pages: the reader memory-maps the source
with `safetensors.safe_open`, and every page it has read stays mapped (`RssFile`) until the file is closed. Those
are clean page cache that the kernel drops under pressure without writing anything, not memory the conversion
holds, so the acceptance is on RssAnon; both are printed, and the largest RssFile seen.

Acceptance, for from_hf and to_hf:  peak RssAnon - constant's peak RssAnon <= 1.5 x the largest tensor.
to_hf assembles one output shard in memory (safetensors.numpy.save_file writes a dict of arrays), so its figure
depends on --max-shard-size; the 5GB row shows the cost of a shard the size of the model.
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


def _status(pid: int) -> dict[str, int]:
    """RssAnon/RssFile/VmHWM of a live process in KiB ({} once it has exited)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return {}
    fields = (line.split(":", 1) for line in lines)
    return {k: int(v.split()[0]) for k, v in fields if k in ("RssAnon", "RssFile", "VmHWM")}


def child(*argv: str, sample_ms: float = 2.0) -> dict:
    """Runs `python ARGV`; returns its exit code, seconds, peak RssAnon and RssFile sampled from /proc (MiB), and
    its peak resident total from the kernel's own accounting (ru_maxrss of os.wait4, MiB)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, *argv], env=env, cwd=REPO, stdout=subprocess.DEVNULL)
    anon = file = samples = 0
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        now = _status(proc.pid)
        anon, file = max(anon, now.get("RssAnon", 0)), max(file, now.get("RssFile", 0))
        samples += 1
        time.sleep(sample_ms / 1000)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"rc": proc.returncode, "seconds": time.perf_counter() - start, "anon_mb": anon / 1024,
            "file_mb": file / 1024, "total_mb": usage.ru_maxrss / 1024, "samples": samples}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=16000)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--mlp", type=int, default=2816)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--workdir", default=None, help="where to write (default: a temporary directory, removed)")
    p.add_argument("--sample-ms", type=float, default=2.0, help="how often RssAnon is read from /proc (ms)")
    p.add_argument("--skip-one-shard", action="store_true", help="skip the informational to_hf run with one shard")
    p.add_argument("--make", default=None, help=argparse.SUPPRESS)  # child mode: write the checkpoint there
    args = p.parse_args()
    if args.make:
        print(json.dumps(write_synthetic(args.make, args)))
        return 0
    work = args.workdir or tempfile.mkdtemp(prefix="convert_memory_")
    try:
        hf_dir = os.path.join(work, "hf")
        start = time.perf_counter()
        sizes = [f"--{k}={getattr(args, k)}" for k in ("vocab", "hidden", "mlp", "layers", "heads")]
        sizes.append(f"--kv-heads={args.kv_heads}")
        made = subprocess.run([sys.executable, __file__, "--make", hf_dir, *sizes], check=True, capture_output=True,
                              text=True)
        total, largest = json.loads(made.stdout)
        print(f"synthetic Llama: {total / 1e6:.0f} MB float32, largest tensor {largest / 1e6:.1f} MB "
              f"(written in {time.perf_counter() - start:.0f} s)")
        cli = ("-m", "maxshard.convert")
        ms = {"sample_ms": args.sample_ms}
        ckpt = os.path.join(work, "out", "checkpoints", "0")
        runs = {
            "imports": child("-c", IMPORTS, **ms),
            "constant": child(*cli, "from_hf", os.path.join(REPO, "tests/fixtures/hf/llama_tied"),
                              os.path.join(work, "t"), **ms),
            "from_hf": child(*cli, "from_hf", hf_dir, os.path.join(work, "out"), **ms),
            "to_hf": child(*cli, "to_hf", ckpt, os.path.join(work, "back"), "--max-shard-size", str(largest), **ms),
        }
        if not args.skip_one_shard:
            runs["to_hf 5GB"] = child(*cli, "to_hf", ckpt, os.path.join(work, "back5"), **ms)
        constant = runs["constant"]["anon_mb"]
        largest_mib = largest / 2**20
        print("| run | peak RssAnon MiB | above constant MiB | / largest tensor | peak RssFile MiB | "
              "peak RSS (VmHWM) MiB | seconds |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        ok = True
        for name, r in runs.items():
            above = r["anon_mb"] - constant
            if name in ("from_hf", "to_hf"):
                ok &= r["rc"] == 0 and above <= 1.5 * largest_mib
            shown = f"{above:.0f} | {above / largest_mib:.2f}" if name not in ("imports", "constant") else "- | -"
            failed = "" if r["rc"] == 0 else f" (exit {r['rc']})"
            print(f"| {name}{failed} | {r['anon_mb']:.0f} | {shown} | {r['file_mb']:.0f} | {r['total_mb']:.0f} | "
                  f"{r['seconds']:.1f} |")
        print(f"model {total / 2**20:.0f} MiB, largest tensor {largest_mib:.1f} MiB; target for from_hf and to_hf: "
              f"peak RssAnon - constant <= 1.5 x largest = {1.5 * largest_mib:.0f} MiB: {'met' if ok else 'NOT met'}")
        return 0 if ok else 1
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
