"""A real single-node SLURM for the tests, and helpers to run the workflow on it.

The cluster is Debian's `slurm-wlm` (22.05) with `munge`, started as root with its own
configuration under ``$MIRAGEFLOW_SLURM_DIR`` (default /var/tmp/mirageflow-slurm) on
non-default ports, so it never touches /etc/slurm or a SLURM the machine already runs.
Every command the tests run finds it through ``SLURM_CONF``.

The node is fake but SLURM is real: 8 CPUs (SlurmdParameters=config_overrides lets a
2-core machine declare them; they are scheduled, not enforced), 4 fake GPUs
(``gres gpu:fake:4`` backed by plain files: SLURM schedules and accounts them but sets no
CUDA_VISIBLE_DEVICES), feature ``fakegpu``, partitions ``cpu`` (default) and ``gpu``.
There is no slurmdbd: job states come from ``squeue``/``scontrol`` (MinJobAge=600 keeps
finished jobs visible for 10 minutes), so accounts and QOS are not validated.

    python tests/slurm_cluster.py start     # install nothing; start munged, slurmctld, slurmd
    python tests/slurm_cluster.py status
    python tests/slurm_cluster.py stop

`.ci/run` installs the packages (as root) and calls `start`; the `slurm_cluster` test
fixture starts the cluster itself when it is not running, and skips with the reason when
that is impossible (not root, packages missing).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(os.environ.get("MIRAGEFLOW_SLURM_DIR", "/var/tmp/mirageflow-slurm"))
CONF = ROOT / "etc" / "slurm.conf"
CTLD_PORT, SLURMD_PORT = 6917, 6918  # not SLURM's 6817/6818: never collide with a real one
NUM_GPUS, NUM_CPUS = 4, 8
PARTITIONS = ("cpu", "gpu")
FEATURE = "fakegpu"
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")


def env() -> dict:
    """The environment every SLURM client command (and the workflow) needs to find this cluster."""
    return {**os.environ, "SLURM_CONF": str(CONF)}


def _which(name: str) -> str | None:
    return shutil.which(name) or next((p for d in ("/usr/sbin", "/sbin") if os.access(p := f"{d}/{name}", os.X_OK)), None)


def unavailable_reason() -> str | None:
    """Why this machine cannot run the test cluster, or None when it can."""
    missing = [b for b in BINARIES if _which(b) is None]
    if running():
        return None
    if missing:
        return (
            f"SLURM test cluster unavailable: {', '.join(missing)} not installed "
            "(as root: apt-get install slurm-wlm munge; `bash .ci/run` does it)"
        )
    if os.geteuid() != 0:
        return "SLURM test cluster unavailable: starting slurmctld/slurmd needs root"
    return None


def _run(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, env=env(), check=check, timeout=timeout)


def running() -> bool:
    """True when our controller answers and the node is usable."""
    if not CONF.exists() or _which("sinfo") is None:
        return False
    try:
        proc = _run("sinfo", "--noheader", "--format=%T", "--nodes", socket.gethostname().split(".")[0], check=False, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    states = proc.stdout.split()
    return proc.returncode == 0 and bool(states) and all(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") for s in states)


def _mem_mb() -> int:
    with open("/proc/meminfo") as f:
        total_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return max(2048, min(16000, total_kb // 1024 - 1024))


def write_config() -> None:
    host = socket.gethostname().split(".")[0]
    for sub in ("etc", "state", "spool", "log", "run", "dev"):
        (ROOT / sub).mkdir(parents=True, exist_ok=True)
    for i in range(NUM_GPUS):
        (ROOT / "dev" / f"fakegpu{i}").touch()
    CONF.write_text(
        f"""# Written by mirageflow tests/slurm_cluster.py: a one-node test cluster.
ClusterName=mirageflow
SlurmctldHost={host}
SlurmctldPort={CTLD_PORT}
SlurmdPort={SLURMD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={ROOT}/state
SlurmdSpoolDir={ROOT}/spool
SlurmctldPidFile={ROOT}/run/slurmctld.pid
SlurmdPidFile={ROOT}/run/slurmd.pid
SlurmctldLogFile={ROOT}/log/slurmctld.log
SlurmdLogFile={ROOT}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=256
SchedulerType=sched/builtin
ReturnToService=2
SlurmdParameters=config_overrides
# Finished jobs stay visible to squeue/scontrol for 10 minutes (there is no slurmdbd).
MinJobAge=600
# Seconds between SIGTERM and SIGKILL for cancelled or timed-out jobs.
KillWait=2
InactiveLimit=0
MaxArraySize=1001
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
GresTypes=gpu
NodeName={host} CPUs={NUM_CPUS} RealMemory={_mem_mb()} Gres=gpu:fake:{NUM_GPUS} Feature={FEATURE} State=UNKNOWN
PartitionName=cpu Nodes={host} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes={host} MaxTime=INFINITE State=UP
"""
    )
    (CONF.parent / "gres.conf").write_text(
        f"NodeName={host} Name=gpu Type=fake File={ROOT}/dev/fakegpu[0-{NUM_GPUS - 1}]\n"
    )


def _start_munge() -> None:
    probe = subprocess.run(["munge", "-n"], capture_output=True) if _which("munge") else None
    if probe is not None and probe.returncode == 0:
        return
    run_dir = MUNGE_SOCKET.parent
    run_dir.mkdir(parents=True, exist_ok=True)
    shutil.chown(run_dir, "munge", "munge")
    # munged refuses to run as root; run it as its own user, as the Debian service does.
    subprocess.run(["runuser", "-u", "munge", "--", _which("munged")], check=True, capture_output=True)
    for _ in range(50):
        if MUNGE_SOCKET.exists():
            return
        time.sleep(0.1)
    raise RuntimeError("munged did not start (no /run/munge/munge.socket.2)")


def _pid(name: str) -> int | None:
    try:
        pid = int((ROOT / "run" / f"{name}.pid").read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def start(timeout: float = 60) -> None:
    """Start munged, slurmctld and slurmd (each only when not running); wait until the node is idle."""
    if running():
        return
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    write_config()
    _start_munge()
    for daemon in ("slurmctld", "slurmd"):
        if _pid(daemon) is None:
            # slurmctld -i: ignore state left by an earlier test cluster (its jobs are gone).
            args = [_which(daemon), "-f", str(CONF)] + (["-i"] if daemon == "slurmctld" else [])
            subprocess.run(args, check=True, capture_output=True, env=env())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running():
            return
        time.sleep(0.5)
        # A node that was down (e.g. after a restart) comes back only when told to.
        _run("scontrol", "update", f"nodename={socket.gethostname().split('.')[0]}", "state=resume", check=False)
    raise RuntimeError(f"SLURM test cluster did not become idle within {timeout:.0f}s; see {ROOT}/log/")


def stop() -> None:
    """Stop slurmd and slurmctld started from this configuration (munged is left running)."""
    for daemon in ("slurmd", "slurmctld"):
        pid = _pid(daemon)
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except OSError:
                    break
                time.sleep(0.1)


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "status"
    if cmd == "start":
        reason = unavailable_reason()
        if reason:
            print(reason, file=sys.stderr)
            return 2
        start()
        print(f"SLURM test cluster up (SLURM_CONF={CONF})")
    elif cmd == "stop":
        stop()
    elif cmd == "status":
        up = running()
        print(f"SLURM test cluster {'up' if up else 'down'} (SLURM_CONF={CONF})")
        return 0 if up else 1
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
