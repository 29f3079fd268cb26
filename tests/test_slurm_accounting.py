"""Cluster accounting (mirageflow.report.slurm_accounting): sacct's output parsed into metrics.json and report.html.

sacct is a separate program: these tests put a fake ``sacct`` first on PATH (a process
boundary) that prints recorded output; tests/test_slurm.py checks the real sacct of the test
cluster. JOBCOMP is real output of ``sacct --completion`` on that cluster (slurm-wlm 22.05.8,
JobCompType=jobcomp/filetxt): jobs 234 (2 CPUs), 235-238 (an array: 237, 238 and 235 are its
tasks 0-2), 236 (exit 3) and 239 (scancel). That cluster has no slurmdbd, so SLURMDBD is
written by hand in the format sacct 22.05 prints from the database (src/sacct/print.c):
job lines then their steps, array tasks as ``<array>_<task>``, TotalCPU as [D-][HH:]MM:SS[.mmm],
MaxRSS on the steps with a unit suffix, memory in AllocTRES.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from mirageflow.report import aggregate as report
from mirageflow.report import slurm_accounting as sa
from mirageflow.files import atomic_write_json

JOBCOMP = """\
236|236|FAILED|0|1|||||1
237|237|COMPLETED|1|1|||||1
238|238|COMPLETED|1|1|||||1
235|235|COMPLETED|1|1|||||1
234|234|COMPLETED|2|2|||||1
239|239|CANCELLED|2|1|||||1
"""
JOBCOMP_STDERR = "sacct: error: Unknown type ArrayJobId: 235\nsacct: error: Unknown type ArrayTaskId: 0\n"

SLURMDBD = """\
500_0|501|COMPLETED|100|2|01:20.000||billing=2,cpu=2,mem=1G,node=1|1G|1
500_0.batch|501.batch|COMPLETED|100|2|01:19.500|524288K|cpu=2,mem=1G,node=1||1
500_0.extern|501.extern|COMPLETED|100|2|00:00.500|1024K|billing=2,cpu=2,mem=1G,node=1||1
500_1|500|TIMEOUT|3720|4|1-00:00:00||billing=4,cpu=4,mem=2G,node=1|2G|1
500_1.batch|500.batch|CANCELLED|3722|4|23:59:58|1.50G|cpu=4,mem=2G,node=1||1
500_1.0|500.0|CANCELLED by 0|3700|4|00:00:02|2097152K|cpu=4,mem=2G,node=1||1
502|502|OUT_OF_MEMORY|60|1|00:30.000||billing=1,cpu=1,mem=256M,node=1|256M|1
502.batch|502.batch|OUT_OF_MEMORY|60|1|00:30.000|262144K|cpu=1,mem=256M,node=1||1
"""


def _fake_sacct(tmp_path: Path, monkeypatch, body: str) -> Path:
    """A `sacct` first on PATH running ``body`` (sh); its arguments go to calls.txt, one call a line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    script = bin_dir / "sacct"
    script.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n{body}\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def _out(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


NO_DBD = (
    'case "$*" in *--completion*) cat {out}; printf "%s" "{err}" >&2;; *) echo "Slurm accounting storage is disabled" >&2; exit 1;; esac'
)


def _metrics(job_ids: dict[int, str], failed: dict[int, str] | None = None) -> dict:
    return {
        "per_shard": [{"shard_id": s, "slurm_job_id": j, "stats": {}} for s, j in job_ids.items()],
        "aggregate": {"failed_shards": [{"shard_id": s, "slurm_job_id": j} for s, j in (failed or {}).items()]},
    }


def test_sacct_durations_and_sizes():
    assert sa.parse_duration("00:00.500") == 0.5
    assert sa.parse_duration("23:59:58") == 86398
    assert sa.parse_duration("1-00:00:00") == 86400
    assert sa.parse_duration("") is None
    assert sa.parse_size("524288K") == 512 * 1024**2
    assert sa.parse_size("1.50G") == 1.5 * 1024**3
    assert sa.parse_size("0") == 0
    assert sa.parse_size("4000Mc") == 4000 * 1024**2  # ReqMem before 21.08: per CPU
    with pytest.raises(ValueError, match="not a sacct duration"):
        sa.parse_duration("soon")


def test_parse_recorded_job_completion_output():
    jobs = sa.parse_sacct(JOBCOMP)
    assert sorted(jobs) == ["234", "235", "236", "237", "238", "239"]
    assert jobs["234"] == {
        "job_id": "234", "sacct_job_id": "234", "state": "COMPLETED", "elapsed_seconds": 2, "alloc_cpus": 2,
        "total_cpu_seconds": None, "requested_mem_bytes": None, "max_rss_bytes": None,
    }  # fmt: skip
    assert (jobs["236"]["state"], jobs["239"]["state"]) == ("FAILED", "CANCELLED")


def test_parse_database_output_merges_steps():
    jobs = sa.parse_sacct(SLURMDBD)
    assert sorted(jobs) == ["500", "501", "502"]
    task0 = jobs["501"]
    assert task0["sacct_job_id"] == "500_0" and task0["total_cpu_seconds"] == 80.0
    assert task0["max_rss_bytes"] == 512 * 1024**2 and task0["requested_mem_bytes"] == 1024**3
    assert jobs["500"]["state"] == "TIMEOUT" and jobs["500"]["max_rss_bytes"] == 2 * 1024**3  # the larger step
    assert jobs["500"]["total_cpu_seconds"] == 86400


def test_parse_rejects_a_line_with_the_wrong_fields():
    with pytest.raises(ValueError, match=r"line 2 has 3 fields, expected 10"):
        sa.parse_sacct("236|236|FAILED|0|1|||||1\n1|2|3\n")


def test_accounting_from_the_job_completion_log(tmp_path, monkeypatch):
    out = _out(tmp_path, "jobcomp.txt", JOBCOMP)
    calls = _fake_sacct(tmp_path, monkeypatch, NO_DBD.format(out=out, err=JOBCOMP_STDERR.replace("\n", "\\n")))
    block = sa.cluster_accounting(_metrics({0: "237", 1: "238", 2: "235"}, failed={3: "239", 4: "9999"}))
    lines = calls.read_text().splitlines()
    assert len(lines) == 2 and "--completion" in lines[1]  # the database first, then the completion log
    assert "--jobs=235,237,238,239,9999" in lines[0] and "--parsable2" in lines[0]
    assert block["available"] and block["source"] == "jobcomp" and "slurmdbd" in block["note"]
    assert [(j["shard_id"], j["job_id"], j["state"], j["outcome"]) for j in block["jobs"]] == [
        (0, "237", "COMPLETED", "completed"), (1, "238", "COMPLETED", "completed"),
        (2, "235", "COMPLETED", "completed"), (3, "239", "CANCELLED", "failed"),
    ]  # fmt: skip
    assert block["missing_job_ids"] == ["9999"]
    assert all(j["cpu_efficiency"] is None and j["memory_efficiency"] is None for j in block["jobs"])
    t = block["totals"]
    assert t["jobs"] == 4 and t["states"] == {"CANCELLED": 1, "COMPLETED": 3}
    assert t["elapsed_seconds"] == 5 and t["allocated_cpu_seconds"] == 5 and t["cpu_efficiency"] is None


def test_efficiencies_from_the_accounting_database(tmp_path, monkeypatch):
    calls = _fake_sacct(tmp_path, monkeypatch, f"cat {_out(tmp_path, 'dbd.txt', SLURMDBD)}")
    block = sa.cluster_accounting(_metrics({0: "501", 1: "502"}, failed={2: "500"}))
    assert len(calls.read_text().splitlines()) == 1
    assert block["source"] == "slurmdbd" and block["note"] is None
    j = {x["shard_id"]: x for x in block["jobs"]}
    assert j[0]["cpu_efficiency"] == pytest.approx(80 / (100 * 2)) and j[0]["memory_efficiency"] == pytest.approx(0.5)
    assert j[0]["max_rss_mb"] == 512 and j[0]["requested_mem_mb"] == 1024
    assert j[1]["state"] == "OUT_OF_MEMORY" and j[1]["memory_efficiency"] == pytest.approx(1.0)
    assert j[2]["cpu_efficiency"] == pytest.approx(86400 / (3720 * 4))
    t = block["totals"]
    assert t["cpu_efficiency"] == pytest.approx((80 + 30 + 86400) / (200 + 60 + 3720 * 4))
    assert t["memory_efficiency_max"] == pytest.approx(1.0) and t["max_rss_mb"] == 2048
    assert t["memory_efficiency_mean"] == pytest.approx((0.5 + 1.0 + 1.0) / 3)


def test_a_group_job_serving_several_shards_counts_once_in_the_totals(tmp_path, monkeypatch):
    # execution_params.shards_per_engine: shards 0 and 1 ran in one group job (501), shard 2 alone
    _fake_sacct(tmp_path, monkeypatch, f"cat {_out(tmp_path, 'dbd.txt', SLURMDBD)}")
    block = sa.cluster_accounting(_metrics({0: "501", 1: "501", 2: "502"}))
    assert [(j["shard_id"], j["job_id"]) for j in block["jobs"]] == [(0, "501"), (1, "501"), (2, "502")]
    t = block["totals"]
    assert (t["jobs"], t["shards"], t["states"]) == (2, 3, {"COMPLETED": 1, "OUT_OF_MEMORY": 1})
    assert t["elapsed_seconds"] == 100 + 60 and t["allocated_cpu_seconds"] == 100 * 2 + 60
    assert t["cpu_efficiency"] == pytest.approx((80 + 30) / (200 + 60))


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('echo "Slurm accounting storage is disabled" >&2; case "$*" in *--completion*) echo "Slurm job completion is disabled" >&2;; esac; exit 1',
         "the cluster keeps no accounting"),
        ('echo "sacct: error: Problem talking to the database: Connection refused" >&2; exit 1', "sacct failed (exit 1): sacct: error: Problem talking"),
        ("sleep 30", "sacct did not answer within 1s"),
        ('echo "1|2|3"', "unreadable sacct output: sacct output line 1 has 3 fields"),
    ],
)  # fmt: skip
def test_unavailable_accounting_is_one_line_not_an_error(tmp_path, monkeypatch, body, reason):
    _fake_sacct(tmp_path, monkeypatch, body)
    block = sa.cluster_accounting(_metrics({0: "237"}), timeout=1)
    assert block["available"] is False and block["reason"].startswith(reason), block
    page = "\n".join(sa.html_section(block))
    assert "Cluster accounting unavailable: " in page and "<table>" not in page


def test_no_slurm_job_or_no_sacct(tmp_path, monkeypatch):
    calls = _fake_sacct(tmp_path, monkeypatch, "exit 1")
    assert sa.cluster_accounting(_metrics({}))["reason"].startswith("no shard recorded a SLURM job")
    assert not calls.exists()  # sacct not called at all
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert sa.cluster_accounting(_metrics({0: "1"}))["reason"].startswith("sacct is not installed")


def test_report_writes_the_block_and_the_table(tmp_path, monkeypatch):
    out = _out(tmp_path, "jobcomp.txt", JOBCOMP)
    _fake_sacct(tmp_path, monkeypatch, NO_DBD.format(out=out, err=""))
    state = tmp_path / "state"
    for shard, job in ((0, "234"), (1, "236")):
        atomic_write_json(state / f"shard_{shard}" / "status.json", {
            "shard_id": shard, "num_shards": 2, "status": "success", "attempt": 1, "slurm_job_id": job,
            "started_at": "2026-12-01T11:32:37+00:00", "finished_at": "2026-12-01T11:32:39+00:00",
            "stats": {"runtime_seconds": 2.0, "inference_runtime_seconds": 1.0, "output_tokens": 4, "num_gpus": 0,
                      "rows_processed": 2, "rows_failed": 0},
        })  # fmt: skip
    report.write_report(state, 2)
    block = json.loads((state / "metrics.json").read_text())["cluster_accounting"]
    assert [(j["shard_id"], j["state"], j["alloc_cpus"]) for j in block["jobs"]] == [(0, "COMPLETED", 2), (1, "FAILED", 1)]
    page = (state / "report.html").read_text()
    assert "<h2>Cluster accounting (SLURM)</h2>" in page and "2 SLURM jobs for 2 shards (COMPLETED 1, FAILED 1)" in page
    assert "<td class=bad>FAILED</td>" in page and "job completion log" in page
