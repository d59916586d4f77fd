"""A step directory's config item (`maxshard/checkpoint/format.py`): absent, readable and damaged are three answers.

A damaged config item must not pass for a missing one where a check reads it (LoRA's base, `to_hf`, generation):
it is one error line naming the step. Only the elastic resume, which walks back past a damaged step, reads it
leniently.
"""

from __future__ import annotations

import dataclasses

import pytest

from maxshard.checkpoint import format as checkpoint_format
from maxshard.checkpoint.health import Outcome, outcome_of
from maxshard.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class _Saved:
    global_batch_size: int = 16
    lora_rank: int = 4
    load_parameters_path: str = "/base/checkpoints/0"


def _step(tmp_path, with_config: bool = True):
    step = tmp_path / "7"
    (step / checkpoint_format.STATE).mkdir(parents=True)
    if with_config:
        checkpoint_format.write_config(step, _Saved())
    return step


def test_a_readable_config_item_reads_the_same_everywhere(tmp_path) -> None:
    step = _step(tmp_path)
    expected = dataclasses.asdict(_Saved())
    assert checkpoint_format.read_config(step) == expected
    assert checkpoint_format.saved_config(step) == expected
    assert checkpoint_format.read_config_or_none(step) == expected


def test_a_missing_config_item_is_empty_where_optional_and_one_line_where_required(tmp_path) -> None:
    step = _step(tmp_path, with_config=False)
    assert checkpoint_format.saved_config(step) == {} and checkpoint_format.read_config_or_none(step) is None
    with pytest.raises(ConfigError, match=r"is not a maxshard checkpoint step directory \(it needs state/ and config/"):
        checkpoint_format.read_config(step)


def test_a_damaged_config_item_is_one_error_line_not_an_empty_config(tmp_path) -> None:
    step = _step(tmp_path)
    for f in (step / checkpoint_format.CONFIG).rglob("*"):
        if f.is_file():
            f.write_text("{not json")
    assert checkpoint_format.read_config_or_none(step) is None  # the elastic resume walks back past it
    for read in (checkpoint_format.saved_config, checkpoint_format.read_config):
        with pytest.raises(ConfigError) as error:
            read(str(step))
        assert str(error.value).startswith(f"{step}: its config item does not read (") and "\n" not in str(error.value)
        assert outcome_of(error.value) is Outcome.DAMAGED  # a resume sets such a step aside, as any damaged one
