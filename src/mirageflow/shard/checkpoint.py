"""Row-level checkpoints and the shard lease.

A shard commits finished rows as numbered part files in ``<output_dir>/shard_<id>/``
(temp name, fsync, rename) and records them in ``<state_dir>/shard_<id>/checkpoint.json``
with the source indices that are done or failed. Neither is a declared Snakemake output,
so both survive Snakemake deleting a failed job's outputs; a rerun skips committed rows.
The manifest carries a fingerprint of everything that determines the output; when it
changes, the old parts are discarded instead of being mixed with new ones.

State files are verified, not trusted. The manifest lists each part with its byte size,
sha256 and the source-index ranges of its rows; ``restore()`` checks every part (size,
then checksum) and recomputes the rows of a missing or damaged one (moved aside to
``<shard state dir>/damaged/<UTC stamp>/``). A damaged ``checkpoint.json`` is renamed to
``checkpoint.json.damaged-<UTC stamp>`` and treated as missing. Part files no manifest
lists are never deleted silently: they are moved to ``<shard state dir>/orphaned/<UTC
stamp>/`` and their rows recomputed (only the parts of a manifest whose fingerprint
changed are deleted). Damaged lines of ``errors.jsonl`` are skipped, and a row the manifest
lists as failed without a readable error line is recomputed, so that failed rows and error
lines always agree. Temp files of writes that a kill interrupted are removed.

Manifest format 2 (``MANIFEST_VERSION``)::

    {"format": 2, "fingerprint": "9f2c...",
     "datasets": {"0": {"out_dir": "out/shard_0", "fmt": "parquet",
                        "parts": [{"name": "part-00000.parquet", "bytes": 48213,
                                   "sha256": "5be1...", "rows": [[0, 500]]}],
                        "done": [[0, 500]], "failed": [[731, 732]], "filtered": [[500, 731]]}},
     "attempts": [{"attempt": 1, "...": "..."}]}

``filtered`` (absent in manifests written before filter steps existed): rows a filter step
dropped; the manifest is their only record (no part file, no error line), and a rerun skips
them as it skips done and failed rows.

A format-1 manifest (``parts`` a list of names; before per-part checksums) is verified by
reading each part: a part that reads back is kept and its rows are the ``source_index``
values it holds, one that does not is moved aside as damaged; the manifest is rewritten in
format 2 at once.

The lease (``lease.json``) keeps two copies of one shard (a restarted driver while old
cluster jobs still run) from writing the same files. A daemon thread renews it from
``acquire()`` to ``release()`` (also while the model loads); a copy that finds it lost
(taken over) stops renewing, and ``check()`` raises ``ShardBusy`` from then on.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

from mirageflow.config.types import PipelineConfig
from mirageflow.config import records_identity
from mirageflow.data.writers import write_part
from mirageflow.files import atomic_write_json
from mirageflow.shard.samples import complete_rows, describe_count, record_unit
from mirageflow.errors import MirageflowError
from mirageflow.state import layout as L
from mirageflow.shard.ledger import BatchLedger, ImageLedger
from mirageflow.shard.error_lines import ErrorLines
from mirageflow.shard.manifest import DatasetProgress, ManifestFile, is_int, merge_ranges
from mirageflow.shard.part_recovery import PartRecovery, sha256_and_size
from mirageflow.shard.tally import RecordTally

log = logging.getLogger(__name__)

# Part of fingerprint()'s material: bumping it changes every shard's fingerprint, which
# discards (deletes) every committed part on upgrade. The manifest layout has its own
# version, MANIFEST_VERSION.
FORMAT_VERSION = 1
# The lease's heartbeat thread renews it every lease_timeout / 4 (three renewals may fail,
# e.g. a stalled file system, before the lease goes stale), and at least this often, so that
# the lease's age stays a liveness signal for `mmirage status` even with a long timeout.
HEARTBEAT_MAX_PERIOD = 30.0


def fingerprint(cfg: PipelineConfig, shard_ranges: dict[int, tuple[int, int]], data: dict[int, list] | None = None) -> str:
    """Hash of what determines this shard's records: the config's records identity (model,
    sampling, prompts, schemas, datasets; the same one that reruns shards through
    ``records.fingerprint``), the shard's row range in each dataset and, in ``data``, each
    dataset's content as its index saw it (``data_identity``): an edited row discards the
    parts made from the old rows (the request cache answers the rows that did not change)."""
    material = {
        "version": FORMAT_VERSION,
        "records": records_identity(cfg),
        "rows": [shard_ranges[d.index] for d in cfg.datasets],
    }
    if data is not None:
        material["data"] = [data.get(d.index) for d in cfg.datasets]
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


def data_identity(index_fingerprint: list[list]) -> list:
    """A dataset's content from its index's file fingerprint: per file its size and SHA-256,
    or its size and mtime where the file is too large to hash (data/readers.py)."""
    return [[size, digest] if digest is not None else [size, mtime] for _, size, mtime, digest in index_fingerprint]


def _runs(sorted_indices: list[int]) -> list[list[int]]:
    """[start, stop) ranges of a sorted list of distinct indices, in one pass."""
    out: list[list[int]] = []
    for i in sorted_indices:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


class Checkpoint:
    """Committed progress of one shard across its datasets.

    Use: ``restore()`` once (under the shard's lease), then ``commit()`` batches of finished
    rows. ``attempts`` (per-attempt stats kept with the checkpoint) is restored too; change
    it with ``begin_attempt``/``update_attempt``; every commit and ``save()`` persist it.

    It keeps the committed progress (``datasets``) and writes the part files; its collaborators
    own the files around them: ``ManifestFile`` (shard/manifest.py: checkpoint.json read,
    checked and written), ``PartRecovery`` (shard/part_recovery.py: what a restore finds on
    disk: parts verified, damaged and unlisted ones moved aside, temp files removed) and
    ``ErrorLines`` (shard/error_lines.py: errors.jsonl appended, read, made to agree).
    """

    def __init__(self, shard_dir: Path, fingerprint: str, outputs: dict[int, tuple[Path, str]], samples: int = 1):
        """``samples``: records per row (n_samples); above 1 every index here is a unit,
        ``source_index * samples + sample_index`` (mirageflow/shard/samples.py)."""
        self.shard_dir = Path(shard_dir)
        self.samples = samples
        self.path = self.shard_dir / L.CHECKPOINT
        self.errors_path = self.shard_dir / L.ERRORS
        self.fingerprint = fingerprint
        self.datasets = {k: DatasetProgress(Path(d), fmt) for k, (d, fmt) in outputs.items()}
        self.attempts: list[dict] = []
        # work that outlives an attempt (shard/ledger.py): provider batches submitted, images written
        self.batches = BatchLedger(self.shard_dir, fingerprint)
        self.images = ImageLedger(self.shard_dir, fingerprint)
        # its collaborators: the manifest file, what a restore finds on disk, the row errors' file
        self.manifest = ManifestFile(self.path, fingerprint, outputs)
        self.recovery = PartRecovery(self.shard_dir, self.path)
        self.errors = ErrorLines(self.errors_path, outputs, samples)
        if any(fmt == "parquet" for _, fmt in outputs.values()):
            # now, not at the first commit: pyarrow, and pandas on the first Table.from_pylist,
            # take ~0.6 s to import, a stall of the event loop mid-generation
            import pyarrow as pa
            import pyarrow.parquet

            pa.Table.from_pylist([{"warm_up": 1}])

    # ------------------------------------------------------------------ resume

    def restore(self, retry_failed: bool, start_over: bool = False) -> None:
        """Load committed progress, verified; or start clean when there is none, the fingerprint
        changed or ``start_over`` (an input file changed by content: mirageflow.state.inputs).

        Every part the manifest lists is checked (size, then sha256); the rows of a missing
        or damaged one are recomputed. Parts no manifest lists are moved aside to
        ``orphaned/``, never deleted, unless the manifest's fingerprint changed (config
        edited): then all parts are deleted. A WARNING names each file concerned.
        """
        self.shard_dir.mkdir(parents=True, exist_ok=True)
        self.recovery.begin()  # one UTC stamp for whatever this restore moves aside
        self.recovery.remove_temp_files(self.datasets)
        saved = self.manifest.load()
        discard = False
        if saved is not None and (start_over or saved["fingerprint"] != self.fingerprint):
            n = sum(len(d["parts"]) for d in saved["datasets"].values())
            log.warning(
                "checkpoint of %s was made with another model/prompt/schema/row range: discarding %d committed part(s)",
                self.shard_dir.name, n,
            )  # fmt: skip
            saved, discard = None, True
        self.attempts = list(saved.get("attempts", [])) if saved is not None else []

        for key, prog in self.datasets.items():
            prog.out_dir.mkdir(parents=True, exist_ok=True)
            entry = saved["datasets"].get(str(key)) if saved is not None else None
            prog.parts, prog.part_info, prog._part_json, prog.next_part = [], {}, [], 0
            prog.done, prog.failed, prog.filtered = set(), set(), set()
            if entry is not None:
                self.recovery.restore_dataset(key, prog, entry, retry_failed)
            self.recovery.set_aside_unlisted(key, prog, discard)
        self.errors.restore(self.datasets, self.path)
        self._save()
        self.batches.restore()
        self.images.restore()

    def committed_units(self) -> int:
        """Units (rows; samples with n_samples > 1) committed: records, row errors and filtered rows."""
        return sum(len(p.done) + len(p.failed) + len(p.filtered) for p in self.datasets.values())

    def complete_rows(self) -> int:
        """Source rows whose every sample is committed (with one sample per row: committed_units)."""
        return sum(
            complete_rows(merge_ranges(merge_ranges(p.ranges("done"), p.ranges("failed")), p.ranges("filtered")), self.samples)
            for p in self.datasets.values()
        )

    def describe_committed(self) -> str:
        """What is committed, in rows and samples: "8 rows", "16 samples (8 rows complete)"."""
        return describe_count(self.committed_units(), self.samples, self.complete_rows() if self.samples > 1 else None)

    def committed_before(self, dataset: int):
        """``skip(index)``: whether the row was committed when this was called (at resume).

        A snapshot, as compact ranges: the writer thread adds to the live sets meanwhile.
        """
        prog = self.datasets[dataset]
        ranges = merge_ranges(merge_ranges(prog.ranges("done"), prog.ranges("failed")), prog.ranges("filtered"))
        if not ranges:
            return lambda index: False
        starts = [a for a, _ in ranges]

        def skip(index: int) -> bool:
            k = bisect.bisect_right(starts, index) - 1
            return k >= 0 and index < ranges[k][1]

        return skip

    def records_tally(self) -> dict:
        """The record figures of the intact parts (shard/tally.py): what the shard's records hold."""
        return RecordTally.merge([p.part_info[name].get("records") for p in self.datasets.values() for name in p.parts])

    def failed_classes(self) -> Counter:
        """Failed rows per error class, from errors.jsonl (the committed failures)."""
        return self.errors.classes()

    # ------------------------------------------------------------------ attempts

    def begin_attempt(self, entry: dict) -> int:
        """Record a new attempt (persisted by the next commit or ``save()``); its index."""
        self.attempts.append(entry)
        return len(self.attempts) - 1

    def update_attempt(self, i: int, entry: dict) -> None:
        """Replace attempt ``i`` (persisted by the next commit or ``save()``)."""
        self.attempts[i] = entry

    def save(self) -> None:
        """Write the manifest now (e.g. after ``update_attempt`` at the end of an attempt)."""
        self._save()

    # ------------------------------------------------------------------ commit

    def commit(self, dataset: int, records: list[dict], errors: list[dict], filtered=(), tally: RecordTally | None = None) -> None:
        """Make these finished rows durable: part file, then error lines, then the manifest
        (which alone records the ``filtered`` source indices: rows a filter step dropped).
        ``tally``: what the records hold (shard/tally.py), kept in the part's entry."""
        prog = self.datasets[dataset]
        n = self.samples
        if records:
            if n == 1:
                records.sort(key=lambda r: r["source_index"])
                indices = [r["source_index"] for r in records]
            else:  # x x x y y y: by row, then sample
                records.sort(key=lambda r: record_unit(r, n))
                indices = [record_unit(r, n) for r in records]
            name = f"part-{prog.next_part:05d}.{prog.fmt}"
            path = prog.out_dir / name
            write_part(path, records, prog.fmt)
            digest, size = sha256_and_size(path)  # read back from the page cache
            prog.add_part(name, size, digest, _runs(indices), tally.to_json() if tally else None)
            prog.add("done", indices)
        if errors:
            self.errors.append(errors)
            prog.add("failed", (record_unit(e, n) for e in errors))
        if filtered:
            prog.add("filtered", filtered)
        self._save()

    def _save(self) -> None:
        self.manifest.write(self.datasets, self.attempts)


# --------------------------------------------------------------------------- lease


class ShardBusy(MirageflowError, RuntimeError):
    pass


def _holder() -> dict:
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}


def _holder_dead(holder: dict) -> bool:
    """The holder is known to be gone: its process on this host, or its SLURM job, no longer
    exists, or it was an earlier run of this very SLURM job (requeued after preemption or a
    node failure: SLURM ended that run before starting this one)."""
    own_job = os.environ.get("SLURM_JOB_ID")
    if (
        own_job
        and str(holder.get("slurm_job_id")) == own_job
        and (holder.get("hostname"), holder.get("pid")) != (socket.gethostname(), os.getpid())
    ):
        return True
    if holder.get("hostname") == socket.gethostname():
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return True
        except (PermissionError, KeyError, ValueError, TypeError):
            return False
        return False
    job = holder.get("slurm_job_id")
    if job and shutil.which("squeue"):
        try:
            out = subprocess.run(["squeue", "-h", "-j", str(job), "-o", "%T"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            return False
        # squeue forgets finished jobs (or errors on unknown ids): either way the holder is gone
        return out.returncode != 0 or not out.stdout.strip() or out.stdout.split()[0] in _ENDED
    return False


_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _describe(holder: dict) -> str:
    return f"host {holder.get('hostname')} pid {holder.get('pid')}" + (
        f" (SLURM job {holder['slurm_job_id']})" if holder.get("slurm_job_id") else ""
    )


class Lease:
    """Exclusive claim on a shard, kept alive by heartbeats; stale after ``timeout`` seconds.

    ``acquire()`` starts a daemon thread that renews the lease every ``period`` seconds
    (``min(timeout / 4, HEARTBEAT_MAX_PERIOD)``) until ``release()``. If a renewal finds the
    lease held by another job (taken over), the thread stops and records it in ``lost``;
    ``check()`` (before each commit) then raises ShardBusy. A renewal that fails with an
    I/O error (disk full) is logged and retried at the next period.
    """

    def __init__(self, shard_dir: Path, timeout: float):
        self.path = Path(shard_dir) / L.LEASE
        self.timeout = timeout
        # the token tells two Lease objects of one process (or a reused pid) apart
        self.me = {**_holder(), "token": uuid.uuid4().hex}
        self.period = min(timeout / 4, HEARTBEAT_MAX_PERIOD)
        self.lost: str | None = None  # why the lease was lost, once a heartbeat or check() found out
        self._lock = threading.Lock()  # one renewal at a time; release() waits for one in flight
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> tuple[dict | None, str | None]:
        """(the lease, None), (None, None) when there is none, or (None, what is wrong) when damaged."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None, None
        try:
            current = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            return None, f"not JSON: {e}"
        if not (
            isinstance(current, dict)
            and isinstance(current.get("heartbeat"), (int, float)) and not isinstance(current["heartbeat"], bool)
            and isinstance(current.get("hostname"), str) and is_int(current.get("pid"))
        ):  # fmt: skip
            return None, "not a lease (no hostname, pid and heartbeat)"
        return current, None

    def acquire(self) -> None:
        current, problem = self._read()
        if problem is not None:
            try:
                age = time.time() - self.path.stat().st_mtime
            except FileNotFoundError:
                age = float("inf")  # removed meanwhile
            if age < self.timeout:
                raise ShardBusy(
                    f"{self.path} is damaged ({problem}) and was written {age:.0f} s ago; if no job runs "
                    f"{self.path.parent.name}, delete it, or rerun after {self.timeout - age:.0f} s "
                    "(shard_params.lease_timeout_seconds)"
                )
            log.warning("taking over %s: it is damaged (%s) and %.0f s old", self.path, problem, age)
        elif current is not None:
            age = time.time() - current["heartbeat"]
            if age < self.timeout and not _holder_dead(current):
                raise ShardBusy(
                    f"{self.path.parent.name} is being run by {_describe(current)}, last heartbeat {age:.0f} s ago. "
                    f"Cancel that job (scancel) or, if it is dead, rerun after {self.timeout - age:.0f} s "
                    f"(shard_params.lease_timeout_seconds) or delete {self.path}."
                )
            log.warning("taking over %s: its holder %s stopped heartbeating %.0f s ago", self.path, current, age)
        self.lost = None
        self.heartbeat(check=False)
        if not self.held():
            raise ShardBusy(f"another job claimed {self.path.parent.name} at the same moment: {self.path}")
        # temp files of lease writes a kill interrupted; no one else writes the lease while we hold it
        for tmp in self.path.parent.glob(f".{self.path.name}.*.tmp"):
            tmp.unlink(missing_ok=True)
        self._stop.set()  # a thread of an earlier acquire() without release()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(self._stop,), name=f"lease-{self.path.parent.name}", daemon=True)
        self._thread.start()

    def held(self) -> bool:
        current, _ = self._read()
        return current is not None and all(current.get(k) == v for k, v in self.me.items())

    def _lost_message(self) -> str:
        current, problem = self._read()
        if current is not None:
            who = f"{_describe(current)} holds it now"
        else:
            who = f"it is damaged ({problem})" if problem else "it was deleted"
        return f"lost {self.path}: {who}; another job took over this shard; stopping to avoid mixed output"

    def check(self) -> None:
        """Raise ShardBusy if the lease was lost (taken over): call before writing the shard's files."""
        if self.lost is None and not self.held():
            self.lost = self._lost_message()
        if self.lost is not None:
            raise ShardBusy(self.lost)

    def heartbeat(self, check: bool = True) -> None:
        with self._lock:
            if check:
                self.check()
            # a liveness mark, not data: no fsync (a crashed node's lease is stale anyway)
            atomic_write_json(self.path, {**self.me, "heartbeat": time.time()}, durable=False)

    def _beat(self, stop: threading.Event) -> None:
        while not stop.wait(self.period):
            with self._lock:
                if stop.is_set():  # released meanwhile: do not write the lease again
                    return
                try:
                    if self.lost is None and not self.held():
                        self.lost = self._lost_message()
                    if self.lost is not None:
                        log.error("%s", self.lost)
                        return
                    atomic_write_json(self.path, {**self.me, "heartbeat": time.time()}, durable=False)
                except OSError as e:  # disk full, a file system hiccup: try again next period
                    log.warning("cannot renew %s: %s; retrying in %.0f s", self.path, e, self.period)

    def release(self) -> None:
        self._stop.set()
        with self._lock:  # waits for a renewal in flight, which then sees the stop
            if self.held():
                self.path.unlink(missing_ok=True)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
