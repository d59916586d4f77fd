"""Prompts for GRPO (`dataset_type: prompts`): records the training loop samples completions from and the reward
scores, read by `make_prompts` (not `make_input`: GRPO's rows are made from its own samples, not from documents).

A record is a JSON object (JSONL, plain, .gz or .zst) or a row of a Hugging Face dataset (map-style or streamed),
holding `prompt` (text) or `messages` (a conversation ending with a user turn), and any other fields (an expected
answer, an id, test cases), all kept in `Prompt.record` for the reward. A prompt becomes the ids generation starts from:

    text       `tokenizer.encode_prompt(prompt)`, as `maxshard.generate` encodes a prompt (BOS where the tokenizer
               adds one); with `grpo_environment` a conversation of one user turn, rendered as messages are, since
               a multi-turn episode continues it with the chat template
    messages   the conversation rendered with the run's chat template and `add_generation_prompt=True`, tokenized as
               SFT tokenizes a rendered conversation (`chat.encode_rendered`: the template writes BOS and the turn
               markers), so the model continues with the assistant's reply

Order: one endless stream of the split's records, the same on every process (each process reads it whole; a prompt
batch is small next to its completions). Train is reshuffled every epoch by `data_shuffle_seed` (a permutation seeded
by the seed and the epoch number, so the stream is a pure function of the config), eval keeps corpus order. The state
is one global position, the records taken so far, bad ones included: a changed tokenizer or `max_prompt_length`
resumes from the same record, while a changed corpus, split or seed (another order) is refused by `set_state`.

A streamed Hugging Face source (`hf_streaming`, `hf_stream`) has no length and no random access: every process
reads the whole stream, records are encoded in it (so an epoch without one usable prompt stops there), the split is
a hash of each record's prompt or messages, train is shuffled in windows of `hf_stream.SHUFFLE_WINDOW` seeded by
`data_shuffle_seed` (grain's `WindowShuffleIterDataset`, as the training pipeline shuffles a stream), eval keeps
stream order; the state is grain's iterator state (the window's start and the stream's own `state_dict()`), so a
resume continues exactly (`StreamedPromptIterator`).

Skipped and counted, never a crash (`BadRecord`, `data/skipped_records` of `data/records_read`): no prompt nor
messages, both, a mistyped or empty field, a conversation that does not end with a user turn, a template that refuses
it, invalid UTF-8, and a prompt of more than `max_prompt_length` tokens. A whole epoch of skipped records is a
ConfigError (never an endless search), as is an empty split, and so is a share of bad records above
`max_bad_record_fraction` once `bad_records.MIN_RECORDS` are read (checked at each bad record). The first bad records
are kept in the state and, for the train stream of the primary process, written for the console (`bad_records`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from maxshard.config import Config
from maxshard.data import bad_records, hf, jsonl
from maxshard.data.chat import Conversation, as_conversation, encode_rendered, load_template
from maxshard.data.chat_template import ChatTemplate, TemplateError
from maxshard.data.sources import BadRecord, Corpus, ReadOptions, as_text, row_keys, split_indices
from maxshard.data.tokenizer import make_tokenizer
from maxshard.errors import ConfigError

__all__ = ["FIELDS", "Prompt", "PromptRecord", "as_prompt", "open_source", "PromptEncoder", "PromptIterator",
           "StreamedPromptIterator", "make_prompts"]

FIELDS = ("prompt", "messages")  # a record holds one of them


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt as the GRPO loop uses it."""

    ids: tuple[int, ...]  # the prompt's token ids as generation starts them (BOS where the tokenizer adds one)
    text: str  # the prompt as rendered text (a conversation: the chat template's output)
    record: dict  # the whole record (all fields), for the reward; shared by a group's completions: do not mutate
    messages: tuple[dict[str, Any], ...] = ()  # the conversation `ids` render (empty: a text prompt, not rendered)


@dataclasses.dataclass(frozen=True)
class PromptRecord:
    """A record read but not yet tokenized: its prompt (text or conversation), the whole record, where it is."""

    prompt: str | Conversation
    record: dict[str, Any]
    where: str


def as_prompt(record: dict[str, Any], where: str) -> PromptRecord | BadRecord:
    """A JSON object or a dataset row -> a PromptRecord, or a BadRecord saying why not (None counts as absent:
    a dataset with both columns has nulls in one of them)."""
    text, messages = record.get("prompt"), record.get("messages")
    if text is not None and messages is not None:
        return BadRecord("both prompt and messages", where)
    if text is not None:
        prompt = as_text(text, where)
        return prompt if isinstance(prompt, BadRecord) else PromptRecord(prompt, record, where)
    conversation = as_conversation(messages, where)
    if isinstance(conversation, BadRecord):
        return conversation
    if conversation.messages[-1]["role"] != "user":
        return BadRecord("not ending with a user turn", where)
    return PromptRecord(conversation, record, where)


# --------------------------------------------------------------------------------------------- reading


def open_source(path: str, key: str, chat: bool, options: ReadOptions) -> Corpus | Any:
    """`dataset_type: prompts` (maxshard/dataset_types.py): JSONL files, else a Hugging Face dataset, map-style or
    (`hf.read_as_stream`) a `hf_stream.HfStream` of prompt records."""
    if not path:
        raise ConfigError(f"{key} is empty; dataset_type=prompts reads JSONL files or a Hugging Face dataset")
    if path.endswith(jsonl.SUFFIXES):  # as `dataset_type: chat` tells its readers apart
        return jsonl.jsonl_corpus(path, FIELDS, options.data_cache_dir, key, whole=as_prompt)
    if hf.read_as_stream(path, options.hf_streaming, key):
        from maxshard.data import hf_stream  # deferred: imports grain

        return hf_stream.open_stream(path, options.hf_split, FIELDS, key, whole=as_prompt)
    return _hf_corpus(path, options.hf_split, key)


def _hf_corpus(path: str, split: str, key: str) -> Corpus:
    """One split of a Hugging Face dataset whose rows are prompt records (every column kept); keys as `hf.hf_corpus`."""
    dataset = hf.load(path, split, key)
    if not set(FIELDS) & set(dataset.column_names):
        raise ConfigError(f"record field=prompt or messages: {key}={path} has no such column "
                          f"(columns: {', '.join(dataset.column_names[:12])})")
    if len(dataset) == 0:
        raise ConfigError(f"{key}={path}: the {split} split has no rows (empty corpus)")
    name = os.path.basename(path.rstrip("/")) or path
    documents = hf.HfDocuments(dataset, FIELDS[0], name, whole=as_prompt)
    return Corpus(documents, row_keys(f"{name}:{split}", len(dataset)), f"{key}={path}")


# --------------------------------------------------------------------------------------------- encoding


@dataclasses.dataclass(frozen=True)
class PromptEncoder:
    """PromptRecord -> Prompt (module docstring), or its BadRecord."""

    tokenizer: Any
    template: ChatTemplate  # the run's chat template (conversations)
    max_length: int  # max_prompt_length: a longer prompt is skipped
    as_chat: bool = False  # a text prompt as a conversation of one user turn (multi-turn rollouts continue it)

    def __call__(self, record: PromptRecord, where: str = "") -> Prompt | BadRecord:
        """`where`: unused (the record names itself); there for the stream's `encode(record, where)`."""
        messages: tuple[dict[str, Any], ...] = ()
        try:
            if isinstance(record.prompt, str) and not self.as_chat:
                text, ids = record.prompt, list(self.tokenizer.encode_prompt(record.prompt))
            else:
                messages = (tuple(dict(m) for m in record.prompt.messages) if isinstance(record.prompt, Conversation)
                            else ({"role": "user", "content": record.prompt},))
                text = self.template.render([dict(m) for m in messages], add_generation_prompt=True)
                ids = encode_rendered(text, self.tokenizer).tolist()
        except TemplateError as e:  # the reason stays fixed (counted by kind); the template's words go to `where`
            return BadRecord("template refused it", f"{record.where} ({str(e)[:80]})")
        except UnicodeEncodeError:
            return BadRecord("invalid UTF-8", record.where)
        if not ids:
            return BadRecord("no tokens", record.where)
        if len(ids) > self.max_length:
            return BadRecord("longer than max_prompt_length", record.where)
        return Prompt(tuple(int(i) for i in ids), text, record.record, messages)


# --------------------------------------------------------------------------------------------- the stream


class _Counted:
    """What both prompt streams share: prompts delivered and records skipped (records read: the two together, as
    a stream reads one record at a time), the first bad records and the bound on their share (`bad_records`)."""

    def __init__(self, identity: dict[str, Any], max_bad_fraction: float | None, examples_path: str | None) -> None:
        """`max_bad_fraction`: the bound (None: none); `examples_path`: where the first bad records are written
        (None: nowhere)."""
        self._identity, self._limit, self._examples_path = identity, max_bad_fraction, examples_path
        self._skipped = self._delivered = 0
        self._examples: list[str] = []

    def _skip(self, record: BadRecord) -> None:
        """Counts a bad record, keeps it (and writes the kept ones) while fewer than `bad_records.SHOWN` are kept,
        and bounds the share."""
        self._skipped += 1
        if len(self._examples) < bad_records.SHOWN:
            bad_records.keep(self._examples, record.where, record.reason)
            if self._examples_path is not None:
                bad_records.write_examples(self._examples_path, self._examples)
        bad_records.check(self._identity["where"], self._skipped, self._skipped + self._delivered, self._limit,
                          self._examples)

    def _counts_state(self) -> dict[str, Any]:
        """The counters and the first bad records, for `get_state`."""
        return {"skipped": self._skipped, "prompts": self._delivered, bad_records.STATE_KEY: list(self._examples)}

    def _restore_counts(self, state: dict[str, Any]) -> None:
        """The counters and first bad records of `state`; the latter written again for this start's console."""
        self._skipped, self._delivered = int(state["skipped"]), int(state["prompts"])
        self._examples = [str(e) for e in state.get(bad_records.STATE_KEY, [])]  # none in older states
        if self._examples and self._examples_path is not None:  # this start's run_dir may be another one
            bad_records.write_examples(self._examples_path, self._examples)

    def stats(self) -> dict[str, int]:
        """The stream's counters so far: prompts delivered, records skipped and read (the run's, as every process
        has the same)."""
        return {"data/prompts": self._delivered, "data/skipped_records": self._skipped,
                "data/records_read": self._skipped + self._delivered}


class PromptIterator(_Counted):
    """The split's prompts as one endless, deterministic stream (module docstring); the same on every process."""

    def __init__(self, documents: Sequence[PromptRecord | BadRecord], indices: np.ndarray, encoder: PromptEncoder,
                 shuffle_seed: int | None, identity: dict[str, Any], max_bad_fraction: float | None = None,
                 examples_path: str | None = None) -> None:
        """`indices`: the split's records; `shuffle_seed`: None keeps corpus order (eval); `identity`: what makes
        the record order, which a restored state must match (JSON values); the rest as `_Counted`'s."""
        super().__init__(identity, max_bad_fraction, examples_path)
        self._documents, self._indices, self._encoder = documents, np.asarray(indices, np.int64), encoder
        self._seed = shuffle_seed
        self._position = 0
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, permutation) of the current epoch

    def next_prompts(self, count: int) -> list[Prompt]:
        """The next `count` prompts of the stream, bad records skipped (and counted) on the way."""
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        prompts: list[Prompt] = []
        bad_run = 0
        while len(prompts) < count:
            result = self._read(self._position)
            self._position += 1
            if isinstance(result, BadRecord):
                self._skip(result)
                bad_run += 1
                if bad_run >= len(self._indices):
                    raise ConfigError(f"{self._identity['where']}: no usable prompt in the {self._identity['split']} "
                                      f"split, all {len(self._indices)} records are skipped (e.g. {result.reason}: "
                                      f"{result.where})")
                continue
            bad_run = 0
            prompts.append(result)
            self._delivered += 1
        return prompts

    def _read(self, position: int) -> Prompt | BadRecord:
        """The record at a global position of the stream, encoded."""
        epoch, offset = divmod(position, len(self._indices))
        if self._seed is not None:
            if self._order is None or self._order[0] != epoch:
                rng = np.random.default_rng(np.random.SeedSequence([self._seed, epoch]))
                self._order = (epoch, rng.permutation(len(self._indices)))
            offset = int(self._order[1][offset])
        record = self._documents[int(self._indices[offset])]
        return record if isinstance(record, BadRecord) else self._encoder(record)

    def get_state(self) -> dict[str, Any]:
        """JSON-serializable: the global position (records taken), the counters, the first bad records, and what
        the order depends on."""
        return {"position": self._position, **self._counts_state(), "stream": dict(self._identity)}

    def set_state(self, state: dict[str, Any]) -> None:
        """Goes on from `state` (`get_state` of the same stream, in this process or another)."""
        if state.get("stream") != self._identity:
            raise ConfigError(f"cannot resume the prompts: the saved stream {state.get('stream')} is not this one "
                              f"{self._identity} (another dataset_path, split, eval_fraction or data_shuffle_seed)")
        self._position = int(state["position"])
        self._restore_counts(state)


class StreamedPromptIterator(_Counted):
    """The split's prompts read from a stream (module docstring), with PromptIterator's interface."""

    def __init__(self, prompts: Any, identity: dict[str, Any], max_bad_fraction: float | None = None,
                 examples_path: str | None = None) -> None:
        """`prompts`: a grain IterDataset of Prompts and BadRecords, endless; the rest as PromptIterator's."""
        super().__init__(identity, max_bad_fraction, examples_path)
        self._prompts = prompts
        self._iterator = iter(prompts)

    def next_prompts(self, count: int) -> list[Prompt]:
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        prompts: list[Prompt] = []
        while len(prompts) < count:  # the stream stops an epoch without a usable prompt itself
            result = next(self._iterator)
            if isinstance(result, BadRecord):
                self._skip(result)
            else:
                prompts.append(result)
                self._delivered += 1
        return prompts

    def get_state(self) -> dict[str, Any]:
        """JSON: grain's iterator state (the window's start, the stream's position), the counters, the first bad
        records, the identity."""
        return {"reader": self._iterator.get_state(), **self._counts_state(), "stream": dict(self._identity)}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("stream") != self._identity or "reader" not in state:
            raise ConfigError(f"cannot resume the prompts: the saved stream {state.get('stream')} is not this one "
                              f"{self._identity} (another dataset_path, split, eval_fraction, data_shuffle_seed or "
                              "hf_streaming)")
        self._iterator = iter(self._prompts)
        self._iterator.set_state(state["reader"])
        self._restore_counts(state)


def _streamed(stream: Any, cfg: Config, split: str, encoder: PromptEncoder,
              examples_path: str | None) -> StreamedPromptIterator:
    """The prompts of a streamed source (module docstring)."""
    from maxshard.data import hf_stream  # deferred: grain only for a stream

    seed = cfg.data_shuffle_seed if split == "train" else None
    prompts = hf_stream.window_shuffled(stream.documents(split, cfg.eval_fraction, 0, 1, encoder), seed)
    identity = {"where": stream.where, "split": split, "records": "streamed", "shuffle_seed": seed,
                "eval_fraction": cfg.eval_fraction, "window": hf_stream.SHUFFLE_WINDOW}
    return StreamedPromptIterator(prompts, identity, cfg.max_bad_record_fraction, examples_path)


def make_prompts(cfg: Config, split: str, max_prompt_length: int) -> PromptIterator | StreamedPromptIterator:
    """The prompt stream of `cfg` (dataset_type prompts): `split` "train" or "eval" as the other readers split
    (`eval_fraction`, by a hash of each record's file and line); prompts of more than `max_prompt_length` tokens
    are skipped; the train stream of the primary process writes its first bad records for the console."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    if cfg.dataset_type != "prompts":
        raise ConfigError(f"dataset_type={cfg.dataset_type}: GRPO samples from dataset_type=prompts")
    if max_prompt_length < 1:
        raise ConfigError(f"grpo_max_prompt_length must be >= 1, got {max_prompt_length}")
    tokenizer = make_tokenizer(cfg)
    template = load_template(cfg.tokenizer_path, cfg.chat_template)
    options = ReadOptions(tokenizer.fingerprint(), cfg.text_field, cfg.messages_field, cfg.hf_split,
                          cfg.data_cache_dir, cfg.hf_streaming)
    corpus = open_source(cfg.dataset_path, "dataset_path", False, options)
    encoder = PromptEncoder(tokenizer, template, max_prompt_length, as_chat=bool(cfg.grpo_environment))
    examples = bad_records.examples_path(cfg.run_dir, jax.process_index() == 0) if split == "train" else None
    if not isinstance(corpus, Corpus):  # a streamed Hugging Face dataset
        return _streamed(corpus, cfg, split, encoder, examples)
    indices = split_indices(corpus.keys, split, cfg.eval_fraction)
    if len(indices) == 0:
        raise ConfigError(f"{corpus.where}: the {split} split is empty ({len(corpus)} records, "
                          f"eval_fraction={cfg.eval_fraction})")
    seed = cfg.data_shuffle_seed if split == "train" else None
    identity = {"where": corpus.where, "split": split, "records": int(len(indices)), "shuffle_seed": seed}
    return PromptIterator(corpus.documents, indices, encoder, seed, identity, cfg.max_bad_record_fraction, examples)
