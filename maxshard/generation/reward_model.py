"""GRPO rewarded by a trained reward model: `reward=model:STEP_DIR`.

STEP_DIR is a checkpoint step of a reward model (a model with a score head, `score_head`, trained with
objective=reward_model, or converted from a Hugging Face `*ForSequenceClassification`). Its saved config gives its
network and tokenizer; its parameters are restored onto the policy's mesh. A completion's reward is the score at its
last token of `[BOS] prompt completion`, tokenized by the reward model's own tokenizer: the position whose score the
reward model was trained on (objectives/reward.py). All completions of a rollout are scored in one call.

`check` runs before anything trains: a path that is not a step, or a step without a score head, is one line naming
`reward`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxshard import rewards
from maxshard.checkpoint import format as checkpoint_format
from maxshard.config import Config
from maxshard.data.prompts import Prompt
from maxshard.data.tokenizer import make_tokenizer
from maxshard.errors import ConfigError
from maxshard.generation import inference
from maxshard.model.transformer import Transformer
from maxshard.parallel import sharding
from maxshard.training.step import mesh_context

__all__ = ["PREFIX", "is_model_reward", "check", "ModelReward"]

PREFIX = rewards.MODEL_PREFIX


def is_model_reward(cfg: Config) -> bool:
    return cfg.reward.startswith(PREFIX)


def check(cfg: Config) -> dict[str, Any]:
    """The reward model's saved config; one ConfigError line when `reward` names no reward model's step."""
    step_dir = cfg.reward[len(PREFIX):]
    try:
        saved = checkpoint_format.read_config(step_dir)
    except ConfigError as e:
        raise ConfigError(f"reward={cfg.reward}: {e}") from None
    if not saved.get("score_head"):
        raise ConfigError(f"reward={cfg.reward}: that step's model has no score head (score_head=false): a reward "
                          "model is trained with objective=reward_model score_head=true")
    return saved


@dataclasses.dataclass
class ModelReward:
    """The scores of a reward model's step (module docstring), restored on `mesh`."""

    cfg: Config
    mesh: jax.sharding.Mesh
    rules: sharding.FlaxRules

    def __post_init__(self) -> None:
        self.step_dir = self.cfg.reward[len(PREFIX):]
        self.name = f"reward={self.cfg.reward}"
        self.model_cfg = model_cfg = inference.with_saved_model(self.cfg, check(self.cfg), command_line_wins=False)
        self.length = model_cfg.max_target_length
        self.tokenizer = make_tokenizer(model_cfg)
        self.params = inference.restore_params(self.step_dir, model_cfg, self.mesh, self.rules)
        model = Transformer(dataclasses.replace(model_cfg.model, pipeline=None))

        def scores(params: Any, inputs: jax.Array, segments: jax.Array, positions: jax.Array) -> jax.Array:
            hidden = model.apply({"params": params}, inputs, segments, positions, method="hidden")
            return model.apply({"params": params}, hidden, method="scores")

        self._scores = jax.jit(scores)

    def _ids(self, prompt: Prompt, completion: str) -> np.ndarray:
        """[BOS] prompt completion in the reward model's tokens, its last max_target_length."""
        start = [] if self.tokenizer.start_id is None else [self.tokenizer.start_id]
        ids = np.concatenate([start, self.tokenizer.encode_array(prompt.text),
                              self.tokenizer.encode_array(completion)]).astype(np.int32)
        return ids[-self.length:]

    def batch(self, prompts: Sequence[Prompt], completions: Sequence[str]) -> np.ndarray:
        """float32 [n]: each completion's reward."""
        ids = [self._ids(p, c) for p, c in zip(prompts, completions)]
        inputs = np.zeros((len(ids), self.length), np.int32)
        segments, positions = np.zeros_like(inputs), np.zeros_like(inputs)
        for row, tokens in enumerate(ids):
            inputs[row, :len(tokens)], segments[row, :len(tokens)] = tokens, 1
            positions[row, :len(tokens)] = np.arange(len(tokens))
        with mesh_context(self.mesh, self.rules):
            scores = self._scores(self.params, jnp.asarray(inputs), jnp.asarray(segments), jnp.asarray(positions))
        last = np.array([len(tokens) - 1 for tokens in ids])
        return np.asarray(jax.device_get(scores))[np.arange(len(ids)), last].astype(np.float32)
