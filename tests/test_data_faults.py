"""Bad data, nothing silent: every fault of every reader ends in one ConfigError line or in counted BadRecord skips,
never a traceback and never a silently shorter corpus where the format can tell (docs/data.md, "Data faults: what
each gets").

`outcome` runs what a training run does with a config's data: the preflight (`data/preflight.py`, before the model
is built), then each source's reader, which opens the corpus and reads every document. The fault matrix names what
each fault must get and at which of the two stages; the fuzz test throws seeded random truncations and byte flips
at every format and accepts only those outcomes.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from maxshard import config, train
from maxshard.data import catalog, parquet, preflight
from maxshard.data.sources import BadRecord
from maxshard.data.tokenizer import make_tokenizer
from maxshard.errors import ConfigError

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
zstandard = pytest.importorskip("zstandard")

BASE = str(Path(__file__).resolve().parent.parent / "configs" / "base.yml")
RECORDS = 40  # records per file: small files, several row groups, zstd and gzip blocks of a few KiB
TEXTS = [f"doc{i} " + " ".join(f"word{j}" for j in range(i % 9 + 3)) for i in range(RECORDS)]


# --------------------------------------------------------------------------------------------- what a run gets


@dataclasses.dataclass(frozen=True)
class Failed:
    """A ConfigError: its one line and the stage that raised it ("preflight": before the model is built)."""

    message: str
    stage: str


@dataclasses.dataclass(frozen=True)
class Read:
    """Every document of the corpus read: the usable ones and the BadRecords skipped and counted."""

    good: list
    bad: list[BadRecord]


def outcome(*keys: str) -> Failed | Read:
    """What a run with `keys` gets from its data: the preflight, then every document of every source."""
    cfg = config.load([BASE, "per_device_batch_size=1", "max_target_length=64", *keys])
    stage = "preflight"
    try:
        preflight.check(cfg)
        stage = "read"
        documents = []
        for spec in catalog.source_specs(cfg):
            corpus = catalog.open_corpus(spec, make_tokenizer(cfg).fingerprint(), cfg.text_field, cfg.hf_split,
                                         cfg.data_cache_dir, cfg.hf_streaming, cfg.messages_field)
            documents += [corpus.documents[i] for i in range(len(corpus))]
    except ConfigError as e:
        assert "\n" not in str(e), f"not one line: {e!r}"
        return Failed(str(e), stage)
    return Read([d for d in documents if not isinstance(d, BadRecord)],
                [d for d in documents if isinstance(d, BadRecord)])


# --------------------------------------------------------------------------------------------- the formats


def jsonl_bytes(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r, ensure_ascii=False).encode() + b"\n" for r in records)


def compress(data: bytes, suffix: str) -> bytes:
    """gzip, or zstd with its content checksum (as the zstd command line writes it), or nothing."""
    if suffix.endswith(".gz"):
        return gzip.compress(data)
    if suffix.endswith(".zst"):
        return zstandard.ZstdCompressor(write_checksum=True).compress(data)
    return data


def text_records(field: str = "text") -> list[dict]:
    return [{field: t, "id": i} for i, t in enumerate(TEXTS)]


def chat_records(field: str = "messages") -> list[dict]:
    return [{field: [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": t}]}
            for i, t in enumerate(TEXTS)]


def preference_records(chosen: str = "chosen") -> list[dict]:
    return [{"prompt": f"q{i}", chosen: t, "rejected": t[::-1]} for i, t in enumerate(TEXTS)]


def prompt_records(field: str = "prompt") -> list[dict]:
    return [{field: f"what is {i}?", "answer": str(i)} for i in range(RECORDS)]


@dataclasses.dataclass(frozen=True)
class Format:
    """A data format: how to write a file of `records` (or of raw bytes), the file's name, the run's keys."""

    name: str
    suffix: str
    keys: tuple[str, ...]  # besides dataset_path
    records: Callable[..., list[dict]] | None  # JSON records (None: the format writes TEXTS its own way)

    def data(self, wrong_field: bool = False) -> bytes:
        """The file's bytes: RECORDS documents (`wrong_field`: under another field name)."""
        if self.records is not None:
            return compress(jsonl_bytes(self.records(*(["body"] if wrong_field else []))), self.suffix)
        if self.name == "text":
            return TEXTS[0].encode()
        if self.name == "parquet":
            return parquet_bytes(TEXTS, "body" if wrong_field else "text")
        return array_record_bytes([t.encode() for t in TEXTS])


def parquet_bytes(texts: list, column: str = "text", kind=None) -> bytes:
    """Row groups of 8 rows, snappy, with page checksums (parquet-mr's default; pyarrow's only when asked)."""
    sink = pa.BufferOutputStream()
    table = pa.table({column: pa.array(texts, type=kind or pa.string()), "id": list(range(len(texts)))})
    pq.write_table(table, sink, row_group_size=8, write_page_checksum=True)
    return sink.getvalue().to_pybytes()


def array_record_bytes(records: list[bytes]) -> bytes:
    from array_record.python import array_record_module

    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "x.arecord")
        writer = array_record_module.ArrayRecordWriter(path, "group_size:1")
        for record in records:
            writer.write(record)
        writer.close()
        return Path(path).read_bytes()


FORMATS = {f.name: f for f in [
    Format("text", ".txt", ("dataset_type=text",), None),
    Format("jsonl", ".jsonl", ("dataset_type=jsonl",), text_records),
    Format("jsonl.gz", ".jsonl.gz", ("dataset_type=jsonl",), text_records),
    Format("jsonl.zst", ".jsonl.zst", ("dataset_type=jsonl",), text_records),
    Format("parquet", ".parquet", ("dataset_type=parquet",), None),
    Format("array_record", ".arecord", ("dataset_type=array_record",), None),
    Format("chat", ".jsonl", ("dataset_type=chat",), chat_records),
    Format("preference", ".jsonl", ("dataset_type=preference", "objective=dpo"), preference_records),
    Format("prompts", ".jsonl", ("dataset_type=prompts", "objective=grpo"), prompt_records),
]}


def run_on(tmp_path: Path, fmt: Format, data: bytes, *keys: str) -> Failed | Read:
    """`outcome` of one file of `data` in format `fmt` (a text corpus: a directory holding it and two good files)."""
    if fmt.name == "text":
        corpus = tmp_path / "corpus"
        corpus.mkdir(exist_ok=True)
        for i, text in enumerate(TEXTS[1:3], start=1):
            (corpus / f"{i}.txt").write_text(text)
        (corpus / "0.txt").write_bytes(data)
        path = corpus
    else:
        path = tmp_path / f"data{fmt.suffix}"
        path.write_bytes(data)
    return outcome(*fmt.keys, f"dataset_path={path}", f"data_cache_dir={tmp_path / 'cache'}", "eval_fraction=0", *keys)


# --------------------------------------------------------------------------------------------- the faults


def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def flipped(fmt: Format, data: bytes) -> bytes:
    """One byte inverted inside the documents: the middle of the file; of a Parquet file's first text column chunk
    (its other column is never read); of an ArrayRecord shard's first chunk (the rest of a small shard is padding to
    its 64 KiB block)."""
    at = len(data) // 2
    if fmt.name == "parquet":
        chunk = pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0).column(0)
        at = (chunk.dictionary_page_offset or chunk.data_page_offset) + chunk.total_compressed_size // 2
    if fmt.name == "array_record":
        at = 200
    return data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:]


def latin1(fmt: Format, every_record: bool = False) -> bytes:
    """The last record (`every_record`: each) written in latin-1 with a non-ASCII character, the others in UTF-8 (a
    text file: the whole document)."""
    if fmt.name == "text":
        return "caf\u00e9 cr\u00e8me".encode("latin-1")
    if fmt.name == "parquet":
        return parquet_bytes([t.encode() for t in TEXTS[:-1]] + ["caf\u00e9".encode("latin-1")], kind=pa.binary())
    if fmt.name == "array_record":
        return array_record_bytes([t.encode() for t in TEXTS[:-1]] + ["caf\u00e9".encode("latin-1")])
    lines = jsonl_bytes(fmt.records()).splitlines(keepends=True)
    for i in range(len(lines)) if every_record else [-1]:  # the first string value gets the character
        lines[i] = lines[i].decode().replace('": "', '": "caf\u00e9 ', 1).encode("latin-1")
    return compress(b"".join(lines), fmt.suffix)


def fault_data(fmt: Format, fault: str) -> bytes:
    return {"truncated": lambda: truncated(fmt.data()), "flipped": lambda: flipped(fmt, fmt.data()),
            "empty": lambda: b"", "wrong field": lambda: fmt.data(wrong_field=True),
            "latin-1 record": lambda: latin1(fmt), "latin-1 file": lambda: latin1(fmt, every_record=True)}[fault]()


JSONL_LIKE = ("jsonl", "chat", "preference", "prompts")
# A compressed file cut short or damaged past its first lines fails where it is decompressed whole, at the first batch
# ("read"); the preflight's first read of a file this small may already reach the damage.
EITHER = ("preflight", "read")
# (format, fault) -> what it gets: ("error", stage, pattern of the one line) or ("skipped", reasons of the
# BadRecords, usable documents (None: those before a cut)). "data" in a pattern is the file's name.
EXPECTED: dict[tuple[str, str], tuple] = {
    ("text", "truncated"): ("skipped", [], 3),  # a text file has no end marker: a shorter document, undetectable
    ("text", "flipped"): ("error", "preflight", r"dataset_path: \S+0\.txt is not UTF-8 text \(byte \d+"),
    ("text", "empty"): ("skipped", ["empty text"], 2),
    ("text", "latin-1 record"): ("error", "preflight", r"dataset_path: \S+0\.txt is not UTF-8 text"),
    **{(name, "truncated"): ("skipped", ["invalid JSON"], None) for name in JSONL_LIKE},  # the cut line
    **{(name, "flipped"): ("skipped", ["invalid UTF-8"], RECORDS - 1) for name in JSONL_LIKE},
    **{(name, "empty"): ("error", "preflight", r"dataset_path=\S+data\.jsonl\S*: the files hold no lines "
                                               r"\(empty corpus\)") for name in (*JSONL_LIKE, "jsonl.gz", "jsonl.zst")},
    ("jsonl", "wrong field"): ("error", "preflight", r"text_field=text: no record of dataset_path=\S+ has that field "
                                                     r"\(fields of its first records: body, id\)"),
    ("chat", "wrong field"): ("error", "preflight", r"messages_field=messages: no record of \S+ has that field"),
    ("preference", "wrong field"): ("error", "preflight", r"record field=chosen: no record of \S+ has that field"),
    ("prompts", "wrong field"): ("error", "preflight", r"record field=prompt or messages: no record of \S+ has that"),
    **{(name, "latin-1 record"): ("skipped", ["invalid UTF-8"], RECORDS - 1) for name in JSONL_LIKE},
    **{(name, "latin-1 file"): ("error", "preflight", r"dataset_path=\S+: none of its first lines is a JSON object "
                                                      r"\(the first: invalid UTF-8\)") for name in JSONL_LIKE},
    **{(name, "truncated"): ("error", EITHER, r"dataset_path: cannot read \S+data\.jsonl\.(gz|zst) \(EOFError: .*"
                                              r"(end-of-stream marker|inside a zstd frame)")
       for name in ("jsonl.gz", "jsonl.zst")},
    ("jsonl.gz", "flipped"): ("error", EITHER, r"dataset_path: cannot read \S+data\.jsonl\.gz \("),
    ("jsonl.zst", "flipped"): ("error", EITHER, r"dataset_path: cannot read \S+data\.jsonl\.zst \(ZstdError: "),
    **{(name, "wrong field"): ("error", "preflight", r"text_field=text: no record of dataset_path=\S+ has that field")
       for name in ("jsonl.gz", "jsonl.zst")},
    **{(name, "latin-1 record"): ("skipped", ["invalid UTF-8"], RECORDS - 1) for name in ("jsonl.gz", "jsonl.zst")},
    **{(name, "latin-1 file"): ("error", "preflight", r"dataset_path=\S+: none of its first lines is a JSON object "
                                                      r"\(the first: invalid UTF-8\)")
       for name in ("jsonl.gz", "jsonl.zst")},
    ("parquet", "truncated"): ("error", "preflight", r"dataset_path: \S+data\.parquet is not a readable Parquet file "
                                                     r"\(ArrowInvalid: Parquet magic bytes not found in footer"),
    ("parquet", "flipped"): ("error", "read", r"dataset_path: \S+data\.parquet row group \d+ is unreadable, the file "
                                              r"is damaged \(OSError: "),
    ("parquet", "empty"): ("error", "preflight", r"dataset_path: \S+data\.parquet is not a readable Parquet file"),
    ("parquet", "wrong field"): ("error", "preflight", r"text_field=text: no file of dataset_path=\S+ has that column "
                                                       r"\(columns: body, id\)"),
    ("parquet", "latin-1 record"): ("skipped", ["invalid UTF-8"], RECORDS - 1),
    ("array_record", "truncated"): ("error", "preflight", r"dataset_path: \S+data\.arecord is not an ArrayRecord file"),
    ("array_record", "flipped"): ("error", "read", r"dataset_path: \S+data\.arecord record \d+ is unreadable, the file "
                                                   r"is damaged \(Corrupted Riegeli/records file: chunk (data|header) "
                                                   r"hash mismatch"),
    ("array_record", "empty"): ("error", "preflight", r"dataset_path: \S+data\.arecord is not an ArrayRecord file "
                                                      r"\(ArrayRecord file should be at least 64KB big\)"),
    ("array_record", "latin-1 record"): ("error", "read", r"dataset_path: \S+data\.arecord record 39 is not UTF-8 "
                                                          r"text"),
}


@pytest.mark.parametrize("case", list(EXPECTED), ids=lambda case: f"{case[0]}-{case[1].replace(' ', '_')}")
def test_each_fault_of_each_format_gets_one_line_or_a_counted_skip(case, tmp_path):
    fmt = FORMATS[case[0]]
    got = run_on(tmp_path, fmt, fault_data(fmt, case[1]))
    expected = EXPECTED[case]
    if expected[0] == "error":
        assert isinstance(got, Failed), got
        assert got.stage in expected[1:2] + (expected[1] if isinstance(expected[1], tuple) else ()), got
        assert re.match(expected[2], got.message), got
    else:
        assert isinstance(got, Read), got
        assert [b.reason for b in got.bad] == expected[1], got
        assert len(got.good) == expected[2] if expected[2] is not None else 0 < len(got.good) < RECORDS, got


@pytest.mark.parametrize("name", list(FORMATS))
def test_every_format_reads_whole_when_nothing_is_wrong(name, tmp_path):
    """The matrix's baseline: each good file reads every record, none skipped."""
    got = run_on(tmp_path, FORMATS[name], FORMATS[name].data())
    assert isinstance(got, Read) and not got.bad, got
    assert len(got.good) == (3 if name == "text" else RECORDS)


# --------------------------------------------------------------------------------------------- the other inputs


def test_a_source_that_does_not_exist_fails_in_the_preflight_naming_its_key(tmp_path):
    got = outcome(f"dataset_mixture=[[{tmp_path}/a.jsonl, 1], [{tmp_path}/none/*.parquet, 1]]")
    assert got == Failed(f"dataset_mixture[0]={tmp_path}/a.jsonl: no such file or directory", "preflight")
    (tmp_path / "a.jsonl").write_bytes(FORMATS["jsonl"].data())
    got = outcome(f"dataset_mixture=[[{tmp_path}/a.jsonl, 1], [{tmp_path}/none/*.parquet, 1]]")
    assert got == Failed(f"dataset_mixture[1]={tmp_path}/none/*.parquet matches no files (empty corpus)", "preflight")


def test_a_compressed_file_that_is_not_what_its_name_says_fails_in_the_preflight(tmp_path):
    plain = jsonl_bytes(text_records())
    for suffix, why in ((".jsonl.gz", r"BadGzipFile: Not a gzipped file .*"), (".jsonl.zst", r"ZstdError: .*")):
        (tmp_path / f"x{suffix}").write_bytes(plain)
        got = outcome("dataset_type=jsonl", f"dataset_path={tmp_path}/x{suffix}")
        assert isinstance(got, Failed) and got.stage == "preflight", got
        assert re.fullmatch(rf"dataset_path: cannot read \S+x{re.escape(suffix)} \({why}\)", got.message), got
    (tmp_path / "y.jsonl").write_bytes(gzip.compress(plain))  # compressed, named plain
    got = outcome("dataset_type=jsonl", f"dataset_path={tmp_path}/y.jsonl")
    assert isinstance(got, Failed) and got.stage == "preflight", got
    assert "none of its first lines is a JSON object" in got.message


def test_a_first_line_longer_than_the_preflight_reads_is_not_taken_for_a_bad_one(tmp_path):
    """The preflight reads at most 1 MiB of a file's start; a longer first line is left unjudged, not refused."""
    long = {"text": "x" * (3 << 19)}
    for suffix in (".jsonl", ".jsonl.zst"):
        (tmp_path / f"long{suffix}").write_bytes(compress(jsonl_bytes([long, *text_records()]), suffix))
        got = outcome("dataset_type=jsonl", f"dataset_path={tmp_path}/long{suffix}", f"data_cache_dir={tmp_path}/c")
        assert isinstance(got, Read) and len(got.good) == RECORDS + 1 and not got.bad, suffix


def test_a_zstd_file_of_several_frames_reads_whole_and_one_cut_in_its_last_frame_fails(tmp_path):
    """Frames are decoded one after another (`jsonl._zstd_chunks`); the cut is found at the last one."""
    data = jsonl_bytes(text_records())
    half = len(data) // 2
    frames = [zstandard.ZstdCompressor().compress(part) for part in (data[:half], data[half:])]
    (tmp_path / "two.jsonl.zst").write_bytes(b"".join(frames))
    got = outcome("dataset_type=jsonl", f"dataset_path={tmp_path}/two.jsonl.zst", f"data_cache_dir={tmp_path}/c")
    assert isinstance(got, Read) and len(got.good) == RECORDS and not got.bad, got
    (tmp_path / "cut.jsonl.zst").write_bytes(frames[0] + frames[1][:-5])
    got = outcome("dataset_type=jsonl", f"dataset_path={tmp_path}/cut.jsonl.zst", f"data_cache_dir={tmp_path}/c")
    assert got == Failed(f"dataset_path: cannot read {tmp_path}/cut.jsonl.zst (EOFError: the file ends inside a zstd "
                         "frame (truncated))", "read"), got


def test_a_large_gzip_file_cut_short_passes_the_preflight_and_fails_where_it_is_decompressed(tmp_path):
    """The preflight reads a file's first lines only; the cut is found when the file is decompressed whole."""
    many = [{"text": f"doc{i} " + "word " * (i % 50)} for i in range(4000)]
    data = gzip.compress(jsonl_bytes(many))
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) * 3 // 4])
    got = outcome("dataset_type=jsonl", f"dataset_path={tmp_path}/cut.jsonl.gz", f"data_cache_dir={tmp_path}/c")
    assert got == Failed(f"dataset_path: cannot read {tmp_path}/cut.jsonl.gz (EOFError: Compressed file ended before "
                         "the end-of-stream marker was reached)", "read"), got
    assert os.listdir(tmp_path / "c") == []  # no partial copy left in the cache for a later run to take


def test_a_parquet_file_that_does_not_start_with_par1_fails_in_the_preflight(tmp_path):
    data = parquet_bytes(TEXTS)
    (tmp_path / "x.parquet").write_bytes(b"XXXX" + data[4:])
    got = outcome("dataset_type=parquet", f"dataset_path={tmp_path}/x.parquet")
    assert got == Failed(f"dataset_path: {tmp_path}/x.parquet is not a readable Parquet file (it starts with b'XXXX', "
                         "not b'PAR1')", "preflight"), got


def test_a_parquet_row_group_that_decodes_to_other_rows_than_its_footer_says_is_damaged(tmp_path):
    """A flipped page header can make a row group decode to fewer rows than the footer counted (the fuzz finds
    such flips): the reader says so instead of failing on a missing row."""
    (tmp_path / "x.parquet").write_bytes(parquet_bytes(TEXTS[:8]))  # one row group of 8 rows
    documents = parquet.ParquetDocuments([str(tmp_path / "x.parquet")], ["x.parquet"], [[9]], "text")
    with pytest.raises(ConfigError, match=r"^dataset_path: \S+x\.parquet row group 0 decodes to 8 rows, its footer "
                                          r"says 9: the file is damaged$"):
        documents[0]


def test_a_bad_tokenizer_chat_template_or_reward_fails_in_the_preflight(tmp_path, capsys):
    (tmp_path / "data.jsonl").write_bytes(jsonl_bytes(chat_records()))
    chat = ("dataset_type=chat", f"dataset_path={tmp_path}/data.jsonl")
    (tmp_path / "tokenizer.json").write_bytes(b'{"version": "1.0", "mod')
    got = outcome(*chat, f"tokenizer_path={tmp_path}/tokenizer.json")
    assert isinstance(got, Failed) and got.stage == "preflight", got
    assert got.message.startswith(f"tokenizer_path={tmp_path}/tokenizer.json is not a Hugging Face tokenizer.json: ")
    with pytest.raises(ConfigError, match=r"^chat_template=\S+missing\.jinja: no such file"):  # the config loader's
        outcome(*chat, f"chat_template={tmp_path}/missing.jinja")
    cases = {
        "broken.jinja": (b"{% for m in messages %}{{ m }", r"chat_template: \S+broken\.jinja is not a jinja2 template "
                                                           r"\(TemplateSyntaxError: "),
        "latin.jinja": ("{{ 'caf\u00e9' }}".encode("latin-1"), r"chat_template=\S+latin\.jinja: cannot read it "
                                                                r"\(UnicodeDecodeError: "),
    }
    for name, (content, message) in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        got = outcome(*chat, f"chat_template={tmp_path}/{name}")
        assert isinstance(got, Failed) and got.stage == "preflight" and re.match(message, got.message), got
    (tmp_path / "prompts.jsonl").write_bytes(jsonl_bytes(prompt_records()))
    grpo = ("objective=grpo", "dataset_type=prompts", f"dataset_path={tmp_path}/prompts.jsonl")
    (tmp_path / "reward.py").write_text("def score(p, c, r)\n    return 0\n")
    assert train.main([BASE, "model_name=tiny", *grpo, f"reward={tmp_path}/reward.py:score",
                       f"base_output_directory={tmp_path}/runs"]) == 2  # loaded beside the preflight
    err = capsys.readouterr().err.strip()
    assert err == (f"maxshard: error: reward={tmp_path}/reward.py:score: {tmp_path}/reward.py line 1: SyntaxError: "
                   "expected ':'"), err
    assert not (tmp_path / "runs").exists()  # before the run directory is touched


def test_a_saved_hf_dataset_without_the_column_fails_in_the_preflight(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"body": TEXTS}).save_to_disk(str(tmp_path / "saved"))
    got = outcome("dataset_type=hf", f"dataset_path={tmp_path}/saved")
    assert got == Failed(f"text_field=text: dataset_path={tmp_path}/saved has no such column (columns: body)",
                         "preflight"), got


# --------------------------------------------------------------------------------------------- through the CLI


def cli(tmp_path: Path, capsys, *keys: str) -> tuple[int, str, str]:
    code = train.main([BASE, "model_name=tiny", "steps=1", "cpu_device_count=8", "per_device_batch_size=1",
                       "eval_period=0", f"base_output_directory={tmp_path}", "run_name=run",
                       "enable_checkpointing=false", "enable_tensorboard=false", *keys])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_cli_stops_before_the_model_on_a_missing_path_or_a_corrupt_parquet(tmp_path, capsys):
    code, out, err = cli(tmp_path, capsys, "dataset_type=jsonl", f"dataset_path={tmp_path}/missing.jsonl")
    assert code == 2 and "starting from step 0" not in out, out
    assert err == f"maxshard: error: dataset_path={tmp_path}/missing.jsonl: no such file or directory\n"
    (tmp_path / "cut.parquet").write_bytes(truncated(parquet_bytes(TEXTS)))
    code, out, err = cli(tmp_path, capsys, "dataset_type=parquet", f"dataset_path={tmp_path}/cut.parquet")
    assert code == 2 and "starting from step 0" not in out, out
    assert re.fullmatch(r"maxshard: error: dataset_path: \S+cut\.parquet is not a readable Parquet file "
                        r"\(ArrowInvalid: Parquet magic bytes not found in footer\..*\)\n", err), err


# --------------------------------------------------------------------------------------------- fuzz


FUZZ_CASES = 40  # per format: a few seconds for all of them
# Formats whose bytes are checked (gzip's CRC, zstd's content checksum, Parquet's page CRCs and footer row counts,
# Riegeli's chunk hashes): a mutated file read without a ConfigError must give the original documents, no fewer and
# none changed (a flip in bytes no reader looks at: padding, an unread column, statistics).
CHECKED = ("jsonl.gz", "jsonl.zst", "parquet", "array_record")


def mutated(data: bytes, rng: np.random.Generator) -> bytes:
    """A random truncation, one to three random bit flips, or both."""
    kind = rng.integers(3)
    if kind != 1 and len(data) > 1:
        data = data[: int(rng.integers(1, len(data)))]
    if kind != 0:
        data = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        data = bytes(data)
    return data


@pytest.mark.parametrize("name", list(FORMATS))
def test_fuzzed_files_give_one_line_or_counted_skips_never_anything_else(name, tmp_path):
    """Seeded random truncations and flips of each format: every outcome is a one-line ConfigError (`outcome`
    lets any other exception through, failing the test) or documents and counted BadRecords; where the format checks
    its bytes, documents read are the original ones."""
    fmt = FORMATS[name]
    (tmp_path / "original").mkdir()
    original = run_on(tmp_path / "original", fmt, fmt.data())
    rng = np.random.default_rng([7, len(name)])
    for case in range(FUZZ_CASES):
        where = tmp_path / str(case)
        where.mkdir()
        got = run_on(where, fmt, mutated(fmt.data(), rng))
        if isinstance(got, Read) and name in CHECKED:
            assert got.good == original.good and not got.bad, (case, got)


def test_the_cli_refuses_a_zstd_corpus_cut_in_half_instead_of_training_on_the_half(tmp_path, capsys):
    """A truncated download is not a smaller corpus: one line naming the file, exit 2, no step trained."""
    import zstandard

    whole = zstandard.ZstdCompressor(write_checksum=True).compress(jsonl_bytes([{"text": t} for t in TEXTS * 20]))
    (tmp_path / "cut.jsonl.zst").write_bytes(whole[: len(whole) // 2])
    code, out, err = cli(tmp_path, capsys, "dataset_type=jsonl", f"dataset_path={tmp_path}/cut.jsonl.zst")
    assert code == 2 and "step 1/1" not in out, out
    assert re.fullmatch(r"maxshard: error: dataset_path: cannot read \S+cut\.jsonl\.zst \(EOFError: .*\)\n", err), err
