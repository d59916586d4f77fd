"""Writes tests/fixtures/eval/NAME.json: what lm-eval's own Hugging Face backend scores on the example tasks of
configs/eval_tasks/ for the Hugging Face fixtures of tests/fixtures/hf (tools/make_hf_fixtures.py).

Run once, by hand, in the venv that holds torch, transformers and lm-eval (never dependencies of maxshard or its CI):

    /work/refvenv/bin/pip install lm-eval==0.4.13
    /work/refvenv/bin/python tools/make_eval_fixtures.py  # --special-tokens-only: special_tokens.json alone

The models cover the three ways a tokenizer treats BOS, since lm-eval conditions an empty context and the first
rolling window on transformers' `bos_token_id`, else on EOS:

  llama_gqa            its config names <s> as BOS, its template adds none: texts start without BOS, the prefix is <s>.
  mixtral              its config names <s> and its template adds it before every text.
  qwen3, qwen3_moe     Qwen's byte-level BPE: no BOS anywhere; the prefix is EOS.
  qwen3_bos_in_vocab   qwen3's weights with a tokenizer whose config has no BOS (bos_token null) but whose
                       vocabulary holds <s>: qwen3's tokenizer with <|im_start|> (id 1) renamed <s>, written to
                       tests/fixtures/eval/qwen3_bos_in_vocab/ (tokenizer.json, tokenizer_config.json). The prefix is
                       EOS (0), not <s>: a token the vocabulary holds is no BOS unless the config names it.

The backend loads each model in float32 (the fixtures' bfloat16 weights exactly, computed as maxshard computes
on CPU) with `max_length=32`, so the longer rolling documents span several windows and generation left-truncates
as it would at a model's full context; batch size 1. Each file holds, per task, lm-eval's metrics and every
document's `resps` (log-likelihoods and greedy flags, rolling log-likelihoods, or generated text), in document
order, and under "tokenizer" the ids transformers reads (`bos_token_id`, `eos_token_id`) and lm-eval's
`prefix_token_id`.

tests/fixtures/eval/special_tokens.json: how transformers' AutoTokenizer reads the special tokens of a
tokenizer.json with each mix of files beside it (none, tokenizer_config.json with the key absent, null, a string
or a dict, special_tokens_map.json alone or over tokenizer_config.json): per case the files, `bos_token_id`,
`eos_token_id`, `pad_token_id` and `tokenizer(TEXT).input_ids`, which maxshard's tokenizer must read alike.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import tempfile

import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

REPO = pathlib.Path(__file__).resolve().parent.parent
TASKS_DIR = REPO / "configs" / "eval_tasks"
HF = REPO / "tests" / "fixtures" / "hf"
OUT = REPO / "tests" / "fixtures" / "eval"
NAMES = ("llama_gqa", "mixtral", "qwen3", "qwen3_moe", "qwen3_bos_in_vocab")
TASKS = ["local_choice", "local_rolling", "local_generate"]
MAX_LENGTH = 32
WEIGHTS = ("config.json", "generation_config.json", "model.safetensors")  # what qwen3_bos_in_vocab takes from qwen3
TEXT = "the lazy dog"
BACKEND = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend"}
ADDED_EOS = {"__type": "AddedToken", "content": "</s>", "lstrip": False, "normalized": False, "rstrip": False,
             "single_word": False, "special": True}  # the dict spelling older tokenizer_config.json files use
# (case, the fixture whose tokenizer.json it takes, {file name: its JSON}); llama_gqa's has no template, mixtral's
# adds <s>; both vocabularies hold <unk> <s> </s> as ids 0 1 2.
SPECIAL_CASES = [
    ("alone", "llama_gqa", {}),
    ("alone_template_bos", "mixtral", {}),
    ("config_without_bos", "llama_gqa", {"tokenizer_config.json": {**BACKEND, "eos_token": "</s>"}}),
    ("config_without_bos_template_bos", "mixtral", {"tokenizer_config.json": {**BACKEND, "eos_token": "</s>"}}),
    ("config_bos_null", "llama_gqa", {"tokenizer_config.json": {**BACKEND, "bos_token": None, "eos_token": "</s>"}}),
    ("config_bos_dict", "llama_gqa", {"tokenizer_config.json": {**BACKEND, "bos_token": ADDED_EOS,
                                                                "eos_token": "<unk>", "pad_token": "<s>"}}),
    ("map_alone", "llama_gqa", {"special_tokens_map.json": {"bos_token": "</s>", "eos_token": "<unk>"}}),
    ("map_over_config", "llama_gqa", {"special_tokens_map.json": {"bos_token": "</s>", "eos_token": "<unk>"},
                                      "tokenizer_config.json": {**BACKEND, "bos_token": "<s>", "eos_token": "</s>"}}),
    ("map_null_over_config", "mixtral", {"special_tokens_map.json": {"bos_token": None},
                                         "tokenizer_config.json": {**BACKEND, "bos_token": "<s>",
                                                                   "eos_token": "</s>"}}),
]


def bos_in_vocab_tokenizer(directory: pathlib.Path) -> None:
    """qwen3's tokenizer files with <|im_start|> renamed <s> (bos_token stays null in tokenizer_config.json)."""
    tok = json.loads((HF / "qwen3" / "tokenizer.json").read_text())
    (added,) = [t for t in tok["added_tokens"] if t["content"] == "<|im_start|>"]
    added["content"] = "<s>"
    tok["model"]["vocab"]["<s>"] = tok["model"]["vocab"].pop("<|im_start|>")
    named = json.loads((HF / "qwen3" / "tokenizer_config.json").read_text())
    assert named["bos_token"] is None and "<|im_start|>" not in json.dumps(named)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tokenizer.json").write_text(json.dumps(tok, indent=2, ensure_ascii=False) + "\n")
    (directory / "tokenizer_config.json").write_text(json.dumps(named, indent=2) + "\n")


def model_dir(name: str, scratch: pathlib.Path) -> pathlib.Path:
    """The checkpoint directory of `name`: a fixture of tests/fixtures/hf, or qwen3_bos_in_vocab assembled in
    `scratch` from qwen3's weights and its own tokenizer (as tests/test_eval.py assembles it)."""
    if name != "qwen3_bos_in_vocab":
        return HF / name
    for file in WEIGHTS:
        shutil.copyfile(HF / "qwen3" / file, scratch / file)
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(OUT / name / file, scratch / file)
    return scratch


def score(path: pathlib.Path) -> dict:
    model = HFLM(pretrained=str(path), dtype="float32", batch_size=1, max_length=MAX_LENGTH, device="cpu")
    results = lm_eval.simple_evaluate(model=model, tasks=TASKS, task_manager=TaskManager(include_path=str(TASKS_DIR)),
                                      log_samples=True, bootstrap_iters=0)
    out: dict = {"tokenizer": {"bos_token_id": model.tokenizer.bos_token_id,
                               "eos_token_id": model.tokenizer.eos_token_id,
                               "prefix_token_id": model.prefix_token_id}}
    for task in TASKS:
        samples = sorted(results["samples"][task], key=lambda s: s["doc_id"])
        metrics = {k: v for k, v in results["results"][task].items() if k != "alias" and "stderr" not in k}
        out[task] = {"metrics": metrics, "resps": [s["resps"] for s in samples],
                     "filtered_resps": [s["filtered_resps"] for s in samples]}
    return out


def special_tokens() -> list[dict]:
    """Each case of SPECIAL_CASES as transformers' AutoTokenizer reads it."""
    from transformers import AutoTokenizer

    cases = []
    for case, fixture, files in SPECIAL_CASES:
        with tempfile.TemporaryDirectory() as scratch:
            shutil.copyfile(HF / fixture / "tokenizer.json", pathlib.Path(scratch) / "tokenizer.json")
            for file, content in files.items():
                (pathlib.Path(scratch) / file).write_text(json.dumps(content))
            tok = AutoTokenizer.from_pretrained(scratch)
            cases.append({"case": case, "tokenizer": fixture, "files": files, "bos_token_id": tok.bos_token_id,
                          "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                          "input_ids": tok(TEXT).input_ids})
    return cases


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "special_tokens.json").write_text(json.dumps(special_tokens(), indent=1) + "\n")
    if "--special-tokens-only" in sys.argv:
        return
    bos_in_vocab_tokenizer(OUT / "qwen3_bos_in_vocab")
    os.chdir(TASKS_DIR)  # lm_eval reads the tasks' relative data_files from the working directory
    for name in NAMES:
        with tempfile.TemporaryDirectory() as scratch:
            scores = score(model_dir(name, pathlib.Path(scratch)))
        (OUT / f"{name}.json").write_text(json.dumps(scores, indent=1) + "\n")
        print(f"wrote {OUT / name}.json")


if __name__ == "__main__":
    main()
