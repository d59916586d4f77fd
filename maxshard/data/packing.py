"""Token documents -> rows of `length` tokens in the batch format of `maxshard.data`.

Each document becomes a pair of equally long streams before packing:

    tokens    BOS t1 t2 ... tn EOS   (BOS only where the tokenizer adds one: data/tokenizer.py)
    inputs    BOS t1 ... tn          (every token but the last)
    targets    t1 t2 ... EOS         (every token but the first)

so a target is always the next token of the *same* document, wherever a row boundary later falls: packing cuts
inputs and targets at the same place. Nothing ever has to be masked for "the target crosses into the next
document"; `loss_weights` is 0 only on padding.

Packing (grain's `ConcatThenSplitIterDataset`) concatenates the pairs and cuts the stream every `length` tokens. A
document that does not fit is split: its first part ends the row, the rest starts the next one (with positions
restarting at 0 there, as a new segment). Worked example, length 6, documents A = a1 a2 a3, B = b1, C = c1 c2 c3 c4
(BOS/EOS written <, >):

    row 0   inputs       <  a1 a2 a3 <  b1        row 1   inputs       <  c1 c2 c3 c4 ...
            targets      a1 a2 a3 >  b1 >                 targets      c1 c2 c3 c4 >  ...
            segment_ids  1  1  1  1  2  2                 segment_ids  1  1  1  1  1  ...
            positions    0  1  2  3  0  1                 positions    0  1  2  3  4  ...

`packing: false` puts one document per row instead, truncated to `length` or padded with PAD (segment 0, weight 0).

Features beyond inputs/targets (`extra`: per-token bookkeeping such as which source a token came from) are cut and
padded (with 0) exactly like the tokens, so they stay aligned with them.

Preference pairs (`data/preference.py`: two halves, chosen then rejected, each its own document) are never cut:
`pack_pairs` places whole pairs first-fit (grain's `FirstFitPackIterDataset`) into `PAIR_BINS` rows at a time, in
the order they come, each into the first of those rows with room; a pair fitting none of them sends the rows on,
unfilled ends padded. The packer numbers the pairs of a row 1, 2, ...; pair p's chosen half gets segment id 2p-1
and its rejected half 2p, and positions restart at 0 at each half (the pair's HALF and HALF_POSITION). Length 8,
pairs P = (chosen p1 p2 p3 | rejected q1 q2) and R = (r1 | s1 s2), inputs:

    inputs       p1 p2 p3 q1 q2 r1 s1 s2
    segment_ids  1  1  1  2  2  3  4  4           odd: chosen, even: rejected, (segment + 1) // 2: pair in row
    positions    0  1  2  0  1  0  0  1

With `packing: false` a row holds one pair, padded.
"""

from __future__ import annotations

import functools

import grain
import numpy as np
from grain.experimental import ConcatThenSplitIterDataset, FirstFitPackIterDataset

from maxshard.data.chat import WEIGHT  # an optional per-target loss weight of a pair (chat: assistant turns only)
from maxshard.objectives.kinds import FIELDS  # the batch fields, named once for every objective

__all__ = ["document_pair", "pack", "pad_to_length", "pack_pairs", "FIELDS", "HALF", "HALF_POSITION", "PAIR_BINS"]

HALF, HALF_POSITION = "_half", "_half_position"  # a preference pair's tokens: 1 chosen, 2 rejected; place in half
PAIR_BINS = 16  # rows filled with whole pairs at once: more pack tighter, but a resume re-reads that many rows

def document_pair(tokens: np.ndarray, bos_id: int | None, eos_id: int) -> dict[str, np.ndarray]:
    """int32 [n] -> {"inputs", "targets"}: BOS (where the tokenizer adds one) and EOS added, shifted by one (see
    module doc), each [n + 1] long with a BOS.

    Without a BOS (bos_id None: a tokenizer whose template adds none, e.g. Qwen's) the pair is [n] long and the
    document's first token is context only, as it is for that model."""
    start = [] if bos_id is None else [bos_id]
    full = np.concatenate([start, np.asarray(tokens, np.int32), [eos_id]]).astype(np.int32)
    return {"inputs": full[:-1], "targets": full[1:]}


def pack(pairs: grain.IterDataset, length: int, extra: tuple[str, ...] = ()) -> grain.IterDataset:
    """Concatenates document pairs and cuts them into rows of `length` (see the worked example above)."""
    features = ("inputs", "targets", *extra)
    packed = ConcatThenSplitIterDataset(pairs, length_struct={k: length for k in features})
    return packed.map(functools.partial(_packed_row, extra=extra))


def _packed_row(element: dict[str, np.ndarray], extra: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    segment_ids = element["inputs_segment_ids"].astype(np.int32)
    return {
        "inputs": element["inputs"],
        "targets": element["targets"],
        "segment_ids": segment_ids,
        "positions": element["inputs_positions"].astype(np.int32),
        "loss_weights": _weights(segment_ids > 0, element),
        **{k: element[k] for k in extra},
    }


def pack_pairs(pairs: grain.IterDataset, length: int, packing: bool = True,
               extra: tuple[str, ...] = ()) -> grain.IterDataset:
    """Preference pairs (with HALF, HALF_POSITION) -> rows of whole pairs, first-fit (packing false: one a row)."""
    features = ("inputs", "targets", HALF, HALF_POSITION, *extra)
    packed = FirstFitPackIterDataset(pairs, length_struct={k: length for k in features}, shuffle_bins=False,
                                     num_packing_bins=PAIR_BINS if packing else 1,
                                     max_sequences_per_bin=None if packing else 1)
    return packed.map(functools.partial(_pair_row, extra=extra))


def _pair_row(element: dict[str, np.ndarray], extra: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    pair = element["inputs_segment_ids"]  # [length]: the pair's number in the row, from 1; 0: padding
    real = pair > 0
    return {
        "inputs": element["inputs"],
        "targets": element["targets"],
        "segment_ids": np.where(real, 2 * pair - 2 + element[HALF], 0).astype(np.int32),
        "positions": element[HALF_POSITION].astype(np.int32),
        "loss_weights": _weights(real, element),
        **{k: element[k] for k in extra},
    }


def pad_to_length(pair: dict[str, np.ndarray], length: int, pad_id: int = 0,
                  extra: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
    """One document per row: the pair truncated to `length`, or padded with `pad_id` (segment 0, weight 0)."""
    n = min(len(pair["inputs"]), length)
    real = np.arange(length) < n
    return {
        "inputs": _fit(pair["inputs"], length, pad_id),
        "targets": _fit(pair["targets"], length, pad_id),
        "segment_ids": real.astype(np.int32),
        "positions": np.where(real, np.arange(length), 0).astype(np.int32),
        "loss_weights": _weights(real, {k: _fit(pair[k], length, 0, pair[k].dtype) for k in extra if k == WEIGHT}),
        **{k: _fit(pair[k], length, 0, pair[k].dtype) for k in extra},
    }


def _weights(real: np.ndarray, element: dict[str, np.ndarray]) -> np.ndarray:
    """1 on real tokens, times the pair's own WEIGHT where it carries one (padding then weighs 0 either way)."""
    weights = real.astype(np.float32)
    return weights * element[WEIGHT].astype(np.float32) if WEIGHT in element else weights


def _fit(x: np.ndarray, length: int, pad_id: int, dtype: np.dtype = np.int32) -> np.ndarray:
    out = np.full(length, pad_id, dtype)
    out[: min(len(x), length)] = x[:length]
    return out
