"""Preference records (`dataset_type: preference`): pairs of a prompt, a chosen and a rejected completion, for
DPO, SimPO and ORPO; or unpaired records of a prompt, a completion and its label, for KTO.

A record is text, `{"prompt": str, "chosen": str, "rejected": str}`, or a conversation: `{"chosen": [messages],
"rejected": [messages]}` (one conversation whose last assistant turn differs), or TRL's conversational form
`{"prompt": [messages], "chosen": [assistant messages], "rejected": [...]}` (the prompt goes before each). From JSONL
(plain, .gz, .zst) or a Hugging Face dataset (`prompt`, `chosen`, `rejected` columns), read map-style or streamed
as `hf_streaming` says (`hf_stream`: each record encoded in the stream, split by a hash of its fields, shuffled in
windows, resumed exactly from the stream's position).

A record becomes one *pair example* of two halves, chosen first, each its own document shifted by one into
inputs/targets (`packing.document_pair`):

    text   [BOS] prompt ids  completion ids  EOS     prompt and completion tokenized apart, then joined, as TRL's
                                                      DPO does (no BPE merge crosses the boundary); BOS where the
                                                      tokenizer adds one
    chat   the whole conversation rendered with the run's chat template, as `dataset_type: chat` renders it
           (`chat.encode_conversation`); the response is the LAST assistant turn, and everything before it (the
           prompt) must be the same tokens in both halves

The weight (`chat.WEIGHT`) is 1 on targets that are completion tokens (the EOS, or the turn's end, included) and 0
on prompt targets. The pair also carries `packing.HALF` (1 chosen, 2 rejected) and `packing.HALF_POSITION`, from
which `packing.pack_pairs` makes the rows: pair p of a row has segment ids 2p-1 (chosen) and 2p (rejected), and
positions restart at 0 at each half.

An unpaired record (KTO: TRL's `{"prompt", "completion", "label"}`, text or TRL's conversational form; `label` a
JSON boolean, true for a desirable completion) becomes one *example* laid out as a pair: its prompt with its own
completion first, then the same prompt with its KL completion, each encoded as above. KTO's reference point
estimates the KL divergence from the reference on mismatched prompt/completion pairs (TRL's KL sequences). TRL's
`KTOTrainer` takes, in dataset order, example i's KL completion from example i - 1 within each batch of its
`per_device_train_batch_size` (the first from the batch's last); here (`KlCompletions`) record i's comes from
record i - 1 of the whole source (record 0's from the last; past bad records and those of the other form, text
against messages, `NEIGHBOURS` at most): TRL's rotation over one batch as large as the source. Maxshard shuffles
records before packing them, so a batch's KL completions are other records' than its own (they only place the
reference point: no gradient flows through them), and with an eval split a train record's neighbour may be an
eval record. The weight on the first half's completion targets is its label, +1 desirable or -1 undesirable
(`objectives/kto.py` reads the sign), and 1 on the KL completion's. An encoder told what its objective reads
(`PreferenceEncoder.unpaired`) skips records of the other kind.

Skipped and counted, never a crash (`BadRecord`, naming the record): a missing or mistyped field, text mixed with
messages, a template that refuses the conversation, a half without a completion, prompts that differ between the
halves, and a pair longer than `max_target_length` (both halves together: a pair always lands whole in one row);
an unpaired record likewise, and one whose label is not a boolean or that has no record nearby for its KL completion.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from maxshard.data import hf, jsonl
from maxshard.data.chat import WEIGHT, Conversation, as_conversation, encode_conversation
from maxshard.data.chat_template import ChatTemplate, TemplateError
from maxshard.data.packing import HALF, HALF_POSITION
from maxshard.data.sources import BadRecord, Corpus, ReadOptions, row_keys
from maxshard.errors import ConfigError

__all__ = ["FIELDS", "Preference", "Unpaired", "as_preference", "as_unpaired", "KlCompletions", "open_source",
           "PreferenceEncoder", "pair_example"]

FIELDS = ("prompt", "chosen", "rejected")  # the record's fields (prompt optional for conversations)
UNPAIRED_FIELDS = ("prompt", "completion", "label")  # an unpaired record's fields (KTO)
RECORD_FIELDS = ("chosen", "completion")  # a record has one of these: a pair, or an unpaired record (hf columns)
NEIGHBOURS = 16  # records looked at before an unpaired one for its KL completion


@dataclasses.dataclass(frozen=True)
class Preference:
    """One preference record: text (three strings) or messages (prompt: the messages before each completion)."""

    prompt: str | Conversation | None
    chosen: str | Conversation
    rejected: str | Conversation


@dataclasses.dataclass(frozen=True)
class Unpaired(Preference):
    """One unpaired record (TRL's `{prompt, completion, label}`), encoded as the pair of its completion (`chosen`)
    and its KL completion (`rejected`: another record's completion, set by `KlCompletions`; None until then)."""

    label: bool = True  # desirable

    @property
    def completion(self) -> str | Conversation:
        return self.chosen


def as_unpaired(record: dict[str, Any], where: str) -> Unpaired | BadRecord:
    """A record with `completion` -> an Unpaired without its KL completion, or a BadRecord saying why not. Text
    (two strings) or messages (TRL's conversational form: prompt messages, then the completion's assistant
    messages); `label` a JSON boolean."""
    prompt, completion, label = record.get("prompt"), record.get("completion"), record.get("label")
    if prompt is None or completion is None or label is None:
        return BadRecord("missing field", where)
    if not isinstance(label, bool):
        return BadRecord("label not a boolean", where)
    if isinstance(prompt, str) and isinstance(completion, str):
        return Unpaired(prompt, completion, None, label)
    if isinstance(prompt, str) or isinstance(completion, str):
        return BadRecord("text mixed with messages", where)
    halves = [as_conversation(value, where) for value in (prompt, completion)]
    bad = next((h for h in halves if isinstance(h, BadRecord)), None)
    return bad if bad is not None else Unpaired(halves[0], halves[1], None, label)


@dataclasses.dataclass(frozen=True)
class KlCompletions(Sequence):
    """A source's records, each Unpaired one with the completion of the nearest good unpaired record before it as
    its KL completion (module docstring); pairs and bad records as they are. Picklable: runs in grain workers."""

    documents: Sequence[Any]

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: int) -> Any:  # type: ignore[override]
        record = self.documents[int(index)]
        if not isinstance(record, Unpaired):
            return record
        text = isinstance(record.completion, str)
        for back in range(1, min(NEIGHBOURS, len(self) - 1) + 1):
            other = self.documents[(int(index) - back) % len(self)]
            if isinstance(other, Unpaired) and isinstance(other.completion, str) == text:
                return dataclasses.replace(record, rejected=other.completion)
        return BadRecord("no record nearby for its KL completion", self.where(int(index)))

    def where(self, index: int) -> str:
        """Where record `index` is (the reader's own words where it has them)."""
        where = getattr(self.documents, "where", None)
        return where(index) if callable(where) else f"document {index}"


def as_preference(record: dict[str, Any], where: str) -> Preference | Unpaired | BadRecord:
    """A JSON object or a dataset row -> a Preference (an Unpaired with `completion`), or a BadRecord saying why
    not."""
    if "completion" in record and "chosen" not in record:
        return as_unpaired(record, where)
    chosen, rejected, prompt = record.get("chosen"), record.get("rejected"), record.get("prompt")
    if chosen is None or rejected is None:
        return BadRecord("missing field", where)
    if isinstance(chosen, str) and isinstance(rejected, str):
        if prompt is None:
            return BadRecord("missing field", where)
        return Preference(prompt, chosen, rejected) if isinstance(prompt, str) else BadRecord("not a string", where)
    if isinstance(chosen, str) or isinstance(rejected, str) or isinstance(prompt, str):
        return BadRecord("text mixed with messages", where)
    halves = [as_conversation(value, where) for value in (prompt, chosen, rejected) if value is not None]
    bad = next((h for h in halves if isinstance(h, BadRecord)), None)
    if bad is not None:
        return bad
    return Preference(halves[0] if prompt is not None else None, halves[-2], halves[-1])


# --------------------------------------------------------------------------------------------- reading


def open_source(path: str, key: str, chat: bool, options: ReadOptions) -> Corpus | Any:
    """`dataset_type: preference` (maxshard/dataset_types.py): JSONL files, else a Hugging Face dataset, map-style
    or (`hf.read_as_stream`) a `hf_stream.HfStream` of preference records."""
    if path.endswith(jsonl.SUFFIXES):  # as `dataset_type: chat` tells its readers apart
        return _jsonl_corpus(path, key, options.data_cache_dir)
    if hf.read_as_stream(path, options.hf_streaming, key):
        from maxshard.data import hf_stream  # deferred: imports grain

        stream = hf_stream.open_stream(path, options.hf_split, FIELDS, key, whole=as_preference)
        if "completion" in (stream.dataset.column_names or ()):
            raise ConfigError(f"{key}={path}: unpaired records (prompt, completion, label) are read map-style, each "
                              "with another record's completion for KTO's KL term: set hf_streaming=never")
        hf.check_text_field(stream.dataset.column_names, "chosen", f"{key}={path}", "record field")
        return stream
    return _hf_corpus(path, options.hf_split, key)


def _jsonl_corpus(path: str, key: str, cache_dir: str) -> Corpus:
    """JSONL files of pairs, else of unpaired records; the error names `chosen` when the files hold neither."""
    try:
        corpus = jsonl.jsonl_corpus(path, "chosen", cache_dir, key, whole=as_preference)
    except ConfigError as no_pairs:
        try:
            corpus = jsonl.jsonl_corpus(path, "completion", cache_dir, key, whole=as_preference)
        except ConfigError:
            raise no_pairs from None
    return dataclasses.replace(corpus, documents=KlCompletions(corpus.documents))


def _hf_corpus(path: str, split: str, key: str) -> Corpus:
    """One split of a Hugging Face dataset whose rows are preference records; split keys as `hf.hf_corpus`."""
    dataset = hf.load(path, split, key)
    hf.check_text_field(dataset.column_names, RECORD_FIELDS, f"{key}={path}", "record field")
    if len(dataset) == 0:
        raise ConfigError(f"{key}={path}: the {split} split has no rows (empty corpus)")
    name = os.path.basename(path.rstrip("/")) or path
    columns = [c for c in dict.fromkeys(FIELDS + UNPAIRED_FIELDS) if c in dataset.column_names]
    documents = hf.HfDocuments(dataset.select_columns(columns), "chosen", name, whole=as_preference)
    return Corpus(KlCompletions(documents), row_keys(f"{name}:{split}", len(dataset)), f"{key}={path}")


# --------------------------------------------------------------------------------------------- encoding


@dataclasses.dataclass(frozen=True)
class PreferenceEncoder:
    """Preference -> pair example (module docstring), or its BadRecord (picklable: runs in grain workers)."""

    tokenizer: Any
    template: ChatTemplate | None  # the run's chat template (conversations)
    max_length: int  # max_target_length: a longer pair is skipped
    unpaired: bool | None = None  # the objective reads unpaired records (Kind.unpaired), else pairs; None: either

    def __call__(self, record: Preference, where: str) -> dict[str, np.ndarray] | BadRecord:
        if self.unpaired is not None and isinstance(record, Unpaired) != self.unpaired:
            return BadRecord("a pair, not an unpaired record" if self.unpaired else "an unpaired record, not a pair",
                             where)
        if isinstance(record, Unpaired):
            return self._unpaired(record, where)
        return self._example(record.prompt, (record.chosen, record.rejected), where)

    def _unpaired(self, record: Unpaired, where: str) -> dict[str, np.ndarray] | BadRecord:
        """An unpaired record -> its example: the pair (own completion, KL completion), the first's completion
        weighted by the label's sign (+1 desirable, -1 undesirable)."""
        if record.rejected is None:  # read without `KlCompletions`
            return BadRecord("no record nearby for its KL completion", where)
        example = self._example(record.prompt, (record.chosen, record.rejected), where)
        if not isinstance(example, BadRecord) and not record.label:
            example[WEIGHT] = np.where(example[HALF] == 1, -example[WEIGHT], example[WEIGHT])
        return example

    def _example(self, prompt: str | Conversation | None, completions: tuple[Any, Any],
                 where: str) -> dict[str, np.ndarray] | BadRecord:
        """The pair example of `prompt` with each of two completions (module docstring), or its BadRecord."""
        try:
            halves = (self._text_halves(prompt, completions) if isinstance(completions[0], str)
                      else self._chat_halves(prompt, completions, where))
        except TemplateError as e:  # the reason stays fixed (counted by kind); the template's words go to `where`
            return BadRecord("template refused it", f"{where} ({str(e)[:80]})")
        except UnicodeEncodeError:
            return BadRecord("invalid UTF-8", where)
        if isinstance(halves, BadRecord):
            return halves
        if not all(weights[1:].any() for _, weights in halves):
            return BadRecord("no completion", where)
        example = pair_example(halves)
        if len(example["inputs"]) > self.max_length:
            return BadRecord("longer than max_target_length", where)
        return example

    def _text_halves(self, text: str, completions: tuple[str, str]) -> list[tuple[np.ndarray, np.ndarray]]:
        """[BOS] prompt completion EOS for each completion, weighted 1 from the completion's first token."""
        start = [] if self.tokenizer.start_id is None else [self.tokenizer.start_id]
        prompt = np.concatenate([start, self.tokenizer.encode_array(text)]).astype(np.int32)
        halves = []
        for completion in completions:
            tokens = np.concatenate([prompt, self.tokenizer.encode_array(completion), [self.tokenizer.eos_id]])
            weights = (np.arange(len(tokens)) >= len(prompt)).astype(np.int8)
            halves.append((tokens.astype(np.int32), weights))
        return halves

    def _chat_halves(self, prompt: Conversation | None, completions: tuple[Conversation, Conversation],
                     where: str) -> list[tuple[np.ndarray, np.ndarray]] | BadRecord:
        """Each whole conversation rendered as SFT renders it, weighted on its last assistant turn only; the tokens
        before that turn must be the same in both."""
        assert self.template is not None, "a preference source without the run's chat template"
        before = () if prompt is None else prompt.messages
        halves, prompts = [], []
        for completion in completions:
            tokens, mask = encode_conversation(Conversation(before + completion.messages), self.template,
                                               self.tokenizer)
            start, end = _last_run(mask)
            if start == end:
                return BadRecord("no assistant turn", where)
            weights = np.zeros(len(tokens), np.int8)
            weights[start:end] = 1
            halves.append((tokens, weights))
            prompts.append(tokens[:start])
        if not np.array_equal(prompts[0], prompts[1]):
            return BadRecord("prompts differ", where)
        return halves


def _last_run(mask: np.ndarray) -> tuple[int, int]:
    """[start, end) of the last run of 1s in `mask` (the last assistant turn); (0, 0) when there is none."""
    ones = np.flatnonzero(mask)
    if not len(ones):
        return 0, 0
    end = int(ones[-1]) + 1
    gaps = np.flatnonzero(mask[:end] == 0)
    return (int(gaps[-1]) + 1 if len(gaps) else 0), end


def pair_example(halves: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    """[(tokens [n_h], weights [n_h]) chosen, rejected] -> the pair example: each half shifted by one, then joined.

    Every field is [n_c - 1 + n_r - 1]: inputs, targets (int32), WEIGHT (float32, of each target), HALF (1 or 2),
    HALF_POSITION (0, 1, ... inside each half)."""
    parts: dict[str, list[np.ndarray]] = {"inputs": [], "targets": [], WEIGHT: [], HALF: [], HALF_POSITION: []}
    for half, (tokens, weights) in enumerate(halves, start=1):
        n = len(tokens) - 1
        parts["inputs"].append(tokens[:-1])
        parts["targets"].append(tokens[1:])
        parts[WEIGHT].append(weights[1:].astype(np.float32))
        parts[HALF].append(np.full(n, half, np.int32))
        parts[HALF_POSITION].append(np.arange(n, dtype=np.int32))
    return {k: np.concatenate(v).astype(np.float32 if k == WEIGHT else np.int32) for k, v in parts.items()}
