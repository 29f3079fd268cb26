"""The shard state machine: what a shard's files say it is, asked by everyone who shows it.

``mmirage status``, ``mmirage retry`` and ``merge``, the terminal's live line and run
summary, the aggregate (metrics.json, report.html) and the merge job all decide "is this
shard done?" here, so they never disagree. A shard is

- ``done``: its status.json says success, for this ``num_shards``, and belongs to the
  current records fingerprint (``is_done``). A status.json written under another
  fingerprint (the prompt, model, sampling, schema or a dataset changed since) is
  *stale*: the shard is ``pending`` with ``stale`` saying why, and the next run reruns it.
  A status.json without a fingerprint (written before the field existed) counts as current.
- ``running``: lease.json heartbeated within the lease timeout, or progress.json was
  updated within ``PROGRESS_STALE_SECONDS`` in a phase that is not done/failed; unless
  the file names a process on this host that is gone (it died without a record).
- ``failed``: failure.json; or a damaged status.json or failure.json; or a progress.json
  that says failed (failure.json could not be written) or stopped updating mid-run
  (SIGKILL, OOM killer, node loss, a full disk).
- ``pending``: none of these (not run yet, or stale).

Works from the files alone (a login node, a laptop): no Snakemake, no SLURM.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from mirageflow.config.types import PipelineConfig
from mirageflow.state import layout as L
from mirageflow.state.records import ProgressRecord, ShardStats, StatusRecord, check_status, damaged_note, read

# progress.json is rewritten every 5 s while a shard lives: older than this, it belongs to no running shard
PROGRESS_STALE_SECONDS = 120.0

STATES = ("done", "running", "failed", "pending")


def current_fingerprint(cfg: PipelineConfig) -> str:
    """The records fingerprint of this config, computed here (what ``<state_dir>/records.fingerprint``
    holds once the driver parsed it). For `mmirage status` and `retry`, which may run before the driver."""
    from mirageflow.state.pipeline import records_fingerprint

    return records_fingerprint(cfg)["sha256"]


def recorded_fingerprint(state_dir: str | os.PathLike) -> str | None:
    """The records fingerprint the driver last wrote (``<state_dir>/records.fingerprint``), or
    None when there is none yet. In the driver it is the current config's (written at parse);
    the jobs (shard, merge, aggregate) use it too, so a ``$VAR`` expanded differently on a
    compute node does not make every shard look stale."""
    data, _why = read(L.StateLayout(state_dir).fingerprint)
    digest = (data or {}).get("sha256")
    return digest if isinstance(digest, str) else None


def default_lease_timeout() -> float:
    """``shard_params.lease_timeout_seconds``' default, from the config schema (where no config is at hand)."""
    from mirageflow.config.loading import schema

    return float(schema()["properties"]["shard_params"]["properties"]["lease_timeout_seconds"]["default"])


def stale_reason(status: StatusRecord, fingerprint: str | None) -> str | None:
    """Why a successful status.json is not the current config's result, or None."""
    theirs = status.get("records_fingerprint")
    if fingerprint is None or theirs is None or theirs == fingerprint:
        return None
    return (
        f"stale: its status.json was written for an earlier config (records fingerprint {theirs[:12]}, "
        f"now {fingerprint[:12]}: a prompt, model, sampling, schema or dataset changed); the next run reruns it"
    )


def is_done(status: StatusRecord | None, num_shards: int, fingerprint: str | None) -> bool:
    """The one answer to "is this shard done?": a status.json (as ``records.read`` returns it)
    saying success, for this num_shards, under the current records fingerprint."""
    return (
        status is not None
        and status.get("status") == "success"
        and status.get("num_shards", num_shards) == num_shards
        and stale_reason(status, fingerprint) is None
    )


def process_gone(record: dict | None) -> bool:
    """The file names a process on this host that no longer exists (it died without writing its end)."""
    if not record or record.get("hostname") != socket.gethostname():
        return False
    pid = record.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OSError):
        return False
    return False


def shard_states(
    state_dir: str | os.PathLike, num_shards: int, lease_timeout: float, fingerprint: str | None = None,
    now: float | None = None,
) -> list[dict]:  # fmt: skip
    """One entry per shard: ``state`` (done | running | failed | pending) and what its files say.

    ``fingerprint``: the current records fingerprint (``current_fingerprint(cfg)``); None
    trusts every status.json. Entries hold ``status`` (done), ``progress``, ``failure``
    (a failed shard's failure.json: its ``stats`` count in the report), ``stale`` (a
    pending shard's outdated status.json), ``damaged`` ([{file, path, reason}], only when
    there are any). A damaged status.json or failure.json fails the shard with ``error``
    "damaged state file <path>: <why>" (unless it runs now); other damaged files are ignored.
    """
    paths = L.StateLayout(state_dir)
    now = time.time() if now is None else now
    return [_shard_state(paths, shard_id, num_shards, lease_timeout, fingerprint, now) for shard_id in range(num_shards)]


def job_fingerprint(cfg: PipelineConfig) -> str:
    """The fingerprint a job works under: the one the driver recorded (the shards' input), or,
    run without the workflow (tests, benchmarks), the config's own."""
    return recorded_fingerprint(cfg.state_dir) or current_fingerprint(cfg)


def states_of(cfg: PipelineConfig, now: float | None = None) -> list[dict]:
    """``shard_states`` of a pipeline config, under its current records fingerprint."""
    return shard_states(cfg.state_dir, cfg.num_shards, cfg.shard.lease_timeout_seconds, current_fingerprint(cfg), now)


def _shard_state(paths: L.StateLayout, shard_id: int, num_shards: int, lease_timeout: float, fingerprint, now: float) -> dict:
    damaged = []

    def load(path: Path, check=None):
        data, why = read(path, check)
        if why:
            damaged.append({"file": path.name, "path": str(path), "reason": why})
        return data

    status = load(paths.status(shard_id), lambda s: check_status(s, shard_id))
    failure = load(paths.failure(shard_id))
    progress = load(paths.progress(shard_id))
    lease = load(paths.lease(shard_id))
    bad = {x["file"]: x for x in damaged}
    entry: dict = {"shard_id": shard_id, "state": "pending", "progress": progress}
    lease_age = now - lease["heartbeat"] if lease and lease.get("heartbeat") is not None else None
    progress_age = now - progress["updated_at_unix"] if progress and progress.get("updated_at_unix") is not None else None
    progress_live = progress is not None and progress.get("phase") not in ("done", "failed") and progress_age is not None
    if L.PROGRESS in bad and progress_age is None:  # a damaged progress.json still says when it was written
        try:
            progress_age = now - paths.progress(shard_id).stat().st_mtime
        except OSError:
            pass
        progress_live = progress_age is not None and status is None
    gone = process_gone(progress) if progress_live else False
    lease_live = lease_age is not None and lease_age < lease_timeout and not process_gone(lease)
    if status is not None and status.get("num_shards", num_shards) != num_shards:
        entry["other_run_num_shards"] = status["num_shards"]
    who = progress or lease or {}
    if is_done(status, num_shards, fingerprint):
        entry.update(state="done", status=status)
    elif lease_live or (progress_live and not gone and progress_age < PROGRESS_STALE_SECONDS):
        entry.update(state="running", since_update_seconds=progress_age if progress_live else lease_age)
        entry["host"], entry["slurm_job_id"] = who.get("hostname"), who.get("slurm_job_id")
    elif L.STATUS in bad or (failure is None and L.FAILURE in bad):
        x = bad.get(L.STATUS) or bad[L.FAILURE]
        more = "not counted as done; delete it and rerun the shard (mmirage retry)" if x["file"] == L.STATUS else "the shard failed"
        entry.update(
            state="failed", error=f"{damaged_note(x['path'], x['reason'])}; {more}", signal=None,
            attempt=(progress or {}).get("attempt"), host=who.get("hostname"), slurm_job_id=who.get("slurm_job_id"),
            finished_at=None,
        )  # fmt: skip
        if failure is not None:
            entry["failure"] = failure
    elif failure is not None:
        entry.update(
            state="failed", error=failure.get("error"), signal=failure.get("signal"), attempt=failure.get("attempt"),
            host=failure.get("hostname"), slurm_job_id=failure.get("slurm_job_id"), finished_at=failure.get("finished_at"),
            failure=failure,
        )  # fmt: skip
    elif progress is not None and progress.get("phase") == "failed":  # it failed, and could not write failure.json
        entry.update(
            state="failed", signal=None, attempt=progress.get("attempt"), host=progress.get("hostname"),
            slurm_job_id=progress.get("slurm_job_id"), finished_at=progress.get("updated_at"),
            error="failed without a failure record: its failure.json could not be written (a full disk?); its log says why",
        )  # fmt: skip
    elif progress_live:  # stopped updating without failure.json: SIGKILL, OOM killer, node failure, a full disk
        from mirageflow.stats.formulas import human_duration

        p = progress or {}
        if progress is None:  # damaged
            x = bad[L.PROGRESS]
            error = (f"{damaged_note(x['path'], x['reason'])}; no status.json or failure.json: stopped (killed?); "
                     f"progress.json last written {human_duration(progress_age)} ago")  # fmt: skip
        elif gone:
            error = (f"stopped without a failure record in phase '{p.get('phase')}': its process {p.get('pid')} on "
                     f"{p.get('hostname')} is gone (killed, or it could not write failure.json: a full disk?)")  # fmt: skip
        else:
            error = (f"stopped without a failure record in phase '{p.get('phase')}' (killed?); "
                     f"progress.json last updated {human_duration(progress_age)} ago")  # fmt: skip
        entry.update(
            state="failed", signal=None, attempt=p.get("attempt"), host=p.get("hostname") or (lease or {}).get("hostname"),
            slurm_job_id=p.get("slurm_job_id"), finished_at=p.get("updated_at"), error=error,
        )  # fmt: skip
    if status is not None and entry["state"] == "pending":
        entry["stale"] = stale_reason(status, fingerprint)
    if damaged:
        entry["damaged"] = damaged
    return entry


def count(states: list[dict]) -> dict[str, int]:
    """Shards per state: {"done": .., "running": .., "failed": .., "pending": ..}."""
    return {k: sum(1 for s in states if s["state"] == k) for k in STATES}


def attempts_count(stats_: ShardStats | None) -> int | None:
    """How many attempts a shard's stats cover: the length of ``stats.attempts``; None in older files without it."""
    attempts = (stats_ or {}).get("attempts")
    return len(attempts) if isinstance(attempts, list) else None


# --------------------------------------------------------------------------- work: rows and samples


def units_of(stats_: ShardStats | None) -> int:
    """Records + row errors + filtered units a shard's stats count (samples when n_samples > 1)."""
    st = stats_ or {}
    return int(sum(st.get(k) or 0 for k in ("rows_processed", "rows_failed", "rows_filtered")))


def progress_work(progress: ProgressRecord, n_samples: int) -> tuple[int, int, int | None]:
    """(rows done, samples done, samples committed) of a running shard's progress.json.

    A progress.json written before samples were counted apart has only ``rows_done``,
    which then counted samples: its rows are that over n_samples, rounded down.
    """
    samples = progress.get("samples_done")
    if samples is None:
        samples = progress.get("rows_done") or 0
        return int(samples) // max(1, n_samples), int(samples), None
    rows = progress.get("rows_done")
    committed = progress.get("samples_committed")
    return int(rows or 0), int(samples), None if committed is None else int(committed)
