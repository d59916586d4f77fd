"""Trains a small SentencePiece tokenizer on a text corpus (default: Python's stdlib), for `tokenizer_path`.

    python tools/train_tokenizer.py OUT.model [--dataset_path DIR_OR_GLOB] [--vocab_size 2048] [--model_type bpe]
    python -m maxshard.train configs/base.yml tokenizer_path=OUT.model

Ids 0-3 are PAD, BOS, EOS, UNK, like the byte tokenizer's first three. Byte fallback means any text encodes (an
unseen character becomes its UTF-8 bytes), and the identity normalization with whitespace kept as is means
decode(encode(text)) == text, indentation included. Only the train split is used, so eval documents stay unseen.
Needs `pip install "maxshard[tokenizer]"`.
"""

from __future__ import annotations

import argparse
import io
import os
import sys
from collections.abc import Iterable, Iterator, Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxshard.data import sources  # noqa: E402
from maxshard.errors import ConfigError  # noqa: E402


def train_lines(dataset_path: str, eval_fraction: float) -> Iterator[str]:
    """The non-empty lines of the train split's documents, corpus order (SentencePiece samples from them)."""
    corpus = sources.text_corpus(dataset_path) if dataset_path else sources.default_corpus()
    for index in sources.split_indices(corpus.keys, "train", eval_fraction):
        for line in corpus.documents[int(index)].splitlines():
            if line.strip():
                yield line


def train(lines: Iterable[str], out_path: str, vocab_size: int = 2048, model_type: str = "bpe",
          max_lines: int = 200_000) -> None:
    """Trains on `lines` (at most `max_lines`, sampled) and writes the model to `out_path`."""
    import sentencepiece as spm

    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size, model_type=model_type,
        pad_id=0, bos_id=1, eos_id=2, unk_id=3, byte_fallback=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, allow_whitespace_only_pieces=True, split_digits=True,
        character_coverage=1.0, input_sentence_size=max_lines, shuffle_input_sentence=True,
        max_sentence_length=16384, hard_vocab_limit=False, minloglevel=2,
    )
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "wb") as f:
        f.write(model.getvalue())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_path", help="where to write the .model file")
    parser.add_argument("--dataset_path", default="", help='directory or glob of text files ("": stdlib .py files)')
    parser.add_argument("--vocab_size", type=int, default=2048, help="pieces, including 4 specials and 256 bytes")
    parser.add_argument("--model_type", default="bpe", choices=("bpe", "unigram"))
    parser.add_argument("--eval_fraction", type=float, default=0.02, help="held-out share, as in the run's config")
    parser.add_argument("--max_lines", type=int, default=200_000, help="lines sampled for training")
    args = parser.parse_args(argv)
    if args.vocab_size < 300:
        parser.error("--vocab_size must be >= 300 (4 specials + 256 byte pieces + some merges)")
    try:
        train(train_lines(args.dataset_path, args.eval_fraction), args.out_path, args.vocab_size, args.model_type,
              args.max_lines)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out_path}; train with tokenizer_path={args.out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
