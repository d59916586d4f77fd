"""GRPO's input: completions sampled from the parameters being trained, rewarded, as batch rows (`objective: grpo`).

Every `grpo_updates_per_rollout` steps, on the training mesh and from the train state's own parameters (no copy, no
second mesh), maxshard's KV-cache generation (`decode.Engine`) continues the next global_batch / grpo_group_size
prompts `grpo_group_size` times each. The reward (`maxshard.rewards`) scores each completion; its advantage is its
reward against its group's (`objectives/grpo.py`). The rows the step trains on, one completion each:

    inputs       prompt c1 c2 ... c(n-1)          the prompt's ids as generation started them, then the completion
    targets      p2 ... c1 c2 ... cn              (ending with the EOS that stopped it, if one did)
    loss_weights 0  ... 1  1  ... 1               the completion's targets only
    old_logps    log p of each target under the parameters that sampled it (one forward pass after sampling), of
                 the logits / grpo_temperature as the step's (`logps_of`)
    advantages   the completion's advantage, on every token of its row

With `grpo_rollout_rows` the engine decodes that many rows at once, each finished row taking the next waiting
completion (generation/refill.py): the cache holds those rows, not the global batch, and a rollout does not wait
for the longest completion of a round. With `grpo_environment` each row is a multi-turn episode
(generation/environments.py): the model's turns take loss, the environment's tokens between them do not.

The sampling key of rollout r is derived from `seed` and r alone (and the turn), and the prompts' position is saved with every
checkpoint, so a resumed run samples what the uninterrupted one did. Between the updates of one rollout
(`grpo_updates_per_rollout` > 1) the batch itself is saved too (the checkpoint's `batch` item, each process writing
its shards; its reward figures and shown samples ride in the JSON state): the parameters that sampled it are gone
by then, so nothing could sample it again, and a run resumed inside the group trains on the very rows the
uninterrupted one did. Only where that batch cannot be had (a checkpoint written before it was kept, or an elastic
restart that changed the global batch) is the rollout sampled again, from the saved parameters, and said so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from maxshard import rewards
from maxshard.checkpoint import format as checkpoint_format
from maxshard.config import Config
from maxshard.data import prompts as prompt_data
from maxshard.data.chat import load_template
from maxshard.data.prompts import Prompt
from maxshard.data.tokenizer import Tokenizer, make_tokenizer
from maxshard.errors import ConfigError
from maxshard.generation import environments
from maxshard.generation.decode import Engine, Result
from maxshard.generation.reward_model import ModelReward, is_model_reward
from maxshard.generation.sampling import Sampling, allowed_tokens
from maxshard.objectives import kinds
from maxshard.parallel import xla_options
from maxshard.training.step import Trainer, TrainState, mesh_context

__all__ = ["Rollouts", "advantages", "throughput", "rows", "sequence_rows", "logps_of", "next_batch", "check"]

_SHOWN_SAMPLES = 2  # completions printed (with their rewards) every log_period steps


def check(cfg: Config) -> None:
    """What GRPO's rollouts need of the run, before anything compiles."""
    if cfg.dataset_type != "prompts":
        raise ConfigError(f"objective=grpo samples completions of prompts: set dataset_type=prompts "
                          f"(dataset_type={cfg.dataset_type})")
    longest = cfg.grpo_max_prompt_length + cfg.grpo_max_new_tokens
    if longest > cfg.max_target_length + 1:
        raise ConfigError(f"grpo_max_prompt_length + grpo_max_new_tokens = {longest} tokens do not fit a row of "
                          f"max_target_length={cfg.max_target_length} (at most max_target_length + 1)")


def advantages(scores: np.ndarray, group: int) -> np.ndarray:
    """float32 [n]: each reward against its group's (consecutive groups of `group`): (r - mean) / (std + 1e-4),
    std unbiased, as TRL's `scale_rewards: group`."""
    grouped = scores.reshape(-1, group).astype(np.float64)
    centred = grouped - grouped.mean(axis=1, keepdims=True)
    return (centred / (grouped.std(axis=1, ddof=1, keepdims=True) + 1e-4)).reshape(-1).astype(np.float32)


def throughput(sampled_tokens: int, timings: Sequence[Result]) -> dict[str, float]:
    """A rollout's speed, logged beside the step (metrics and console): its wall time without compiles (prefill
    and decode, every turn's), the tokens it sampled per second and the decode steps it ran (the mean sampled
    tokens per completion is the step's `completion_length`)."""
    seconds = sum(t.prefill_seconds + t.decode_seconds for t in timings)
    return {"rollout/seconds": seconds, "rollout/tokens_per_sec": sampled_tokens / max(seconds, 1e-9),
            "rollout/decode_steps": sum(t.decode_steps for t in timings)}


def rows(prompt_ids: Sequence[Sequence[int]], completions: Sequence[Sequence[int]], advantage: np.ndarray,
         length: int) -> dict[str, np.ndarray]:
    """The batch rows [n, length] of prompt + completion pairs (module docstring), old_logps still zero."""
    return sequence_rows([([*p, *c], [False] * len(p) + [True] * len(c)) for p, c in zip(prompt_ids, completions)],
                         advantage, length)


def sequence_rows(sequences: Sequence[tuple[Sequence[int], Sequence[bool]]], advantage: np.ndarray,
                  length: int) -> dict[str, np.ndarray]:
    """The batch rows [n, length] of token sequences, each with a flag per token: sampled by the model (its
    target takes loss) or not (the prompt's, a multi-turn environment's); old_logps still zero."""
    out = {k: np.zeros((len(sequences), length), np.dtype(dtype)) for k, dtype in kinds.rollout_fields().items()}
    for i, (ids, sampled) in enumerate(sequences):
        tokens, used = np.asarray(ids, np.int32), len(ids) - 1
        out["inputs"][i, :used], out["targets"][i, :used] = tokens[:-1], tokens[1:]
        out["segment_ids"][i, :used], out["positions"][i, :used] = 1, np.arange(used)
        out["loss_weights"][i, :used] = np.asarray(sampled[1:], bool)
        out["advantages"][i, :used] = advantage[i]
    return out


def logps_of(trainer: Trainer, batch_sharding: jax.sharding.NamedSharding) -> Callable[[Any, Any], jax.Array]:
    """(params, batch) -> the targets' log-probabilities under `params` [batch, length], jitted: the rollout policy's
    `old_logps`, taken as the step takes the policy's (at the objective's temperature: `Trainer._tempered`)."""
    return jax.jit(lambda params, batch: trainer._token_logps(params, batch)[0],
                   in_shardings=(trainer.state_shardings.params, trainer.batch_shardings(batch_sharding)),
                   out_shardings=batch_sharding, compiler_options=xla_options.for_mesh(trainer.mesh))


def _episodes(cfg: Config, tokenizer: Tokenizer) -> environments.Episodes:
    """The player of a multi-turn run's episodes (generation/environments.py)."""
    template = load_template(cfg.tokenizer_path, cfg.chat_template)
    return environments.Episodes(cfg.grpo_environment, template, tokenizer, cfg.grpo_max_turns,
                                 cfg.grpo_max_new_tokens, cfg.max_target_length + 1,
                                 refilled=cfg.grpo_rollout_rows > 0)


class Rollouts:
    """The GRPO run's batches: `next_for(state)` samples, scores and lays out a rollout every
    `grpo_updates_per_rollout` calls and returns it each time; get_state/set_state as the data iterators'."""

    def __init__(self, cfg: Config, trainer: Trainer, batch_sharding: jax.sharding.NamedSharding) -> None:
        check(cfg)
        self.cfg, self.trainer, self.sharding = cfg, trainer, batch_sharding
        self.prompts = prompt_data.make_prompts(cfg, "train", cfg.grpo_max_prompt_length)
        self.reward = (ModelReward(cfg, trainer.mesh, trainer.rules) if is_model_reward(cfg)
                       else rewards.load_reward(cfg))
        self.tokenizer: Tokenizer = make_tokenizer(cfg)
        self.episodes = _episodes(cfg, self.tokenizer) if cfg.grpo_environment else None
        self.step, self._batch, self._engine = 0, None, None
        self._stats: dict[str, float] = {}
        self._samples: list[tuple[str, str, float]] = []
        self._logps = logps_of(trainer, batch_sharding)

    def next_for(self, state: TrainState) -> dict[str, jax.Array]:
        """The batch of step `self.step`: a new rollout at every `grpo_updates_per_rollout`-th step (or the first
        after a resume), else the last one again."""
        if self._batch is None or self.step % self.cfg.grpo_updates_per_rollout == 0:
            self._batch = self._rollout(state.params, self.step // self.cfg.grpo_updates_per_rollout)
        self.step += 1
        return self._batch

    def _rollout(self, params: Any, index: int) -> dict[str, jax.Array]:
        cfg, group = self.cfg, self.cfg.grpo_group_size
        chosen = self.prompts.next_prompts(cfg.global_batch_size // group)
        asked = [p for p in chosen for _ in range(group)]
        sequences, scores, texts, timings, extra = (self._single_turn(params, asked, index) if self.episodes is None
                                                    else self._episodes(params, asked, index))
        host = sequence_rows(sequences, advantages(scores, group), cfg.max_target_length)
        batch = {k: self._global(v) for k, v in host.items()}
        with mesh_context(self.trainer.mesh, self.trainer.rules):
            batch["old_logps"] = self._logps(params, batch)
        self._stats = {"reward/mean": float(scores.mean()), "reward/std": float(scores.std()),
                       "reward/min": float(scores.min()), "reward/max": float(scores.max()),
                       **throughput(sum(sum(m) for _, m in sequences), timings), **extra}
        self._samples = [(p.text, t, float(s)) for p, t, s in zip(asked[:_SHOWN_SAMPLES], texts, scores)]
        return batch

    def _single_turn(self, params: Any, asked: list[Prompt], index: int) -> tuple[list, np.ndarray, list[str],
                                                                                 list[Result], dict[str, float]]:
        """(sequences with their sampled flags, rewards, completion texts, timings, extra stats) of one completion
        per prompt, scored by the run's reward."""
        sampled = self._sample(params, [list(p.ids) for p in asked], index, 0, self.cfg.grpo_max_prompt_length)
        completions = sampled.tokens
        texts = [self.tokenizer.decode([t for t in c if t not in self.tokenizer.stop_ids]) for c in completions]
        scores = rewards.score(self.reward, asked, texts)
        sequences = [([*p.ids, *c], [False] * len(p.ids) + [True] * len(c)) for p, c in zip(asked, completions)]
        return sequences, scores, texts, [sampled], {}

    def _episodes(self, params: Any, asked: list[Prompt], index: int) -> tuple[list, np.ndarray, list[str],
                                                                               list[Result], dict[str, float]]:
        """As `_single_turn`, of an episode per prompt played with the environment (generation/environments.py),
        its reward the environment's; the text shown is all that followed the prompt."""
        episodes, timings = self.episodes.play(
            asked, lambda contexts, length, turn: self._sample(params, contexts, index, turn, length),
            self.cfg.grpo_max_prompt_length)
        scores = np.asarray([e.reward for e in episodes], np.float32)
        texts = [self.tokenizer.decode(e.tokens[e.prompt_tokens:]) for e in episodes]
        n = len(episodes)
        extra = {"rollout/turns": sum(e.turns for e in episodes) / n,
                 "rollout/tool_calls": sum(e.tool_calls for e in episodes) / n,
                 "rollout/episodes_cut": sum(e.ended != "done" for e in episodes) / n}
        return [(e.tokens, e.sampled) for e in episodes], scores, texts, timings, extra

    def _sample(self, params: Any, prompt_ids: list[list[int]], index: int, turn: int, prompt_length: int
                ) -> Result:
        """The generation of each prompt's continuation from `params` (its `tokens` end with a stop id where one
        stopped them; its timings are the rollout's); `turn` of a multi-turn episode keys its own samples."""
        if self._engine is None:
            allowed = allowed_tokens(self.cfg.model.vocab_size, self.tokenizer.vocab_size,
                                     self.tokenizer.never_generated)
            self._engine = Engine(self.cfg.model, self.trainer.mesh, self.trainer.rules, params, allowed)
        # The last step's update is still running (dispatch is asynchronous) and the prefill needs it: wait here,
        # so that the rollout's own time (`throughput`) does not hold the step's
        self._engine.params = jax.block_until_ready(params)
        sampling = Sampling(self.cfg.grpo_temperature, 0, self.cfg.grpo_top_p)
        seed = (self.cfg.seed * 1_000_003 + index + turn * 7_919_083) % (2**31 - 1)
        return self._engine.generate(prompt_ids, self.cfg.grpo_max_new_tokens, self.tokenizer.stop_ids,
                                     self.tokenizer.pad_id, sampling, seed, prompt_length=prompt_length,
                                     rows=self.cfg.grpo_rollout_rows)

    def _global(self, host: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(host.shape, self.sharding, lambda index: host[index])

    def samples(self) -> list[tuple[str, str, float]]:
        """(prompt, completion, reward) of the first completions of the last rollout."""
        return list(self._samples)

    def get_state(self) -> dict[str, Any]:
        """The position (JSON), and inside a rollout's updates the batch the next step trains on again (arrays,
        under checkpoint_format.BATCH: the checkpoint writes them as an item of their own)."""
        state = {"step": self.step, "prompts": self.prompts.get_state(), "rollout_stats": dict(self._stats),
                 "rollout_samples": [list(sample) for sample in self._samples]}
        if self._batch is not None and self.step % self.cfg.grpo_updates_per_rollout:
            state[checkpoint_format.BATCH] = self._batch
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self.step, self._batch = int(state["step"]), state.get(checkpoint_format.BATCH)
        self.prompts.set_state(state["prompts"])
        self._stats = dict(state.get("rollout_stats", {}))
        self._samples = [(p, c, float(r)) for p, c, r in state.get("rollout_samples", [])]
        if self._batch is None and self.step % self.cfg.grpo_updates_per_rollout:
            print(f"the checkpoint at step {self.step} holds no rollout batch (saved before batches were kept, or "
                  "for another global batch): sampling it again from the saved parameters, so the next steps "
                  "differ from the uninterrupted run", flush=True)

    def stats(self) -> dict[str, float]:
        """The last rollout's reward figures and the prompts' counters (skipped records)."""
        return {**self.prompts.stats(), **self._stats}


def next_batch(batches: Any, state: TrainState) -> dict[str, jax.Array]:
    """The next train batch: GRPO's rollouts sample it from `state`; every other input is a plain iterator."""
    return batches.next_for(state) if isinstance(batches, Rollouts) else next(batches)


def show_samples(batches: Any, step: int, every: int, printer: Callable[[str], None] = print) -> None:
    """A few sampled completions with their rewards, every `every` steps (GRPO only)."""
    if not isinstance(batches, Rollouts) or step % every:
        return
    for prompt, completion, reward in batches.samples():
        printer(f"sample at step {step} (reward {reward:g}): {prompt!r} -> {completion!r}")
