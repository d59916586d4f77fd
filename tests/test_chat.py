"""Chat data (`dataset_type: chat`): templates rendered as transformers renders them, assistant-only loss weights,
skipped records, mixtures with text, and supervised fine-tuning of an imported model that learns a fixed reply.

The reference renderings and masks in tests/fixtures/chat/expected.json were made once with transformers
(tools/make_chat_fixtures.py); transformers is not needed here.
"""

from __future__ import annotations

import gzip
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from maxshard import config, generate, train
from maxshard.convert import __main__ as convert_cli
from maxshard.data import chat, make_input
from maxshard.data.chat_template import DEFAULT_TEMPLATE
from maxshard.data.sources import BadRecord
from maxshard.data.tokenizer import ByteTokenizer, load_hf_tokenizer
from maxshard.errors import ConfigError
from maxshard.parallel import mesh as mesh_lib
from tests.test_data import BASE, assert_same, take

REPO = Path(__file__).resolve().parent.parent
CHAT = REPO / "tests" / "fixtures" / "chat"
QWEN = REPO / "tests" / "fixtures" / "hf" / "qwen3"
EXPECTED = json.loads((CHAT / "expected.json").read_text())
REPLY = "the lazy dog jumps"


def template(name: str) -> chat.ChatTemplate:
    return chat.ChatTemplate((CHAT / f"{name}.jinja").read_text(), name, EXPECTED["specials"])


def conversation(index: int) -> list[dict[str, str]]:
    return EXPECTED["conversations"][index]


@pytest.mark.parametrize("case", EXPECTED["cases"], ids=lambda c: f"{c['template']}-{c['conversation']}")
def test_renders_as_transformers_apply_chat_template(case):
    """Every fixture template renders each conversation to transformers' text, with and without the generation
    prompt; a conversation the template refuses (raise_exception) is a TemplateError."""
    chosen = template(case["template"])
    if "error" in case:
        with pytest.raises(chat.TemplateError, match="must alternate"):
            chosen.render(conversation(case["conversation"]))
        return
    assert chosen.render(conversation(case["conversation"])) == case["text"]
    assert chosen.render(conversation(case["conversation"]), add_generation_prompt=True) == case["prompt_text"]


@pytest.mark.parametrize("name", ["chatml_generation", "chatml"])
def test_assistant_mask_is_transformers_return_assistant_tokens_mask(name):
    """The ids and the assistant mask equal transformers' (`return_assistant_tokens_mask`, which needs generation
    tags): from the tags themselves, and from prefix renderings of the same template without tags."""
    tokenizer = load_hf_tokenizer(str(QWEN / "tokenizer.json"))
    cases = [c for c in EXPECTED["cases"] if "assistant_mask" in c]
    assert len(cases) == 4 and all(sum(c["assistant_mask"]) for c in cases)
    for case in cases:
        ids, mask = chat.encode_conversation(chat.Conversation(tuple(conversation(case["conversation"]))),
                                             template(name), tokenizer)
        assert ids.tolist() == case["ids"] and mask.tolist() == case["assistant_mask"]


def test_default_template_with_bytes_uses_the_bos_and_eos_ids():
    """The default template's <|bos|>/<|eos|> become the byte tokenizer's ids; only the replies and their EOS weigh."""
    assert (CHAT / "default.jinja").read_text() == DEFAULT_TEMPLATE  # the template transformers rendered
    tok = ByteTokenizer()
    ids, mask = chat.encode_conversation(chat.Conversation(tuple(conversation(1))), chat.load_template("", ""), tok)
    assert ids[0] == tok.bos_id and (ids == tok.eos_id).sum() == 2
    weighted = ids[mask == 1]
    assert tok.decode(weighted.tolist()) == "foursix\nthat is" and (weighted == tok.eos_id).sum() == 2
    assert tok.decode(ids.tolist()).startswith("<|system|>\nBe brief.\n<|user|>\n2+2?\n<|assistant|>\nfour")


def test_unusable_records_are_bad_records_never_errors():
    encoder = chat.ChatEncoder(template("mistral"), load_hf_tokenizer(str(QWEN / "tokenizer.json")), 64)
    refused = encoder(chat.Conversation(tuple(conversation(3))), "line 4")
    assert isinstance(refused, BadRecord) and refused.reason == "template refused it" and "alternate" in refused.where
    too_long = chat.ChatEncoder(encoder.template, encoder.tokenizer, 8)(chat.Conversation(tuple(conversation(0))), "")
    assert isinstance(too_long, BadRecord) and too_long.reason == "longer than max_target_length"
    silent = encoder(chat.Conversation(({"role": "user", "content": "hi"},)), "")
    assert isinstance(silent, BadRecord) and silent.reason == "no assistant turn"
    for value in (None, "not json", [], [{"content": "no role"}], ["text"], 7):
        assert isinstance(chat.as_conversation(value, "x"), BadRecord)
    pair = encoder(chat.Conversation(tuple(conversation(0))), "")
    assert pair["inputs"].shape == pair["targets"].shape == pair[chat.WEIGHT].shape
    copied = pickle.loads(pickle.dumps(encoder))(chat.Conversation(tuple(conversation(0))), "")  # grain workers
    assert all(np.array_equal(pair[k], copied[k]) for k in pair)


def noise_conversations(count: int, seed: int) -> list[dict]:
    """User turns of random letters, the assistant always says REPLY."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnoprstuwy "))
    return [{"messages": [{"role": "user", "content": "".join(rng.choice(letters, rng.integers(8, 24)))},
                          {"role": "assistant", "content": REPLY}]} for _ in range(count)]


def write_jsonl(path: Path, records: list[dict], compress: bool = False) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if compress:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


def test_pipeline_weighs_assistant_tokens_only_and_mixes_with_text(tmp_path):
    """A gzipped chat JSONL mixed with text: chat rows weigh only the reply tokens, conversations are never cut by a
    row's end, text rows weigh every token, bad chat records are counted in data/skipped_records."""
    too_long = {"messages": [{"role": "user", "content": "abc " * 80}, {"role": "assistant", "content": REPLY}]}
    records = noise_conversations(40, seed=0) + [{"messages": "oops"}, {"other": 1}, too_long] * 4
    chats = write_jsonl(tmp_path / "sft.jsonl.gz", records, compress=True)
    (tmp_path / "text.txt").write_text("plain text for pretraining. " * 40)
    cfg = config.load([BASE, "per_device_batch_size=1", "max_target_length=64", "eval_fraction=0",
                       f"tokenizer_path={QWEN / 'tokenizer.json'}", f"chat_template={CHAT / 'chatml.jinja'}",
                       f"dataset_mixture=[[chat:{chats}, 0.5], [{tmp_path / 'text.txt'}, 0.5]]"])
    it = make_input(cfg, mesh_lib.build(cfg))
    tok = load_hf_tokenizer(str(QWEN / "tokenizer.json"))
    im_start, reply = tok.encode("<|im_start|>")[0], tok.encode(REPLY + "<|im_end|>")
    chat_segments = text_tokens = fillers = 0
    for batch in take(it, 6):
        for row in range(batch["inputs"].shape[0]):
            for segment in np.unique(batch["segment_ids"][row][batch["segment_ids"][row] > 0]):
                where = batch["segment_ids"][row] == segment
                inputs, targets = batch["inputs"][row][where], batch["targets"][row][where]
                weights = batch["loss_weights"][row][where]
                if not inputs.any() and not weights.any():
                    fillers += 1  # the padding that ends a row before a conversation that would not fit
                elif im_start in inputs:
                    chat_segments += 1
                    assert inputs[0] == im_start  # whole, from its start
                    assert targets[weights > 0].tolist() == reply
                else:
                    assert weights.all()
                    text_tokens += int(weights.sum())
    assert chat_segments > 10 and text_tokens > 0 and fillers > 0
    stats = it.stats()
    chat_label = next(k for k in stats if k.startswith("data/tokens/0_") and k.endswith("sft.jsonl.gz"))
    assert stats["data/skipped_records"] >= 3 and stats[chat_label] > 0
    state = json.loads(json.dumps(it.get_state()))  # a held conversation and the row's fill resume exactly
    after = take(it, 2)
    resumed = make_input(cfg, mesh_lib.build(cfg))
    resumed.set_state(state)
    assert_same(take(resumed, 2), after)


def test_chat_keys_fail_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="^chat_template=nope.jinja: no such file"):
        config.load([BASE, "dataset_type=chat", "chat_template=nope.jinja"])
    with pytest.raises(ConfigError, match="^messages_field must name"):
        config.load([BASE, "dataset_type=chat", "messages_field="])
    path = write_jsonl(tmp_path / "c.jsonl", noise_conversations(4, seed=1))
    cfg = config.load([BASE, "dataset_type=chat", f"dataset_path={path}", "messages_field=turns",
                       "per_device_batch_size=1", "max_target_length=64"])
    with pytest.raises(ConfigError, match="^messages_field=turns: no record"):
        make_input(cfg, mesh_lib.build(cfg))


def imported_sft_argv(root: Path, run_name: str, *keys: str) -> list[str]:
    """The qwen3 fixture imported under `root` and the command that fine-tunes it on noise prompts with a fixed
    reply (64 conversations, float32), plus `keys` (steps, learning rate, checkpoints, LoRA ...)."""
    assert convert_cli.main(["from_hf", str(QWEN), str(root / "imported")]) == 0
    data = write_jsonl(root / "sft.jsonl", noise_conversations(64, seed=2))
    return [str(root / "imported" / "config.yml"), "dataset_type=chat", f"dataset_path={data}",
            f"chat_template={CHAT / 'chatml.jinja'}", f"base_output_directory={root}", f"run_name={run_name}",
            "log_period=1", "eval_period=0", "max_target_length=64", "per_device_batch_size=2",
            "warmup_steps_fraction=0.1", "enable_tensorboard=false", "eval_fraction=0", "dtype=float32",
            "weight_dtype=float32", *keys]


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """The qwen3 fixture imported, then fine-tuned on noise prompts with a fixed reply: (run dir, metrics)."""
    root = tmp_path_factory.mktemp("sft")
    argv = imported_sft_argv(root, "sft", "steps=30", "learning_rate=1e-2", "checkpoint_period=30")
    assert train.main(argv) == 0
    lines = (root / "sft" / "metrics.jsonl").read_text().splitlines()
    return root, argv, [json.loads(line) for line in lines]


def test_fine_tuning_learns_the_reply_and_not_the_noise(fine_tuned):
    """Acceptance: the loss per assistant token falls near zero, which it could not if the random user tokens were
    in the loss; the startup record names the template and every step records the tokens in its loss."""
    _, _, records = fine_tuned
    startup = records[0]["startup"]
    assert startup["chat_template"]["name"].endswith("chatml.jinja") and len(startup["chat_template"]["sha256"]) == 12
    steps = [r for r in records if "loss" in r and "step" in r]
    reply_tokens = len(load_hf_tokenizer(str(QWEN / "tokenizer.json")).encode(REPLY + "<|im_end|>"))
    rows = 16  # per_device_batch_size=2 x 8 devices; a row holds one to three whole conversations
    assert all(r["tokens"] % reply_tokens == 0 and rows <= r["tokens"] // reply_tokens <= 3 * rows for r in steps)
    assert steps[0]["loss"] > 1.0 and steps[-1]["loss"] < 0.05, [round(r["loss"], 3) for r in steps]


def test_generation_after_the_assistant_prefix_gives_the_reply(fine_tuned, tmp_path):
    """maxshard.generate at temperature 0 continues an unseen noise prompt, rendered up to the assistant prefix,
    with the reply and stops at <|im_end|>."""
    root, argv, _ = fine_tuned
    prompt = template("chatml").render([{"role": "user", "content": "wobbly snarf glim"}], add_generation_prompt=True)
    out = tmp_path / "out.jsonl"
    trained = f"load_parameters_path={root / 'sft' / 'checkpoints' / '30'}"  # not the imported one in config.yml
    assert generate.main([*argv, trained, f"prompt={prompt}", "max_new_tokens=14", "temperature=0",
                          f"generate_output={out}"]) == 0
    row = json.loads(out.read_text())
    assert row["completion"] == REPLY and row["tokens"][-1] == 2  # <|im_end|>, one of the fixture's EOS ids


@pytest.mark.parametrize("source", ["jsonl", "hf"])
def test_unpacked_rows_weigh_the_reply_only(tmp_path, source):
    """packing=false: one conversation per row, padded; the weights are still the reply's tokens alone. From JSONL
    and from a Hugging Face `save_to_disk` directory (its `messages` column: lists of structs)."""
    path = write_jsonl(tmp_path / "c.jsonl", noise_conversations(16, seed=3))
    if source == "hf":
        import datasets

        datasets.Dataset.from_list(noise_conversations(16, seed=3)).save_to_disk(str(tmp_path / "saved"))
        path = tmp_path / "saved"
    cfg = config.load([BASE, "dataset_type=chat", f"dataset_path={path}", "packing=false", "eval_fraction=0",
                       "per_device_batch_size=1", "max_target_length=64", f"tokenizer_path={QWEN / 'tokenizer.json'}",
                       f"chat_template={CHAT / 'chatml.jinja'}"])
    reply = load_hf_tokenizer(str(QWEN / "tokenizer.json")).encode(REPLY + "<|im_end|>")
    batch = take(make_input(cfg, mesh_lib.build(cfg)), 1)[0]
    for targets, weights in zip(batch["targets"], batch["loss_weights"]):
        assert targets[weights > 0].tolist() == reply
