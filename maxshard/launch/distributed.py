"""Multi-host start-up: join this process to the others with `jax.distributed.initialize`, or do nothing.

Where the three facts (coordinator address, process count, this process's id) come from, first found wins, per fact:

    fact          config key                 environment (GKE JobSet / XPK / other launchers)
    address       coordinator_address        JAX_COORDINATOR_ADDRESS (+ JAX_COORDINATOR_PORT when it has no port)
    count         process_count              JAX_PROCESS_COUNT, JAX_NUM_PROCESSES, NNODES
    id            process_id                 JAX_PROCESS_ID, JAX_PROCESS_INDEX, NODE_RANK

XPK sets JAX_COORDINATOR_ADDRESS, JAX_COORDINATOR_PORT, NNODES and NODE_RANK on GPU nodes. On Cloud TPU (GKE sets
TPU_WORKER_HOSTNAMES, and MEGASCALE_* for multi-slice) JAX finds all three itself, so facts left unknown there are
passed as None. A count of one, or no facts at all off a multi-host TPU, is a single-host run: nothing to do.

Why a watchdog: when a peer is missing or the coordinator cannot be reached, JAX's client does not raise; it aborts
the whole process with a C++ stack trace some seconds after its own timeout. The watchdog fires first, at
`distributed_timeout`, prints one line that says what to check, and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import sys
import threading
from collections.abc import Mapping

from maxshard.config import Config
from maxshard.errors import ConfigError

__all__ = ["DistributedInitError", "Plan", "plan", "initialize", "timeout_message", "EXIT_CODE"]

ADDRESS_ENV = ("JAX_COORDINATOR_ADDRESS",)
PORT_ENV = "JAX_COORDINATOR_PORT"
COUNT_ENV = ("JAX_PROCESS_COUNT", "JAX_NUM_PROCESSES", "NNODES")
ID_ENV = ("JAX_PROCESS_ID", "JAX_PROCESS_INDEX", "NODE_RANK")
TPU_HOSTS_ENV = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
_UNSET = "unset"
EXIT_CODE = 2  # same as every other user-facing error of maxshard
_JAX_GRACE_S = 10  # JAX's own deadline sits past ours, so that our one-line message wins the race


class DistributedInitError(ConfigError):
    """Joining the other processes failed; one line that names the address, the count and the key to check."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What `jax.distributed.initialize` gets; None leaves a fact to JAX's Cloud TPU auto-detection."""

    coordinator_address: str | None
    num_processes: int | None
    process_id: int | None
    timeout_s: int
    sources: tuple[str, str, str]  # where address, count and id came from, for error messages

    def describe(self) -> str:
        """'process 1 (process_id) of 2 ($NNODES), coordinator h:1234 (coordinator_address)'."""
        values = (self.coordinator_address, self.num_processes, self.process_id)
        address, count, pid = ("?" if v is None else v for v in values)
        address_src, count_src, pid_src = self.sources
        return f"process {pid} ({pid_src}) of {count} ({count_src}), coordinator {address} ({address_src})"


# --------------------------------------------------------------------------------------------- plan


def _from_env(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[str | None, str]:
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return value, f"${name}"
    return None, _UNSET


def _env_int(environ: Mapping[str, str], names: tuple[str, ...]) -> tuple[int | None, str]:
    raw, source = _from_env(environ, names)
    if raw is None:
        return None, source
    try:
        return int(raw), source
    except ValueError:
        raise ConfigError(f"{source[1:]}={raw!r} is not a whole number") from None


def _resolve_count(cfg: Config, environ: Mapping[str, str]) -> tuple[int | None, str]:
    if cfg.process_count < 0:
        raise ConfigError(f"process_count must be >= 0 (0: from the environment), got {cfg.process_count}")
    if cfg.process_count > 0:
        return cfg.process_count, "process_count"
    return _env_int(environ, COUNT_ENV)


def _resolve_id(cfg: Config, environ: Mapping[str, str]) -> tuple[int | None, str]:
    if cfg.process_id < -1:
        raise ConfigError(f"process_id must be >= 0, or -1 (from the environment), got {cfg.process_id}")
    if cfg.process_id >= 0:
        return cfg.process_id, "process_id"
    return _env_int(environ, ID_ENV)


def _has_port(address: str) -> bool:
    host, sep, port = address.rpartition(":")
    return bool(sep) and port.isdigit() and (host.endswith("]") or ":" not in host)


def _resolve_address(cfg: Config, environ: Mapping[str, str]) -> tuple[str | None, str]:
    if cfg.coordinator_address:
        address, source = cfg.coordinator_address, "coordinator_address"
    else:
        address, source = _from_env(environ, ADDRESS_ENV)
    if address is None or _has_port(address):
        return address, source
    port = environ.get(PORT_ENV, "").strip()
    if port.isdigit():
        return f"{address}:{port}", f"{source} + ${PORT_ENV}"
    raise ConfigError(f"coordinator address {address!r} (from {source}) needs a port: host:port")


def _cloud_tpu_multihost(environ: Mapping[str, str]) -> bool:
    """GKE's TPU env: several hosts in the slice or several slices; JAX then detects everything itself."""
    hosts, _ = _from_env(environ, TPU_HOSTS_ENV)
    slices = environ.get("MEGASCALE_NUM_SLICES", "1").strip()
    return (hosts is not None and len(hosts.split(",")) > 1) or (slices.isdigit() and int(slices) > 1)


def plan(cfg: Config, environ: Mapping[str, str] | None = None) -> Plan | None:
    """Decides from config and environment (no JAX calls) whether and how to join; None: a single-host run."""
    environ = os.environ if environ is None else environ
    if cfg.distributed_timeout < 1:
        raise ConfigError(f"distributed_timeout must be >= 1 second, got {cfg.distributed_timeout}")
    address, address_src = _resolve_address(cfg, environ)
    count, count_src = _resolve_count(cfg, environ)
    pid, pid_src = _resolve_id(cfg, environ)
    auto = _cloud_tpu_multihost(environ)
    if count is None and not auto and address is not None:
        raise ConfigError(
            f"coordinator address {address} (from {address_src}) is set but the process count is unknown; "
            f"set process_count or ${COUNT_ENV[0]}"
        )
    if count is not None and count < 1:
        raise ConfigError(f"process count {count} (from {count_src}) must be >= 1")
    if count == 1 or (count is None and not auto):
        return None
    _check_complete(count, address, pid, (address_src, count_src, pid_src), auto)
    sources = ("found by JAX on Cloud TPU" if s == _UNSET else s for s in (address_src, count_src, pid_src))
    return Plan(address, count, pid, cfg.distributed_timeout, tuple(sources))  # type: ignore[arg-type]


def _check_complete(
    count: int | None, address: str | None, pid: int | None, sources: tuple[str, str, str], auto: bool
) -> None:
    """Off Cloud TPU every fact must be known; ids must fall in [0, count)."""
    if address is None and not auto:
        raise ConfigError(
            f"{count} processes (from {sources[1]}) need a coordinator: set coordinator_address=host:port "
            f"or ${ADDRESS_ENV[0]}"
        )
    if pid is None and not auto:
        raise ConfigError(
            f"{count} processes (from {sources[1]}) need this process's id: set process_id "
            f"or one of {', '.join('$' + n for n in ID_ENV)}"
        )
    if pid is not None and count is not None and not 0 <= pid < count:
        raise ConfigError(f"process id {pid} (from {sources[2]}) must be in [0, {count}) ({count} from {sources[1]})")


# --------------------------------------------------------------------------------------------- initialize


def initialize(cfg: Config, environ: Mapping[str, str] | None = None) -> Plan | None:
    """Joins the other processes of a multi-host run; returns the plan used, or None on a single host.

    Call it once, right after `config.parse` and before anything asks JAX about devices (`config.load`,
    `jax.devices()`, any computation): JAX fixes the device list when its backend starts.
    """
    chosen = plan(cfg, environ)
    if chosen is None:
        return None
    import jax  # deferred: planning alone must not import JAX
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise DistributedInitError(
            "distributed.initialize must run before JAX's first device query; call it right after config.parse"
        )
    _use_gloo_on_cpu(jax)
    watchdog = threading.Timer(chosen.timeout_s, _give_up, args=(chosen,))
    watchdog.daemon = True
    watchdog.start()
    try:
        _join(jax, chosen)
    except Exception as e:  # noqa: BLE001 - every JAX failure here becomes one line
        raise DistributedInitError(f"{_first_line(e)}; {chosen.describe()}") from None
    finally:
        watchdog.cancel()
    return chosen


def _use_gloo_on_cpu(jax: object) -> None:
    """Cross-process CPU collectives need gloo (the default CPU client has none across processes); the setting only
    affects the CPU client."""
    if jax.config.jax_cpu_collectives_implementation != "mpi":  # type: ignore[attr-defined]
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[attr-defined]


_MAX_HEARTBEAT_S = 100


def _join(jax: object, chosen: Plan) -> None:
    jax.distributed.initialize(  # type: ignore[attr-defined]
        coordinator_address=chosen.coordinator_address,
        num_processes=chosen.num_processes,
        process_id=chosen.process_id,
        initialization_timeout=chosen.timeout_s + _JAX_GRACE_S,
        # A dead peer is noticed after this long; then every survivor stops instead of waiting in a collective.
        heartbeat_timeout_seconds=min(chosen.timeout_s, _MAX_HEARTBEAT_S),
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def _give_up(chosen: Plan) -> None:
    """Watchdog: JAX would abort with a stack trace; say instead, in one line, what to check, and exit."""
    print(f"maxshard: error: {timeout_message(chosen)}", file=sys.stderr, flush=True)
    os._exit(EXIT_CODE)


def timeout_message(chosen: Plan) -> str:
    """Why joining took longer than `distributed_timeout`, told from this process's side, naming what to check."""
    address_src, count_src, pid_src = chosen.sources
    head = f"distributed init timed out after {chosen.timeout_s}s (distributed_timeout): {chosen.describe()}"
    if chosen.process_id == 0:
        return f"{head}; not all processes joined this coordinator: check {count_src} and that every host started"
    if chosen.coordinator_address is not None and not _reachable(chosen.coordinator_address):
        return f"{head}; nothing answers at the coordinator: check {address_src} and that process 0 started"
    return f"{head}; the coordinator answers but not all processes joined: check {count_src} and {pid_src}"


def _reachable(address: str, timeout_s: float = 1.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False
