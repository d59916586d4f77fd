"""`python -m maxshard.convert from_hf HF_DIR OUT_DIR` and `python -m maxshard.convert to_hf STEP_DIR HF_DIR`.

Every user mistake (an architecture or field maxshard cannot represent, a missing tensor, a taken OUT_DIR) is one
line `maxshard: error: ...` and exit code 2, like `maxshard.train`.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from collections.abc import Sequence

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # converting needs no accelerator; never grab one from a training job

from absl import logging as absl_logging  # noqa: E402

from maxshard.errors import ConfigError  # noqa: E402

__all__ = ["main", "parser"]

FAMILY_HELP = ("a YAML family row for an architecture maxshard has no row for, built from kinds it has "
               "(convert/family_file.py: architecture, model_type, like: a row to start from, the fields that differ)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m maxshard.convert",
                                description="Convert checkpoints of the Hugging Face families maxshard has rows for "
                                            "(docs/models-and-conversion.md), or of one a --family file describes, "
                                            "between Hugging Face and maxshard.")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("from_hf", help="Hugging Face directory -> OUT_DIR/config.yml + orbax checkpoint",
                       description="Reads config.json and *.safetensors of a supported family's model "
                                   "and writes OUT_DIR/config.yml (a CONFIG for maxshard.train), "
                                   "OUT_DIR/checkpoints/0 (the parameters) and OUT_DIR/hf (tokenizer, config).")
    a.add_argument("hf_dir", metavar="HF_DIR")
    a.add_argument("out_dir", metavar="OUT_DIR")
    a.add_argument("--base-config", default=None,
                   help="the base config config.yml extends (default: this repository's configs/base.yml)")
    a.add_argument("--family", default=None, metavar="FILE", help=FAMILY_HELP)
    a.add_argument("--adapters", default=None, metavar="PEFT_DIR",
                   help="a PEFT LoRA directory (adapter_config.json, adapter_model.safetensors) saved on this model: "
                        "imported as OUT_DIR/adapters/0, a LoRA step that config.yml's run starts from")
    b = sub.add_parser("to_hf", help="maxshard checkpoint step directory -> Hugging Face directory",
                       description="Writes config.json, model.safetensors (sharded with an index above "
                                   "--max-shard-size) and the tokenizer files, loadable by transformers.")
    b.add_argument("step_dir", metavar="CHECKPOINT_STEP_DIR", help="e.g. runs/NAME/checkpoints/300")
    b.add_argument("hf_dir", metavar="HF_DIR")
    b.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file before sharding (default 5GB); one file is assembled in memory at "
                        "a time, so this also bounds the memory export needs")
    b.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="tensor dtype to write (default: as stored in the checkpoint)")
    b.add_argument("--template", default=None,
                   help="a Hugging Face directory whose config.json and tokenizer to reuse (default: the hf/ "
                        "directory from_hf wrote, found through the checkpoint's tokenizer_path)")
    b.add_argument("--family", default=None, metavar="FILE", help=FAMILY_HELP)
    b.add_argument("--max-position-embeddings", type=int, default=None,
                   help="override max_position_embeddings in config.json")
    b.add_argument("--adapters-only", action="store_true",
                   help="a LoRA run's checkpoint: write its adapters alone in PEFT's layout (adapter_model.safetensors"
                        ", adapter_config.json) instead of the base's weights with the adapters merged")
    return p


def run(args: argparse.Namespace) -> None:
    if args.family:
        from maxshard.convert import family_file

        family_file.register_file(args.family)
    if args.command == "from_hf":
        from maxshard.convert import hf_config, multimodal

        # refuse an unsupported model before importing jax
        hf_config.model_keys(multimodal.text_model(hf_config.read(args.hf_dir))[0])
        from maxshard.convert import from_hf

        r = from_hf.convert(args.hf_dir, args.out_dir, args.base_config, args.adapters)
        print(f"converted {r.architecture} ({r.num_params:,} parameters, {'/'.join(r.dtypes)}) from {args.hf_dir}")
        print(f"  parameters: {r.step_dir}")
        if args.adapters:
            print(f"  adapters:   {r.adapters_dir} (LoRA from {args.adapters})")
        print(f"  config:     {r.config_path}")
        print(f"  tokenizer:  {r.tokenizer_path or 'none in the source: set tokenizer_path before training on text'}")
        print(f"fine-tune: python -m maxshard.train {r.config_path} dataset_path=YOUR_TEXT run_name=NAME")
    else:
        from maxshard.convert import to_hf

        r = to_hf.export(args.step_dir, args.hf_dir, args.max_shard_size, args.dtype, args.template,
                         args.max_position_embeddings, args.adapters_only)
        written = ", ".join(r.files) if args.adapters_only else f"{', '.join(r.files)}, config.json"
        print(f"wrote {r.num_tensors} tensors ({r.dtype}) to {args.hf_dir}: {written}")
        print(f"  config.json template: {r.template or 'none (defaults; see --template)'}")
        print(f"  copied: {', '.join(r.tokenizer_files) or 'no tokenizer files found (the byte tokenizer has none)'}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    absl_logging.set_verbosity(absl_logging.ERROR)  # orbax's notes about its internals are noise for a one-shot tool
    try:
        run(args)
    except ConfigError as e:
        print(f"maxshard: error: {e}", file=sys.stderr)
        return 2
    return 0


def return_large_frees_to_the_os() -> None:
    """Pins glibc's mmap threshold at 1 MiB, so every freed block buffer goes straight back to the OS.

    By default glibc raises the threshold to the size of the first large buffer freed; later block-sized buffers
    then come from the heap, and interleaved with tensorstore's own allocations they fragment it, so from_hf's
    memory grew several-fold with this off (benchmarks/README.md, "Conversion memory"). Only the command line does this;
    importing the package changes nothing. Without glibc, nothing to do.
    """
    try:
        ctypes.CDLL("libc.so.6").mallopt(-3, 2**20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    return_large_frees_to_the_os()
    sys.exit(main())
