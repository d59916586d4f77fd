"""Checks of a run's inputs made before the model is built, so a bad path or file fails in one line before
anything is allocated or compiled (`maxshard.train` calls `check` right after loading the config).

Only what is cheap whatever the corpus's size: each file's first bytes and footer, never its documents.

    every source      it exists (a path, or a glob that matches files)
    text              each file's first bytes are UTF-8 text (`sources.check_source`)
    jsonl (.gz/.zst)  each file's first lines decompress (gzip and zstd check their own headers) and are JSON
                      objects holding the field the reader needs (`jsonl.check_source`); chat, preference and
                      prompt records likewise, with their own fields
    parquet           each file starts and ends with PAR1, its footer decodes and the schema has `text_field`
                      (`parquet.check_source`: what the reader does at startup, footers only)
    array_record      each shard opens (its footer) and was written with the run's tokenizer
                      (`records.check_source`)
    hf                a local path exists or the name can be a hub name; a `save_to_disk` directory has the split
                      and column (`hf.check_source`)
    tokenizer_path    it loads (`tokenizer.make_tokenizer`; the config loader loaded it already to size the
                      vocabulary)
    chat_template     the run's template reads and compiles as jinja2, when the run reads conversations

Each reader's own check names the config key (`dataset_path`, `dataset_mixture[i]`, `text_field`, ...) and the file.
What needs a whole file stays with the readers: a compressed file cut short fails when it is decompressed, a damaged
Parquet row group or ArrayRecord chunk when it is read (both ConfigErrors naming the file), and a bad record is
skipped and counted (`sources.BadRecord`). GRPO's reward, which scores what the data holds, is loaded beside this
check by `maxshard.train` (`rewards` sits above the data in the import order). `eval_tasks` are found right after
the model's shapes are derived, before anything compiles (`evaluation/in_training.py`); finding them imports
lm-eval, which takes seconds, so they are not looked up here too.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from maxshard import dataset_types
from maxshard.config import Config
from maxshard.data import catalog, files
from maxshard.data.sources import ReadOptions
from maxshard.data.tokenizer import make_tokenizer
from maxshard.errors import ConfigError

__all__ = ["check", "check_source"]


def check(cfg: Config) -> None:
    """ConfigError (one line naming the key and the file) for an input of `cfg` that cannot be read (module doc)."""
    tokenizer = make_tokenizer(cfg)
    if cfg.dataset_type != "synthetic" or cfg.dataset_mixture:
        options = ReadOptions(tokenizer.fingerprint(), cfg.text_field, cfg.messages_field, cfg.hf_split,
                              cfg.data_cache_dir, cfg.hf_streaming)
        for spec in catalog.source_specs(cfg):
            check_source(spec, options)
    _check_template(cfg)


def check_source(spec: catalog.SourceSpec, options: ReadOptions) -> None:
    """One source: that it exists, then its reader's own check of first bytes and footers: the `check_source(path,
    key, chat, options)` beside the `open_source` its row of maxshard/dataset_types.py names (`_reader_check`), or
    for the readers of whole records (preference pairs, prompts) the check of their JSONL or dataset here."""
    _check_exists(spec)
    checker = _WHOLE_RECORDS.get(spec.kind) or _reader_check(spec.kind)
    if checker is not None:
        checker(spec.path, spec.key, spec.chat, options)


def _reader_check(kind: str) -> Callable[[str, str, bool, ReadOptions], None] | None:
    """The `check_source` of reader `kind`'s module (None: it has none; store and synthetic, which have no opener,
    are checked when they open), imported only now, as `catalog` imports its opener."""
    opener = dataset_types.reader(kind).opener
    return getattr(importlib.import_module(opener.split(":")[0]), "check_source", None) if opener else None


def _check_exists(spec: catalog.SourceSpec) -> None:
    prefix = dataset_types.reader(spec.kind).prefix
    if not spec.path or prefix or files.is_remote(spec.path) or files.has_magic(spec.path):
        return  # the stdlib corpus, a hub name, a remote path or a glob: its reader lists it
    if not os.path.exists(spec.path):
        raise ConfigError(f"{spec.key}={spec.path}: no such file or directory")


def _check_preference(path: str, key: str, chat: bool, options: ReadOptions) -> None:
    """Preference records: JSONL or a Hugging Face dataset with `chosen`, else `completion` (unpaired records, KTO),
    as `preference.open_source` reads them; the error names `chosen` when it has neither."""
    try:
        _check_records(path, key, options, ("chosen",))
    except ConfigError as no_pairs:
        try:
            _check_records(path, key, options, ("completion",))
        except ConfigError:
            raise no_pairs from None


def _check_prompts(path: str, key: str, chat: bool, options: ReadOptions) -> None:
    """GRPO prompts: JSONL or a Hugging Face dataset with `prompt` or `messages` (`prompts.open_source`)."""
    from maxshard.data import prompts  # deferred: only prompt sources need it

    if not path:
        raise ConfigError(f"{key} is empty; dataset_type=prompts reads JSONL files or a Hugging Face dataset")
    _check_records(path, key, options, prompts.FIELDS)


def _check_records(path: str, key: str, options: ReadOptions, fields: tuple[str, ...]) -> None:
    """Records read whole (preference pairs, prompts) from JSONL, else from a Hugging Face dataset, as their readers
    tell the two apart: by the JSONL suffixes."""
    from maxshard.data import hf, jsonl  # deferred: as the readers, imported by the sources that need them

    if path.endswith(jsonl.SUFFIXES):
        jsonl.check_files(path, fields, key, "record field")
    else:
        hf.check_fields(path, key, fields, options.hf_split, options.hf_streaming, "record field")


_WHOLE_RECORDS: dict[str, Callable[[str, str, bool, ReadOptions], None]] = {
    "preference": _check_preference,
    "prompts": _check_prompts,
}


def _check_template(cfg: Config) -> None:
    """The run's chat template, when it reads conversations: the file exists, is UTF-8 and compiles as jinja2."""
    from maxshard.data import chat

    try:
        chat.run_template(cfg)
    except (OSError, UnicodeDecodeError) as e:  # the template file itself, or the tokenizer's, unreadable
        setting = cfg.chat_template or f"\"\" (the template beside tokenizer_path={cfg.tokenizer_path})"
        raise ConfigError(f"chat_template={setting}: cannot read it ({type(e).__name__}: {e})") from None
