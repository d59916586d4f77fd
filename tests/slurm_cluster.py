"""A one-node SLURM cluster on localhost for the tests: installed if missing (root, Debian's packages), configured in a
temporary directory, started, and stopped again.

Everything is the test's own: its munge key and socket, its slurm.conf (ports picked free, state and spool under the
temporary directory), its daemons (munged, slurmctld, slurmd run in the foreground as children of the test process,
so stopping them is stopping those pids). Clients find it through SLURM_CONF, which `start` returns in the
environment to give them. The configuration avoids what needs systemd or cgroups on a container: proctrack/linuxproc
(slurmstepd signals every process of a step's tree), task/none, no accounting; `ReturnToService=2` returns a node
that went down to service when its slurmd answers again.

Why `release_hold`: SLURM holds a requeued job for a fixed two minutes (its `BeginTime`) before it may start again.
The tests do not wait for that: `scontrol update StartTime=now` makes it eligible (two seconds after the requeue,
see wait_job), as an operator could.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("sbatch", "srun", "scontrol", "squeue", "sinfo", "scancel", "slurmctld", "slurmd", "munged", "mungekey")
PARTITION = "maxshard"
NODE = "localhost"  # the node's name, which jobs see in $SLURM_JOB_NODELIST: one that resolves on any machine


def install() -> str | None:
    """Installs SLURM and munge with apt when a binary is missing; None when ready, else why the tests skip."""
    if all(shutil.which(b) for b in BINARIES):
        return None
    if os.geteuid() != 0:
        return "SLURM is not installed and only root may install it (apt-get install " + " ".join(PACKAGES) + ")"
    if shutil.which("apt-get") is None:
        return "SLURM is not installed and there is no apt-get to install it with"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install_cmd = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    done = subprocess.run(install_cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:  # a fresh machine may have no package lists yet
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, text=True)
        done = subprocess.run(install_cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"apt-get could not install {' '.join(PACKAGES)}: {last}"
    missing = [b for b in BINARIES if shutil.which(b) is None]
    return f"installed, but {missing} are not on PATH" if missing else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slurm_conf(root: Path, host: str, cpus: int) -> str:
    """A one-node cluster: this host, its CPUs, one default partition, state and logs under `root`."""
    return f"""\
ClusterName=maxshardtest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
ReturnToService=2
KillWait=5
MinJobAge=60
InactiveLimit=0
NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


# slurmd builds a cgroup context even when no cgroup plugin is used; this one asks nothing of systemd.
CGROUP_CONF = "CgroupPlugin=autodetect\nIgnoreSystemd=yes\n"


@dataclasses.dataclass
class Cluster:
    root: Path
    env: dict[str, str]  # the caller's environment plus SLURM_CONF: give it to every client and CLI run
    daemons: list[subprocess.Popen]
    cpus: int

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, check=check)

    def logs(self) -> str:
        """The daemons' logs' tails, for a failing test's message."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log"):
            path = self.root / name
            text = path.read_text(errors="replace").splitlines()[-20:] if path.exists() else ["(none)"]
            parts.append(f"== {name}\n" + "\n".join(text))
        return "\n".join(parts)


def _munged(root: Path) -> subprocess.Popen:
    munge = root / "munge"
    munge.mkdir(mode=0o700)
    key = munge / "munge.key"
    subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True)
    key.chmod(0o600)
    return subprocess.Popen(["munged", "--foreground", "--force", f"--socket={munge}/socket", f"--key-file={key}",
                             f"--pid-file={munge}/pid", f"--log-file={munge}/log", f"--seed-file={munge}/seed"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _wait_for(what: str, ready, timeout_s: float, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline or any(p.poll() is not None for p in cluster.daemons):
            stop(cluster)
            raise RuntimeError(f"the test SLURM cluster: {what} did not happen within {timeout_s}s\n{cluster.logs()}")
        time.sleep(0.1)


def start(root: Path, environ: dict[str, str] | None = None) -> Cluster:
    """munged, slurmctld and slurmd on this host, configured in `root`; returns once the node is idle."""
    host = socket.gethostname().split(".")[0]
    cpus = os.cpu_count() or 1
    for sub in ("state", "spool"):
        (root / sub).mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, host, cpus))
    (root / "cgroup.conf").write_text(CGROUP_CONF)
    env = {**(os.environ if environ is None else environ), "SLURM_CONF": str(conf)}
    cluster = Cluster(root, env, [], cpus)
    cluster.daemons.append(_munged(root))
    _wait_for("munged's socket", (root / "munge" / "socket").exists, 10, cluster)
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env}
    cluster.daemons.append(subprocess.Popen(["slurmctld", "-D", "-i", "-f", str(conf)], **quiet))
    cluster.daemons.append(subprocess.Popen(["slurmd", "-D", "-N", NODE, "-f", str(conf)], **quiet))

    def idle() -> bool:
        return cluster.run("sinfo", "-h", "-o", "%T", check=False).stdout.strip() == "idle"

    _wait_for("the node to be idle", idle, 30, cluster)
    return cluster


def stop(cluster: Cluster) -> None:
    """Cancels every job, then stops slurmd, slurmctld and munged (SIGTERM, then SIGKILL after 10 s)."""
    if cluster.daemons and all(p.poll() is None for p in cluster.daemons):
        cluster.run("scancel", "--partition", PARTITION, check=False)
        deadline = time.monotonic() + 15
        while cluster.run("squeue", "-h", check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.2)
    for proc in reversed(cluster.daemons):
        if proc.poll() is None:
            proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    cluster.daemons.clear()


def job_states(cluster: Cluster, job_id: str) -> list[tuple[str, str]]:
    """(state, reason) of the job's (or the array's) tasks still in the queue; [] once all have ended."""
    out = cluster.run("squeue", "-h", "-j", job_id, "-o", "%T|%r", check=False).stdout
    return [tuple(line.split("|", 1)) for line in out.splitlines() if "|" in line]  # type: ignore[misc]


def release_hold(cluster: Cluster, job_id: str) -> None:
    """Lets a requeued job start now instead of after SLURM's fixed hold (module docstring)."""
    cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now", check=False)


# slurmd refuses to start a job whose credential is no newer, to the second, than its last kill ("Job N already
# killed, do not launch batch job"): a hold is released only this long after it was first seen.
_RELEASE_AFTER_S = 2.0


def wait_job(cluster: Cluster, job_id: str, timeout_s: float) -> None:
    """Until the job left the queue (requeue holds released on the way); RuntimeError after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    held_since = None
    while states := job_states(cluster, job_id):
        if not any(reason == "BeginTime" for _, reason in states):
            held_since = None
        elif held_since is None:
            held_since = time.monotonic()
        elif time.monotonic() - held_since >= _RELEASE_AFTER_S:
            release_hold(cluster, job_id)
        if time.monotonic() > deadline:
            cluster.run("scancel", job_id, check=False)
            raise RuntimeError(f"job {job_id} still {states} after {timeout_s}s\n{cluster.logs()}")
        time.sleep(0.2)
