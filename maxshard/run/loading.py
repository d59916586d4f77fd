"""One way to load a run: parse, join the other processes, finalize for the devices, resolve the vocabulary,
derive the model. Train, generate, the tools and the benchmarks all start here, so a config means the same
thing everywhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from maxshard import config
from maxshard.config import Config
from maxshard.data.tokenizer import resolve_vocab
from maxshard.model import attention_choice, quantization
from maxshard.spec.model_config import ModelConfig, model_fields, resolve_dtype, resolve_moe_exchange, resolve_moe_impl
from maxshard.parallel import mesh, stages
from maxshard.planning import fit, memory
from maxshard.planning.fit import Capacity
from maxshard.run import elastic

__all__ = ["load_run", "complete", "check_memory", "model_config", "replace", "resume_layout"]


def model_config(cfg: Config, mesh_sizes: dict[str, int] | None = None) -> ModelConfig:
    """The network of a finalized config (vocabulary resolved), with its pipeline shape on a mesh of `mesh_sizes`."""
    sizes = mesh.axis_sizes(cfg) if mesh_sizes is None else mesh_sizes
    platform = "cpu" if cfg.device_kind.lower() in ("cpu", "") else "accelerator"
    values = {key: getattr(cfg, key) for key in model_fields()}
    values["dtype"] = resolve_dtype(cfg.dtype, platform)
    values["weight_dtype"] = resolve_dtype(cfg.weight_dtype, platform)
    values["moe_dropless_impl"] = resolve_moe_impl(cfg.moe_dropless_impl, cfg.device_kind)
    values["moe_exchange"] = _moe_exchange(cfg)
    values["attention"] = attention_choice.resolve(cfg, values["dtype"], sizes)
    quantization.check(cfg.quantization, values["dtype"], cfg.device_kind)
    return ModelConfig(**values, pipeline=stages.resolve(cfg, sizes))


def _moe_exchange(cfg: Config) -> str:
    """`moe_exchange` for the config's device kind. An explicit `ragged` runs on CPU too: XLA:CPU has no ragged
    all-to-all, and the emulation in `layers/ragged_all_to_all.py` (the collective's contract, from fixed-size
    all_to_alls) stands in for it there, so a TPU or GPU config runs unchanged on a laptop."""
    return resolve_moe_exchange(cfg.moe_exchange, attention_choice.platform_of(cfg.device_kind or "cpu"))


def complete(cfg: Config, capacity: Capacity | None = None) -> Config:
    """A finalized config with its vocabulary resolved, `loss_chunks` and `remat_policy: auto` decided and its
    `model` derived.

    `auto` becomes the least recomputation whose planned peak fits `capacity` (default: this machine's devices,
    `planning/fit.py`); the decision is kept in `cfg.memory_fit`. When nothing fits, `full` with `fits` False:
    `check_memory` (which `load_run` calls for runs) turns that into the error line.
    """
    cfg = resolve_vocab(cfg)
    model = model_config(cfg)  # loss_chunks is no model key: the model stays valid when it is decided
    if cfg.loss_chunks == 0:
        sized = dataclasses.replace(cfg, model=model)
        cfg = dataclasses.replace(cfg, loss_chunks=memory.auto_loss_chunks(sized, mesh.axis_sizes(cfg)))
    if cfg.remat_policy == "auto":
        provisional = dataclasses.replace(cfg, model=model)
        decided = fit.decide(provisional, capacity or fit.local_capacity(cfg), strict=False)
        cfg = dataclasses.replace(cfg, remat_policy=decided.policy, memory_fit=decided)
    return dataclasses.replace(cfg, model=model_config(cfg))


def check_memory(cfg: Config, capacity: Capacity | None = None) -> Config:
    """`cfg` with its fit recorded; ConfigError (one line) when its remat policy (explicit, or the `full` that
    `auto` fell back to) is planned over the usable memory by more than the plan's error (`fit.PLAN_ERROR`): the
    shortfall and the cheapest policy that fits. Closer calls are left to the compiled step (compile_check.py)."""
    if cfg.memory_fit is not None and cfg.memory_fit.fits:
        return cfg
    requested = cfg.memory_fit.requested if cfg.memory_fit is not None else cfg.remat_policy
    decided = fit.decide(dataclasses.replace(cfg, remat_policy=requested), capacity or fit.local_capacity(cfg))
    return dataclasses.replace(cfg, memory_fit=decided)


def replace(cfg: Config, **changes: object) -> Config:
    """A complete config with some keys changed and its model derived again (a plain `dataclasses.replace` would
    leave `cfg.model` describing the old keys)."""
    return complete(dataclasses.replace(cfg, model=None, **changes))


def resume_layout(cfg: Config, capacity: Capacity | None = None) -> Config:
    """`complete(cfg)`, for a run that may resume from its checkpoints on other devices (`elastic.py`): the
    checkpoint's global batch kept, the per-device batch derived again and the fewest accumulation steps whose
    planned peak fits; one line says what changed. All processes read the same checkpoint and agree on the memory
    capacity (`fit.local_capacity`), so they decide alike; with several processes that is checked."""
    saved = elastic.saved_layout(cfg.checkpoint_dir) if cfg.enable_checkpointing else None
    kept = elastic.keep_global_batch(cfg, saved) if saved is not None else None
    if kept is None:
        done = complete(cfg, capacity)
    else:
        for candidate in elastic.accumulation_choices(kept):
            done = complete(candidate, capacity)
            if _fits(done, capacity):
                break
    if saved is not None and elastic.changed(done, saved):
        print(elastic.describe(done, saved), flush=True)
    _check_agreed(done, saved)
    return done


def _fits(cfg: Config, capacity: Capacity | None) -> bool:
    decided = cfg.memory_fit or fit.decide(cfg, capacity or fit.local_capacity(cfg), strict=False)
    return decided.fits


def _check_agreed(cfg: Config, saved: elastic.SavedLayout | None) -> None:
    """Every process found the same checkpoint and derived the same batch split (else they would compile different
    programs, or restore different steps, and hang); every process calls this at the same point."""
    if cfg.num_processes > 1:
        from jax.experimental import multihost_utils  # deferred: one process never needs it

        step = -1 if saved is None else saved.step
        decided = (step, cfg.global_batch_size, cfg.per_device_batch_size, cfg.gradient_accumulation_steps)
        multihost_utils.assert_equal(decided, "the processes derived different batch splits for the resume")


def load_run(
    argv: Sequence[str],
    num_devices: int | None = None,
    device_kind: str | None = None,
    join_processes: bool = False,
    check_fit: bool = True,
    resume: bool = False,
) -> Config:
    """`[CONFIG.yml, key=value, ...]` -> the run's complete Config.

    Without `num_devices` JAX is asked (after `cpu_device_count` is applied); with `join_processes` this process
    first joins the others (multi-host), which must precede every device query. With `check_fit` (a run that will
    allocate its state) an explicit remat policy whose planned peak does not fit the devices is a ConfigError. With
    `resume` (training) a run with checkpoints keeps their global batch on any device count (`resume_layout`). A
    policy that offloads (maxshard/spec/remat.py) on devices without host memory to offload to is a ConfigError too.
    """
    parsed = config.parse(argv)
    if join_processes:
        from maxshard.launch import distributed  # deferred: only the CLI entry points join processes

        distributed.initialize(parsed)
    finalized = config.load_parsed(parsed, num_devices, device_kind)
    cfg = resume_layout(finalized) if resume else complete(finalized)
    if not check_fit:
        return cfg
    if num_devices is None:  # this process's own devices: an offload policy needs their host memory
        fit.check_host_memory(cfg)
    return check_memory(cfg)
