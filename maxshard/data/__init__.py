"""Input pipelines. Every source yields the same batch: a dict of global jax.Arrays [batch, length]:

    inputs        int32  token ids fed to the model
    targets       int32  the next token of each input
    segment_ids   int32  document number inside a packed row (0: padding); attention stays inside a segment
    positions     int32  position of each token inside its document (RoPE)
    loss_weights  float32 1 where the target counts in the loss, 0 for padding and document boundaries

Iterators also have `get_state()` / `set_state()` so a checkpoint can resume the exact batch sequence. States are
JSON-serializable dicts, the same in every process (one global position, `pipeline`). `stats()` gives metrics about
the data delivered so far (tokens per source, skipped bad records), the run's, not one process's.

The dataset types and their readers are the rows of `maxshard/dataset_types.py`. Modules: `sources` (text files,
default corpus, train/eval split), `records` (ArrayRecord shards), `chat` and
`chat_template` (conversations -> tokens whose loss counts the assistant turns, `dataset_type: chat`), `preference`
(prompt/chosen/rejected records -> pairs of halves packed whole, `dataset_type: preference`), `prompts` (records
GRPO samples completions from, `dataset_type: prompts`: `make_prompts`, not `make_input`),
`jsonl`, `parquet`, `hf` (Hugging Face datasets), `hf_stream` (one read as a stream), `files` (listing local and remote paths), `catalog` (which sources a
config names, mixtures), `shuffle` (block-wise shuffle), `mixture` (token-weighted interleave, bad-record skipping),
`tokenizer`, `packing` (documents -> rows), `pipeline` (the grain graph and the global-batch iterator), `store`
(a token store: packed rows by global row number, each process reading only its own), `synthetic`.
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
from jax.sharding import Mesh, NamedSharding

from maxshard import dataset_types
from maxshard.config import Config
from maxshard.data.synthetic import SyntheticIterator
from maxshard.errors import ConfigError
from maxshard.objectives import kinds as objective_kinds
from maxshard.parallel import axis_names, sharding

__all__ = ["InputIterator", "batch_sharding", "make_input"]


class InputIterator(Protocol):
    def __next__(self) -> dict[str, jax.Array]: ...

    def get_state(self) -> dict[str, Any]: ...

    def set_state(self, state: dict[str, Any]) -> None: ...

    def stats(self) -> dict[str, int]: ...


def batch_sharding(cfg: Config, mesh: Mesh, batch_size: int | None = None) -> NamedSharding:
    """Sharding of an input batch [batch, length]; errors if the batch does not divide over its mesh axes."""
    shape = (batch_size or cfg.global_batch_size, cfg.max_target_length)
    spec = sharding.logical_to_spec(
        axis_names.INPUT_AXES, sharding.flax_rules(cfg), dict(mesh.shape), shape, "input batch [batch, length]"
    )
    return NamedSharding(mesh, spec)


def make_input(cfg: Config, mesh: Mesh, split: str = "train", batch_size: int | None = None) -> InputIterator:
    """The iterator for `cfg.dataset_type`; `split` is "train" or "eval".

    Every type read from documents (`dataset_types.grain`) and `dataset_mixture` (`pipeline.make_grain_input`):
    every process builds the same stream of global batches from all the split's documents and hands JAX its devices'
    rows, so a state resumes on any process count (elastic restarts). Both splits repeat forever; train is
    reshuffled every epoch (`data_shuffle_seed`; a streamed hf source: in windows, see `hf_stream`), eval keeps
    corpus order, so a fresh eval iterator always yields the same batches. Bad paths and files raise ConfigError here
    or at the first batch.
    """
    if cfg.dataset_type == "prompts":
        raise ConfigError("dataset_type=prompts holds prompts, not training rows: GRPO reads them with "
                          "maxshard.data.prompts.make_prompts, not make_input")
    batch_size = batch_size or cfg.global_batch_size
    if cfg.dataset_type == "synthetic":
        seed = cfg.seed if split == "train" else cfg.seed + 1_000_003
        return SyntheticIterator(seed, batch_size, cfg.max_target_length, cfg.vocab_size,
                                 batch_sharding(cfg, mesh, batch_size), objective_kinds.kind(cfg.objective).rows)
    if cfg.dataset_type == "store":  # each process reads only its own rows (data/store.py)
        from maxshard.data import store  # deferred: grain is only needed for real data

        return store.make_store_input(cfg, batch_sharding(cfg, mesh, batch_size), split, batch_size)
    if dataset_types.grain(cfg.dataset_type) or cfg.dataset_mixture:
        from maxshard.data import pipeline  # deferred: grain is only needed for real data

        return pipeline.make_grain_input(cfg, batch_sharding(cfg, mesh, batch_size), split, batch_size)
    raise ConfigError(f"dataset_type={cfg.dataset_type!r} is not available")
