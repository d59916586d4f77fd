"""The data readers (`dataset_type`): one row each, so a reader is named here once. Read by the config schema (the
allowed names), `maxshard.data.make_input` (which types go through the grain pipeline), `data/catalog.py` (which
reader a mixture source's name implies, and the dispatch: a row's `opener`), the readers' own file listings
(`suffixes`) and `tools/prepare_data.py` (the text sources it tokenizes).

A leaf outside `maxshard.data` so that the config schema can import it without the input pipeline (jax, grain).

A row that opens sources names its `opener`, "module:function" with the signature `open_source(path, key, chat,
options) -> Corpus | HfStream` (`data/sources.py`: `ReadOptions` carries the config keys of the same names): `path` is
the source's path (`dataset_path` or a mixture entry), `key` the config key that named it (for messages), `chat`
whether its records are conversations. `chat` has no opener of its own: its sources are read by the rows marked
`chat`; `synthetic` reads nothing (`data/synthetic.py` makes batches on device).
"""

from __future__ import annotations

import dataclasses

__all__ = ["Reader", "READERS", "NAMES", "PREFIXES", "CHAT_PREFIX", "reader", "grain"]


@dataclasses.dataclass(frozen=True)
class Reader:
    """One `dataset_type` (module docstring)."""

    name: str
    opener: str  # "module:function" that opens one source of this type ("" for none)
    yields: str  # "text", "tokens" (or text stored as records), "rows" (packed rows of a token store),
    # "conversations", "pairs", "prompts" (for
    # generation, not training rows: `data/prompts.py`), or "batches" (no documents)
    keys: tuple[str, ...]  # config keys it reads besides dataset_path
    summary: str
    suffixes: tuple[str, ...] = ()  # file names of this type: what a directory lists, a mixture source's type
    prefix: str = ""  # a mixture source `PREFIX:NAME` is of this type
    chat: bool = False  # reads conversations too (`dataset_type: chat`, `chat:` mixture sources)


READERS = (
    Reader("text", "maxshard.data.sources:open_source", "text", (),
           "every file of a directory or glob is one document (empty dataset_path: Python's stdlib sources)",
           suffixes=(".txt",)),
    Reader("jsonl", "maxshard.data.jsonl:open_source", "text", ("text_field", "data_cache_dir"),
           "JSON Lines, plain, .gz or .zst (decompressed once into data_cache_dir), the text in text_field",
           suffixes=(".jsonl", ".jsonl.gz", ".jsonl.zst", ".ndjson", ".ndjson.gz", ".ndjson.zst"), chat=True),
    Reader("parquet", "maxshard.data.parquet:open_source", "text", ("text_field",),
           "the text_field column of Parquet files, read row group by row group", suffixes=(".parquet", ".pq")),
    Reader("hf", "maxshard.data.hf:open_source", "text", ("text_field", "hf_split", "hf_streaming"),
           "a Hugging Face dataset (save_to_disk directory, data files or hub name), map-style or streamed",
           prefix="hf", chat=True),
    Reader("array_record", "maxshard.data.records:open_source", "tokens", ("tokenizer_path",),
           "ArrayRecord shards that tools/prepare_data.py writes (token ids of the run's tokenizer, or text)",
           suffixes=(".arecord",)),
    Reader("store", "", "rows", ("tokenizer_path",),
           "a token store that tools/prepare_data.py --store writes (dataset_path: its directory): packed rows by "
           "global row number, each process reading only its own rows (data/store.py)"),
    Reader("chat", "", "conversations",
           ("messages_field", "chat_template", "hf_split", "hf_streaming", "data_cache_dir"),
           "conversations for supervised fine-tuning, from JSONL or a Hugging Face dataset; the loss counts the "
           "assistant turns (data/chat.py)"),
    Reader("preference", "maxshard.data.preference:open_source", "pairs",
           ("chat_template", "hf_split", "hf_streaming", "data_cache_dir"),
           "preference pairs (prompt, chosen, rejected: text or conversations) for DPO, SimPO, ORPO, or unpaired "
           "records (prompt, completion, label) for KTO, from JSONL or a Hugging Face dataset; each pair (example) "
           "whole in one row, loss weights on the completions (data/preference.py)"),
    Reader("prompts", "maxshard.data.prompts:open_source", "prompts",
           ("chat_template", "tokenizer_path", "hf_split", "hf_streaming", "data_cache_dir"),
           "prompts for GRPO's rollouts (text, or a conversation ending with a user turn) with any other fields, which "
           "the reward sees, from JSONL or a Hugging Face dataset; read by make_prompts, not make_input "
           "(data/prompts.py)"),
    Reader("synthetic", "", "batches", ("seed", "vocab_size"),
           "a learnable task made on device (data/synthetic.py): no files, for measuring the step"),
)
NAMES = tuple(r.name for r in READERS)
_BY_NAME = {r.name: r for r in READERS}
PREFIXES = {f"{r.prefix}:": r.name for r in READERS if r.prefix}  # mixture sources named, not paths: "hf:" -> hf
CHAT_PREFIX = "chat:"  # a mixture source of conversations (`chat:sft/*.jsonl`, `chat:hf:owner/name`)


def reader(name: str) -> Reader:
    """The row of `dataset_type` `name` (KeyError for an unknown name; the schema admits only NAMES)."""
    return _BY_NAME[name]


def grain(name: str) -> bool:
    """Whether `dataset_type` `name` is read from documents through the grain pipeline (False: made on device,
    prompts that GRPO generates from (`data/prompts.py`), or not a type at all)."""
    return name in _BY_NAME and _BY_NAME[name].yields not in ("batches", "prompts")
