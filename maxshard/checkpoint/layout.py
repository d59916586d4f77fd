"""Checkpoints that move between layouts: a state written under one mesh restores under any other.

Parameter values never depend on the layout (`model.init_params`); only the shape of the decoder's stack does. A
scanned model stores it as `decoder/layers/...: [units, ...]`, a circular pipeline as
`decoder/pipeline/layers/...: [repeats, stages, layers per stage, ...]`, unit r*S*L + s*L + l at [r, s, l]. The
scanned form is the canonical one: names and shapes are compared in it, so "the same model" means the same
canonical tree whatever wrote the checkpoint.

A checkpoint is saved in the layout of the run that wrote it (converting before an asynchronous save would hold a
second copy of the whole train state on the devices). Restoring into another layout reads each array in the
writer's shape, sharded like the target on the dimensions both share and unsplit on the stacked leading ones, then
reshapes it into the target's layout and sharding. Restores in the same layout read directly, as before. Meshes and
device counts need nothing of this: orbax reshards on load.

Worked example, a pipeline with R=2, S=2, L=1 written, read by a scanned run with stage=1:
    saved  params/decoder/pipeline/layers/mlp/wo/kernel  [2, 2, 1, 64, 32]   canonical [4, 64, 32]
    target params/decoder/layers/mlp/wo/kernel           [4, 64, 32]         spec (None, 'tensor', 'fsdp')
    read as [2, 2, 1, 64, 32] with spec (None, None, None, 'tensor', 'fsdp'), then reshaped to [4, 64, 32].
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from maxshard.errors import ConfigError
from maxshard.parallel.sharding import path_name

__all__ = ["canonical_path", "canonical_shapes", "check_matches", "needs_relayout", "read_target", "relayout"]

_PIPELINED = "decoder/pipeline/layers/"
_SCANNED = "decoder/layers/"


def flat(tree: Any) -> dict[str, Any]:
    """'params/decoder/.../kernel' -> leaf; the same names for a live TrainState and orbax's metadata tree."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {path_name(path): leaf for path, leaf in leaves}


def _lead(path: str) -> int:
    """Leading stacked dimensions of a leaf: 3 in a pipelined stack, 1 in a scanned one, 0 elsewhere."""
    return 3 if _PIPELINED in path else 1 if _SCANNED in path else 0


def canonical_path(path: str) -> str:
    return path.replace(_PIPELINED, _SCANNED)


def canonical_shapes(tree: Any) -> dict[str, tuple[int, ...]]:
    """Every leaf's canonical name and shape: a pipelined stack [R, S, L, ...] counts as [R*S*L, ...]."""
    shapes = {}
    for path, leaf in flat(tree).items():
        shape, lead = tuple(leaf.shape), _lead(path)
        shapes[canonical_path(path)] = (math.prod(shape[:lead]), *shape[lead:]) if lead == 3 else shape
    return shapes


def check_matches(saved: Any, target: Any, where: str) -> None:
    """One-line ConfigError naming the first array whose canonical name or shape differs (dtypes are cast)."""
    have, want = canonical_shapes(saved), canonical_shapes(target)
    for path, shape in want.items():
        if path not in have:
            raise ConfigError(f"{where} does not match the model: it has no {path} (shape {shape} in the model)")
        if have[path] != shape:
            raise ConfigError(f"{where} does not match the model: {path} has shape {have[path]} in the checkpoint, "
                              f"{shape} in the model")
    extra = [path for path in have if path not in want]
    if extra:
        raise ConfigError(f"{where} does not match the model: it has {extra[0]}, which the model lacks")


def needs_relayout(saved: Any, target: Any) -> bool:
    """True when the checkpoint's stack is laid out otherwise than the target's (pipelined vs scanned)."""
    return set(flat(saved)) != set(flat(target))


def _read_spec(saved_shape: tuple[int, ...], saved_path: str, target: jax.ShapeDtypeStruct, target_path: str
               ) -> PartitionSpec:
    """The target's spec on the dimensions after the stacked ones, nothing on the writer's stacked dimensions."""
    spec = tuple(target.sharding.spec) + (None,) * (len(target.shape) - len(target.sharding.spec))
    return PartitionSpec(*(None,) * _lead(saved_path), *spec[_lead(target_path):])


def read_target(saved: Any, target: Any) -> Any:
    """Abstract arrays in the checkpoint's own structure and shapes, sharded for this mesh (see the module doc)."""
    targets = {canonical_path(p): (p, leaf) for p, leaf in flat(target).items()}

    def leaf(path: tuple, meta: Any) -> jax.ShapeDtypeStruct:
        name = path_name(path)
        target_path, want = targets[canonical_path(name)]
        spec = _read_spec(tuple(meta.shape), name, want, target_path)
        return jax.ShapeDtypeStruct(tuple(meta.shape), want.dtype, sharding=NamedSharding(want.sharding.mesh, spec))

    return jax.tree_util.tree_map_with_path(leaf, saved)


def relayout(restored: Any, target: Any) -> Any:
    """Arrays read by `read_target` reshaped into the target's tree, layout and shardings."""
    arrays = {canonical_path(p): a for p, a in flat(restored).items()}

    def leaf(path: tuple, want: jax.ShapeDtypeStruct) -> jax.Array:
        array = arrays[canonical_path(path_name(path))]
        if array.shape == want.shape and array.sharding == want.sharding:
            return array
        return jax.jit(lambda a: a.reshape(want.shape), out_shardings=want.sharding)(array)

    return jax.tree_util.tree_map_with_path(leaf, target)
