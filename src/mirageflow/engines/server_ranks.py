"""A launched server spanning the nodes of its SLURM job (``execution_params.nodes`` > 1; not an
engine): rank 0 here, ranks 1..N-1 on the job's other nodes, started by ``srun``.

The shard runs on the job's first node (the SLURM plugin's job step: one task, so srun puts it
there). Its engine (sglang_server, vllm_server) builds its server command as for one node;
``NodeSpan.server`` turns it into a ``RankedServer``:

- rank 0: that command plus the engine's rank flags (``RankFlags``: ``--nnodes N`` and where the
  ranks meet, the first node's host and a free port of it) and ``--node-rank 0``; it serves
  the HTTP API on this node, fed as on one node;
- ranks 1..N-1: ONE ``srun`` step, a ``ServerProcess`` of its own (log ``<log>.ranks.log``)::

      srun --nodes=N-1 --ntasks=N-1 --ntasks-per-node=1 --relative=1 --kill-on-bad-exit=1 --label
           [--cpus-per-task=C] --mem=0 --job-name=<server>-ranks
           sh -c 'exec "$@" --node-rank $((SLURM_PROCID + 1))' rank <command> <rank flags> <others' flags>

  ``--relative=1`` starts the step at the allocation's second node (node 0 is rank 0's),
  ``--nodes/--ntasks-per-node`` place one rank per other node, so the task id ``SLURM_PROCID``
  (0..N-2, srun sets it per task) + 1 is the node rank; ``--kill-on-bad-exit`` ends every rank
  when one fails; ``--label`` prefixes each line with its task id, and srun's own error lines
  name the node of a task that died. The step asks for no GPUs: a step is given the job's
  gres on its nodes (srun's ``--gres`` default); ``--mem=0`` is the job's memory of each
  node. The step's inherited ``SLURM_*`` (those of the shard's one-task step, as the plugin's
  job step drops the job's before its own srun) are unset, except the job's identity.

Readiness: rank 0's health endpoint answers only once every rank joined (SGLang and vLLM
initialise their process groups across the nodes before serving). A rank that exits first
fails the start naming the nodes and the ranks' log; a rank that never joins shows as rank 0
never healthy within ``server_start_timeout``, and that message names them too. During the
run, a rank's exit is the server's death (engines/server_restarts.py restarts all ranks, or
gives up), its cause naming the nodes. Teardown (close, a failed start, SIGTERM, interpreter
exit): SIGTERM to rank 0's process group and to the srun (which passes it to every rank),
SIGKILL after the grace; when the job ends SLURM ends any step left.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from mirageflow.engines.base import EngineError
from mirageflow.engines.server_process import LOG_TAIL_LINES, ServerProcess, classify_exit
from mirageflow.errors import EngineDeathClass as D

log = logging.getLogger(__name__)

# What the ranks' srun keeps of the shard step's SLURM_* variables: the job's identity (the
# rest describe the one-task step, and srun would read some as its own options).
KEPT_SLURM = frozenset({"SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME", "SLURM_CONF", "SLURM_SUBMIT_DIR", "SLURM_SUBMIT_HOST"})
RANKS_SETTLE_SECONDS = 2.0  # rank 0 exited: how long its death waits to see whether the ranks' srun ended too
RANK_SHELL = 'echo "mirageflow: engine rank $((SLURM_PROCID + 1)) on $(hostname)"; exec "$@" --node-rank "$((SLURM_PROCID + 1))"'


@dataclass(frozen=True)
class RankFlags:
    """How a server takes its place among N ranks: ``every(nnodes, first_host, port)`` are the
    flags of every rank, ``others`` those of ranks 1..N-1 only (each engine module defines its
    own: SGLang's --dist-init-addr, vLLM's --master-addr and --headless)."""

    every: Callable[[int, str, int], list[str]]
    others: tuple[str, ...] = ()


@dataclass(frozen=True)
class NodeSpan:
    """The N nodes an engine spans: ``hosts`` in SLURM's order (the first is rank 0's, this node)."""

    nodes: int
    hosts: tuple[str, ...]
    cpus_per_task: str | None = None  # the shard step's, given to each rank
    # srun's placement of ranks 1..N-1; empty: one per other node, from the allocation's second
    # (tests on the one-node SLURM test cluster place them beside rank 0 instead)
    placement: tuple[str, ...] = ()

    @classmethod
    def from_slurm(cls, nodes: int, environ: Mapping[str, str] = os.environ) -> NodeSpan:
        """The span of this SLURM job; EngineError when this is not a job of at least ``nodes`` nodes."""
        need = f"execution_params.nodes: {nodes} runs one engine across {nodes} nodes of a SLURM job"
        if not environ.get("SLURM_JOB_ID"):
            raise EngineError(f"{need}, and this is not a SLURM job (no SLURM_JOB_ID): run it on SLURM (profiles/slurm)")
        have = int(environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES") or 1)
        if have < nodes:
            raise EngineError(f"{need}, and job {environ['SLURM_JOB_ID']} holds {have} (SLURM_JOB_NUM_NODES)")
        here = environ.get("SLURMD_NODENAME") or socket.gethostname().split(".")[0]
        hosts = _hostnames(environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST") or "")
        others = [h for h in hosts if h != here] or hosts[1:]
        return cls(nodes, (here, *others[: nodes - 1]), environ.get("SLURM_CPUS_PER_TASK"))

    @property
    def others(self) -> str:
        """The other nodes, for messages."""
        return ", ".join(self.hosts[1:]) or "(not known)"

    def srun(self, command: list[str], name: str) -> list[str]:
        """The srun command that starts ranks 1..N-1 of ``command`` (node rank appended per task)."""
        n = self.nodes - 1
        placement = list(self.placement) or [f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", "--relative=1"]
        cpus = [f"--cpus-per-task={self.cpus_per_task}"] if self.cpus_per_task else []
        job = name.replace(" ", "-").strip("-") + "-ranks"
        return ["srun", *placement, "--kill-on-bad-exit=1", "--label", *cpus, "--mem=0", f"--job-name={job}", "sh", "-c", RANK_SHELL, "rank", *command]  # fmt: skip

    def server(self, name: str, command: list[str], log_path: Path, env: dict | None, flags: RankFlags, dist_port: int) -> RankedServer:
        """Rank 0 of ``command`` here and its other ranks through srun (not started)."""
        every = flags.every(self.nodes, self.hosts[0], dist_port)
        ranks = self.srun([*command, *every, *flags.others], name)
        return RankedServer(name, [*command, *every, "--node-rank", "0"], Path(log_path), env, ranks, self)


def _hostnames(nodelist: str) -> list[str]:
    """SLURM's compressed node list (``n[01-03],m7``) as names, by ``scontrol show hostnames``."""
    if not nodelist:
        return []
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True)
        return out.stdout.split()
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("scontrol show hostnames %s failed (%s); the ranks' nodes are named as listed", nodelist, e)
        return [nodelist]


class RankedServer(ServerProcess):
    """Rank 0 (this ServerProcess) and ``ranks``, the srun of ranks 1..N-1, started, watched and
    stopped as one server."""

    def __init__(self, name: str, command: list[str], log_path: Path, env: dict | None, ranks_command: list[str], span: NodeSpan):
        super().__init__(name, command, log_path, env)
        self.span = span
        unset = tuple(k for k in os.environ if (k.startswith(("SLURM_", "SRUN_", "SBATCH_")) and k not in KEPT_SLURM))
        ranks_log = log_path.with_name(log_path.stem + ".ranks" + log_path.suffix)
        self.ranks = ServerProcess(f"{name}'s ranks 1..{span.nodes - 1} (srun on {span.others})", ranks_command, ranks_log, env, unset)

    def start(self, on_exit: Callable[[int], None] | None = None) -> None:
        def ranks_exited(rc: int) -> None:  # a rank ended while serving: the engine is dead
            if not self.closing and on_exit is not None:
                on_exit(rc)

        self.ranks.start(on_exit=ranks_exited)  # first: they join while rank 0 loads
        try:
            super().start(on_exit)
        except BaseException:
            self.ranks.kill(0.0)
            raise

    def poll(self) -> int | None:
        rc = super().poll()
        return rc if rc is not None else self.ranks.poll()

    def _ranks_said(self) -> str:
        return f"ranks 1..{self.span.nodes - 1} on {self.span.others}; last {LOG_TAIL_LINES} lines of {self.ranks.log_path}:\n{self.ranks.tail()}"

    def exit_cause(self, rc: int) -> tuple[D, str]:
        """A rank's loss when the ranks' srun ended too (rank 0 that loses a rank exits as well,
        often first: its exit waits up to RANKS_SETTLE_SECONDS for theirs), else rank 0's own."""
        deadline = time.monotonic() + RANKS_SETTLE_SECONDS
        while self.ranks.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        ranks_rc = self.ranks.poll()
        others = f"ranks 1..{self.span.nodes - 1} on {self.span.others}"
        if ranks_rc is None:  # rank 0 itself
            death_class, cause = super().exit_cause(rc)
            return death_class, f"{cause} (rank 0; {others} still ran)"
        death_class, cause = classify_exit(ranks_rc, self.ranks.tail())
        return death_class, f"lost a rank: srun of {others} {cause} (log: {self.ranks.log_path})"

    def exited_early(self) -> str | None:
        here = super().exited_early()
        if here is not None:
            return f"{here}\n(other {self._ranks_said()})"
        rc = self.ranks.poll()
        if rc is None:
            return None
        return f"{self.name}: a rank exited (srun code {rc}) before the engine became healthy: {self._ranks_said()}"

    def wait_healthy(
        self, base_url: str, path: str, timeout: float, poll_interval: float = 0.1, timeout_name: str = "server_start_timeout"
    ) -> float:
        try:
            return super().wait_healthy(base_url, path, timeout, poll_interval, timeout_name)
        except EngineError as e:
            if self.ranks.poll() is None and "did not become healthy" in str(e):  # a rank that never joined
                raise EngineError(f"{e}\n(every rank must join first: {self._ranks_said()})") from None
            raise

    def terminate(self) -> None:
        super().terminate()
        self.ranks.terminate()

    def kill(self, grace: float = 15.0) -> None:
        self.ranks.terminate()  # srun passes SIGTERM to every rank while rank 0 stops
        super().kill(grace)
        self.ranks.kill(grace)


def span_details(server: ServerProcess | None) -> dict:
    """What an engine's info shows of a server across nodes (status.json -> engines): its nodes,
    the ranks' log, and which GPUs the shard's NVML sampling saw. {} for a server on one node."""
    if not isinstance(server, RankedServer):
        return {}
    span = server.span
    return {
        "nodes": span.nodes,
        "node_hosts": list(span.hosts),
        "ranks_log": str(server.ranks.log_path),
        "gpu_sampling": f"NVML samples the GPUs of {span.hosts[0]} (rank 0's node) only; num_gpus counts all {span.nodes} nodes'",
    }
