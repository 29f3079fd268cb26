"""Row-level checkpoints and the shard lease.

A shard commits finished rows as numbered part files in ``<output_dir>/shard_<id>/``
(temp name, fsync, rename) and records them in ``<state_dir>/shard_<id>/checkpoint.json``
with the source indices that are done or failed. Neither is a declared Snakemake output,
so both survive Snakemake deleting a failed job's outputs; a rerun skips committed rows.
The manifest carries a fingerprint of everything that determines the output; when it
changes, the old parts are discarded instead of being mixed with new ones.

The lease (``lease.json``) keeps two copies of one shard (a restarted driver while old
cluster jobs still run) from writing the same files.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mirageflow.data.writers import atomic_write_json, write_part

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


def fingerprint(cfg, shard_ranges: dict[int, tuple[int, int]]) -> str:
    """Hash of what determines a shard's records: model, sampling, prompts, schemas, rows."""
    raw = cfg.raw
    material = {
        "version": FORMAT_VERSION,
        "processors": raw["processors"],
        "processing_params": raw["processing_params"],
        "datasets": [
            {"path": d.path, "type": d.type, "split": d.split, "format": d.output_format, "rows": shard_ranges[d.index]}
            for d in cfg.datasets
        ],
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True, default=str).encode()).hexdigest()


# --------------------------------------------------------------------------- index ranges


def to_ranges(indices: set[int]) -> list[list[int]]:
    """Sorted disjoint [start, stop) ranges covering the set (compact on disk)."""
    out: list[list[int]] = []
    for i in sorted(indices):
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return out


def from_ranges(ranges: list[list[int]]) -> set[int]:
    return {i for a, b in ranges for i in range(a, b)}


def merge_ranges(a: list[list[int]], b: list[list[int]]) -> list[list[int]]:
    """The union of two sorted range lists, as sorted disjoint ranges (new lists)."""
    out: list[list[int]] = []
    for start, stop in heapq.merge(a, b):
        if out and start <= out[-1][1]:
            if stop > out[-1][1]:
                out[-1][1] = stop
        else:
            out.append([start, stop])
    return out


# --------------------------------------------------------------------------- manifest


@dataclass
class DatasetProgress:
    out_dir: Path
    fmt: str
    parts: list[str] = field(default_factory=list)
    done: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    # ranges of done/failed kept up to date by add(), so a commit does not sort every index
    # committed so far (quadratic over a long shard); rebuilt if the set was replaced or changed
    _ranges: dict = field(default_factory=dict, repr=False, compare=False)

    def ranges(self, which: str) -> list[list[int]]:
        indices = getattr(self, which)
        cached = self._ranges.get(which)
        if cached is None or cached[0] is not indices or cached[1] != len(indices):
            cached = self._ranges[which] = (indices, len(indices), to_ranges(indices))
        return cached[2]

    def add(self, which: str, new) -> None:
        indices = getattr(self, which)
        current = self.ranges(which)
        fresh = sorted({i for i in new if i not in indices})
        indices.update(fresh)
        self._ranges[which] = (indices, len(indices), merge_ranges(current, to_ranges(fresh)) if fresh else current)


class Checkpoint:
    """Committed progress of one shard across its datasets."""

    def __init__(self, shard_dir: Path, fingerprint: str, outputs: dict[int, tuple[Path, str]]):
        self.shard_dir = Path(shard_dir)
        self.path = self.shard_dir / "checkpoint.json"
        self.errors_path = self.shard_dir / "errors.jsonl"
        self.fingerprint = fingerprint
        self.datasets = {k: DatasetProgress(Path(d), fmt) for k, (d, fmt) in outputs.items()}
        if any(fmt == "parquet" for _, fmt in outputs.values()):
            # now, not at the first commit: pyarrow, and pandas on the first Table.from_pylist,
            # take ~0.6 s to import, a stall of the event loop mid-generation
            import pyarrow as pa
            import pyarrow.parquet  # noqa: F401

            pa.Table.from_pylist([{"warm_up": 1}])

    # ------------------------------------------------------------------ resume

    def restore(self, retry_failed: bool) -> None:
        """Load committed progress, or start clean when there is none or the fingerprint changed."""
        saved = None
        if self.path.exists():
            saved = json.loads(self.path.read_text())
            if saved.get("fingerprint") != self.fingerprint:
                n = sum(len(d["parts"]) for d in saved["datasets"].values())
                log.warning(
                    "checkpoint of %s was made with another model/prompt/schema/row range: discarding %d committed part(s)",
                    self.shard_dir.name, n,
                )  # fmt: skip
                saved = None
        kept_errors: list[str] = []
        if saved is not None:
            for key, d in saved["datasets"].items():
                prog = self.datasets[int(key)]
                prog.parts = list(d["parts"])
                prog.done = from_ranges(d["done"])
                prog.failed = set() if retry_failed else from_ranges(d["failed"])
            if self.errors_path.exists():
                for line in self.errors_path.read_text().splitlines():
                    entry = json.loads(line)
                    if entry["source_index"] in self.datasets[entry["dataset"]].failed:
                        kept_errors.append(line)
        # Parts not in the manifest were renamed into place by a run that died before
        # recording them (or belong to a discarded checkpoint): their rows are not committed.
        for prog in self.datasets.values():
            prog.out_dir.mkdir(parents=True, exist_ok=True)
            for stale in prog.out_dir.glob("part-*"):
                if stale.name not in prog.parts:
                    stale.unlink()
        self._write_errors(kept_errors, mode="w")
        self._save()

    def resumed_rows(self) -> int:
        return sum(len(p.done) + len(p.failed) for p in self.datasets.values())

    def committed_before(self, dataset: int):
        """``skip(index)``: whether the row was committed when this was called (at resume).

        A snapshot, as compact ranges: the writer thread adds to the live sets meanwhile.
        """
        prog = self.datasets[dataset]
        ranges = merge_ranges(prog.ranges("done"), prog.ranges("failed"))
        if not ranges:
            return lambda index: False
        starts = [a for a, _ in ranges]

        def skip(index: int) -> bool:
            k = bisect.bisect_right(starts, index) - 1
            return k >= 0 and index < ranges[k][1]

        return skip

    def failed_classes(self) -> Counter:
        """Failed rows per error class, from errors.jsonl (the committed failures)."""
        counts: Counter = Counter()
        if self.errors_path.exists():
            for line in self.errors_path.read_text().splitlines():
                counts[json.loads(line)["error"]] += 1
        return counts

    # ------------------------------------------------------------------ commit

    def commit(self, dataset: int, records: list[dict], errors: list[dict]) -> None:
        """Make these finished rows durable: part file, then error lines, then the manifest."""
        prog = self.datasets[dataset]
        if records:
            records.sort(key=lambda r: r["source_index"])
            name = f"part-{len(prog.parts):05d}.{prog.fmt}"
            write_part(prog.out_dir / name, records, prog.fmt)
            prog.parts.append(name)
            prog.add("done", (r["source_index"] for r in records))
        if errors:
            self._write_errors([json.dumps(e, ensure_ascii=False) for e in errors], mode="a")
            prog.add("failed", (e["source_index"] for e in errors))
        self._save()

    def _write_errors(self, lines: list[str], mode: str) -> None:
        with open(self.errors_path, mode) as f:
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())

    def _save(self) -> None:
        atomic_write_json(
            self.path,
            {
                "fingerprint": self.fingerprint,
                "datasets": {
                    str(k): {"out_dir": str(p.out_dir), "parts": p.parts, "done": p.ranges("done"), "failed": p.ranges("failed")}
                    for k, p in self.datasets.items()
                },
            },
            indent=None,  # rewritten at every commit: compact, by the C encoder
        )


# --------------------------------------------------------------------------- lease


class ShardBusy(RuntimeError):
    pass


def _holder() -> dict:
    return {"hostname": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID")}


def _holder_dead(holder: dict) -> bool:
    """The holder is known to be gone: its process on this host, or its SLURM job, no longer exists."""
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


class Lease:
    """Exclusive claim on a shard, kept alive by heartbeats; stale after ``timeout`` seconds."""

    def __init__(self, shard_dir: Path, timeout: float):
        self.path = Path(shard_dir) / "lease.json"
        self.timeout = timeout
        self.me = _holder()

    def acquire(self) -> None:
        try:
            current = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            current = None
        if current is not None:
            age = time.time() - current.get("heartbeat", 0)
            if age < self.timeout and not _holder_dead(current):
                who = f"host {current['hostname']} pid {current['pid']}" + (
                    f" (SLURM job {current['slurm_job_id']})" if current.get("slurm_job_id") else ""
                )
                raise ShardBusy(
                    f"{self.path.parent.name} is being run by {who}, last heartbeat {age:.0f} s ago. "
                    f"Cancel that job (scancel) or, if it is dead, rerun after {self.timeout - age:.0f} s "
                    f"(shard_params.lease_timeout_seconds) or delete {self.path}."
                )
            log.warning("taking over %s: its holder %s stopped heartbeating %.0f s ago", self.path, current, age)
        self.heartbeat(check=False)
        if not self.held():
            raise ShardBusy(f"another job claimed {self.path.parent.name} at the same moment: {self.path}")

    def held(self) -> bool:
        try:
            current = json.loads(self.path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return False
        return all(current.get(k) == v for k, v in self.me.items())

    def heartbeat(self, check: bool = True) -> None:
        if check and not self.held():
            raise ShardBusy(f"lost {self.path}: another job took over this shard; stopping to avoid mixed output")
        # a liveness mark, not data: no fsync (a crashed node's lease is stale anyway)
        atomic_write_json(self.path, {**self.me, "heartbeat": time.time()}, durable=False)

    def release(self) -> None:
        if self.held():
            self.path.unlink(missing_ok=True)
