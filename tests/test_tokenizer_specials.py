"""A Hugging Face tokenizer's special tokens as transformers reads them: tests/fixtures/eval/special_tokens.json holds
what AutoTokenizer (transformers 5.24) made of one tokenizer.json with each mix of files beside it
(tools/make_eval_fixtures.py); maxshard's tokenizer must read the same BOS, EOS and PAD, and start texts alike."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from maxshard.data.tokenizer import load_hf_tokenizer
from maxshard.errors import ConfigError

FIXTURES = Path(__file__).resolve().parent / "fixtures"
CASES = json.loads((FIXTURES / "eval" / "special_tokens.json").read_text())
TEXT = "the lazy dog"  # the text the fixture's input_ids encode


def _tokenizer_dir(tmp_path: Path, fixture: str, files: dict[str, dict]) -> str:
    shutil.copyfile(FIXTURES / "hf" / fixture / "tokenizer.json", tmp_path / "tokenizer.json")
    for name, content in files.items():
        (tmp_path / name).write_text(json.dumps(content))
    return str(tmp_path / "tokenizer.json")


@pytest.mark.parametrize("case", CASES, ids=[c["case"] for c in CASES])
def test_specials_are_transformers(tmp_path, case):
    """BOS and PAD exactly as transformers has them (PAD 0 where it has none: padding carries no loss), EOS too
    where a file names one (maxshard needs an EOS, so a bare tokenizer.json's is its well-known </s>); a prompt
    encodes as tokenizer(text), and start_id is what the template puts before it."""
    tok = load_hf_tokenizer(_tokenizer_dir(tmp_path, case["tokenizer"], case["files"]))
    assert tok.bos_id == case["bos_token_id"]
    assert tok.eos_id == (case["eos_token_id"] if case["eos_token_id"] is not None else 2)
    assert tok.pad_id == (case["pad_token_id"] if case["pad_token_id"] is not None else 0)
    ids = case["input_ids"]
    assert tok.encode_prompt(TEXT) == ids
    start = [] if tok.start_id is None else [tok.start_id]
    assert start == ids[: len(ids) - len(tok.encode(TEXT))] and start + tok.encode(TEXT) == ids


def test_a_named_token_the_vocabulary_lacks_is_refused(tmp_path):
    path = _tokenizer_dir(tmp_path, "llama_gqa", {"tokenizer_config.json": {"bos_token": "<|begin_of_text|>",
                                                                             "eos_token": "</s>"}})
    with pytest.raises(ConfigError, match=r"tokenizer_path=.*tokenizer\.json: its config names bos_token "
                                          r"'<\|begin_of_text\|>', which tokenizer\.json's vocabulary does not hold"):
        load_hf_tokenizer(path)
