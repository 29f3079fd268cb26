"""One engine across the nodes of a SLURM job (execution_params.nodes > 1; engines/server_ranks.py):
rank 0 started by the engine, ranks 1..N-1 by srun, as one server.

The server is the SGLang stand-in (tests/fakes/fake_sglang_server.py), whose ranks meet over
TCP (fakes/fake_ranks.py) before rank 0 serves; ``srun`` is tests/fakes/fake_srun.py first on
PATH, running the "other nodes'" ranks as processes here with srun's task environment. The
tests marked ``slurm`` use the real srun and sbatch of tests/slurm_cluster.py instead: its one
node holds the "nodes" as tasks of the job, ranks 1..N-1 placed beside rank 0 (NodeSpan.placement).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fakes import FAKES, alive, drive, stand_in_command, vllm_stand_in_command
from fakes.http_engines import processor, req

from mirageflow.config import load_config
from mirageflow.engines.base import EngineError
from mirageflow.engines.server_ranks import NodeSpan
from mirageflow.engines.sglang_server import SGLangServerEngine, ServerDied
from mirageflow.engines.vllm_server import RANKS as VLLM_RANKS
from mirageflow.shard.runner import index_datasets, run_shard


@pytest.fixture
def fast(monkeypatch):
    """Quick health polls and kill grace."""
    monkeypatch.setattr(SGLangServerEngine, "health_poll_interval", 0.05)
    monkeypatch.setattr(SGLangServerEngine, "kill_grace", 2.0)


@pytest.fixture
def job(monkeypatch, tmp_path):
    """This process as the shard step of a 3-node SLURM job, with the srun stand-in on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f'#!/bin/sh\nexec {sys.executable} {FAKES / "fake_srun.py"} "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{__import__('os').environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "3")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    monkeypatch.setenv("SLURMD_NODENAME", "localhost")  # rank 0's node: where the ranks meet
    monkeypatch.setenv("SLURM_STEP_ID", "0")  # the shard's step: srun must not inherit it
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "6")
    return tmp_path


def engine(tmp_path: Path, **fields) -> SGLangServerEngine:
    return SGLangServerEngine(processor(nodes=3, server_args={"tp_size": 3}, **fields), 8, log_dir=tmp_path / "logs")


def argv(log: Path, label: str = "") -> list[list[str]]:
    return [json.loads(a) for a in re.findall(rf"^{label}fake sglang argv: (.*)$", log.read_text(), re.M)]


def pids(log: Path) -> list[int]:
    text = log.read_text()
    found = re.findall(r"fake srun: (?:task \d+ )?pid (\d+)", text) + re.findall(r"rank \d+ of \d+, meeting at \S+, pid (\d+)", text)
    return [int(p) for p in found]


def test_the_ranks_get_their_flags_meet_and_the_engine_serves_from_rank_0(fast, job):
    e = engine(job)
    e.load()
    try:
        done = drive(e, [req(i) for i in range(12)])
        server_pid, srun_pid = e.server.pid, e.server.ranks.pid
    finally:
        e.close()
    assert [c.id for c in done] == list(range(12)) and all(c.error_kind is None for c in done)
    logs = job / "logs"
    [rank0] = argv(logs / "sglang_server.log")
    port = rank0[rank0.index("--dist-init-addr") + 1].rpartition(":")[2]
    assert rank0[-6:] == ["--nnodes", "3", "--dist-init-addr", f"localhost:{port}", "--node-rank", "0"]
    assert "--tp-size" in rank0 and rank0[rank0.index("--tp-size") + 1] == "3"  # tp spans the nodes
    ranks_log = logs / "sglang_server.ranks.log"
    srun_line = re.search(r"^fake srun: (.*)$", ranks_log.read_text(), re.M).group(1).split()
    assert srun_line[:8] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--relative=1", "--kill-on-bad-exit=1", "--label",
                             "--cpus-per-task=6", "--mem=0"]  # fmt: skip
    for task in (0, 1):  # node ranks 1 and 2, each on its node, told where rank 0 waits
        [flags] = argv(ranks_log, f"{task}: ")
        assert flags[:-6] == rank0[:-6]
        assert flags[-6:] == ["--nnodes", "3", "--dist-init-addr", f"localhost:{port}", "--node-rank", str(task + 1)]
        assert f"{task}: mirageflow: engine rank {task + 1} on " in ranks_log.read_text()
    assert "fake rendezvous: all 3 ranks joined" in (logs / "sglang_server.log").read_text()
    left = [p for p in [server_pid, srun_pid, *pids(ranks_log)] if alive(p)]
    assert not left  # no rank on any "node"


def test_a_rank_that_dies_at_start_fails_the_start_naming_its_node_and_log(fast, job, monkeypatch):
    monkeypatch.setenv("FAKE_RANK_EXIT_AT_START", "2")
    e = engine(job)
    with pytest.raises(EngineError) as err:
        e.load()
    message = str(err.value)
    ranks_log = job / "logs" / "sglang_server.ranks.log"
    assert "a rank exited (srun code 3) before the engine became healthy" in message
    assert "srun: error: fakenode2: task 1: Exited with exit code 3" in message  # the node
    assert str(ranks_log) in message and "NCCL error" in message
    assert not [p for p in pids(ranks_log) + pids(job / "logs" / "sglang_server.log") if alive(p)]


def test_a_rank_that_never_joins_fails_the_start_naming_the_ranks_log(fast, job, monkeypatch):
    monkeypatch.setenv("FAKE_RANK_NEVER_JOINS", "1")
    e = engine(job, server_start_timeout=2.0)
    with pytest.raises(EngineError) as err:
        e.load()
    message = str(err.value)
    ranks_log = job / "logs" / "sglang_server.ranks.log"
    assert "did not become healthy within server_start_timeout=2 s" in message
    assert "every rank must join first" in message and str(ranks_log) in message
    assert "0: fake rendezvous: rank 1 stuck before joining" in message
    assert not [p for p in pids(ranks_log) + pids(job / "logs" / "sglang_server.log") if alive(p)]


@pytest.mark.parametrize("restarts", [0, 1])
def test_killing_a_rank_mid_run_fails_or_restarts_every_rank(fast, job, monkeypatch, restarts):
    """A rank SIGKILLed while serving: srun ends the other ranks, rank 0 loses it; the engine
    restarts all of them (max_restarts 1) or fails the requests naming the lost rank (0)."""
    from mirageflow.engines.server_restarts import ServerSupervisor

    monkeypatch.setattr(ServerSupervisor, "restart_base_delay", 0.05)
    monkeypatch.setenv("FAKE_SGLANG_LATENCY", "0.05")
    e = engine(job, max_restarts=restarts, max_retries=0)
    e.load()
    ranks_log = job / "logs" / "sglang_server.ranks.log"
    victim = int(re.search(r"fake srun: task 1 pid (\d+)", ranks_log.read_text()).group(1))
    first = drive(e, [req(i) for i in range(4)])
    try:
        __import__("os").kill(victim, 9)
        deadline = time.monotonic() + 20
        while not e.deaths() and time.monotonic() < deadline:
            time.sleep(0.05)
        [death] = e.deaths()
        assert death["cause"].startswith("lost a rank: srun of ranks 1..2 on ") and str(ranks_log) in death["cause"]
        if restarts:
            later = drive(e, [req(i) for i in range(4, 10)])
            assert [c.id for c in first + later] == list(range(10)) and e.restarts() == 1
        else:
            with pytest.raises(ServerDied, match="lost a rank"):
                drive(e, [req(i) for i in range(4, 10)])
    finally:
        e.close()
    everyone = pids(ranks_log) + pids(job / "logs" / "sglang_server.log")
    assert len(everyone) == 6 * (1 + restarts) and not [p for p in everyone if alive(p)]


def test_the_span_comes_from_the_slurm_job_or_the_engine_refuses_to_start(monkeypatch):
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2", "SLURMD_NODENAME": "n1", "SLURM_JOB_NODELIST": "n1"}
    assert NodeSpan.from_slurm(2, env).hosts[0] == "n1"
    with pytest.raises(EngineError, match="this is not a SLURM job"):
        NodeSpan.from_slurm(2, {})
    with pytest.raises(EngineError, match="job 7 holds 1"):
        NodeSpan.from_slurm(2, {**env, "SLURM_JOB_NUM_NODES": "1"})


def test_vllm_ranks_use_its_multiprocessing_multi_node_flags():
    """vLLM's route: --nnodes/--node-rank with --master-addr/--master-port, ranks > 0 headless (no Ray)."""
    span = NodeSpan(2, ("n1", "n2"))
    server = span.server("the vLLM server", ["vllm", "--model", "m"], Path("/tmp/v.log"), None, VLLM_RANKS, 29600)
    assert server.command == ["vllm", "--model", "m", "--nnodes", "2", "--master-addr", "n1", "--master-port", "29600", "--node-rank", "0"]
    assert (
        server.ranks.command[-9:]
        == ["vllm", "--model", "m", "--nnodes", "2", "--master-addr", "n1", "--master-port", "29600", "--headless"][-9:]
    )
    assert server.ranks.log_path == Path("/tmp/v.ranks.log")


def shard_config(job: Path, rows: int, model: str = "m", backend: str = "sglang_server") -> dict:
    """A one-shard pipeline on ``backend`` (its stand-in) across 3 nodes of 2 GPUs each."""
    data = job / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"row {i}"}) + "\n" for i in range(rows)))
    return {
        "processors": [{"type": "llm", "backend": backend, "server_args": {"model_path": model, "tp_size": 6},
                        "server_command": stand_in_command() if backend == "sglang_server" else vllm_stand_in_command(),
                        "server_start_timeout": 30, "apply_chat_template": False}],
        "loading_params": {"state_dir": str(job / "state"),
                           "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(job / "out"), "output_format": "jsonl"}]},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}],
                              "remove_columns": True, "output_schema": {"q": "{{ q }}", "a": "{{ a }}"}},
        "shard_params": {"checkpoint_rows": 2, "checkpoint_min_seconds": 0},
        "execution_params": {"nodes": 3, "gpus": 2},
    }  # fmt: skip


@pytest.mark.parametrize("backend", ["sglang_server", "vllm_server"])
def test_a_shard_runs_on_an_engine_across_nodes_and_counts_every_nodes_gpus(fast, job, monkeypatch, backend):
    """The shard runner feeds the engine's rank 0 as on one node; its numbers count the GPUs of
    all 3 nodes (this node's 2 each), and its engine details say NVML saw this node's only.
    vLLM's ranks > 0 are --headless (its stand-in refuses otherwise) and meet at --master-addr."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    cfg = load_config(shard_config(job, 10, backend=backend), check_paths=False)
    index_datasets(cfg)
    status = run_shard(cfg, 0)
    st = status["stats"]
    assert st["rows_processed"] == 10 and st["rows_failed"] == 0
    assert st["num_gpus"] == 6  # 3 nodes x 2
    assert st["tokens_per_sec_per_gpu"] * 6 == pytest.approx(st["tokens_per_sec"])
    [engine_info] = status["engines"].values()
    details = engine_info["details"]
    assert details["nodes"] == 3 and details["node_hosts"][0] == "localhost"
    assert details["gpu_sampling"].startswith("NVML samples the GPUs of localhost (rank 0's node) only")
    ranks_log = Path(details["ranks_log"])
    assert "all 3 ranks joined" in Path(details["log"]).read_text()
    assert not [p for p in pids(ranks_log) + pids(Path(details["log"])) if alive(p)]  # every rank ended with the shard


def test_sigterm_to_the_shard_job_ends_every_rank(job, monkeypatch):
    """SLURM's SIGTERM before the time limit reaches the shard job (python -m mirageflow.jobs):
    it commits, writes failure.json, and no rank is left on any node."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("FAKE_SGLANG_LATENCY", "0.2")
    model = job / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    config = job / "pipeline.yaml"
    config.write_text(__import__("yaml").safe_dump(shard_config(job, 400, str(model))))
    index_datasets(load_config(str(config)))
    log = job / "state" / "logs" / "shard_0.log"
    proc = subprocess.Popen([sys.executable, "-m", "mirageflow.jobs", "--config", str(config), "--log", str(log), "shard", "0"])
    server_log = job / "state" / "logs"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        found = list(server_log.rglob("sglang_server.log"))
        if found and "all 3 ranks joined" in found[0].read_text() and list((job / "out").rglob("part-*")):
            break
        time.sleep(0.1)
    [rank0_log] = list(server_log.rglob("sglang_server.log"))
    ranks_log = rank0_log.with_name("sglang_server.ranks.log")
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    failure = json.loads((job / "state/shard_0/failure.json").read_text())
    assert failure["signal"] == "SIGTERM", failure
    everyone = pids(ranks_log) + pids(rank0_log)
    assert len(everyone) == 6 and not [p for p in everyone if alive(p)]  # srun, its 2 tasks (ranks 1, 2), rank 0: none left


@pytest.mark.parametrize("submits", [False, True], ids=["local", "slurm-profile"])
def test_a_run_that_executes_its_jobs_here_is_refused_before_any_job(tmp_path, submits):
    """nodes > 1 needs SLURM's nodes: a local run stops before any job, naming the key; the same
    config with the SLURM profile (a dry run) shows the shard job with its nodes."""
    from conftest import run_workflow

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    extra = ["--profile", str(Path(__file__).resolve().parents[1] / "profiles" / "slurm")] if submits else []
    proc = run_workflow(tmp_path, shard_config(tmp_path, 4, str(model)), "-n", *extra, check=False)
    if submits:
        assert proc.returncode == 0, proc.text[-3000:]
        assert "rule shard:" in proc.text and "nodes=3" in proc.text and "gres=gpu:2" in proc.text
    else:
        assert proc.returncode == 1
        assert "execution_params.nodes: 3 runs each shard's engine across that many nodes of a SLURM job" in proc.text
        assert "rule shard:" not in proc.text


# --------------------------------------------------------------------------- the real srun (tests/slurm_cluster.py)


@pytest.fixture
def real_slurm():
    """The real SLURM of tests/slurm_cluster.py (started here when not running), else a skip."""
    import slurm_cluster

    reason = slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    started_here = slurm_cluster.start()
    yield slurm_cluster
    if started_here:
        slurm_cluster.stop()


# Run as a batch job of 3 tasks on the test cluster's one node: rank 0 in the batch shell, ranks 1
# and 2 through the real srun, placed beside it (the cluster has no second node for --relative=1).
REAL_SRUN_JOB = """
import json, os, re, signal, socket, sys, time
from pathlib import Path
from mirageflow.engines.http import free_port
from mirageflow.engines.server_ranks import NodeSpan
from mirageflow.engines.sglang_server import RANKS
out = Path(sys.argv[1])
host = socket.gethostname().split(".")[0]
span = NodeSpan(3, (host,), placement=("--nodes=1", "--ntasks=2", "--ntasks-per-node=2"))
port = free_port()
command = [sys.executable, sys.argv[2], "--model-path", "m", "--host", "127.0.0.1", "--port", str(port), "--tp-size", "3"]
server = span.server("the SGLang server", command, out / "sglang_server.log", None, RANKS, free_port("0.0.0.0"))
deaths = []
server.start(on_exit=lambda rc: deaths.append(server.exit_cause(rc)[1]))
server.wait_healthy(f"http://127.0.0.1:{port}", "/health_generate", 120)
ranks_log = server.ranks.log_path.read_text()
victim = int(re.search(r"^1: fake rendezvous: rank 2 of 3, meeting at \\S+, pid (\\d+)", ranks_log, re.M).group(1))
os.kill(victim, signal.SIGKILL)
deadline = time.monotonic() + 60
while not deaths and time.monotonic() < deadline:
    time.sleep(0.1)
server.kill(5.0)
(out / "result.json").write_text(json.dumps({"deaths": deaths, "srun_rc": server.ranks.poll()}))
"""


@pytest.mark.slurm
def test_the_ranks_start_under_the_real_srun_and_a_killed_rank_ends_them_all(real_slurm, tmp_path):
    script = tmp_path / "job.py"
    script.write_text(REAL_SRUN_JOB)
    cmd = f"{sys.executable} {script} {tmp_path} {FAKES / 'fake_sglang_server.py'}"
    proc = subprocess.run(
        ["sbatch", "--wait", "--parsable", "--nodes=1", "--ntasks=3", "--cpus-per-task=1", "-t", "5",
         f"--output={tmp_path / 'job.out'}", f"--wrap={cmd}"],
        capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    output = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert proc.returncode == 0, proc.stderr + output
    ranks_log = (tmp_path / "sglang_server.ranks.log").read_text()
    for task in (0, 1):  # SLURM_PROCID from the real srun: node ranks 1 and 2
        [flags] = argv(tmp_path / "sglang_server.ranks.log", f"{task}: ")
        assert flags[-2:] == ["--node-rank", str(task + 1)] and flags[flags.index("--nnodes") + 1] == "3"
    assert "fake rendezvous: all 3 ranks joined" in (tmp_path / "sglang_server.log").read_text()
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["deaths"] and result["deaths"][0].startswith("lost a rank: srun of ranks 1..2"), result
    assert result["srun_rc"] is not None  # --kill-on-bad-exit ended the step
    everyone = [int(p) for p in re.findall(r"meeting at \S+, pid (\d+)", ranks_log + (tmp_path / "sglang_server.log").read_text())]
    assert len(everyone) == 3 and not [p for p in everyone if alive(p)], ranks_log


# Put on the shard job's PYTHONPATH by the test below (as tests/slurm_cluster.py's fault_env does):
# the test cluster has one node, so a span of N nodes is realised as N tasks of the job on it.
# The real NodeSpan.from_slurm reads the job (SLURM_NTASKS standing for its node count); the
# ranks' srun then places ranks 1..N-1 beside rank 0 instead of --relative=1 on other nodes.
TASKS_AS_NODES_SITE = """\
import dataclasses, os
from mirageflow.engines.server_ranks import NodeSpan

_real = NodeSpan.from_slurm.__func__

def _tasks_as_nodes(cls, nodes, environ=os.environ):
    span = _real(cls, nodes, {**environ, "SLURM_JOB_NUM_NODES": environ["SLURM_NTASKS"]})
    others = nodes - 1
    return dataclasses.replace(span, placement=("--nodes=1", f"--ntasks={others}", f"--ntasks-per-node={others}"))

NodeSpan.from_slurm = classmethod(_tasks_as_nodes)
"""


def _wait(what: str, ready, timeout: float, describe) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:.0f} s for {what}; {describe()}")
        time.sleep(0.2)


@pytest.mark.slurm
@pytest.mark.parametrize("restarts", [1, 0])
def test_a_shard_job_on_the_real_slurm_runs_its_engine_as_two_ranks_and_a_killed_rank_restarts_or_fails_it(real_slurm, tmp_path, restarts):
    """A whole shard (python -m mirageflow.jobs) in a real sbatch job of 2 tasks, its engine the
    SGLang stand-in with nodes: 2: rank 0 in the job's shell, rank 1 through the real srun. Rank 1
    sees its flags; SIGKILLed mid-run it takes the engine down: with max_restarts: 1 the shard
    restarts both ranks and completes with every row once, with 0 the job fails naming the lost
    rank (the rows written so far once each). Either way no rank and no job is left."""
    model = tmp_path / "model"  # its path in every rank's argv: the marker ps looks for
    model.mkdir()
    (model / "config.json").write_text("{}")
    rows = 120
    cfg = shard_config(tmp_path, rows, str(model))
    proc_cfg = cfg["processors"][0]
    proc_cfg["server_args"] = {"model_path": str(model), "tp_size": 2, "extra_engine_args": {"max_running_requests": 2}}
    proc_cfg.update(max_restarts=restarts, server_start_timeout=180)
    cfg["execution_params"] = {"nodes": 2, "gpus": 1}
    config = tmp_path / "pipeline.yaml"
    config.write_text(__import__("yaml").safe_dump(cfg))
    index_datasets(load_config(str(config)))
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(TASKS_AS_NODES_SITE)
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, (site, repo / "src", repo / "tests"))),
           "CUDA_VISIBLE_DEVICES": "0", "FAKE_SGLANG_LATENCY": "0.2"}  # fmt: skip
    job_out = tmp_path / "job.out"
    shard = f"{sys.executable} -m mirageflow.jobs --config {config} --log {tmp_path / 'shard_0.log'} shard 0"
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--cpus-per-task=1", "-t", "10", "--job-name=ranks-shard",
         f"--output={job_out}", f"--chdir={tmp_path}", f"--wrap={shard}"],
        capture_output=True, text=True, timeout=60, env=env, check=True,
    )  # fmt: skip
    jobid = submitted.stdout.strip().split(";")[0]

    def queued() -> bool:
        listed = subprocess.run(["squeue", "--noheader", "--format=%i", f"--jobs={jobid}"], capture_output=True, text=True)
        return jobid in listed.stdout.split()

    def said() -> str:
        logs = [job_out, tmp_path / "shard_0.log", *sorted((tmp_path / "state").rglob("sglang_server*.log"))]
        return "\n".join(f"--- {p}:\n{p.read_text()[-2000:]}" for p in logs if p.exists())

    try:
        logs = tmp_path / "state"
        rank0_log = lambda: next(iter(sorted(logs.rglob("sglang_server.log"))), None)  # noqa: E731
        _wait("both ranks to join and the first rows to be written",
              lambda: rank0_log() is not None and "all 2 ranks joined" in rank0_log().read_text()
              and list((tmp_path / "out").rglob("part-*")), 300, said)  # fmt: skip
        ranks_log = rank0_log().with_name("sglang_server.ranks.log")
        first = re.search(r"^0: fake rendezvous: rank 1 of 2, meeting at \S+, pid (\d+)", ranks_log.read_text(), re.M)
        assert first, said()
        os.kill(int(first.group(1)), signal.SIGKILL)  # rank 1, mid-run
        _wait(f"job {jobid} to leave squeue", lambda: not queued(), 300, said)
    finally:
        if queued():
            subprocess.run(["scancel", jobid])
    # no rank left (their argv holds the model's path) and no job or step in the queue
    ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True, check=True).stdout
    assert not [line for line in ps.splitlines() if str(model) in line], ps
    steps = subprocess.run(["squeue", "--noheader", "--steps", "--format=%i"], capture_output=True, text=True).stdout
    assert not queued() and not [s for s in steps.split() if s.startswith(f"{jobid}.")], steps
    # rank 1 (the srun's task 0), at each start, was told its place and where rank 0 waits
    host = real_slurm._host()
    rank0_starts, rank1_starts = argv(rank0_log()), argv(ranks_log, "0: ")
    assert len(rank0_starts) == len(rank1_starts) == 1 + restarts, said()  # the start and any restart
    for rank0, rank1 in zip(rank0_starts, rank1_starts):
        addr = rank0[rank0.index("--dist-init-addr") + 1]
        assert addr.startswith(f"{host}:") and rank1[:-6] == rank0[:-6], (rank0, rank1)
        assert rank1[-6:] == ["--nnodes", "2", "--dist-init-addr", addr, "--node-rank", "1"], rank1
    state = real_slurm.job(jobid)
    written = [json.loads(line) for p in sorted((tmp_path / "out").rglob("*.jsonl")) for line in p.read_text().splitlines()]
    if not restarts:  # the engine is not restarted: the shard fails, naming the lost rank
        assert state.get("JobState") == "FAILED", f"{state}\n{said()}"
        failure = json.loads(next((tmp_path / "state").rglob("shard_0/failure.json")).read_text())
        assert "lost a rank: srun of ranks 1..1" in json.dumps(failure), failure
        assert 0 < len(written) < rows and len({r["q"] for r in written}) == len(written), said()
        return
    assert state.get("JobState") == "COMPLETED" and state.get("ExitCode") == "0:0", f"{state}\n{said()}"
    # every row once
    assert sorted(r["q"] for r in written) == sorted(f"row {i}" for i in range(rows)), said()
    # the shard saw the rank's loss and restarted the engine once
    status = json.loads(next((tmp_path / "state").rglob("shard_0/status.json")).read_text())
    assert status["stats"]["rows_processed"] == rows and status["stats"]["rows_failed"] == 0, status["stats"]
    [death] = status["stats"]["engine_deaths"]
    assert status["stats"]["engine_restarts"] == 1 and death["cause"].startswith("lost a rank: srun of ranks 1..1"), death
    assert str(ranks_log) in death["cause"] and death["class"] == "killed_by_signal", death
