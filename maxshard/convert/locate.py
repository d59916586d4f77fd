"""Where one Hugging Face tensor of a parameter lies in a checkpoint, whichever decoder layout saved it."""

from __future__ import annotations

import numpy as np

from maxshard.checkpoint import orbax_io
from maxshard.convert import layout
from maxshard.errors import ConfigError
from maxshard.spec.blocks import MAIN_STACK

__all__ = ["locate", "locate_layer"]


def locate(reader: orbax_io.Reader, param: layout.Param,
           at: tuple[int, ...] | int | None) -> tuple[tuple[str, ...], tuple]:
    """(array path, index) of one Hugging Face tensor of a parameter (`at`: (layer,) or (layer, expert)),
    whichever decoder layout the checkpoint was saved in: scanned [layers, ...], unrolled layers_<i>, or pipelined
    [repeats, stages, layers_per_stage, ...]; an expert's index follows the layer's."""
    at = (at,) if isinstance(at, int) else tuple(at or ())
    if not param.stacked:
        return param.path, param.local(at) if param.layer is not None else ()
    layer, expert = at[0], at[1:]
    path, index = locate_layer(reader, param, layer)
    return path, index + expert


def locate_layer(reader: orbax_io.Reader, param: layout.Param, layer: int) -> tuple[tuple[str, ...], tuple]:
    """Hugging Face's layer `layer` of a stacked parameter: unit `(layer - param.first) // param.period` of its
    stack, scanned, unrolled, or (the main stack only) pipelined."""
    rest, stack, unit = param.path[2:], param.stack, param.local((layer,))[0]
    candidates = [(("decoder", stack, *rest), (unit,)), (("decoder", f"{stack}_{unit}", *rest), ())]
    pipelined = ("decoder", "pipeline", "layers", *rest)
    if stack == MAIN_STACK and pipelined in reader.arrays:
        lead = tuple(reader.arrays[pipelined].shape[:3])
        candidates.append((pipelined, tuple(int(i) for i in np.unravel_index(unit, lead))))
    for path, index in candidates:
        if path in reader.arrays:
            return path, index
    raise ConfigError(f"the checkpoint has no params/{'/'.join(param.path)} for layer {layer} "
                      "(is it a maxshard model with these model keys?)")
