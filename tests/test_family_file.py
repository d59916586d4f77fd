"""A family as data: a YAML row given to `maxshard.convert --family FILE` converts a checkpoint whose architecture
maxshard has no built-in row for, both ways, and every mistake in the file is one line naming its field.

The checkpoint is tests/fixtures/hf/mistral's under a renamed model type (MyMistralForCausalLM, my_mistral): its
tensors, so transformers' logits for them are the reference. The CLI runs in-process (convert's `main`, as
`python -m` calls it); each run's registered row is dropped after the test.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_convert import FIXTURES, TOLERANCE, apply, read_all, start_from_converted

from maxshard.convert import __main__ as cli
from maxshard.convert import families

SOURCE = FIXTURES / "mistral"
ROW = "architecture: MyMistralForCausalLM\nmodel_type: my_mistral\nlike: MistralForCausalLM\n"


@pytest.fixture(autouse=True)
def _no_rows_left(monkeypatch):
    """Each test registers into a registry of its own."""
    monkeypatch.setattr(families, "_REGISTERED", [])


def _renamed(tmp_path: Path) -> Path:
    directory = tmp_path / "my_mistral"
    shutil.copytree(SOURCE, directory)
    cfg = json.loads((directory / "config.json").read_text())
    cfg |= {"architectures": ["MyMistralForCausalLM"], "model_type": "my_mistral"}
    (directory / "config.json").write_text(json.dumps(cfg))
    return directory


def _family_file(tmp_path: Path, text: str = ROW) -> Path:
    path = tmp_path / "family.yml"
    path.write_text(text)
    return path


def _one_line_error(capsys, argv: list[str]) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("maxshard: error: ") and err.count("\n") == 1, err
    return err


def test_a_renamed_family_converts_from_its_file_with_transformers_logits_and_back_bit_for_bit(tmp_path, capsys):
    source, row = _renamed(tmp_path), _family_file(tmp_path)
    assert "is not supported" in _one_line_error(capsys, ["from_hf", str(source), str(tmp_path / "refused")])
    out = tmp_path / "converted"
    assert cli.main(["from_hf", str(source), str(out), "--family", str(row)]) == 0
    trainer, state = start_from_converted(out, tmp_path / "run", "remat_policy=full")
    tokens, want = np.load(SOURCE / "tokens.npy"), np.load(SOURCE / "logits.npy")
    np.testing.assert_allclose(apply(trainer, state.params, tokens), want, rtol=0, atol=TOLERANCE)
    back = tmp_path / "hf"
    assert cli.main(["to_hf", str(out / "checkpoints" / "0"), str(back), "--family", str(row)]) == 0
    exported = json.loads((back / "config.json").read_text())
    assert (exported["architectures"], exported["model_type"]) == (["MyMistralForCausalLM"], "my_mistral")
    original, again = read_all(SOURCE), read_all(back)
    assert sorted(again) == sorted(original)
    assert all(again[name].tobytes() == array.tobytes() for name, array in original.items())


@pytest.mark.parametrize("text, says", [
    (ROW + "qk_norms: true\n", "unknown field 'qk_norms'"),
    (ROW + "qk_norm: yes please\n", "qk_norm='yes please' must be like False"),
    (ROW + "fields: {rope_thing: no_such_key}\n", "fields.rope_thing names 'no_such_key', which is not a maxshard"),
    (ROW + "carries: [emb_dim]\n", "carries[0]='emb_dim' is not a layer option"),
    (ROW.replace("MistralForCausalLM\n", "MistralLMHead\n"), "like='MistralLMHead' is not a family row"),
    ("architecture: MistralForCausalLM\nmodel_type: other\n", "architecture='MistralForCausalLM' is already a row"),
    ("model_type: my_mistral\n", "architecture is required"),
    ("- a list\n", "a family file is a mapping"),
])
def test_a_mistake_in_the_file_is_one_line_naming_it(tmp_path, capsys, text, says):
    err = _one_line_error(capsys, ["from_hf", str(_renamed(tmp_path)), str(tmp_path / "out"), "--family",
                                   str(_family_file(tmp_path, text))])
    assert says in err, err


def test_a_tensor_the_row_does_not_map_is_one_line(tmp_path, capsys):
    source = _renamed(tmp_path)
    tensors = load_file(source / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.o_proj.bias": np.zeros(32, np.float32)},
              source / "model.safetensors", metadata={"format": "pt"})
    err = _one_line_error(capsys, ["from_hf", str(source), str(tmp_path / "out"), "--family",
                                   str(_family_file(tmp_path))])
    assert "model.layers.0.self_attn.o_proj.bias has no place" in err, err
