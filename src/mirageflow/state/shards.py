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
from dataclasses import dataclass, field
from pathlib import Path

from mirageflow.config.types import PipelineConfig
from mirageflow.state import layout as L
from mirageflow.state.records import (
    DamagedFile,
    FailureRecord,
    LeaseRecord,
    ProgressRecord,
    ShardStats,
    StatusRecord,
    check_status,
    damaged_note,
    read,
)

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
) -> list[ShardState]:  # fmt: skip
    """One ``ShardState`` per shard: ``state`` (done | running | failed | pending) and what its files say.

    ``fingerprint``: the current records fingerprint (``current_fingerprint(cfg)``); None
    trusts every status.json. A damaged status.json or failure.json fails the shard with
    ``error`` "damaged state file <path>: <why>" (unless it runs now); other damaged files
    are ignored (listed in ``damaged``).
    """
    paths = L.StateLayout(state_dir)
    now = time.time() if now is None else now
    return [_shard_state(paths, shard_id, num_shards, lease_timeout, fingerprint, now) for shard_id in range(num_shards)]


def job_fingerprint(cfg: PipelineConfig) -> str:
    """The fingerprint a job works under: the one the driver recorded (the shards' input), or,
    run without the workflow (tests, benchmarks), the config's own."""
    return recorded_fingerprint(cfg.state_dir) or current_fingerprint(cfg)


def states_of(cfg: PipelineConfig, now: float | None = None) -> list[ShardState]:
    """``shard_states`` of a pipeline config, under its current records fingerprint."""
    return shard_states(cfg.state_dir, cfg.num_shards, cfg.shard.lease_timeout_seconds, current_fingerprint(cfg), now)


@dataclass
class ShardState:
    """What a shard's files say it is: the state machine's answer (``shard_states``), read by
    `mmirage status`/`retry`/`merge`, the terminal and the report. Only the fields of its
    ``state`` are set; ``to_json`` is what `mmirage status --json` shows of it."""

    shard_id: int
    state: str = "pending"  # done | running | failed | pending
    progress: ProgressRecord | None = None  # its progress.json, when it reads
    status: StatusRecord | None = None  # its status.json, when it reads (a done shard's figures: ``stats``)
    failure: FailureRecord | None = None  # a failed shard's failure.json, when it reads (its stats count in the report)
    stale: str | None = None  # pending: why its status.json is not the current config's (None: it is, or none)
    damaged: list[DamagedFile] = field(default_factory=list)  # state files that do not read
    other_run_num_shards: int | None = None  # its status.json is of a run with another num_shards
    since_update_seconds: float | None = None  # running: since its progress.json or lease.json was last written
    host: str | None = None  # running, failed: where it ran
    slurm_job_id: str | None = None
    error: str | None = None  # failed: why
    signal: str | None = None  # failed: the signal that stopped it
    failure_class: str | None = None  # failed: the class of the engine death that ended it (an EngineDeathClass value)
    attempt: int | None = None  # failed: its attempt
    finished_at: str | None = None  # failed: when

    @property
    def stats(self) -> ShardStats | None:
        """A done shard's stats (sums over its attempts, from its status.json); None for any other state."""
        return self.status["stats"] if self.state == "done" and self.status is not None else None

    @property
    def failure_stats(self) -> ShardStats | None:
        """A failed shard's stats as its failure.json has them (totals over its attempts), else None."""
        return (self.failure or {}).get("stats")

    def to_json(self) -> dict:
        """The fields of its state (status.json and failure.json left out: `mmirage status --json` shows the states)."""
        out: dict = {"shard_id": self.shard_id, "state": self.state, "progress": self.progress}
        if self.other_run_num_shards is not None:
            out["other_run_num_shards"] = self.other_run_num_shards
        if self.state == "running":
            out |= {"since_update_seconds": self.since_update_seconds, "host": self.host, "slurm_job_id": self.slurm_job_id}
        elif self.state == "failed":
            out |= {
                "error": self.error, "signal": self.signal, "failure_class": self.failure_class, "attempt": self.attempt,
                "host": self.host, "slurm_job_id": self.slurm_job_id, "finished_at": self.finished_at,
            }  # fmt: skip
        elif self.state == "pending" and self.status is not None:
            out["stale"] = self.stale
        if self.damaged:
            out["damaged"] = self.damaged
        return out


@dataclass
class _Files:
    """One shard's state files as read (None: absent or damaged) and the damaged ones, by file name."""

    status: StatusRecord | None
    failure: FailureRecord | None
    progress: ProgressRecord | None
    lease: LeaseRecord | None
    damaged: list[DamagedFile]

    @property
    def bad(self) -> dict[str, DamagedFile]:
        return {x["file"]: x for x in self.damaged}


def _read_files(paths: L.StateLayout, shard_id: int) -> _Files:
    damaged: list[DamagedFile] = []

    def load(path: Path, check=None):
        data, why = read(path, check)
        if why:
            damaged.append({"file": path.name, "path": str(path), "reason": why})
        return data

    status = load(paths.status(shard_id), lambda s: check_status(s, shard_id))
    failure = load(paths.failure(shard_id))
    progress = load(paths.progress(shard_id))
    lease = load(paths.lease(shard_id))
    return _Files(status, failure, progress, lease, damaged)


@dataclass
class _Liveness:
    """How recently a shard's lease.json and progress.json were written, and whether they say it runs."""

    lease_age: float | None  # seconds since the lease's heartbeat
    progress_age: float | None  # seconds since progress.json was written
    progress_live: bool  # progress.json says the shard was mid-run (not done, not failed)
    gone: bool  # ... and names a process on this host that is gone
    lease_live: bool  # the heartbeat is within the lease timeout, its process not gone

    @property
    def running(self) -> bool:
        fresh = self.progress_age is not None and self.progress_age < PROGRESS_STALE_SECONDS
        return self.lease_live or (self.progress_live and not self.gone and fresh)

    @property
    def since_update(self) -> float | None:
        return self.progress_age if self.progress_live else self.lease_age


def _liveness(paths: L.StateLayout, shard_id: int, f: _Files, lease_timeout: float, now: float) -> _Liveness:
    progress, lease = f.progress, f.lease
    lease_age = now - lease["heartbeat"] if lease and lease.get("heartbeat") is not None else None
    progress_age = now - progress["updated_at_unix"] if progress and progress.get("updated_at_unix") is not None else None
    progress_live = progress is not None and progress.get("phase") not in ("done", "failed") and progress_age is not None
    if L.PROGRESS in f.bad and progress_age is None:  # a damaged progress.json still says when it was written
        try:
            progress_age = now - paths.progress(shard_id).stat().st_mtime
        except OSError:
            pass
        progress_live = progress_age is not None and f.status is None
    gone = process_gone(progress) if progress_live else False
    lease_live = lease_age is not None and lease_age < lease_timeout and not process_gone(lease)
    return _Liveness(lease_age, progress_age, progress_live, gone, lease_live)


def _shard_state(paths: L.StateLayout, shard_id: int, num_shards: int, lease_timeout: float, fingerprint, now: float) -> ShardState:
    f = _read_files(paths, shard_id)
    status, progress, bad = f.status, f.progress, f.bad
    live = _liveness(paths, shard_id, f, lease_timeout, now)
    entry = ShardState(shard_id, progress=progress, status=status, damaged=f.damaged)
    if status is not None and status.get("num_shards", num_shards) != num_shards:
        entry.other_run_num_shards = status["num_shards"]
    who = progress or f.lease or {}
    if is_done(status, num_shards, fingerprint):
        entry.state = "done"
    elif live.running:
        entry.state, entry.since_update_seconds = "running", live.since_update
        entry.host, entry.slurm_job_id = who.get("hostname"), who.get("slurm_job_id")
    elif L.STATUS in bad or (f.failure is None and L.FAILURE in bad):
        _failed_damaged(entry, bad.get(L.STATUS) or bad[L.FAILURE], who)
        entry.failure = f.failure
    elif f.failure is not None:
        _failed_recorded(entry, f.failure)
    elif progress is not None and progress.get("phase") == "failed":  # it failed, and could not write failure.json
        _failed(entry, progress, "failed without a failure record: its failure.json could not be written (a full disk?); its log says why")
    elif live.progress_live:  # stopped updating without failure.json: SIGKILL, OOM killer, node failure, a full disk
        _failed_silently(entry, progress, f.lease, bad, live.gone, live.progress_age)
    if status is not None and entry.state == "pending":
        entry.stale = stale_reason(status, fingerprint)
    return entry


def _failed_damaged(entry: ShardState, x: DamagedFile, who: dict) -> None:
    """A damaged status.json (not counted as done) or failure.json fails the shard."""
    more = "not counted as done; delete it and rerun the shard (mmirage retry)" if x["file"] == L.STATUS else "the shard failed"
    entry.state, entry.error = "failed", f"{damaged_note(x['path'], x['reason'])}; {more}"
    entry.attempt = (entry.progress or {}).get("attempt")
    entry.host, entry.slurm_job_id = who.get("hostname"), who.get("slurm_job_id")


def _failed_recorded(entry: ShardState, failure: FailureRecord) -> None:
    """failure.json says why."""
    entry.state, entry.error, entry.signal, entry.attempt = "failed", failure.get("error"), failure.get("signal"), failure.get("attempt")
    entry.failure_class = failure.get("failure_class")
    entry.host, entry.slurm_job_id, entry.finished_at = failure.get("hostname"), failure.get("slurm_job_id"), failure.get("finished_at")
    entry.failure = failure


def _failed(entry: ShardState, progress: ProgressRecord | dict, error: str, host: str | None = None) -> None:
    """Failed without failure.json: what its progress.json says of it."""
    entry.state, entry.error, entry.attempt = "failed", error, progress.get("attempt")
    entry.host, entry.slurm_job_id, entry.finished_at = (
        host or progress.get("hostname"),
        progress.get("slurm_job_id"),
        progress.get("updated_at"),
    )


def _failed_silently(entry: ShardState, progress, lease, bad: dict, gone: bool, progress_age: float) -> None:
    """progress.json stopped updating mid-run and no failure.json says why (killed?)."""
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
    _failed(entry, p, error, host=p.get("hostname") or (lease or {}).get("hostname"))


def count(states: list[ShardState]) -> dict[str, int]:
    """Shards per state: {"done": .., "running": .., "failed": .., "pending": ..}."""
    return {k: sum(1 for s in states if s.state == k) for k in STATES}


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
