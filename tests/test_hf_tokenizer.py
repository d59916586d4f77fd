"""tokenizer_path = a Hugging Face tokenizer.json: same surface as the other tokenizers, in the input pipeline too."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from maxshard import config
from maxshard.data import make_input
from maxshard.data.tokenizer import (ByteTokenizer, HuggingFaceTokenizer, load_hf_tokenizer, make_tokenizer,
                                     resolve_vocab)
from maxshard.errors import ConfigError
from maxshard.parallel import mesh

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "tests" / "fixtures" / "hf" / "llama_gqa" / "tokenizer.json"
TEXT = "the quick brown llama reads sharded arrays"


def cfg_with(*overrides: str) -> config.Config:
    return config.load([str(REPO / "configs" / "base.yml"), "per_device_batch_size=1", "max_target_length=16",
                        *overrides])


def test_ids_round_trip_and_specials_from_tokenizer_config():
    tok = load_hf_tokenizer(str(TOKENIZER))
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 128)  # <unk> doubles as pad
    assert tok.start_id is None  # its tokenizer.json has no template: texts start without BOS
    ids = tok.encode(TEXT)
    assert tok.bos_id not in ids and tok.eos_id not in ids  # the pipeline adds EOS (and BOS) itself, once
    assert tok.encode_prompt(TEXT) == ids
    assert tok.decode(ids) == TEXT and tok.decode([tok.bos_id, *ids, tok.eos_id]) == TEXT
    assert tok.encode_array(TEXT).dtype == np.int32 and tok.encode_array(TEXT).tolist() == ids
    copy = pickle.loads(pickle.dumps(tok))  # grain workers get their own copy
    assert copy.encode(TEXT) == ids and copy.fingerprint() == tok.fingerprint()
    assert tok.fingerprint().startswith("hf-tokenizers:") and tok.fingerprint() != ByteTokenizer().fingerprint()


def test_without_tokenizer_config_only_the_eos_falls_back_to_known_names(tmp_path):
    shutil.copyfile(TOKENIZER, tmp_path / "tokenizer.json")  # no tokenizer_config.json beside it
    tok = load_hf_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id) == (None, 2)  # "</s>"; its "<s>" is named by no file, so no BOS
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": {"content": "</s>"}, "eos_token": "<unk>"}')
    tok = load_hf_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id) == (2, 0)  # the config wins, in either spelling


def test_make_tokenizer_and_vocab_and_errors(tmp_path):
    cfg = cfg_with(f"tokenizer_path={TOKENIZER}")
    assert isinstance(make_tokenizer(cfg), HuggingFaceTokenizer)
    assert resolve_vocab(cfg).vocab_size == 128
    with pytest.raises(ConfigError, match="tokenizer.json: no such file"):
        make_tokenizer(cfg_with(f"tokenizer_path={tmp_path}/tokenizer.json"))
    (tmp_path / "bad.json").write_text('{"not": "a tokenizer"}')
    with pytest.raises(ConfigError, match=r"bad\.json is not a Hugging Face tokenizer\.json"):
        make_tokenizer(cfg_with(f"tokenizer_path={tmp_path}/bad.json"))


@pytest.mark.parametrize(("fixture", "starts_with_bos"), [("llama_gqa", False), ("mixtral", True)])
def test_input_pipeline_reads_text_with_it(tmp_path, fixture, starts_with_bos):
    """Documents start with BOS exactly when the tokenizer's template adds one; EOS always ends them."""
    (tmp_path / "a.txt").write_text(TEXT + "\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("a tiny book about rotary embeddings\n", encoding="utf-8")
    tokenizer = TOKENIZER.parent.parent / fixture / "tokenizer.json"
    cfg = resolve_vocab(cfg_with(f"tokenizer_path={tokenizer}", f"dataset_path={tmp_path}/*.txt",
                                 "eval_fraction=0.0"))
    batch = {k: np.asarray(v) for k, v in next(make_input(cfg, mesh.build(cfg))).items()}
    real = batch["segment_ids"] > 0
    inputs, targets = batch["inputs"][real], batch["targets"][real]
    assert inputs.max() < 128 and (targets == 2).any()  # the model's own ids; EOS ends documents
    assert (inputs == 1).any() == starts_with_bos


def _beside(tmp_path: Path, fixture: str, **files: str) -> str:
    """A copy of a fixture's tokenizer.json and tokenizer_config.json with `files` (name_json=text) beside it."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(TOKENIZER.parent.parent / fixture / name, tmp_path / name)
    for name, text in files.items():
        (tmp_path / name.replace("_json", ".json")).write_text(text)
    return str(tmp_path / "tokenizer.json")


def test_generation_also_stops_at_the_tokenizers_eos(tmp_path):
    """generation_config.json naming only other ids (an instruct model's end of turn) still stops at the EOS every
    fine-tuning document ends with; its own ids keep their order."""
    tok = load_hf_tokenizer(_beside(tmp_path, "mixtral", generation_config_json='{"eos_token_id": [7, 5]}'))
    assert tok.eos_id == 2 and tok.stop_ids == (7, 5, 2)
    tok = load_hf_tokenizer(_beside(tmp_path, "mixtral", generation_config_json='{"eos_token_id": [2, 7]}'))
    assert tok.stop_ids == (2, 7)
    eight = json.dumps({"eos_token_id": [*range(3, 11)]})
    with pytest.raises(ConfigError, match=r"generation_config\.json lists 9 EOS ids .* up to 8$"):
        load_hf_tokenizer(_beside(tmp_path, "mixtral", generation_config_json=eight))


@pytest.mark.parametrize(("fixture", "flags", "error"), [
    ("mixtral", '{"add_bos_token": true, "add_eos_token": false}', None),
    ("qwen3", '{"add_bos_token": false}', None),
    ("mixtral", '{"add_bos_token": false}', "add_bos_token=false but the template of tokenizer.json adds BOS"),
    ("llama_gqa", '{"add_bos_token": true}', "add_bos_token=true but the template of tokenizer.json adds no BOS"),
    ("mixtral", '{"add_eos_token": true}', "add_eos_token=true but the template of tokenizer.json adds no EOS"),
])
def test_add_bos_and_eos_token_must_agree_with_the_template(tmp_path, fixture, flags, error):
    """transformers' Llama-style tokenizers rebuild the template from add_bos_token/add_eos_token: where they
    disagree with tokenizer.json's template, what transformers encodes depends on the class, so it is refused."""
    path = _beside(tmp_path, fixture)
    named = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**named, **json.loads(flags)}))
    if error is None:
        load_hf_tokenizer(path)
        return
    with pytest.raises(ConfigError, match=error):
        load_hf_tokenizer(path)


def test_a_template_that_changes_the_texts_tokens_is_refused(tmp_path):
    """Where the plain encoding is not inside the templated one, BOS cannot be told: refused, not guessed."""

    class Changing:  # encodes "a" as [5] alone but [1, 6] with special tokens
        def encode(self, text, add_special_tokens):
            return SimpleNamespace(ids=[1, 6] if add_special_tokens else [5])

        def token_to_id(self, token):
            return {"</s>": 2}.get(token)

    with pytest.raises(ConfigError, match=r"the template of tokenizer\.json changes a text's tokens"):
        HuggingFaceTokenizer(Changing(), str(tmp_path / "tokenizer.json"), {"eos_token": "</s>"}, {})
