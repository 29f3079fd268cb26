"""A real single-node SLURM for the tests, and helpers to run the workflow on it.

The cluster is Debian's `slurm-wlm` (22.05) with `munge`, started as root. Its
configuration is /etc/slurm/slurm.conf, where SLURM's commands look by default (the SLURM
plugin's job step drops every SLURM_* variable, SLURM_CONF included, before its `srun`).
It is written only when absent or written by this module before: a machine with its own
SLURM configuration there is left alone, and the tests skip. State, spool and logs live
under ``$MIRAGEFLOW_SLURM_DIR`` (default /var/tmp/mirageflow-slurm); the daemons listen
on non-default ports.

The node is fake but SLURM is real: 16 CPUs (SlurmdParameters=config_overrides lets a
2-core machine declare them; they are scheduled, not enforced), 8 fake GPUs
(``gres gpu:fake:8`` backed by plain files: SLURM schedules and accounts them but sets no
CUDA_VISIBLE_DEVICES), feature ``fakegpu``, partitions ``cpu`` (default) and ``gpu``.
There is no slurmdbd: job states come from ``squeue``/``scontrol`` (MinJobAge=600 keeps
finished jobs visible for 10 minutes), and accounts and QOS are accepted unchecked. SLURM's
job completion log (jobcomp/filetxt) is on, so ``sacct --completion`` (the report's cluster
accounting) has each finished job's state, times and CPUs, not its CPU time or memory.
Jobs run at the nice value of whoever submitted them (PropagatePrioProcess=1).

    python tests/slurm_cluster.py start     # installs nothing; starts munged, slurmctld, slurmd
    python tests/slurm_cluster.py status
    python tests/slurm_cluster.py stop

`.ci/run` installs the packages (as root) and calls `start`; the `cluster` fixture of
tests/test_slurm.py starts the cluster itself when it is not running, and skips with the
reason when that is impossible (not root, packages missing).

Faults for the tests are injected from outside the project: ``fault_env`` puts a
``sitecustomize.py`` on PYTHONPATH that, only when a shard job calls the shard runner and
only for the listed (shard, attempt) pairs, fails or hangs before handing over to the real
``mirageflow.shard.runner.run_shard``. Everything else (sbatch, the plugin's job step, srun,
Snakemake in the job, the shard runner) is the real thing.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
ROOT = Path(os.environ.get("MIRAGEFLOW_SLURM_DIR", "/var/tmp/mirageflow-slurm"))
CONF = Path("/etc/slurm/slurm.conf")
MARKER = "# Written by mirageflow tests/slurm_cluster.py"
CTLD_PORT, SLURMD_PORT = 6917, 6918  # not SLURM's 6817/6818
NUM_GPUS, NUM_CPUS = 8, 16
FEATURE = "fakegpu"
MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")

# Test-only overrides of profiles/slurm: poll every second (the plugin adds 10 s per poll
# that saw nothing finish, and resets when a job finishes), squeue (no slurmdbd here), keep
# every job's SLURM log, and log the sbatch calls (--verbose).
FAST_POLLING = [
    "--slurm-status-command", "squeue",
    "--slurm-init-seconds-before-status-checks", "1",
    "--seconds-between-status-checks", "1",
    "--latency-wait", "5",
    "--slurm-keep-successful-logs",
    "--verbose",
]  # fmt: skip


# --------------------------------------------------------------------------- the cluster


def _host() -> str:
    return socket.gethostname().split(".")[0]


def _which(name: str) -> str | None:
    found = shutil.which(name)
    if found:
        return found
    for d in ("/usr/sbin", "/sbin"):
        if os.access(f"{d}/{name}", os.X_OK):
            return f"{d}/{name}"
    return None


def ours() -> bool:
    """True when /etc/slurm/slurm.conf is absent or was written by this module."""
    try:
        return CONF.read_text().startswith(MARKER)
    except FileNotFoundError:
        return True


def unavailable_reason() -> str | None:
    """Why this machine cannot run the test cluster, or None when it can."""
    if not ours():
        return f"SLURM test cluster unavailable: {CONF} exists and was not written by tests/slurm_cluster.py; not touching it"
    missing = [b for b in BINARIES if _which(b) is None]
    if missing:
        return (
            f"SLURM test cluster unavailable: {', '.join(missing)} not installed "
            "(as root: apt-get install slurm-wlm munge, which `bash .ci/run` does)"
        )
    if running():
        return None
    if os.geteuid() != 0:
        return "SLURM test cluster unavailable: not root (starting munged, slurmctld and slurmd needs root)"
    return None


def _run(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout)


def running() -> bool:
    """True when our controller answers and the node takes jobs."""
    if not CONF.exists() or not ours() or _which("sinfo") is None:
        return False
    try:  # generous: on a loaded 2-core machine sinfo can take seconds
        proc = _run("sinfo", "--noheader", "--format=%T", "--nodes", _host(), check=False, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    states = proc.stdout.split()
    return proc.returncode == 0 and bool(states) and all(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") for s in states)


def _mem_mb() -> int:
    with open("/proc/meminfo") as f:
        total_kb = int(next(line for line in f if line.startswith("MemTotal")).split()[1])
    return max(2048, min(16000, total_kb // 1024 - 1024))


def config_text() -> str:
    host = _host()
    return f"""{MARKER}: a one-node test cluster.
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
# Jobs run at the nice value of the process that submitted them: `nice -n 10` on a driver
# (a benchmark) makes its shard jobs yield the CPUs too.
PropagatePrioProcess=1
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Job completion records (state, times, CPUs) for `sacct --completion`: accounting without
# slurmdbd. They carry no CPU time or memory use (those need slurmdbd).
JobCompType=jobcomp/filetxt
JobCompLoc={ROOT}/log/jobcomp.txt
GresTypes=gpu
NodeName={host} CPUs={NUM_CPUS} RealMemory={_mem_mb()} Gres=gpu:fake:{NUM_GPUS} Feature={FEATURE} State=UNKNOWN
PartitionName=cpu Nodes={host} Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes={host} MaxTime=INFINITE State=UP
"""


def write_config() -> None:
    CONF.parent.mkdir(parents=True, exist_ok=True)
    for sub in ("state", "spool", "log", "run", "dev"):
        (ROOT / sub).mkdir(parents=True, exist_ok=True)
    for i in range(NUM_GPUS):
        (ROOT / "dev" / f"fakegpu{i}").touch()
    CONF.write_text(config_text())
    (CONF.parent / "gres.conf").write_text(f"{MARKER}\nNodeName={_host()} Name=gpu Type=fake File={ROOT}/dev/fakegpu[0-{NUM_GPUS - 1}]\n")


def _start_munge() -> None:
    if _which("munge") and subprocess.run(["munge", "-n"], capture_output=True).returncode == 0:
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


def start(timeout: float = 60) -> bool:
    """Start munged, slurmctld and slurmd (each unless running); wait until the node is idle.

    A cluster started from an older version of this configuration is restarted. True when
    this call started the daemons, False when they were running already (whoever started
    them stops them): judged by their pid files, not by sinfo, which can time out under load
    and must not make a caller stop or restart a cluster that others' jobs run on.
    """
    reason = unavailable_reason()
    if reason:
        raise RuntimeError(reason)
    if _pid("slurmctld") and _pid("slurmd") and CONF.exists() and CONF.read_text() == config_text():
        deadline = time.monotonic() + timeout
        while not running():
            if time.monotonic() > deadline:
                raise RuntimeError(f"SLURM test cluster runs but its node is not up within {timeout:.0f}s; see {ROOT}/log/")
            time.sleep(0.5)
        return False
    stop()
    write_config()
    _start_munge()
    for daemon in ("slurmctld", "slurmd"):
        # slurmctld -i: ignore the state an earlier test cluster left (its jobs are gone).
        args = [_which(daemon), "-f", str(CONF)] + (["-i"] if daemon == "slurmctld" else [])
        subprocess.run(args, check=True, capture_output=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if running():
            return True
        time.sleep(0.5)
        # A node marked down (e.g. after an unclean stop) comes back only when told to.
        _run("scontrol", "update", f"nodename={_host()}", "state=resume", check=False)
    raise RuntimeError(f"SLURM test cluster did not become idle within {timeout:.0f}s; see {ROOT}/log/")


def stop() -> None:
    """Stop the slurmd and slurmctld started from this configuration (munged keeps running)."""
    for daemon in ("slurmd", "slurmctld"):
        pid = _pid(daemon)
        if pid is None:
            continue
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            try:
                os.kill(pid, 0)
            except OSError:
                break
            time.sleep(0.1)


def node_cpu_seconds() -> float | None:
    """CPU seconds used by slurmd and every job it started since it was moved into our cgroup.

    The first call moves the running slurmd into a cpuacct cgroup (v1, or v2's cpu.stat);
    everything it forks after that (slurmstepd, the jobs) is counted there, whoever's child
    it becomes. The benchmarks take the difference of two calls: the compute node's CPU
    cost of a run, apart from the driver and from whatever else the machine runs. None
    where no such cgroup can be made (not root, no cgroup filesystem).
    """
    pid = _pid("slurmd")
    v2 = Path("/sys/fs/cgroup/cgroup.controllers").exists()
    group = Path("/sys/fs/cgroup" if v2 else "/sys/fs/cgroup/cpuacct") / "mirageflow-slurmd"
    try:
        group.mkdir(exist_ok=True)
        if pid is not None and str(pid) not in (group / "cgroup.procs").read_text().split():
            (group / "cgroup.procs").write_text(str(pid))
        if v2:
            usage = next(line for line in (group / "cpu.stat").read_text().splitlines() if line.startswith("usage_usec"))
            return int(usage.split()[1]) / 1e6
        return int((group / "cpuacct.usage").read_text()) / 1e9
    except (OSError, StopIteration, ValueError):
        return None


# --------------------------------------------------------------------------- jobs


def job(jobid: str) -> dict:
    """`scontrol show job` as a dict (one entry per KEY=VALUE; array tasks by <id>_<task>)."""
    out = _run("scontrol", "show", "job", "--oneliner", jobid).stdout.strip()
    info = {}
    for item in re.findall(r"(\S+?)=(.*?)(?=\s+\S+?=|$)", out):
        info.setdefault(item[0], item[1].strip())
    return info


def jobs_named(name: str) -> list[dict]:
    """Every job (finished ones too, for MinJobAge) whose name is ``name``, oldest first."""
    out = _run("squeue", "--noheader", "--states=all", "--name", name, "--format=%i").stdout.split()
    return [job(j) for j in sorted(set(out), key=lambda j: [int(x) for x in j.split("_") if x.isdigit()])]


def cancel_named(name: str) -> None:
    _run("scancel", "--name", name, check=False)


# --------------------------------------------------------------------------- faults

SITECUSTOMIZE = '''\
"""Test-only fault injection for mirageflow shard jobs (written by tests/slurm_cluster.py).

$MIRAGEFLOW_TEST_FAULTS is JSON {"<shard>": {"<attempt>": "fail" | "hang"}}. When a
shard job calls the shard runner, and only for those (shard, attempt) pairs, it records a
marker file in $MIRAGEFLOW_TEST_FAULTS_DIR (holding the SLURM job id) and fails (exit 3)
or hangs until SLURM kills the job; otherwise the real mirageflow.shard.runner.run_shard runs.
"""
import os
import sys

if os.environ.get("MIRAGEFLOW_TEST_FAULTS"):
    import json
    import time
    from pathlib import Path

    from mirageflow import shard as _shard_module

    _faults = json.loads(os.environ["MIRAGEFLOW_TEST_FAULTS"])
    _real = _shard_module.run_shard

    def _run_shard(cfg, shard_id, attempt=1, **kwargs):
        shard = str(shard_id)
        action = _faults.get(shard, {}).get(str(attempt))
        if action:
            marker = Path(os.environ["MIRAGEFLOW_TEST_FAULTS_DIR"]) / f"shard{shard}.attempt{attempt}.{action}"
            marker.write_text(os.environ.get("SLURM_JOB_ID", ""))
            print(f"TEST FAULT: {action} in shard {shard}, attempt {attempt}", file=sys.stderr, flush=True)
            if action == "fail":
                sys.exit(3)
            while True:
                time.sleep(60)
        return _real(cfg, shard_id, attempt=attempt, **kwargs)

    _shard_module.run_shard = _run_shard
'''


def fault_env(directory: Path, faults: dict) -> dict:
    """Environment for a driver whose shard jobs meet ``faults`` (sbatch --export=ALL passes it on)."""
    site = directory / "faults_site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    markers = directory / "faults"
    markers.mkdir(exist_ok=True)
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "PYTHONPATH": path,
        "MIRAGEFLOW_TEST_FAULTS": json.dumps(faults),
        "MIRAGEFLOW_TEST_FAULTS_DIR": str(markers),
    }


# --------------------------------------------------------------------------- workflow runs


def write_rows(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"text": f"Passage {i} about the sea and the wind."}) + "\n" for i in range(n)))
    return path


def openai_pipeline(config: dict, base_url: str, **shard_params) -> dict:
    """``config`` with its processor switched to the ``openai`` backend at ``base_url``
    (tests/fakes/fake_http.py's server: a cheap engine whose speed the test sets)."""
    proc = config["processors"][0]
    proc.update(backend="openai", base_url=base_url, server_args={"model_path": "fake-model"})
    if shard_params:
        config["shard_params"] = shard_params
    return config


def pipeline_config(model: Path, data: Path, num_shards: int, **execution_params) -> dict:
    return {
        "processors": [
            {
                "type": "llm",
                "backend": "transformers",
                "server_args": {"model_path": str(model)},
                "default_sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
            }
        ],
        "loading_params": {
            "state_dir": "state",
            "datasets": [{"path": str(data), "type": "JSONL", "output_dir": "out"}],
            "num_shards": num_shards,
            "batch_size": 4,
        },
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}],
            "outputs": [{"name": "summary", "type": "llm", "prompt": "Summarise: {{ text }}"}],
        },
        "execution_params": execution_params,
    }


class Run:
    """One `python -m snakemake --profile profiles/slurm` driver, started in the background."""

    def __init__(self, workdir: Path, config: dict, *extra: str, env: dict | None = None, name: str = "driver"):
        self.workdir = workdir
        cfg_path = workdir / "pipeline.yaml"
        cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log = workdir / f"{name}.log"
        self.cmd = [
            sys.executable, "-m", "snakemake",
            "--snakefile", str(REPO / "Snakefile"),
            "--directory", str(workdir),
            "--configfile", str(cfg_path),
            "--profile", str(REPO / "profiles" / "slurm"),
            *FAST_POLLING,
            *extra,
        ]  # fmt: skip
        self.started = time.monotonic()
        self.seconds: float | None = None
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=workdir, start_new_session=True)

    @property
    def output(self) -> str:
        return self.log.read_text()

    def run_id(self) -> str:
        m = re.search(r"SLURM run ID: (\S+)", self.output)
        assert m, f"no SLURM run ID in the driver's output:\n{self.output[-3000:]}"
        return m.group(1)

    def wait(self, timeout: float = 600) -> int:
        """Wait for the driver (``timeout`` counts from its start); stop it when it runs over."""
        try:
            rc = self.proc.wait(timeout=max(1.0, timeout - (time.monotonic() - self.started)))
        except subprocess.TimeoutExpired:
            self.stop()
            raise AssertionError(f"snakemake ran over {timeout:.0f}s:\n{self.output[-6000:]}") from None
        if self.seconds is None:
            self.seconds = time.monotonic() - self.started
        return rc

    def stop(self) -> None:
        """Kill the driver if it still runs, and cancel whatever jobs of this run are left."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        m = re.search(r"SLURM run ID: (\S+)", self.output)
        if m:
            cancel_named(m.group(1))

    def sbatch_calls(self) -> list[str]:
        """The sbatch command lines the plugin ran (--verbose), in order.

        An array whose command line is too long for --wrap is logged twice (the plugin
        retries it through /dev/stdin); ``submissions()`` counts what SLURM accepted.
        """
        calls = re.findall(r"^(?:Submitting array job with )?sbatch call: (sbatch .*)$", self.output, re.MULTILINE)
        return [c for i, c in enumerate(calls) if not (c.endswith(" /dev/stdin") and i and "--array=" in calls[i - 1]
                and calls[i - 1].split(" --wrap=")[0] == c[: -len(" /dev/stdin")])]  # fmt: skip

    def submissions(self) -> list[str]:
        """The SLURM job id of every successful sbatch submission (a plain job or a whole array)."""
        found = re.findall(
            # a group job's Snakemake id is a UUID
            r"^(?:Job \S+ has been submitted with SLURM jobid (\d+) |Submitted array job with Snakemake IDs \S+ and SLURM job ID (\d+)\.)",
            self.output, re.MULTILINE,
        )  # fmt: skip
        return [plain or array for plain, array in found]

    def submitted_jobs(self) -> dict[int, list[str]]:
        """Shard -> the SLURM jobs that ran it, oldest first: plain job ids and array tasks (``<array>_<task>``).

        Read from the driver's --verbose output (each job's block names its Snakemake jobid
        and wildcards; the plugin logs which SLURM job or array task got each jobid): every
        task of an array carries the first shard's --comment, so the comment cannot tell.
        """
        shard_of: dict[str, int] = {}
        jobid = None
        for line in self.output.splitlines():
            if line.startswith("rule ") or line.startswith("localrule "):
                jobid = None if line != "rule shard:" else ""
            elif jobid is not None and line.startswith("    jobid: "):
                jobid = line.split(": ", 1)[1].strip()
            elif jobid and line.startswith("    wildcards: shard="):
                shard_of[jobid] = int(line.split("=", 1)[1])
        found: dict[int, list[str]] = {}
        for m in re.finditer(
            r"^(?:Job (\d+) has been submitted with SLURM jobid (\d+) |Registered array job task: external_jobid=(\S+), snakemake_jobid=(\d+))",
            self.output, re.MULTILINE,
        ):  # fmt: skip
            snakemake_id, slurm_id = (m[1], m[2]) if m[1] else (m[4], m[3])
            if snakemake_id in shard_of:
                found.setdefault(shard_of[snakemake_id], []).append(slurm_id)
        return found

    def jobs(self) -> list[dict]:
        return jobs_named(self.run_id())

    def shard_jobs(self, shard: int) -> list[dict]:
        """The SLURM jobs (or array tasks) that ran shard ``shard``, oldest first, as ``scontrol`` shows them."""
        return [job(j) for j in self.submitted_jobs().get(shard, [])]


def wait_for(path: Path, timeout: float, run: Run) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if run.proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"{path} did not appear within {timeout:.0f}s:\n{run.output[-4000:]}")


def wait_for_any(paths: list[Path], timeout: float, run: Run) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for path in paths:
            if path.exists():
                return path
        if run.proc.poll() is not None:
            break
        time.sleep(0.5)
    raise AssertionError(f"none of {[str(p) for p in paths]} appeared within {timeout:.0f}s:\n{run.output[-4000:]}")


# --------------------------------------------------------------------------- CLI


def main(argv: list[str]) -> int:
    cmd = argv[1] if len(argv) > 1 else "status"
    if cmd == "start":
        reason = unavailable_reason()
        if reason:
            print(reason, file=sys.stderr)
            return 2
        start()
        print(f"SLURM test cluster up ({CONF})")
    elif cmd == "stop":
        stop()
    elif cmd == "status":
        up = running()
        print(f"SLURM test cluster {'up' if up else 'down'} ({CONF})")
        return 0 if up else 1
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
