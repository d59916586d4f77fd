"""Config loading: base.yml agrees with the schema, overrides are typed, a mistake is one ConfigError naming the key.

The CLI tests at the end run `python -m maxshard.train` in a subprocess: a user mistake is exactly one line on stderr
and exit code 2, whether it is found while parsing, while building the mesh or while laying out the parameters.
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from maxshard import config
from maxshard.config import Config
from maxshard.config import schema as config_schema
from maxshard.errors import ConfigError
from maxshard.model import transformer as model
from maxshard.run import loading
import cli_processes

REPO = Path(__file__).resolve().parent.parent
BASE = str(REPO / "configs" / "base.yml")
DEFAULT_ONLY_IN_YAML = {"logical_axis_rules"}  # the rules table is data: its default lives only in base.yml


def load(*overrides: str, path: str = BASE, num_devices: int = 8) -> Config:
    return config.load([path, *overrides], num_devices=num_devices)


def load_error(*overrides: str, path: str = BASE, num_devices: int = 8) -> str:
    with pytest.raises(ConfigError) as info:
        load(*overrides, path=path, num_devices=num_devices)
    message = str(info.value)
    assert "\n" not in message
    return message


def write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


# --------------------------------------------------------------------------------------------- base.yml vs schema


def _base_lines() -> dict[str, tuple[int, str]]:
    """{top-level key: (line index, line)} of base.yml."""
    lines = Path(BASE).read_text(encoding="utf-8").splitlines()
    return {m.group(1): (i, line) for i, line in enumerate(lines) if (m := re.match(r"^(\w+):", line))}


def test_base_yml_has_every_user_key_and_nothing_else() -> None:
    assert set(_base_lines()) == set(config.user_keys())


def test_every_key_in_base_yml_has_a_trailing_comment() -> None:
    lines = Path(BASE).read_text(encoding="utf-8").splitlines()
    for key, (i, line) in _base_lines().items():
        if key in DEFAULT_ONLY_IN_YAML:  # a block value: its comment is the paragraph just above it
            assert lines[i - 1].startswith("#"), key
            continue
        assert re.match(rf"^{key}:\s*\S.*?\s#\s*\S", line), f"base.yml: {key} has no trailing '# comment'"


@pytest.mark.parametrize("key", ["attention", "remat_policy", "dataset_type"])
def test_base_yml_comment_names_every_value_of_a_tabled_key(key: str) -> None:
    """Keys whose values are the rows of one table (spec/attention_kinds.py, spec/remat.py, dataset_types.py): the
    schema reads the table, and the one-line comment a user reads in base.yml names every value."""
    values = typing.get_args(typing.get_type_hints(Config)[key])
    comment = _base_lines()[key][1].split("#", 1)[1]
    assert [v for v in values if not re.search(rf"(?<![\w.]){re.escape(v)}(?!\w)", comment)] == []


def test_base_yml_values_equal_the_schema_defaults() -> None:
    cfg = config.parse([BASE])
    defaults = Config()
    for key in config.user_keys():
        if key in DEFAULT_ONLY_IN_YAML:
            continue
        assert getattr(cfg, key) == getattr(defaults, key), key
        assert type(getattr(cfg, key)) is type(getattr(defaults, key)), key


def test_logical_axis_rules_default_lives_only_in_base_yml() -> None:
    assert Config().logical_axis_rules == ()
    rules = config.parse([BASE]).logical_axis_rules
    assert ("embed", ("fsdp", "fsdp_transpose", "sequence", "context", "expert")) in rules
    assert ("norm", ()) in rules  # null -> replicated


def test_derived_fields_are_not_user_keys() -> None:
    derived = {f.name for f in dataclasses.fields(Config) if f.metadata.get("derived")}
    assert {"num_devices", "global_batch_size", "run_dir"} <= derived
    assert not derived & set(config.user_keys())


def test_config_is_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        load().steps = 1  # type: ignore[misc]


# --------------------------------------------------------------------------------------------- overrides


def test_overrides_are_coerced_to_the_declared_types() -> None:
    cfg = load("steps=4", "learning_rate=1e-3", "packing=false", "run_name=007", "per_device_batch_size=4",
               "dtype=bfloat16", "eval_period=2.0")
    assert (cfg.steps, type(cfg.steps)) == (4, int)
    assert (cfg.learning_rate, type(cfg.learning_rate)) == (1e-3, float)
    assert cfg.packing is False
    assert cfg.run_name == "007"  # str keys keep the text as typed
    assert (cfg.per_device_batch_size, type(cfg.per_device_batch_size)) == (4.0, float)
    assert cfg.dtype == "bfloat16"
    assert (cfg.eval_period, type(cfg.eval_period)) == (2, int)
    assert cfg.explicit_keys == tuple(sorted(["steps", "learning_rate", "packing", "run_name",
                                              "per_device_batch_size", "dtype", "eval_period"]))


def test_text_choice_keeps_the_empty_string() -> None:
    assert load("profiler=").profiler == ""
    assert load("profiler=xplane").profiler == "xplane"


def test_finalize_derives_batch_schedule_and_directories() -> None:
    cfg = load("per_device_batch_size=0.5", "steps=200", "warmup_steps_fraction=0.1", "run_name=r")
    assert (cfg.num_devices, cfg.global_batch_size) == (8, 4)
    assert (cfg.schedule_steps, cfg.warmup_steps) == (200, 20)
    assert cfg.run_dir == os.path.join(os.getcwd(), "runs", "r")  # base_output_directory: runs, made absolute
    assert cfg.checkpoint_dir == os.path.join(os.getcwd(), "runs", "r", "checkpoints")


@pytest.mark.parametrize("key", config_schema.path_keys())
def test_every_path_key_resolves_a_relative_path_against_the_working_directory(key, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert set(config_schema.path_keys()) >= {"base_output_directory", "dataset_path", "tokenizer_path",
                                                "load_parameters_path", "load_full_state_path"}
    relative = config.finalize(config.parse([BASE, f"{key}=some/dir"]), 8)
    assert getattr(relative, key) == str(tmp_path / "some" / "dir")
    remote = config.finalize(config.parse([BASE, f"{key}=gs://bucket/dir"]), 8)
    assert getattr(remote, key) == "gs://bucket/dir"  # URLs untouched
    if key == "base_output_directory":
        assert remote.run_dir == "gs://bucket/dir/default"
        assert relative.checkpoint_dir == str(tmp_path / "some" / "dir" / "default" / "checkpoints")


@pytest.mark.parametrize(
    ("tokens", "fragment"),
    [
        (["ici_fsdp_parallelizm=2"], "did you mean ici_fsdp_parallelism"),
        (["steps=abc"], "steps expects int, got 'abc'"),
        (["steps=4.5"], "steps expects int"),
        (["packing=1"], "packing expects bool"),
        (["learning_rate=fast"], "learning_rate expects float"),
        (["dtype=bf16"], "dtype expects one of 'auto', 'float32', 'bfloat16', 'float16'"),
        (["dataset_type=csv"], "dataset_type expects one of"),
        (["steps=3", "steps=4"], "steps is given twice"),
        (["num_devices=4"], "num_devices is derived and cannot be set"),
        (["global_batch_size=4"], "global_batch_size is derived"),
        (["steps"], "expected key=value"),
        (["steps=0"], "steps must be >= 1"),
        (["learning_rate=nan"], "learning_rate must be a finite number"),
        (["norm_epsilon=.inf"], "norm_epsilon must be a finite number"),
        (["steps=" + "9" * 30], "steps must fit in a signed 64-bit integer"),
        (["ici_fsdp_parallelism=0"], "ici_fsdp_parallelism must be a positive size or -1"),
        (["warmup_steps_fraction=2"], "warmup_steps_fraction must be in [0, 1]"),
        (["run_name=a/b"], "run_name must be a non-empty name"),
        (["per_device_batch_size=0.1"], "per_device_batch_size=0.1 x 8 devices"),
        (["per_device_batch_size=1e308"], "is not a whole global batch"),
        (["model_name=nope"], "model_name='nope' has no preset; available: "),
        (["logical_axis_rules=[[embed, [fsdp, fsdp]]]"], "rule 'embed' uses mesh axis 'fsdp' twice"),
        (["logical_axis_rules=[[embed, fsdp2]]"], "names unknown mesh axis 'fsdp2'"),
        (["logical_axis_rules=[embed]"], "logical_axis_rules (from command line): rule 0 must be"),
        (["mesh_rules=[[cpu, {model_name: tiny}]]"], "cannot set 'model_name'"),
        (["mesh_rules=[['(', {steps: 1}]]"], "invalid regex"),
        (["mesh_rules=[[cpu, {steps: x}]]"], "steps expects int"),
    ],
)
def test_mistakes_are_config_errors_that_name_the_key(tokens: list[str], fragment: str) -> None:
    assert fragment in load_error(*tokens)


def test_unknown_model_lists_the_presets() -> None:
    available = load_error("model_name=nope").split("available: ")[1].split(", ")
    assert {"tiny", "125m", "1b", "8b"} <= set(available) and available == sorted(available)


def test_unknown_key_without_a_close_match_points_to_base_yml() -> None:
    assert "see configs/base.yml for every key" in load_error("zzzzzz=1")


def test_missing_file_and_usage() -> None:
    assert "config file not found: /nonexistent.yml" in load_error(path="/nonexistent.yml")
    with pytest.raises(ConfigError, match="usage"):
        config.load([], num_devices=8)


# --------------------------------------------------------------------------------------------- YAML files


def test_base_config_chain_root_first_then_command_line(tmp_path: Path) -> None:
    write(tmp_path / "root.yml", f"base_config: {BASE}\nsteps: 10\nseed: 1\nrun_name: root\n")
    write(tmp_path / "sub" / "mid.yml", "base_config: ../root.yml\nsteps: 20\n")
    leaf = write(tmp_path / "sub" / "leaf.yml", "base_config: mid.yml\nlearning_rate: 1e-3\n")
    cfg = load("seed=5", path=leaf)
    assert (cfg.steps, cfg.seed, cfg.run_name, cfg.learning_rate) == (20, 5, "root", 1e-3)
    assert cfg.log_period == Config().log_period  # untouched keys come from base.yml
    assert cfg.explicit_keys == ("seed",)  # file values are not "explicit": mesh rules may still set them


def test_base_config_cycle_and_bad_values(tmp_path: Path) -> None:
    a = write(tmp_path / "a.yml", "base_config: b.yml\n")
    write(tmp_path / "b.yml", "base_config: a.yml\n")
    assert "base_config cycle" in load_error(path=a)
    bad = write(tmp_path / "bad.yml", "base_config: [x]\n")
    assert "base_config in" in load_error(path=bad)


def test_unknown_key_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yml", f"base_config: {BASE}\nlearning_rat: 0.1\n")
    message = load_error(path=path)
    assert "'learning_rat'" in message and path in message and "did you mean learning_rate" in message


def test_invalid_yaml_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path / "broken.yml", "steps: 3\nseed: [1, 2\n")
    message = load_error(path=path)
    assert message.startswith(f"invalid YAML in {path} line ")
    not_a_mapping = write(tmp_path / "list.yml", "- 1\n- 2\n")
    assert "must hold a mapping" in load_error(path=not_a_mapping)


def test_wrong_type_in_a_file_names_key_and_file(tmp_path: Path) -> None:
    path = write(tmp_path / "t.yml", f"base_config: {BASE}\nscan_layers: maybe\n")
    message = load_error(path=path)
    assert "scan_layers expects bool, got 'maybe'" in message and path in message


# --------------------------------------------------------------------------------------------- model presets

TINY = yaml.safe_load((REPO / "configs" / "models" / "tiny.yml").read_text(encoding="utf-8"))


def test_model_name_merges_the_preset() -> None:
    cfg = load("model_name=tiny")
    for key, value in TINY.items():
        assert getattr(cfg, key) == value, key
    assert cfg.emb_dim != Config().emb_dim  # the preset really changed something


def test_model_preset_found_beside_a_file_of_the_chain(tmp_path: Path) -> None:
    write(tmp_path / "models" / "mine.yml", "emb_dim: 32\nnum_layers: 1\n")
    own = write(tmp_path / "own.yml", f"base_config: {BASE}\nmodel_name: mine\n")
    assert (load(path=own).emb_dim, load(path=own).num_layers) == (32, 1)
    uses_tiny = write(tmp_path / "t.yml", f"base_config: {BASE}\nmodel_name: tiny\n")
    assert load(path=uses_tiny).emb_dim == TINY["emb_dim"]  # configs/models/ beside base.yml


def test_model_preset_and_command_line_conflict() -> None:
    message = load_error("model_name=tiny", "emb_dim=128")
    assert message.startswith("emb_dim is set by model preset") and "override_model_config=true" in message
    assert load("model_name=tiny", "emb_dim=64").emb_dim == 64  # the same value is no conflict
    assert load("model_name=tiny", "emb_dim=128", "override_model_config=true").emb_dim == 128
    assert load("model_name=tiny", "steps=7").steps == 7  # keys the preset does not set are free


def test_model_preset_with_an_unknown_key(tmp_path: Path) -> None:
    write(tmp_path / "models" / "typo.yml", "emb_dims: 32\n")
    path = write(tmp_path / "c.yml", f"base_config: {BASE}\nmodel_name: typo\n")
    message = load_error(path=path)
    assert "'emb_dims'" in message and "typo.yml" in message


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [("tiny", 1.5e5, 2.5e5), ("125m", 1.1e8, 1.7e8), ("1b", 0.9e9, 1.3e9), ("8b", 7.9e9, 8.1e9),
     ("70b", 7.0e10, 7.1e10)],
)
def test_model_presets_load_with_the_expected_size(name: str, low: float, high: float) -> None:
    cfg = loading.complete(load(f"model_name={name}"))
    assert cfg.model_name == name
    assert low <= model.param_count(cfg.model) <= high  # eval_shape only: nothing is allocated, even for 8B


@pytest.mark.parametrize("name", ["tiny", "125m", "1b", "8b", "70b"])
def test_dense_presets_hold_only_model_keys(name: str) -> None:
    model_keys = {"emb_dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "max_target_length",
                  "vocab_size", "logits_via_embedding", "rope_max_timescale", "norm_epsilon"}
    keys = set(yaml.safe_load((REPO / "configs" / "models" / f"{name}.yml").read_text(encoding="utf-8")))
    assert keys <= model_keys, keys - model_keys


# --------------------------------------------------------------------------------------------- mesh_rules

MESH_RULES = "mesh_rules=[['cpu-8', {ici_tensor_parallelism: 2}], ['^tpu', {ici_tensor_parallelism: 4, steps: 5}]]"


def test_mesh_rule_selected_by_detected_hardware() -> None:
    cfg = load(MESH_RULES)
    assert (cfg.ici_tensor_parallelism, cfg.mesh_rule_applied) == (2, "cpu-8")
    other = load(MESH_RULES, num_devices=4)  # "cpu-4" matches no rule
    assert (other.ici_tensor_parallelism, other.mesh_rule_applied) == (1, "")


def test_mesh_rule_selected_by_mesh_selector() -> None:
    cfg = load(MESH_RULES, "mesh_selector=tpu-v5p")
    assert (cfg.ici_tensor_parallelism, cfg.steps, cfg.mesh_rule_applied) == (4, 5, "^tpu")


def test_command_line_wins_over_the_mesh_rule() -> None:
    cfg = load(MESH_RULES, "mesh_selector=tpu-v5p", "ici_tensor_parallelism=8")
    assert (cfg.ici_tensor_parallelism, cfg.steps) == (8, 5)


def test_mesh_rule_from_a_file_overrides_file_values(tmp_path: Path) -> None:
    path = write(tmp_path / "r.yml", f"base_config: {BASE}\nsteps: 9\nmesh_rules: [['cpu', {{steps: 3}}]]\n")
    assert load(path=path).steps == 3
    assert load("steps=9", path=path).steps == 9


# --------------------------------------------------------------------------------------------- property

_VALUES = st.one_of(
    st.text(max_size=12),
    st.integers().map(str),
    st.floats().map(repr),
    st.sampled_from(["-1", "0", "1", "8", "1e-3", "true", "null", "~", "[1, 2]", "{a: 1}", "[[embed, fsdp]]",
                     "[[cpu, {steps: 2}]]", "'x'", ".nan", "-.inf", "1e400", "9" * 30, "2020-01-01", "tiny", "8b",
                     "[", "a: b: c", "&a [*a]"]),
)
_TOKENS = st.one_of(
    st.builds(lambda key, value: f"{key}={value}", st.sampled_from(config.user_keys()), _VALUES),
    st.text(max_size=20),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_TOKENS, max_size=3))
def test_any_override_loads_or_raises_config_error(tokens: list[str]) -> None:
    try:
        cfg = config.load([BASE, *tokens], num_devices=8)
    except ConfigError as e:
        assert str(e)
    else:
        assert cfg.num_devices == 8 and cfg.global_batch_size >= 1
        for key, hint in typing.get_type_hints(Config).items():
            if hint in (int, float, bool, str):
                assert type(getattr(cfg, key)) is hint, key


# --------------------------------------------------------------------------------------------- the CLI


def run_train(*overrides: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, "-m", "maxshard.train", BASE, "cpu_device_count=8", "dataset_type=synthetic", *overrides]
    return cli_processes.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=REPO)


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        (["ici_fsdp_parallelism=3"], "ici parallelism product 3 (ici_fsdp_parallelism=3) does not equal 8 devices"),
        (["ici_fsdp_parallelizm=2"], "unknown key 'ici_fsdp_parallelizm'"),
        (["steps=many"], "steps expects int"),
        (["logical_axis_rules=[[embed,[fsdp,fsdp]]]"], "uses mesh axis 'fsdp' twice"),
        (["ici_tensor_parallelism=8", "num_heads=4", "num_kv_heads=4", "ici_fsdp_parallelism=1"],
         "of size 4 is not divisible by 8"),
    ],
)
def test_cli_mistake_is_one_line_and_exit_code_2(overrides: list[str], fragment: str) -> None:
    result = run_train(*overrides)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("maxshard: error: ") and fragment in lines[0]
    assert "Traceback" not in result.stderr + result.stdout
