"""SLURM accounting of a run's shard jobs: metrics.json ``cluster_accounting`` and its table in report.html.

Each shard records the SLURM job it ran in (``slurm_job_id`` in status.json or failure.json).
The aggregate asks ``sacct`` once for all of them (``--parsable2``, with a timeout) and keeps,
per shard: its job's state, elapsed, allocated CPUs and, where SLURM measured them, CPU efficiency
``TotalCPU / (Elapsed x AllocCPUS)`` and memory efficiency ``MaxRSS / allocated memory`` (the
figures of SLURM's ``seff``; MaxRSS is the largest of the job's steps). The totals count each SLURM job once (the shards
of a group job share one). Two sources, in order:

- the accounting database (slurmdbd; ``source: "slurmdbd"``): everything above;
- without one, the job completion log (``sacct --completion``, ``JobCompType=jobcomp/filetxt``;
  ``source: "jobcomp"``): state, elapsed and CPUs only. It has no CPU time or memory use, so
  the efficiencies are null and ``note`` says why.

Where neither exists, sacct is missing, fails or runs past its timeout, or no shard ran under
SLURM, the block is ``{"available": false, "reason": ...}``: the report says so in one line.
Accounting is a report extra, read after every row is written: it never fails the aggregate.
"""

from __future__ import annotations

import html
import logging
import re
import shutil
import subprocess

from mirageflow.errors import MirageflowError

log = logging.getLogger(__name__)

SACCT_TIMEOUT = 60.0  # one call for all jobs; slurmdbd on a busy cluster can take a while
FIELDS = ("JobID", "JobIDRaw", "State", "ElapsedRaw", "AllocCPUS", "TotalCPU", "MaxRSS", "AllocTRES", "ReqMem", "NNodes")
NO_USAGE_NOTE = "CPU time and memory use are not in SLURM's job completion log (they need slurmdbd): efficiencies n/a"
MAX_HTML_ROWS = 500  # accounting table rows in report.html; all jobs are in metrics.json
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}
_MB = 1024**2


class AccountingUnavailable(MirageflowError, RuntimeError):
    """sacct cannot tell: the message is the one-line reason the report shows."""


# --------------------------------------------------------------------------- parsing sacct's fields


def parse_duration(text: str) -> float | None:
    """sacct's ``[D-][HH:]MM:SS[.mmm]`` (TotalCPU, Elapsed) in seconds; None when empty."""
    text = text.strip()
    if not text:
        return None
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+(?:\.\d+)?)", text)
    if not m:
        raise ValueError(f"not a sacct duration: {text!r}")
    days, hours, minutes, seconds = (float(g) if g else 0.0 for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def parse_size(text: str) -> float | None:
    """A sacct size (MaxRSS ``1234K``, ``2.50G``, ``0``; ReqMem ``300M`` or the older ``300Mn``/``300Mc``) in bytes.

    A trailing n (per node) or c (per CPU) is dropped here; :func:`_requested_bytes` scales it.
    """
    text = text.strip()
    if not text:
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTP]?)[nc]?", text)
    if not m:
        raise ValueError(f"not a sacct size: {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def _tres_mem(tres: str) -> float | None:
    """The ``mem=`` entry of a TRES string (``cpu=2,mem=1G,node=1``) in bytes."""
    for item in tres.split(","):
        key, _, value = item.partition("=")
        if key == "mem" and value:
            return parse_size(value)
    return None


def _requested_bytes(row: dict) -> float | None:
    """The job's memory: AllocTRES mem (the whole job), else ReqMem scaled by its n/c suffix."""
    mem = _tres_mem(row.get("AllocTRES", ""))
    if mem is not None:
        return mem
    req = row.get("ReqMem", "").strip()
    size = parse_size(req)
    if size is None:
        return None
    if req.endswith("c"):
        return size * int(row.get("AllocCPUS") or 1)
    if req.endswith("n"):
        return size * int(row.get("NNodes") or 1)
    return size


def parse_sacct(text: str, fields: tuple[str, ...] = FIELDS) -> dict[str, dict]:
    """``sacct --parsable2 --noheader --format=<fields>`` output -> {raw job id: job}.

    Job lines (JobIDRaw ``123``) give state, elapsed, CPUs, TotalCPU and memory; step lines
    (``123.batch``, ``123.extern``, ``123.0``) give MaxRSS, whose largest value is kept. An
    array task is listed as JobID ``<array>_<task>`` with its own JobIDRaw. A job listed twice
    (the completion log keeps every record) keeps its last line.
    """
    jobs: dict[str, dict] = {}
    steps: dict[str, list[float]] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        values = line.split("|")
        if len(values) != len(fields):
            raise ValueError(f"sacct output line {lineno} has {len(values)} fields, expected {len(fields)} ({'|'.join(fields)}): {line!r}")
        row = dict(zip(fields, values))
        raw, _, step = row["JobIDRaw"].partition(".")
        try:
            rss = parse_size(row.get("MaxRSS", ""))
            if step:
                if rss is not None:
                    steps.setdefault(raw, []).append(rss)
                continue
            elapsed = row.get("ElapsedRaw", "").strip()
            cpus = row.get("AllocCPUS", "").strip()
            jobs[raw] = {
                "job_id": raw,
                "sacct_job_id": row.get("JobID", raw),
                "state": row.get("State", "").split(" ")[0] or None,  # "CANCELLED by 0" -> CANCELLED
                "elapsed_seconds": int(elapsed) if elapsed else None,
                "alloc_cpus": int(cpus) if cpus else None,
                "total_cpu_seconds": parse_duration(row.get("TotalCPU", "")),
                "requested_mem_bytes": _requested_bytes(row),
                "job_max_rss_bytes": rss,
            }
        except ValueError as e:
            raise ValueError(f"sacct output line {lineno} ({line!r}): {e}") from None
    for raw, job in jobs.items():
        rss = [r for r in steps.get(raw, []) + [job.pop("job_max_rss_bytes")] if r is not None]
        job["max_rss_bytes"] = max(rss) if rss else None
    return jobs


# --------------------------------------------------------------------------- running sacct


def _sacct(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AccountingUnavailable(f"sacct did not answer within {timeout:.0f}s") from None


def run_sacct(job_ids: list[str], timeout: float = SACCT_TIMEOUT) -> tuple[str, dict[str, dict]]:
    """(source, jobs) for ``job_ids`` from one sacct call (two when the database is off)."""
    sacct = shutil.which("sacct")
    if sacct is None:
        raise AccountingUnavailable("sacct is not installed on the machine that wrote the report")
    base = [sacct, "--parsable2", "--noheader", "--format=" + ",".join(FIELDS), "--jobs=" + ",".join(job_ids)]
    proc = _sacct(base, timeout)
    source = "slurmdbd"
    if proc.returncode != 0 and "accounting storage is disabled" in proc.stderr + proc.stdout:
        proc = _sacct(base + ["--completion"], timeout)
        source = "jobcomp"
        if proc.returncode != 0 and "job completion is disabled" in proc.stderr + proc.stdout:
            raise AccountingUnavailable("the cluster keeps no accounting (no slurmdbd, no JobCompType): sacct has no records")
    if proc.returncode != 0:
        raise AccountingUnavailable(f"sacct failed (exit {proc.returncode}): {(proc.stderr.strip() or proc.stdout.strip())[:300]}")
    try:
        return source, parse_sacct(proc.stdout)
    except ValueError as e:
        raise AccountingUnavailable(f"unreadable sacct output: {e}") from None


# --------------------------------------------------------------------------- the metrics.json block


def _ratio(num, den) -> float | None:
    return num / den if num is not None and den else None


def _mb(value) -> float | None:
    return None if value is None else value / _MB


def shard_jobs(metrics: dict) -> list[dict]:
    """[{shard_id, job_id, outcome}] for every shard with a recorded SLURM job: the completed
    shards' last attempt (status.json) and the failed shards' (failure.json)."""
    out = [
        {"shard_id": s["shard_id"], "job_id": str(s["slurm_job_id"]), "outcome": "completed"}
        for s in metrics.get("per_shard") or []
        if s.get("slurm_job_id")
    ]
    out += [
        {"shard_id": f["shard_id"], "job_id": str(f["slurm_job_id"]), "outcome": "failed"}
        for f in (metrics.get("aggregate") or {}).get("failed_shards") or []
        if f.get("slurm_job_id")
    ]
    return sorted(out, key=lambda j: j["shard_id"])


def cluster_accounting(metrics: dict, timeout: float = SACCT_TIMEOUT) -> dict:
    """The ``cluster_accounting`` block of metrics.json (see the module docstring); never raises for sacct's sake."""
    wanted = shard_jobs(metrics)
    if not wanted:
        return {"available": False, "reason": "no shard recorded a SLURM job (not a SLURM run)"}
    try:
        source, found = run_sacct(sorted({j["job_id"] for j in wanted}, key=lambda x: (len(x), x)), timeout)
    except AccountingUnavailable as e:
        log.warning("cluster accounting unavailable: %s", e)
        return {"available": False, "reason": str(e)}
    jobs, missing = [], []
    for w in wanted:
        acct = found.get(w["job_id"])
        if acct is None:
            missing.append(w["job_id"])
            continue
        cpu_s = acct["total_cpu_seconds"]
        alloc_cpu_s = acct["elapsed_seconds"] * acct["alloc_cpus"] if acct["elapsed_seconds"] is not None and acct["alloc_cpus"] else None
        jobs.append(
            {
                "shard_id": w["shard_id"],
                "outcome": w["outcome"],
                "job_id": w["job_id"],
                "sacct_job_id": acct["sacct_job_id"],
                "state": acct["state"],
                "elapsed_seconds": acct["elapsed_seconds"],
                "alloc_cpus": acct["alloc_cpus"],
                "total_cpu_seconds": cpu_s,
                "cpu_efficiency": _ratio(cpu_s, alloc_cpu_s),
                "max_rss_mb": _mb(acct["max_rss_bytes"]),
                "requested_mem_mb": _mb(acct["requested_mem_bytes"]),
                "memory_efficiency": _ratio(acct["max_rss_bytes"], acct["requested_mem_bytes"]),
            }
        )
    return {
        "available": True,
        "source": source,
        "note": NO_USAGE_NOTE if source == "jobcomp" else None,
        "jobs": jobs,
        "missing_job_ids": missing,
        "totals": totals(jobs),
    }


def totals(jobs: list[dict]) -> dict:
    """Sums over the jobs; an efficiency total covers only the jobs that have the figure.

    ``jobs`` has one entry per shard; a group job (execution_params.shards_per_engine) is
    one SLURM job, one allocation, for its engine and K shards, so each SLURM job counts once."""
    shards = len(jobs)
    jobs = list({j["job_id"]: j for j in jobs}.values())
    states: dict[str, int] = {}
    for j in jobs:
        states[j["state"] or "unknown"] = states.get(j["state"] or "unknown", 0) + 1
    timed = [j for j in jobs if j["total_cpu_seconds"] is not None and j["elapsed_seconds"] is not None and j["alloc_cpus"]]
    mem = [j for j in jobs if j["memory_efficiency"] is not None]
    cpu_s = sum(j["total_cpu_seconds"] for j in timed)
    alloc_s = sum(j["elapsed_seconds"] * j["alloc_cpus"] for j in timed)
    rss = [j["max_rss_mb"] for j in jobs if j["max_rss_mb"] is not None]
    return {
        "jobs": len(jobs),
        "shards": shards,
        "states": dict(sorted(states.items())),
        "elapsed_seconds": sum(j["elapsed_seconds"] or 0 for j in jobs),
        "allocated_cpu_seconds": sum((j["elapsed_seconds"] or 0) * (j["alloc_cpus"] or 0) for j in jobs),
        "total_cpu_seconds": cpu_s if timed else None,
        "cpu_efficiency": _ratio(cpu_s, alloc_s) if timed else None,
        "max_rss_mb": max(rss) if rss else None,
        "memory_efficiency_mean": sum(j["memory_efficiency"] for j in mem) / len(mem) if mem else None,
        "memory_efficiency_max": max(j["memory_efficiency"] for j in mem) if mem else None,
    }


# --------------------------------------------------------------------------- report.html


def _f(value, digits: int = 1) -> str:
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}" if isinstance(value, float) else f"{value:,}"


def _pct(value) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def html_section(block: dict | None) -> list[str]:
    """report.html's "Cluster accounting" section: one line when unavailable, else totals and a table per job."""
    e = html.escape
    out = ["<h2>Cluster accounting (SLURM)</h2>"]
    if not block:
        return out + ['<p class="note">No cluster accounting in this metrics.json (written before it existed).</p>']
    if not block.get("available"):
        return out + [f'<p class="note">Cluster accounting unavailable: {e(str(block.get("reason")))}.</p>']
    t = block["totals"]
    states = ", ".join(f"{k} {v}" for k, v in t["states"].items()) or "none"
    out.append(
        f"<p>From <code>sacct</code> ({e('accounting database' if block['source'] == 'slurmdbd' else 'job completion log')}): "
        f"{t['jobs']} SLURM jobs for {t.get('shards', t['jobs'])} shards ({e(states)}); {e(_f(t['elapsed_seconds']))} s elapsed, "
        f"{e(_f(t['allocated_cpu_seconds']))} CPU-seconds allocated; CPU efficiency {e(_pct(t['cpu_efficiency']))}; "
        f"memory efficiency mean {e(_pct(t['memory_efficiency_mean']))}, max {e(_pct(t['memory_efficiency_max']))}; "
        f"max RSS {e(_f(t['max_rss_mb']))} MB.</p>"
    )
    notes = [block["note"]] if block.get("note") else []
    if block.get("missing_job_ids"):
        notes.append(f"not found by sacct: job(s) {', '.join(block['missing_job_ids'][:20])}")
    if len(block["jobs"]) > MAX_HTML_ROWS:
        notes.append(f"the first {MAX_HTML_ROWS} of {len(block['jobs'])} jobs; all are in metrics.json")
    out += [f'<p class="note">{e(n)}.</p>' for n in notes]
    out.append(
        "<table><tr><th>shard</th><th>outcome</th><th>SLURM job</th><th>state</th><th>elapsed s</th><th>CPUs</th>"
        "<th>CPU time s</th><th>CPU efficiency</th><th>max RSS MB</th><th>memory MB</th><th>memory efficiency</th></tr>"
    )
    for j in block["jobs"][:MAX_HTML_ROWS]:
        bad = " class=bad" if j["state"] != "COMPLETED" else ""
        cells = [
            _f(j["elapsed_seconds"]), _f(j["alloc_cpus"]), _f(j["total_cpu_seconds"]), _pct(j["cpu_efficiency"]),
            _f(j["max_rss_mb"]), _f(j["requested_mem_mb"], 0), _pct(j["memory_efficiency"]),
        ]  # fmt: skip
        out.append(
            f"<tr><td class=n>{j['shard_id']}</td><td>{e(j['outcome'])}</td><td>{e(j['sacct_job_id'])}</td>"
            f"<td{bad}>{e(str(j['state']))}</td>" + "".join(f"<td class=n>{e(c)}</td>" for c in cells) + "</tr>"
        )
    out.append("</table>")
    return out
