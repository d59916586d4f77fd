"""One process of a multi-process test run (tests/test_distributed.py starts two of these, or one alone).

Usage: python tests/distributed_worker.py key=value ...   (keys of configs/base.yml, e.g. process_id=1)
Prints one JSON line: what this process sees after `distributed.initialize` and a sum over every process's data.
"""

from __future__ import annotations

import json
import os
import sys

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maxshard import config  # noqa: E402
from maxshard.errors import ConfigError
from maxshard.launch import distributed  # noqa: E402

LOCAL_DEVICES = 4


def cross_process_sum() -> float:
    """Each process holds 4 of the values 1..8 ([8] sharded over all devices); the jitted sum needs all of them."""
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    first = jax.process_index() * LOCAL_DEVICES
    local = np.arange(first + 1, first + LOCAL_DEVICES + 1, dtype=np.float32)  # [4]
    values = jax.make_array_from_process_local_data(sharding, local, (jax.device_count(),))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    total = jax.jit(lambda x: x.sum(), out_shardings=replicated)(values)
    return float(total.addressable_data(0))


def main(argv: list[str]) -> int:
    jax.config.update("jax_num_cpu_devices", LOCAL_DEVICES)
    try:
        cfg = config.parse(["configs/base.yml", *argv])
        chosen = distributed.initialize(cfg)
    except ConfigError as e:
        print(f"maxshard: error: {e}", file=sys.stderr)
        return 2
    result = {
        "initialized": chosen is not None,
        "process_index": jax.process_index(),
        "process_count": jax.process_count(),
        "device_count": jax.device_count(),
        "local_device_count": jax.local_device_count(),
        "sum": cross_process_sum(),
    }
    # One write of the whole line (atomic on a pipe below PIPE_BUF): gloo's C++ log lines share this stdout, and
    # print() writes the text and its newline separately, between which a gloo line once landed.
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
