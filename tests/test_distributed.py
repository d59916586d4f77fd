"""Multi-host start-up: where the coordinator, count and id come from; clear failures; a real 2-process run."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from maxshard.config import Config
from maxshard.errors import ConfigError
from maxshard.launch import distributed
from maxshard.launch.distributed import Plan
import cli_processes

REPO = Path(__file__).resolve().parent.parent
WORKER = REPO / "tests" / "distributed_worker.py"
XPK_GPU_ENV = {"JAX_COORDINATOR_ADDRESS": "w-slice-job-0-0.w", "JAX_COORDINATOR_PORT": "6002", "NNODES": "2",
               "NODE_RANK": "1"}


def cfg(**keys: object) -> Config:
    return dataclasses.replace(Config(), **keys)


def free_ports(n: int = 1) -> list[int]:
    """n distinct ports nobody listens on (all held open while choosing, so they differ)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


# --------------------------------------------------------------------------------------------- plan


def test_single_host_needs_nothing():
    assert distributed.plan(cfg(), {}) is None
    assert distributed.plan(cfg(process_count=1), XPK_GPU_ENV) is None
    assert distributed.plan(cfg(), {"TPU_WORKER_HOSTNAMES": "only-host"}) is None
    assert distributed.initialize(cfg(), {}) is None


def test_xpk_gpu_environment():
    plan = distributed.plan(cfg(distributed_timeout=60), XPK_GPU_ENV)
    assert plan == Plan("w-slice-job-0-0.w:6002", 2, 1, 60,
                        ("$JAX_COORDINATOR_ADDRESS + $JAX_COORDINATOR_PORT", "$NNODES", "$NODE_RANK"))


def test_config_keys_win_over_environment_fact_by_fact():
    plan = distributed.plan(cfg(coordinator_address="10.0.0.1:1234", process_id=0), XPK_GPU_ENV)
    assert (plan.coordinator_address, plan.num_processes, plan.process_id) == ("10.0.0.1:1234", 2, 0)
    assert plan.sources == ("coordinator_address", "$NNODES", "process_id")


def test_jax_environment_names():
    env = {"JAX_COORDINATOR_ADDRESS": "[::1]:99", "JAX_NUM_PROCESSES": "4", "JAX_PROCESS_INDEX": "3"}
    assert distributed.plan(cfg(), env).describe() == (
        "process 3 ($JAX_PROCESS_INDEX) of 4 ($JAX_NUM_PROCESSES), coordinator [::1]:99 ($JAX_COORDINATOR_ADDRESS)"
    )


@pytest.mark.parametrize("env", [{"TPU_WORKER_HOSTNAMES": "h0,h1,h2,h3"}, {"MEGASCALE_NUM_SLICES": "2"}])
def test_cloud_tpu_leaves_unknown_facts_to_jax(env):
    plan = distributed.plan(cfg(), {**env, "TPU_WORKER_ID": "2"})
    assert (plan.coordinator_address, plan.num_processes, plan.process_id) == (None, None, None)
    assert "found by JAX on Cloud TPU" in plan.describe()


@pytest.mark.parametrize(
    "keys, env, message",
    [
        ({"process_count": 2}, {}, r"need a coordinator: set coordinator_address=host:port or \$JAX_COORDINATOR"),
        ({"process_count": 2, "coordinator_address": "h:1"}, {}, r"need this process's id: set process_id"),
        ({"process_count": 2, "process_id": 2, "coordinator_address": "h:1"}, {}, r"process id 2 .* \[0, 2\)"),
        ({"coordinator_address": "h:1"}, {}, r"process count is unknown; set process_count"),
        ({"coordinator_address": "h", "process_count": 2, "process_id": 0}, {}, r"'h' .* needs a port"),
        ({}, {"NNODES": "two"}, r"NNODES='two' is not a whole number"),
        ({}, {"NNODES": "0", "JAX_COORDINATOR_ADDRESS": "h:1"}, r"process count 0 \(from \$NNODES\) must be >= 1"),
        ({"process_count": -1}, {}, r"process_count must be >= 0"),
        ({"process_id": -2}, {}, r"process_id must be >= 0, or -1"),
        ({"distributed_timeout": 0}, {}, r"distributed_timeout must be >= 1"),
    ],
)
def test_incomplete_or_wrong_facts_name_the_key(keys, env, message):
    with pytest.raises(ConfigError, match=message) as e:
        distributed.plan(cfg(**keys), env)
    assert "\n" not in str(e.value)


def test_initialize_after_a_device_query_is_refused():
    jax.devices()  # the pytest process has long started its backend; make sure of it
    with pytest.raises(distributed.DistributedInitError, match="before JAX's first device query"):
        distributed.initialize(cfg(coordinator_address="127.0.0.1:1", process_count=2, process_id=1), {})


def test_timeout_messages_say_what_to_check():
    (port,) = free_ports()
    alone = Plan(f"127.0.0.1:{port}", 2, 0, 5, ("coordinator_address", "process_count", "process_id"))
    assert distributed.timeout_message(alone).endswith(
        "not all processes joined this coordinator: check process_count and that every host started"
    )
    lost = dataclasses.replace(alone, process_id=1)
    assert "nothing answers at the coordinator: check coordinator_address" in distributed.timeout_message(lost)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        answering = dataclasses.replace(lost, coordinator_address=f"127.0.0.1:{listener.getsockname()[1]}")
        assert "the coordinator answers but not all processes joined" in distributed.timeout_message(answering)


# --------------------------------------------------------------------------------------------- real processes


def start_worker(*keys: str, env_extra: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """One worker process; the environment carries no launcher variables but `env_extra`."""
    drop = {*distributed.ADDRESS_ENV, distributed.PORT_ENV, *distributed.COUNT_ENV, *distributed.ID_ENV,
            *distributed.TPU_HOSTS_ENV, "MEGASCALE_NUM_SLICES"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(JAX_PLATFORMS="cpu", **(env_extra or {}))
    return cli_processes.popen([sys.executable, str(WORKER), *keys], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[str], timeout: float = 50) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"worker still running after {timeout}s; stderr: {err[-2000:]}")
    return proc.returncode, out, err


@pytest.mark.slow
def test_missing_peer_and_unreachable_coordinator_fail_fast_in_one_line():
    common = ("process_count=2", "distributed_timeout=3")
    ports = free_ports(2)
    start = time.monotonic()
    # process 0 runs the coordinator and waits for a peer that never comes; process 1 finds nobody at its address
    alone = start_worker(*common, f"coordinator_address=127.0.0.1:{ports[0]}", "process_id=0")
    lost = start_worker(*common, f"coordinator_address=127.0.0.1:{ports[1]}", "process_id=1")
    results = [finish(alone), finish(lost)]
    assert time.monotonic() - start < 40
    for (code, out, err), hint in zip(results, ("check process_count", "nothing answers at the coordinator")):
        last = err.strip().splitlines()[-1]
        assert (code, out) == (distributed.EXIT_CODE, "")
        assert last.startswith("maxshard: error: distributed init timed out after 3s (distributed_timeout)")
        assert hint in last and "Check failure" not in err


@pytest.mark.slow
def test_two_processes_see_eight_devices_and_sum_across_them():
    """Process 0 is configured by keys, process 1 by the variables XPK sets on GPU nodes."""
    (port,) = free_ports()
    keys = (f"coordinator_address=127.0.0.1:{port}", "process_count=2", "process_id=0", "distributed_timeout=40")
    xpk_env = {"JAX_COORDINATOR_ADDRESS": "127.0.0.1", "JAX_COORDINATOR_PORT": str(port), "NNODES": "2",
               "NODE_RANK": "1"}
    procs = [start_worker(*keys), start_worker("distributed_timeout=40", env_extra=xpk_env)]
    results = [finish(p) for p in procs]
    seen = []
    for code, out, err in results:
        assert code == 0, err[-2000:]
        # gloo's C++ log lines ("[Gloo] Rank 0 is connected ...") share stdout and may land after the JSON line,
        # even on it: read the one JSON object the line starts with
        line = next(line for line in reversed(out.splitlines()) if line.startswith("{"))
        seen.append(json.JSONDecoder().raw_decode(line)[0])
    assert [s["process_index"] for s in seen] == [0, 1]
    for s in seen:
        assert s == {**s, "initialized": True, "process_count": 2, "device_count": 8, "local_device_count": 4}
        assert s["sum"] == 36.0  # 1 + 2 + ... + 8: half the values live in each process
