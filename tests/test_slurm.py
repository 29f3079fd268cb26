"""The workflow on a real SLURM: `python -m snakemake --profile profiles/slurm`, tiny model.

A one-node SLURM with fake GPUs (tests/slurm_cluster.py) is started when absent; without
root or the slurm-wlm/munge packages these tests skip and say why. Two workflows run side
by side to keep the suite short (the second mostly waits on a time limit):

- run "ok": 3 shards, every SLURM option set from execution_params; shard 2's first
  attempt fails, the profile's retry resubmits it with twice the time limit.
- run "faults" (`--retries 0`): shard 0's job is cancelled with scancel while it runs,
  shard 1 hangs past its 1-minute time limit. The driver reports both failed; a rerun
  (as a job array) completes them.

Faults are injected from outside the project (see slurm_cluster.fault_env).
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

import slurm_cluster
from slurm_cluster import Run

pytestmark = pytest.mark.slurm

TIME_LIMIT, RETRY_TIME_LIMIT = "00:05:00", "00:10:00"  # attempt 1, attempt 2 (x2)
OK_EXEC = {
    "account": "mf-acct",
    "partition": "gpu",
    "qos": "normal",
    "cpus_per_task": 2,
    "mem": "1G",
    "time_limit": TIME_LIMIT,
    "constraint": slurm_cluster.FEATURE,
    "slurm_extra": "--nice=7",
}  # gpus unset: tp_size 2 x dp_size 1 = 2 GPUs per shard


@pytest.fixture(scope="module")
def cluster():
    reason = slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    started_here = not slurm_cluster.running()
    slurm_cluster.start()
    yield
    if started_here:
        slurm_cluster.stop()


@pytest.fixture(scope="module")
def runs(cluster, tiny_model, tmp_path_factory):
    ok_dir, faults_dir = tmp_path_factory.mktemp("slurm_ok"), tmp_path_factory.mktemp("slurm_faults")

    ok_cfg = slurm_cluster.pipeline_config(tiny_model, slurm_cluster.write_rows(ok_dir / "in.jsonl", 9), 3, **OK_EXEC)
    ok_cfg["processors"][0]["server_args"]["tp_size"] = 2
    ok = Run(ok_dir, ok_cfg, env=slurm_cluster.fault_env(ok_dir, {"2": {"1": "fail"}}))

    faults_cfg = slurm_cluster.pipeline_config(
        tiny_model, slurm_cluster.write_rows(faults_dir / "in.jsonl", 6), 2,
        partition="gpu", gpus=1, cpus_per_task=1, time_limit="00:01:00",
    )  # fmt: skip
    faults = Run(
        faults_dir, faults_cfg, "--retries", "0",
        env=slurm_cluster.fault_env(faults_dir, {"0": {"1": "hang"}, "1": {"1": "hang"}}),
    )  # fmt: skip
    try:
        # Shard 0's job is running its shard step: cancel it mid-run.
        jobid = slurm_cluster.wait_for(faults_dir / "faults" / "shard0.attempt1.hang", 300, faults)
        subprocess.run(["scancel", jobid], check=True)
        ok.wait(600)
        faults.wait(600)
        # What the failed run left, before the rerun test changes it.
        faults.left = sorted(str(f.relative_to(faults_dir)) for f in (faults_dir / "state").rglob("*.json"))
        yield {"ok": ok, "faults": faults}
    finally:
        for run in (ok, faults):
            run.stop()
        print(f"\nSLURM runs side by side: ok {ok.seconds or 0:.0f}s, faults {faults.seconds or 0:.0f}s")


def _metrics(workdir) -> dict:
    return json.loads((workdir / "state" / "metrics.json").read_text())["aggregate"]


def test_all_shards_complete_through_sbatch(runs):
    ok = runs["ok"]
    assert ok.proc.returncode == 0, ok.output[-6000:]
    for shard in range(3):
        final = ok.shard_jobs(shard)[-1]
        assert final["JobState"] == "COMPLETED"
        status = json.loads((ok.workdir / "state" / f"shard_{shard}" / "status.json").read_text())
        assert status["status"] == "success" and status["slurm_job_id"] == final["JobId"]
    index_jobs = [j for j in ok.jobs() if j["Comment"] == "rule_index_dataset_wildcards_0"]
    assert [j["JobState"] for j in index_jobs] == ["COMPLETED"]
    agg = _metrics(ok.workdir)
    assert agg["completed_shards"] == agg["total_shards"] == 3 and agg["total_rows_processed"] == 9
    assert (ok.workdir / "state" / "summary.md").exists()


def test_sbatch_requests_come_from_execution_params(runs):
    ok = runs["ok"]
    shard_calls = [c for c in ok.sbatch_calls() if "--comment rule_shard_" in c]
    assert len(shard_calls) == 4, ok.sbatch_calls()  # 3 shards + 1 retry
    for call in shard_calls:
        for flag in ("-A mf-acct", "-p gpu", "--qos=normal", "-C fakegpu", "--mem 1024", "--gpus=2", "--cpus-per-task=2", "--nice=7"):
            assert f" {flag} " in f" {call} ", (flag, call)
        assert "--job-name mirageflow_" in call
    for shard in range(3):
        for j in ok.shard_jobs(shard):  # what SLURM granted, read back
            assert (j["Account"], j["Partition"], j["Features"], j["Nice"]) == ("mf-acct", "gpu", "fakegpu", "7")
            assert j["TresPerJob"] == "gres:gpu:2" and j["NumCPUs"] == "2" and j["MinMemoryNode"] == "1G"
    first = [ok.shard_jobs(s)[0]["TimeLimit"] for s in range(3)]
    assert first == [TIME_LIMIT] * 3
    # The index job is light: 1 CPU, no GPU, same account and partition.
    (index_call,) = [c for c in ok.sbatch_calls() if "--comment rule_index_dataset_" in c]
    assert " -A mf-acct " in index_call and " -p gpu " in index_call and "--cpus-per-task=1" in index_call
    assert "--gpus" not in index_call and "--gres" not in index_call


def test_failed_attempt_is_retried_with_a_longer_time_limit(runs):
    ok = runs["ok"]
    first, second = ok.shard_jobs(2)
    assert (first["JobState"], first["TimeLimit"]) == ("FAILED", TIME_LIMIT)
    assert (second["JobState"], second["TimeLimit"]) == ("COMPLETED", RETRY_TIME_LIMIT)
    assert (ok.workdir / "faults" / "shard2.attempt1.fail").read_text() == first["JobId"]
    status = json.loads((ok.workdir / "state" / "shard_2" / "status.json").read_text())
    assert status["attempt"] == 2 and status["slurm_job_id"] == second["JobId"]
    assert [len(ok.shard_jobs(s)) for s in (0, 1)] == [1, 1]


def test_cancelled_and_timed_out_shards_are_reported_failed(runs):
    faults = runs["faults"]
    assert faults.proc.returncode != 0
    (cancelled,), (timed_out,) = faults.shard_jobs(0), faults.shard_jobs(1)
    assert cancelled["JobState"] == "CANCELLED"
    assert timed_out["JobState"] == "TIMEOUT" and timed_out["TimeLimit"] == "00:01:00"
    out = faults.output
    assert f"SLURM-job '{cancelled['JobId']}' failed, SLURM status is: 'CANCELLED'" in out
    assert f"SLURM-job '{timed_out['JobId']}' failed, SLURM status is: 'TIMEOUT'" in out
    assert not [f for f in faults.left if f.endswith(("status.json", "metrics.json"))], faults.left


def test_rerun_completes_the_failed_shards_as_a_job_array(runs):
    faults = runs["faults"]
    assert faults.proc.returncode is not None
    t0 = time.monotonic()
    rerun = Run(faults.workdir, _config_of(faults), "--slurm-array-jobs", "shard", name="rerun")
    assert rerun.wait(600) == 0, rerun.output[-6000:]
    print(f"\nSLURM rerun: {time.monotonic() - t0:.0f}s")
    calls = rerun.sbatch_calls()
    assert len(calls) == 1 and "--array=1-2" in calls[0], calls  # no index job: it is done
    assert "--mem" not in calls[0]  # profile: no 1 MB "memory fudge" when mem is unset
    jobs = rerun.jobs()
    assert len(jobs) == 2 and {j["JobState"] for j in jobs} == {"COMPLETED"}
    assert len({j["ArrayJobId"] for j in jobs}) == 1 and {j["ArrayTaskId"] for j in jobs} == {"1", "2"}
    agg = _metrics(faults.workdir)
    assert agg["completed_shards"] == 2 and agg["total_rows_processed"] == 6


def test_invalid_config_fails_on_the_login_node_before_any_submission(cluster, tiny_model, tmp_path):
    cfg = slurm_cluster.pipeline_config(
        tiny_model, slurm_cluster.write_rows(tmp_path / "in.jsonl", 2), 1, slurm_extra="--gres=gpu:2"
    )
    run = Run(tmp_path, cfg)
    assert run.wait(120) != 0
    assert "execution_params.slurm_extra: sets the generic resources (GRES)" in run.output
    assert "sbatch call" not in run.output and not (tmp_path / ".snakemake" / "slurm_logs").exists()


def _config_of(run: Run) -> dict:
    import yaml

    return yaml.safe_load((run.workdir / "pipeline.yaml").read_text())


def test_every_profile_entry_is_commented():
    """No cluster needed: each top-level entry of the profile sits under a comment."""
    lines = (slurm_cluster.REPO / "profiles" / "slurm" / "profile.yaml").read_text().splitlines()
    entries = {i for i, line in enumerate(lines) if line and not line.startswith(("#", " "))}
    assert len(entries) >= 12
    for i in sorted(entries):
        above = i - 1
        while above in entries:  # consecutive entries may share one comment
            above -= 1
        assert lines[above].startswith("#"), f"no comment above: {lines[i]}"
