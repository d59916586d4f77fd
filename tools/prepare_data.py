"""Documents (text files, JSONL, Parquet, a Hugging Face dataset) -> tokenized ArrayRecord shards, or a token store.

    python tools/prepare_data.py OUT_DIR [--dataset_type TYPE] [--dataset_path PATH_DIR_OR_GLOB]
        [--text_field text] [--hf_split train] [--data_cache_dir DIR] [--tokenizer_path M.model] [--shards 4] [--text]
    python -m maxshard.train configs/base.yml dataset_type=array_record dataset_path='OUT_DIR/*.arecord'

    python tools/prepare_data.py OUT_DIR --store [--workers 8] [--process_index I --process_count P] [source options]
    python -m maxshard.train configs/base.yml dataset_type=store dataset_path=OUT_DIR

`--store` writes a token store (`maxshard/data/store.py`): shard s holds the documents [s N / S, (s + 1) N / S) of
the corpus, tokenized once; a run reads packed rows from it by global row number, each process only its own rows.
Shards are written in parallel: `--workers` processes on this host, and with `--process_index/--process_count`
several hosts share the shards (shard s is written by host s % P), each drawing its own progress line.

The source options mean what the training config keys of the same names mean, and are read by the same readers:
TYPE is any `dataset_type` whose reader yields text (`maxshard/dataset_types.py`; default text).
Tokenizing ahead of time moves the tokenizer's cost out of training. Document i goes to shard i % shards, so
shards are balanced and the record order is the corpus order. `--text` stores the text itself (the run tokenizes it).
Bad records (missing field, not a string, invalid UTF-8, empty) are skipped and counted. To mix several sources,
prepare each into its own directory and list them in `dataset_mixture` (`.arecord` globs are mixture sources).
`OUT_DIR/maxshard_data.json` records which tokenizer made the ids; a run with another tokenizer refuses the shards.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence

from array_record.python import array_record_module

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxshard import dataset_types  # noqa: E402
from maxshard.data import catalog, records, store  # noqa: E402
from maxshard.data import tokenizer as tokenizers  # noqa: E402
from maxshard.data.sources import BadRecord  # noqa: E402
from maxshard.errors import ConfigError  # noqa: E402


class Progress:
    """One `\\r`-rewritten line on stderr: documents done, tokens, rate. Redrawn at most 5 times a second."""

    def __init__(self, total: int, stream=sys.stderr) -> None:
        self.total, self.stream = total, stream
        self.start = self.last = time.perf_counter()

    def update(self, done: int, tokens: int, final: bool = False) -> None:
        now = time.perf_counter()
        if not final and now - self.last < 0.2:
            return
        self.last = now
        rate = tokens / max(now - self.start, 1e-9)
        self.stream.write(f"\r[prepare_data] {done}/{self.total} documents, {tokens:,} tokens, {rate:,.0f} tokens/s")
        if final:
            self.stream.write("\n")
        self.stream.flush()


TEXT_TYPES = tuple(r.name for r in dataset_types.READERS if r.yields == "text")  # what this tool tokenizes


def shard_paths(out_dir: str, shards: int) -> list[str]:
    return [os.path.join(out_dir, f"data-{i:05d}-of-{shards:05d}.arecord") for i in range(shards)]


def prepare(dataset_path: str, tokenizer_path: str, out_dir: str, shards: int = 4, as_text: bool = False,
            dataset_type: str = "text", text_field: str = "text", hf_split: str = "train",
            data_cache_dir: str = "") -> dict:
    """Writes the shards and `maxshard_data.json`; returns that metadata (documents, tokens, shard paths)."""
    tok, corpus = _open(dataset_path, tokenizer_path, dataset_type, text_field, hf_split, data_cache_dir)
    os.makedirs(out_dir, exist_ok=True)
    paths = shard_paths(out_dir, min(shards, len(corpus)))
    writers = [array_record_module.ArrayRecordWriter(p, "group_size:1") for p in paths]
    progress, tokens, written, skipped = Progress(len(corpus)), 0, 0, 0
    try:
        for i in range(len(corpus)):
            text = corpus.documents[i]
            ids = None if isinstance(text, BadRecord) else _encode(tok, text)
            if ids is None:
                skipped += 1
                continue
            tokens += len(ids)
            writers[written % len(writers)].write(text.encode("utf-8") if as_text else records.encode_tokens(ids))
            written += 1
            progress.update(i + 1, tokens)
    finally:
        for w in writers:
            w.close()
    progress.update(len(corpus), tokens, final=True)
    meta = {"tokenizer": tokenizer_path or "byte", "tokenizer_id": tok.fingerprint(), "vocab_size": tok.vocab_size,
            "records": "text" if as_text else "tokens", "documents": written, "skipped_records": skipped,
            "tokens": tokens, "source": corpus.where, "shards": [os.path.basename(p) for p in paths]}
    with open(os.path.join(out_dir, records.METADATA_FILE), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    return meta


def _open(dataset_path: str, tokenizer_path: str, dataset_type: str, text_field: str, hf_split: str,
          data_cache_dir: str):
    tok = tokenizers.tokenizer_at(tokenizer_path)
    spec = catalog.SourceSpec(dataset_type, dataset_path, 1.0, "dataset_path", dataset_type)
    # hf_streaming=never: this tool counts and reads every document by index, which a stream cannot give
    return tok, catalog.open_corpus(spec, tok.fingerprint(), text_field, hf_split, data_cache_dir, "never")


def _write_store_shard(out_dir: str, source: tuple, shards: int, chunk: int, shard: int) -> dict:
    """Writes shard `shard` of `shards` of a token store (runs in a worker process; `source`: _open's arguments)."""
    tok, corpus = _open(*source)
    first, end = shard * len(corpus) // shards, (shard + 1) * len(corpus) // shards
    writer = store.ShardWriter(os.path.join(out_dir, store.shard_name(shard, shards)), tok, source[1] or "byte", chunk)
    skipped, reported = 0, (0, 0)
    for i in range(first, end):
        text = corpus.documents[i]
        ids = None if isinstance(text, BadRecord) else _encode(tok, text)
        if ids is None:
            skipped += 1
        else:
            writer.add(ids)
        if i + 1 == end or (i - first) % 64 == 63:  # counters shared with the progress line
            with _DONE.get_lock():
                _DONE.value += i + 1 - first - reported[0]
                _TOKENS.value += writer.tokens - reported[1]
            reported = (i + 1 - first, writer.tokens)
    return {**writer.close(), "skipped_records": skipped}


_DONE = _TOKENS = None  # multiprocessing.Value counters: set in each worker (and here) by _share


def _share(done, tokens) -> None:
    global _DONE, _TOKENS
    _DONE, _TOKENS = done, tokens


def prepare_store(dataset_path: str, tokenizer_path: str, out_dir: str, shards: int = 4, workers: int = 1,
                  process_index: int = 0, process_count: int = 1, dataset_type: str = "text",
                  text_field: str = "text", hf_split: str = "train", data_cache_dir: str = "",
                  chunk_tokens: int = store.CHUNK_TOKENS) -> dict:
    """Writes this host's shards of a token store (shard s: host s % process_count) with `workers` processes;
    returns its totals (documents, tokens, skipped records, shards written)."""
    source = (dataset_path, tokenizer_path, dataset_type, text_field, hf_split, data_cache_dir)
    _, corpus = _open(*source)
    os.makedirs(out_dir, exist_ok=True)
    shards = min(shards, len(corpus))
    mine = list(range(process_index, shards, process_count))
    total = sum((s + 1) * len(corpus) // shards - s * len(corpus) // shards for s in mine)
    context = multiprocessing.get_context("spawn")  # no fork of a process that may hold threads (grain, JAX)
    done, tokens = context.Value("q", 0), context.Value("q", 0)
    _share(done, tokens)
    progress, metas = Progress(total), []
    write = functools.partial(_write_store_shard, out_dir, source, shards, chunk_tokens)
    if workers == 1:  # in this process: no worker to start
        for shard in mine:
            metas.append(write(shard))
            progress.update(done.value, tokens.value)
    else:
        with context.Pool(min(workers, len(mine)) or 1, initializer=_share, initargs=(done, tokens)) as pool:
            pending = pool.map_async(write, mine)
            while not pending.ready():
                pending.wait(0.2)
                progress.update(done.value, tokens.value)
            metas = pending.get()
    progress.update(done.value, tokens.value, final=True)
    return {"documents": sum(m["documents"] for m in metas), "tokens": sum(m["tokens"] for m in metas),
            "skipped_records": sum(m["skipped_records"] for m in metas), "shards": len(metas),
            "source": corpus.where}


def _encode(tok, text: str):
    """int32 ids, or None for text that is not UTF-8 (a lone surrogate from JSON)."""
    try:
        return tok.encode_array(text)
    except UnicodeEncodeError:
        return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory for the shards and maxshard_data.json")
    parser.add_argument("--dataset_type", default="text", choices=TEXT_TYPES,
                        help="reader of --dataset_path, as the config key")
    parser.add_argument("--dataset_path", default="",
                        help='file, directory or glob (text "": stdlib .py files; hf: saved dataset, files or name)')
    parser.add_argument("--text_field", default="text", help="jsonl/parquet/hf: the field holding the text")
    parser.add_argument("--hf_split", default="train", help="hf: the split to read")
    parser.add_argument("--data_cache_dir", default="", help='where .gz/.zst JSONL is decompressed ("": temp dir)')
    parser.add_argument("--tokenizer_path", default="", help='SentencePiece model or tokenizer.json ("": bytes)')
    parser.add_argument("--shards", type=int, default=4, help="number of ArrayRecord files")
    parser.add_argument("--text", action="store_true", help="store text records instead of token ids")
    parser.add_argument("--store", action="store_true", help="write a token store (dataset_type=store)")
    parser.add_argument("--workers", type=int, default=1, help="--store: processes writing shards on this host")
    parser.add_argument("--process_index", type=int, default=0, help="--store: this host's number")
    parser.add_argument("--process_count", type=int, default=1, help="--store: hosts sharing the shards")
    parser.add_argument("--chunk_tokens", type=int, default=store.CHUNK_TOKENS,
                        help="--store: ids per record (a row reads whole records)")
    args = parser.parse_args(argv)
    if args.shards < 1:
        parser.error("--shards must be >= 1")
    if args.workers < 1 or args.chunk_tokens < 1 or not 0 <= args.process_index < args.process_count:
        parser.error("--workers and --chunk_tokens must be >= 1 and 0 <= --process_index < --process_count")
    if args.store and args.text:
        parser.error("--store holds token ids; --text is for array_record shards")
    try:
        if args.store:
            meta = prepare_store(args.dataset_path, args.tokenizer_path, args.out_dir, args.shards, args.workers,
                                 args.process_index, args.process_count, args.dataset_type, args.text_field,
                                 args.hf_split, args.data_cache_dir, args.chunk_tokens)
            shards, train_with = meta["shards"], f"dataset_type=store dataset_path={args.out_dir}"
        else:
            meta = prepare(args.dataset_path, args.tokenizer_path, args.out_dir, args.shards, args.text,
                           args.dataset_type, args.text_field, args.hf_split, args.data_cache_dir)
            shards = len(meta["shards"])
            train_with = f"dataset_type=array_record dataset_path='{args.out_dir}/*.arecord'"
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    skipped = f", skipped {meta['skipped_records']} bad records" if meta["skipped_records"] else ""
    print(f"wrote {meta['documents']} documents ({meta['tokens']:,} tokens{skipped}) to {shards} shards in "
          f"{args.out_dir}; train with {train_with}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
