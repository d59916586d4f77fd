"""Block-wise shuffling of document indices, for sources whose documents are cheap to read only together.

A Parquet row group is decoded as a whole; a global shuffle would decode one row group per document. Here each
epoch's order is: the blocks in a random order, cut into windows of `window_blocks` consecutive blocks, and the
documents of each window in a random order. A reader then holds at most a window's blocks (plus read-ahead) at a time
while documents of different blocks still mix. Like grain's own shuffle, the order is a pure function of
(seed, epoch), so a grain iterator state (a position) restores it exactly.
"""

from __future__ import annotations

import threading
from typing import Any

import grain
import numpy as np

__all__ = ["BlockShuffleMapDataset", "WINDOW_BLOCKS"]

WINDOW_BLOCKS = 2


class BlockShuffleMapDataset(grain.MapDataset):
    """`indices` reordered per epoch: random block order, random order inside windows of blocks; repeats forever."""

    def __init__(self, indices: np.ndarray, blocks: np.ndarray, seed: int, window_blocks: int = WINDOW_BLOCKS):
        """`blocks[i]`: the block of `indices[i]`."""
        super().__init__()
        self._indices = np.asarray(indices, np.int64)
        _, self._block_of = np.unique(np.asarray(blocks), return_inverse=True)  # block numbers 0..B-1
        self._block_count = int(self._block_of.max()) + 1 if len(self._block_of) else 0
        self._seed, self._window_blocks = int(seed), int(window_blocks)
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._indices)

    def __str__(self) -> str:
        return f"BlockShuffleMapDataset(blocks={self._block_count}, window={self._window_blocks})"

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.slice(index)
        epoch, position = divmod(int(index), len(self._indices))
        return int(self.epoch_order(epoch)[position])

    def epoch_order(self, epoch: int) -> np.ndarray:
        """int64 [len]: the indices in epoch `epoch`'s order (the last two epochs are kept: threads straddle one)."""
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                order = self._orders[epoch] = self._order(epoch)
                for old in sorted(self._orders)[:-2]:
                    del self._orders[old]
            return order

    def _order(self, epoch: int) -> np.ndarray:
        rng = np.random.default_rng([self._seed, epoch])
        block_rank = np.empty(self._block_count, np.int64)
        block_rank[rng.permutation(self._block_count)] = np.arange(self._block_count)
        window = block_rank[self._block_of] // self._window_blocks
        order = np.lexsort((rng.random(len(self._indices)), window))  # by window, then randomly inside it
        return self._indices[order]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_orders"], state["_lock"] = {}, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
