"""The workflow on a real SLURM: `python -m snakemake --profile profiles/slurm`.

A one-node SLURM with fake GPUs (tests/slurm_cluster.py) is started when absent; without
root or the slurm-wlm/munge packages these tests skip and say why. Three workflows run side
by side to keep the suite short:

- run "ok" (tiny model): 3 shards, every SLURM option set from execution_params, one
  sbatch each (the profile's default: no job arrays); shard 2's first attempt fails, the
  profile's retry resubmits it alone with twice the time limit, and no other shard is
  reported failed or resubmitted (with arrays they would be: plugin #447, docs/cluster.md).
- run "faults" (`--retries 0`, the `openai` backend against a slow fake server): shard 0's
  job is cancelled with scancel while it runs; shards 1 and 2 are too slow for their
  1-minute time limit and get SIGTERM before it (`--signal`), commit what they finished and
  write failure.json. The driver reports all failed; a rerun with job arrays turned on as
  the profile documents (one array) completes them, resuming from the checkpoints: every
  row exactly once, none computed twice.
- run "many" (`openai`, fast): 6 shards with job arrays on, the array chunk and the
  submission rate cut to 2, the setting that hangs plugin 2.8 when they differ: 3 array
  submissions, all done. It and "ok" start once the slow shards have committed a row
  (2 CPUs here).

A fourth run on its own: 2 shards sharing one engine service (shards_per_engine: 2), one
group job that loads the tiny model once.

Faults are injected from outside the project (see slurm_cluster.fault_env).
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

import slurm_cluster
from fakes.fake_http import Behaviour, FakeServer
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
SLOW_ROWS, SLOW_LATENCY = 90, 2.5  # 3 shards, 30 rows each x 2.5 s, one at a time: past a 1-minute limit
MANY_SHARDS, CHUNK = 6, 2


def _array_opt_in(profile) -> list[str]:
    """The flags a profile's comment gives to turn job arrays on (they are off by default)."""
    (line,) = re.findall(r"^#\s+(--slurm-array-jobs .*)$", profile.read_text(), re.MULTILINE)
    return line.split()


ARRAYS = _array_opt_in(slurm_cluster.REPO / "profiles" / "slurm" / "profile.yaml")


def _arrays(chunk: int) -> list[str]:
    """The documented opt-in (ARRAYS) with the array chunk and the submission rate both ``chunk``."""
    return ["--slurm-array-jobs", "shard", "--slurm-array-limit", str(chunk), "--max-jobs-per-timespan", f"{chunk}/1s"]


@pytest.fixture(scope="module")
def cluster():
    reason = slurm_cluster.unavailable_reason()
    if reason:
        pytest.skip(reason)
    started_here = slurm_cluster.start()
    yield
    if started_here:
        slurm_cluster.stop()


@pytest.fixture(scope="module")
def servers():
    """Fake OpenAI-compatible engines in this process (the jobs run on this machine)."""
    slow, fast = FakeServer(Behaviour(latency=SLOW_LATENCY)).start(), FakeServer().start()
    yield {"slow": slow, "fast": fast}
    slow.stop(), fast.stop()


@pytest.fixture(scope="module")
def runs(cluster, tiny_model, servers, tmp_path_factory):
    ok_dir, faults_dir, many_dir = (tmp_path_factory.mktemp(f"slurm_{n}") for n in ("ok", "faults", "many"))
    ok_cfg = slurm_cluster.pipeline_config(tiny_model, slurm_cluster.write_rows(ok_dir / "in.jsonl", 9), 3, **OK_EXEC)
    ok_cfg["processors"][0]["server_args"]["tp_size"] = 2
    faults_cfg = slurm_cluster.openai_pipeline(
        slurm_cluster.pipeline_config(
            tiny_model, slurm_cluster.write_rows(faults_dir / "in.jsonl", SLOW_ROWS), 3,
            partition="gpu", gpus=1, cpus_per_task=1, time_limit="00:01:00",
        ),
        servers["slow"].url + "/v1", max_inflight=1, checkpoint_rows=1, checkpoint_min_seconds=0,
    )  # fmt: skip
    faults = Run(faults_dir, faults_cfg, "--retries", "0", env=slurm_cluster.fault_env(faults_dir, {"0": {"1": "hang"}}))
    many_cfg = slurm_cluster.openai_pipeline(
        slurm_cluster.pipeline_config(
            tiny_model, slurm_cluster.write_rows(many_dir / "in.jsonl", MANY_SHARDS), MANY_SHARDS, gpus=0, mem="300M"
        ),
        servers["fast"].url + "/v1",
    )
    many = ok = None
    try:
        # Shard 0's job is running its shard step: cancel it mid-run.
        slurm_cluster.wait_for(faults_dir / "faults" / "shard0.attempt1.hang", 300, faults)
        subprocess.run(["scancel", faults.submitted_jobs()[0][-1]], check=True)
        # The others start once the slow shards run, so that their starts do not eat the
        # slow shards' minute (2 CPUs here).
        slurm_cluster.wait_for_any([faults_dir / "state" / f"shard_{i}" / "checkpoint.json" for i in (1, 2)], 300, faults)
        many = Run(many_dir, many_cfg, *_arrays(CHUNK))
        # The tests' --latency-wait (5 s), not the profile's 120 s: with job arrays (plugin
        # 2.8, snakemake-executor-plugin-slurm#447) the shards that end more than that before
        # the array's failing first task would be reported failed; one sbatch per shard has
        # no such check (test_failed_attempt_is_retried_alone_with_a_longer_time_limit)
        ok = Run(ok_dir, ok_cfg, env=slurm_cluster.fault_env(ok_dir, {"2": {"1": "fail"}}))
        ok.wait(600)
        faults.wait(600)
        many.wait(600)
        # What the failed run left, before the rerun test changes it.
        faults.left = sorted(str(f.relative_to(faults_dir)) for f in (faults_dir / "state").rglob("*.json"))
        faults.requests_before_rerun = len(servers["slow"].records)
        yield {"ok": ok, "faults": faults, "many": many}
    finally:
        for run in (faults, many, ok):
            if run is not None:
                run.stop()
        seconds = [f"{name} {run.seconds or 0:.0f}s" for name, run in (("faults", faults), ("many", many), ("ok", ok)) if run]
        print(f"\nSLURM runs (many and ok start once the slow shards run): {', '.join(seconds)}")


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


def test_report_has_sacct_accounting_of_the_shard_jobs(runs):
    """The test cluster has no slurmdbd but keeps SLURM's job completion log: sacct --completion
    gives each shard job's state, elapsed and CPUs (no CPU time or memory use: efficiencies n/a)."""
    ok = runs["ok"]
    block = json.loads((ok.workdir / "state" / "metrics.json").read_text())["cluster_accounting"]
    assert block["available"] and block["source"] == "jobcomp" and block["missing_job_ids"] == [], block
    assert [j["shard_id"] for j in block["jobs"]] == [0, 1, 2]
    for j in block["jobs"]:
        assert j["job_id"] == ok.shard_jobs(j["shard_id"])[-1]["JobId"]
        assert (j["state"], j["alloc_cpus"], j["cpu_efficiency"]) == ("COMPLETED", OK_EXEC["cpus_per_task"], None), j
        assert j["elapsed_seconds"] >= 0
    assert block["totals"]["states"] == {"COMPLETED": 3}
    assert "3 SLURM jobs for 3 shards (COMPLETED 3)" in (ok.workdir / "state" / "report.html").read_text()


def test_sbatch_requests_come_from_execution_params(runs):
    ok = runs["ok"]
    shard_calls = [c for c in ok.sbatch_calls() if "--comment rule_shard_" in c]
    assert len(shard_calls) == 4, ok.sbatch_calls()  # one sbatch per shard + 1 retry
    assert not [c for c in shard_calls if "--array" in c], shard_calls
    for call in shard_calls:
        for flag in (
            "-A mf-acct", "-p gpu", "--qos=normal", "-C fakegpu", "--mem 1024", "--gpus=2", "--cpus-per-task=2",
            "--nice=7", "--signal=TERM@30",  # SIGTERM 30 s (a tenth) before the 5-minute limit
        ):  # fmt: skip
            assert f" {flag} " in f" {call} ", (flag, call)
        assert "--job-name mirageflow_" in call
    for shard in range(3):
        for j in ok.shard_jobs(shard):  # what SLURM granted, read back
            assert (j["Account"], j["Partition"], j["Features"], j["Nice"]) == ("mf-acct", "gpu", "fakegpu", "7")
            assert j["TresPerJob"] == "gres:gpu:2" and j["NumCPUs"] == "2" and j["MinMemoryNode"] == "1G"
    first = [ok.shard_jobs(s)[0]["TimeLimit"] for s in range(3)]
    assert first == [TIME_LIMIT] * 3
    # The index job is light: 1 CPU, no GPU, same account and partition, no early SIGTERM.
    (index_call,) = [c for c in ok.sbatch_calls() if "--comment rule_index_dataset_" in c]
    assert " -A mf-acct " in index_call and " -p gpu " in index_call and "--cpus-per-task=1" in index_call
    assert "--gpus" not in index_call and "--gres" not in index_call and "--signal" not in index_call


def test_shards_go_out_as_job_arrays_in_fewer_sbatch_calls(runs):
    """Job arrays turned on as the profile documents: 6 shards, chunk 2 -> 3 array submissions
    (plus the index job), all complete.

    The submission rate equals the chunk (as in the documented opt-in: 40 and 40/1s), so the
    first batch (2 shards while 4 more wait) goes out instead of being held back forever.
    """
    many = runs["many"]
    assert many.proc.returncode == 0, many.output[-6000:]
    submitted = many.submissions()
    arrays = [c for c in many.sbatch_calls() if "--comment rule_shard_" in c]
    assert len(submitted) == 4 and len(arrays) == 3, many.sbatch_calls()  # index + 3 arrays for 6 shards
    assert sorted(c.split("--array=")[1].split()[0] for c in arrays) == ["1-2", "1-2", "1-2"]
    assert "waiting for more jobs" not in many.output
    tasks = many.submitted_jobs()
    assert sorted(tasks) == list(range(MANY_SHARDS)) and all(len(t) == 1 and "_" in t[0] for t in tasks.values())
    assert {j["JobState"] for s in range(MANY_SHARDS) for j in many.shard_jobs(s)} == {"COMPLETED"}
    agg = _metrics(many.workdir)
    assert agg["completed_shards"] == MANY_SHARDS and agg["total_rows_processed"] == MANY_SHARDS


def test_failed_attempt_is_retried_alone_with_a_longer_time_limit(runs):
    ok = runs["ok"]
    first, second = ok.shard_jobs(2)
    assert (first["JobState"], first["TimeLimit"]) == ("FAILED", TIME_LIMIT)
    assert (second["JobState"], second["TimeLimit"]) == ("COMPLETED", RETRY_TIME_LIMIT)
    assert (ok.workdir / "faults" / "shard2.attempt1.fail").read_text() == first["JobId"]
    status = json.loads((ok.workdir / "state" / "shard_2" / "status.json").read_text())
    # Snakemake's retry number is 2; the shard's own count is 1: the failed job stopped
    # before the shard runner, so it made no attempt at the shard (state/records.py)
    (attempt,) = status["stats"]["attempts"]
    assert (attempt["attempt"], attempt["snakemake_attempt"], attempt["slurm_job_id"]) == (1, 2, second["JobId"])
    assert status["attempt"] == 1 and status["slurm_job_id"] == second["JobId"]
    # The shards that succeeded ran once and were never reported failed, although they ended
    # long before shard 2's retry (with job arrays they would be: plugin #447, docs/cluster.md)
    assert [len(ok.shard_jobs(s)) for s in (0, 1)] == [1, 1]
    assert re.findall(r"SLURM-job '([^']+)' failed", ok.output) == [first["JobId"]], ok.output[-6000:]
    # every error block (the driver's, and the inner ones of the failed job's log it prints)
    reported = re.findall(r"^Error in rule shard:\n(?:    .*\n)*?    output: (\S+)", ok.output, re.MULTILINE)
    assert reported and set(reported) == {"state/shard_2/status.json"}, reported
    assert "MissingOutputException" not in ok.output
    for shard in (0, 1):
        status = json.loads((ok.workdir / "state" / f"shard_{shard}" / "status.json").read_text())
        assert [a["snakemake_attempt"] for a in status["stats"]["attempts"]] == [1], status["stats"]["attempts"]


def test_cancelled_shard_is_reported_failed(runs):
    faults = runs["faults"]
    assert faults.proc.returncode != 0
    (cancelled,) = faults.shard_jobs(0)
    assert cancelled["JobState"] == "CANCELLED" and "ArrayTaskId" not in cancelled  # a plain job
    assert f"SLURM-job '{faults.submitted_jobs()[0][0]}' failed, SLURM status is: 'CANCELLED'" in faults.output
    assert not [f for f in faults.left if f.endswith(("status.json", "metrics.json"))], faults.left


def test_shards_at_their_time_limit_get_sigterm_commit_and_record_it(runs):
    """`--signal=TERM@6` (a tenth of 1 minute): the shards stop themselves before SLURM kills them.

    A plain job runs the shard in a job step, where `--signal` reaches it. (With job arrays the
    plugin runs an array's first task outside any job step: mirageflow.cluster.time_limit,
    called by the shard job, covers that task; tests/test_time_limit.py.)
    """
    faults = runs["faults"]
    for shard in (1, 2):
        (slow,) = faults.shard_jobs(shard)
        assert slow["TimeLimit"] == "00:01:00" and "ArrayTaskId" not in slow, slow
        assert slow["JobState"] == "FAILED", slow  # not TIMEOUT: it stopped first
        failure = json.loads((faults.workdir / "state" / f"shard_{shard}" / "failure.json").read_text())
        assert failure["signal"] == "SIGTERM" and failure["slurm_job_id"] == slow["JobId"], failure
        assert 0 < _committed(failure) < SLOW_ROWS // 3, failure["error"]
    assert "failed, SLURM status is: 'FAILED'" in faults.output


def test_rerun_resumes_the_failed_shards_as_a_job_array(runs, servers):
    faults = runs["faults"]
    assert faults.proc.returncode is not None
    committed = sum(_committed(json.loads(f.read_text())) for f in (faults.workdir / "state").glob("shard_*/failure.json"))
    servers["slow"].behaviour.latency = 0.0
    t0 = time.monotonic()
    # Job arrays on as the profile documents; the profile's --latency-wait (120 s), so that
    # a task ending before the array's first one is not reported failed (plugin #447)
    rerun = Run(faults.workdir, _config_of(faults), *ARRAYS, "--latency-wait", "120", name="rerun")
    assert rerun.wait(600) == 0, rerun.output[-6000:]
    print(f"\nSLURM rerun: {time.monotonic() - t0:.0f}s")
    calls = rerun.sbatch_calls()
    assert len(calls) == 1 and "--array=1-3" in calls[0], calls  # no index job: it is done
    assert "--mem" not in calls[0]  # profile: no 1 MB "memory fudge" when mem is unset
    jobs = rerun.jobs()
    assert len(jobs) == 3 and {j["JobState"] for j in jobs} == {"COMPLETED"}
    assert len({j["ArrayJobId"] for j in jobs}) == 1 and {j["ArrayTaskId"] for j in jobs} == {"1", "2", "3"}
    agg = _metrics(faults.workdir)
    assert agg["completed_shards"] == 3 and agg["total_rows_processed"] == SLOW_ROWS
    # The slow shards resumed: the rerun asked the engine once for each row not committed
    # before (shard 0's, and the rest of shards 1 and 2), never for a committed one.
    asked = [re.findall(r"Passage (\d+) ", json.dumps(r["body"])) for r in servers["slow"].records[faults.requests_before_rerun :]]
    assert all(len(a) == 1 for a in asked) and len({a[0] for a in asked}) == len(asked) == SLOW_ROWS - committed
    import pandas as pd

    merged = pd.read_parquet(faults.workdir / "out" / "merged")
    assert sorted(merged["text"]) == sorted(f"Passage {i} about the sea and the wind." for i in range(SLOW_ROWS))


def test_invalid_config_fails_on_the_login_node_before_any_submission(cluster, tiny_model, tmp_path):
    cfg = slurm_cluster.pipeline_config(tiny_model, slurm_cluster.write_rows(tmp_path / "in.jsonl", 2), 1, slurm_extra="--gres=gpu:2")
    run = Run(tmp_path, cfg)
    assert run.wait(120) != 0
    assert "execution_params.slurm_extra: sets the generic resources (GRES)" in run.output
    assert "sbatch call" not in run.output and not (tmp_path / ".snakemake" / "slurm_logs").exists()


def test_a_shared_engine_and_its_shards_are_one_group_job_that_loads_the_model_once(cluster, tiny_model, tmp_path):
    """execution_params.shards_per_engine: 2 shards and their engine service go out as one
    sbatch (a Snakemake group job, not an array) with the engine's GPU and memory and a CPU
    per job; the model is loaded once and each shard keeps its own status.json."""
    cfg = slurm_cluster.pipeline_config(
        tiny_model, slurm_cluster.write_rows(tmp_path / "in.jsonl", 4), 2,
        partition="gpu", gpus=1, cpus_per_task=1, mem="1G", time_limit="00:15:00", shards_per_engine=2,
    )  # fmt: skip
    # Inside the job Snakemake runs the engine and both shards at once with `--cores all`:
    # 2 on this machine, which binds no CPUs to jobs; a served shard counts 0 of them.
    run = Run(tmp_path, cfg)
    assert run.wait(900) == 0, run.output[-6000:]
    groups = [c for c in run.sbatch_calls() if "'engine:group=0'" in c]
    assert len(groups) == 1 and "--array" not in groups[0], run.sbatch_calls()
    assert "'shard:shard=0'" in groups[0] and "'shard:shard=1'" in groups[0]
    assert re.search(r" --gpus=1\b", groups[0]) and " --cpus-per-task=3 " in groups[0] and " --mem 1024 " in groups[0]
    assert len(run.submissions()) == 2  # the index job and the group
    statuses = [json.loads((tmp_path / "state" / f"shard_{i}" / "status.json").read_text()) for i in range(2)]
    assert statuses[0]["slurm_job_id"] == statuses[1]["slurm_job_id"] == run.submissions()[1]
    assert all(s["engines"]["llm"]["details"]["shared_engine"]["group"] == 0 for s in statuses)
    metrics = json.loads((tmp_path / "state" / "metrics.json").read_text())
    shared = metrics["aggregate"]["shared_engines"]
    assert (shared["engine_loads"], shared["shards_served"]) == (1, 2)
    assert metrics["aggregate"]["total_rows_processed"] == 4
    acct = metrics["cluster_accounting"]
    assert acct["available"] and (acct["totals"]["jobs"], acct["totals"]["shards"]) == (1, 2)  # one allocation


def _committed(failure: dict) -> int:
    """Rows a failed attempt committed, from failure.json's message."""
    if "nothing was committed" in failure["error"]:  # stopped before the shard runner started
        return 0
    m = re.search(r"(\d+) rows? committed", failure["error"])
    assert m, failure["error"]
    return int(m.group(1))


def _config_of(run: Run) -> dict:
    import yaml

    return yaml.safe_load((run.workdir / "pipeline.yaml").read_text())


def test_profiles_submit_one_sbatch_per_shard_and_document_the_array_opt_in():
    """No cluster needed: job arrays off by default (snakemake-executor-plugin-slurm#447,
    docs/cluster.md), a polite submission rate, and the opt-in that the profiles and
    docs/cluster.md give: no job cap, submission rate = array chunk <= 40 (plugin 2.8 hangs
    or runs the wrong shards otherwise)."""
    import yaml

    for name in ("slurm", "slurm-gpu"):
        path = slurm_cluster.REPO / "profiles" / name / "profile.yaml"
        profile = yaml.safe_load(path.read_text())
        assert not [k for k in profile if k.startswith("slurm-array")], path
        assert profile["jobs"] == "unlimited"  # the arrays need it when turned on
        rate, per = profile["max-jobs-per-timespan"].split("/")
        assert per == "1s" and 1 <= int(rate) <= 20, path  # one sbatch (a slurmctld RPC) per shard
        assert _array_opt_in(path) == ARRAYS, path
    chunk = int(ARRAYS[ARRAYS.index("--slurm-array-limit") + 1])
    assert ARRAYS == _arrays(chunk)  # arrays of `shard`, rate == chunk
    # plugin 2.8: more tasks overflow the sbatch line (128 KiB per argument) and its stdin
    # fallback runs the array's first shard in every task (profiles/slurm/profile.yaml)
    assert 1 <= chunk <= 40
    assert " ".join(ARRAYS) in (slurm_cluster.REPO / "docs" / "cluster.md").read_text()


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
