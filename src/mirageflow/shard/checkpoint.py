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
import heapq
import io
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mirageflow.config.types import PipelineConfig
from mirageflow.config import records_identity
from mirageflow.data.writers import write_part
from mirageflow.files import atomic_write_json, atomic_write_text
from mirageflow.shard.samples import complete_rows, describe_count, record_unit
from mirageflow.errors import MirageflowError
from mirageflow.state import layout as L
from mirageflow.shard.ledger import BatchLedger, ImageLedger
from mirageflow.shard.tally import RecordTally, valid_entry

log = logging.getLogger(__name__)

# Part of fingerprint()'s material: bumping it changes every shard's fingerprint, which
# discards (deletes) every committed part on upgrade. The manifest layout has its own
# version, MANIFEST_VERSION.
FORMAT_VERSION = 1
# Layout of checkpoint.json: 1 = part names only; 2 = per-part size, sha256 and row ranges,
# plus "format" and "attempts".
MANIFEST_VERSION = 2

# Temp files of atomic writes that another thread of this process may be writing right now
# (the lease heartbeat, the progress reporter) are removed only once older than this.
TEMP_GRACE_SECONDS = 10.0
# The lease's heartbeat thread renews it every lease_timeout / 4 (three renewals may fail,
# e.g. a stalled file system, before the lease goes stale), and at least this often, so that
# the lease's age stays a liveness signal for `mmirage status` even with a long timeout.
HEARTBEAT_MAX_PERIOD = 30.0


class CheckpointError(MirageflowError, RuntimeError):
    """The checkpoint cannot be used as it is; the message names the file and what to do."""


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


def _error_line(entry: dict) -> str:
    """One errors.jsonl line: UTF-8 text, or \\u escapes where a value holds a lone surrogate."""
    line = json.dumps(entry, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(entry)
    return line


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


def _utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _unique(path: Path) -> Path:
    """``path``, or ``path-1``, ``path-2``... whichever does not exist yet."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _sha256_and_size(path: Path) -> tuple[str, int]:
    """One read of the file (just written: from the page cache)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return digest, os.fstat(f.fileno()).st_size


# --------------------------------------------------------------------------- manifest


_PART_NAME = re.compile(r"part-\d+\.[A-Za-z0-9]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _bad_ranges(ranges) -> bool:
    return not isinstance(ranges, list) or not all(
        isinstance(r, list) and len(r) == 2 and _is_int(r[0]) and _is_int(r[1]) and 0 <= r[0] < r[1] for r in ranges
    )


def _json_dumps(obj) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=str)


@dataclass
class DatasetProgress:
    out_dir: Path
    fmt: str
    parts: list[str] = field(default_factory=list)  # names of the committed part files, in commit order
    done: set[int] = field(default_factory=set)
    failed: set[int] = field(default_factory=set)
    filtered: set[int] = field(default_factory=set)  # rows a filter step dropped: no record, no error
    # name -> {"bytes", "sha256", "rows"} of each committed part (what restore() verifies)
    part_info: dict[str, dict] = field(default_factory=dict, repr=False)
    next_part: int = 0  # number of the next part file (never one of a kept part)
    # each part's manifest entry, encoded once: a commit rewrites the manifest by joining them
    _part_json: list[str] = field(default_factory=list, repr=False, compare=False)
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

    def add_part(self, name: str, size: int, sha256: str, rows: list[list[int]], records: dict | None = None) -> None:
        """Record a committed part file (the rows' indices go to ``done`` separately).
        ``records``: the tally of the records it holds (shard/tally.py), None for a part
        committed before tallies were kept."""
        info = {"name": name, "bytes": size, "sha256": sha256, "rows": rows}
        if records is not None:
            info["records"] = records
        self.parts.append(name)
        self.part_info[name] = info
        self._part_json.append(_json_dumps(info))
        m = re.fullmatch(r"part-(\d+)\..*", name)
        if m:
            self.next_part = max(self.next_part, int(m.group(1)) + 1)

    def manifest_json(self) -> str:
        return (
            f'{{"out_dir":{_json_dumps(str(self.out_dir))},"fmt":{_json_dumps(self.fmt)},'
            f'"parts":[{",".join(self._part_json)}],'
            f'"done":{_json_dumps(self.ranges("done"))},"failed":{_json_dumps(self.ranges("failed"))},'
            f'"filtered":{_json_dumps(self.ranges("filtered"))}}}'
        )


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
        self._stamp: str | None = None  # of the damaged/ and orphaned/ directories of this restore
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
        self._stamp = None  # one UTC stamp for whatever this restore moves aside
        self._remove_temp_files()
        saved = self._load_manifest()
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
                self._restore_dataset(key, prog, entry, retry_failed)
            self._set_aside_unlisted(key, prog, discard)
        self._restore_errors()
        self._save()
        self.batches.restore()
        self.images.restore()

    def _restore_dataset(self, key: int, prog: DatasetProgress, entry: dict, retry_failed: bool) -> None:
        """Verify the dataset's listed parts; done = the rows of the parts that are intact."""
        for part in entry["parts"]:
            if isinstance(part, str):  # format 1: no size or checksum recorded, read it back
                info = self._verify_unrecorded_part(key, prog, part)
            else:
                info = self._verify_part(key, prog, part)
            if info is not None:
                prog.add_part(info["name"], info["bytes"], info["sha256"], info["rows"], info.get("records"))
        prog.done = from_ranges(merge_ranges(sorted(r for name in prog.parts for r in prog.part_info[name]["rows"]), []))
        listed = from_ranges(entry["done"])
        unbacked = len(listed - prog.done)
        lost_in_parts = sum(
            b - a for part in entry["parts"] if not isinstance(part, str) and part["name"] not in prog.part_info for a, b in part["rows"]
        )
        if unbacked > lost_in_parts:  # beyond the rows of the parts reported damaged or missing
            log.warning(
                "%s lists %d row(s) of dataset %d as done that no intact part file holds: they will be recomputed",
                self.path, unbacked - lost_in_parts, key,
            )  # fmt: skip
        if not retry_failed:
            prog.failed = from_ranges(entry["failed"]) - prog.done
        # filtered rows have no file to verify; retry_failed_rows does not redo them (not failures)
        prog.filtered = from_ranges(entry.get("filtered", [])) - prog.done - prog.failed

    def _verify_part(self, key: int, prog: DatasetProgress, part: dict) -> dict | None:
        """The part's entry when its file is intact; else None (moved aside, WARNING)."""
        path = prog.out_dir / part["name"]
        rows = sum(b - a for a, b in part["rows"])
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            log.warning("part file %s listed in %s is missing: its %d row(s) will be recomputed", path, self.path, rows)
            return None
        if size != part["bytes"]:
            self._move_damaged(key, path, f"{size} bytes, {self.path.name} says {part['bytes']}", rows)
            return None
        digest, _ = _sha256_and_size(path)
        if digest != part["sha256"]:
            self._move_damaged(key, path, f"sha256 {digest[:12]}..., {self.path.name} says {part['sha256'][:12]}...", rows)
            return None
        return part

    def _verify_unrecorded_part(self, key: int, prog: DatasetProgress, name: str) -> dict | None:
        """A format-1 part (no size or checksum on record): intact if it reads back; its rows
        are the source_index values it holds."""
        path = prog.out_dir / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            log.warning("part file %s listed in %s is missing: its rows will be recomputed", path, self.path)
            return None
        try:
            indices = _part_indices(data, prog.fmt)
        except (ValueError, KeyError, TypeError, OSError) as e:  # pyarrow's errors are ValueError/OSError
            self._move_damaged(key, path, f"unreadable: {str(e)[:200]}", None)
            return None
        return {"name": name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "rows": to_ranges(indices)}

    def _aside_dir(self, kind: str, key: int) -> Path:
        if self._stamp is None:
            # one stamp per restore; a second restore within the same second gets a suffix
            base, n = _utc_stamp(), 0
            self._stamp = base
            while any((self.shard_dir / k / self._stamp).exists() for k in ("damaged", "orphaned")):
                n += 1
                self._stamp = f"{base}-{n}"
        return self.shard_dir / kind / self._stamp / f"dataset_{key}"

    def _move_damaged(self, key: int, path: Path, why: str, rows: int | None) -> None:
        dest = self._aside_dir("damaged", key)
        dest.mkdir(parents=True, exist_ok=True)
        shutil.move(str(path), str(dest / path.name))
        log.warning(
            "part file %s is damaged (%s): moved to %s; its %s will be recomputed",
            path, why, dest, f"{rows} row(s)" if rows is not None else "rows",
        )  # fmt: skip

    def _set_aside_unlisted(self, key: int, prog: DatasetProgress, discard: bool) -> None:
        """Part files not in the manifest: a run that died between renaming a part into place
        and recording it, a lost or damaged manifest, or a discarded checkpoint."""
        unlisted = sorted(p for p in prog.out_dir.glob("part-*") if p.name not in prog.part_info)
        if not unlisted:
            return
        if discard:  # another config made them: deleting them is the point
            for p in unlisted:
                p.unlink()
            return
        dest = self._aside_dir("orphaned", key)
        dest.mkdir(parents=True, exist_ok=True)
        for p in unlisted:
            shutil.move(str(p), str(dest / p.name))
        log.warning(
            "%d part file(s) in %s not listed in %s moved to %s; their rows will be recomputed",
            len(unlisted), prog.out_dir, self.path, dest,
        )  # fmt: skip

    def _remove_temp_files(self) -> None:
        """Temp files of writes that a kill interrupted (part files, manifest, lease, progress...)."""
        now = time.time()
        for prog in self.datasets.values():
            for tmp in prog.out_dir.glob(".part-*.tmp") if prog.out_dir.is_dir() else ():
                tmp.unlink(missing_ok=True)
        for tmp in (self.shard_dir / L.BATCH_SPOOL).glob(".*.tmp"):  # a killed download of batch results
            tmp.unlink(missing_ok=True)
        for tmp in self.shard_dir.glob(".*.tmp"):
            if tmp.name.startswith((".lease.json.", ".progress.json.")):  # may be being written by a live thread
                try:
                    if now - tmp.stat().st_mtime < TEMP_GRACE_SECONDS:
                        continue
                except FileNotFoundError:  # its write just finished
                    continue
            tmp.unlink(missing_ok=True)

    def _load_manifest(self) -> dict | None:
        """The manifest, checked; None when there is none or it is damaged (renamed aside, WARNING)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            saved = json.loads(raw.decode("utf-8"))
            problem = self._manifest_problem(saved)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problem = f"not JSON: {e}"
        if problem is None:
            return saved
        aside = _unique(self.path.with_name(f"{self.path.name}.damaged-{_utc_stamp()}"))
        os.replace(self.path, aside)
        log.warning(
            "%s is damaged (%s): renamed to %s; the shard's committed part files are moved aside and their rows recomputed",
            self.path, problem, aside,
        )  # fmt: skip
        return None

    def _manifest_problem(self, saved) -> str | None:
        """What is wrong with a parsed manifest (None: nothing). A newer format raises."""
        if not isinstance(saved, dict):
            return f"a JSON {type(saved).__name__}, not an object"
        version = saved.get("format", 1)
        if not _is_int(version):
            return "'format' is not an integer"
        if version > MANIFEST_VERSION:
            raise CheckpointError(
                f"{self.path} has manifest format {version}, newer than this mirageflow reads ({MANIFEST_VERSION}): "
                f"run this shard with the newer mirageflow, or delete {self.path} to recompute the shard"
            )
        if not isinstance(saved.get("fingerprint"), str):
            return "no 'fingerprint'"
        datasets = saved.get("datasets")
        if not isinstance(datasets, dict):
            return "no 'datasets' object"
        for key, d in datasets.items():
            if not (isinstance(key, str) and key.isdigit()):
                return f"bad dataset key {key!r}"
            if int(key) not in self.datasets and saved["fingerprint"] == self.fingerprint:  # else: config changed
                return f"unknown dataset {key!r}"
            if not isinstance(d, dict) or not isinstance(d.get("parts"), list):
                return f"dataset {key}: no 'parts' list"
            for name in ("done", "failed", "filtered"):
                if _bad_ranges(d.get(name, [] if name == "filtered" else None)):  # manifests before filters have none
                    return f"dataset {key}: '{name}' is not a list of [start, stop) ranges"
            for part in d["parts"]:
                if version == 1:
                    if not (isinstance(part, str) and _PART_NAME.fullmatch(part)):
                        return f"dataset {key}: bad part name {part!r}"
                elif not (
                    isinstance(part, dict)
                    and isinstance(part.get("name"), str) and _PART_NAME.fullmatch(part["name"])
                    and _is_int(part.get("bytes")) and part["bytes"] >= 0
                    and isinstance(part.get("sha256"), str) and _SHA256.fullmatch(part["sha256"])
                    and not _bad_ranges(part.get("rows"))
                    and valid_entry(part.get("records"))
                ):  # fmt: skip
                    return f"dataset {key}: bad part entry {str(part)[:200]}"
        attempts = saved.get("attempts", [])
        if not isinstance(attempts, list) or not all(isinstance(a, dict) for a in attempts):
            return "'attempts' is not a list of objects"
        return None

    def _read_error_lines(self):
        """(line number, text, entry) of each readable line of errors.jsonl; a damaged line
        (a kill mid-append cuts the last one) is skipped with a WARNING naming file:line."""
        try:
            raw = self.errors_path.read_bytes()
        except FileNotFoundError:
            return
        for n, chunk in enumerate(raw.split(b"\n"), 1):
            if not chunk.strip():
                continue
            try:
                text = chunk.decode("utf-8")
                entry = json.loads(text)
                ok = (
                    isinstance(entry, dict) and _is_int(entry.get("dataset")) and entry["dataset"] in self.datasets
                    and _is_int(entry.get("source_index")) and isinstance(entry.get("error"), str)
                    and (self.samples == 1 or _is_int(entry.get("sample_index")) and 0 <= entry["sample_index"] < self.samples)
                )  # fmt: skip
            except (UnicodeDecodeError, json.JSONDecodeError):
                ok = False
            if not ok:
                log.warning("%s:%d is damaged (not a row error of this shard): skipped", self.errors_path, n)
                continue
            yield n, text, entry

    def _restore_errors(self) -> None:
        """Keep one error line per row the manifest lists as failed; a failed row without one
        is recomputed (failed rows == error lines, always)."""
        kept: list[str] = []
        seen: dict[int, set[int]] = {k: set() for k in self.datasets}
        for _, text, entry in self._read_error_lines():
            ds, index = entry["dataset"], record_unit(entry, self.samples)
            if index in self.datasets[ds].failed and index not in seen[ds]:
                seen[ds].add(index)
                kept.append(text)
        for key, prog in self.datasets.items():
            missing = len(prog.failed) - len(seen[key])
            if missing:
                log.warning(
                    "%d row(s) of dataset %d listed as failed in %s have no readable line in %s: they will be recomputed",
                    missing, key, self.path, self.errors_path,
                )  # fmt: skip
                prog.failed = seen[key]
        self._write_errors(kept, mode="w")

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
        return Counter(entry["error"] for _, _, entry in self._read_error_lines())

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
            digest, size = _sha256_and_size(path)  # read back from the page cache
            prog.add_part(name, size, digest, _runs(indices), tally.to_json() if tally else None)
            prog.add("done", indices)
        if errors:
            self._write_errors([_error_line(e) for e in errors], mode="a")
            prog.add("failed", (record_unit(e, n) for e in errors))
        if filtered:
            prog.add("filtered", filtered)
        self._save()

    def _write_errors(self, lines: list[str], mode: str) -> None:
        with open(self.errors_path, mode, encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())

    def _save(self) -> None:
        # built from pre-encoded pieces: rewritten at every commit, and each part's entry is
        # encoded once, when committed (attempts are few and may be changed in place: encoded each time)
        datasets = ",".join(f'"{k}":{p.manifest_json()}' for k, p in self.datasets.items())
        text = (
            f'{{"format":{MANIFEST_VERSION},"fingerprint":{_json_dumps(self.fingerprint)},'
            f'"datasets":{{{datasets}}},"attempts":{_json_dumps(self.attempts)}}}\n'
        )
        atomic_write_text(self.path, text)


def _part_indices(data: bytes, fmt: str) -> set[int]:
    """The source_index values of a part file's records (raises when it does not read back)."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        column = pq.read_table(pa.BufferReader(data), columns=["source_index"]).column("source_index")
        indices = column.to_pylist()
    else:
        indices = [json.loads(line)["source_index"] for line in io.StringIO(data.decode("utf-8")) if line.strip()]
    if not all(_is_int(i) for i in indices):
        raise ValueError("source_index values are not all integers")
    return set(indices)


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
            and isinstance(current.get("hostname"), str) and _is_int(current.get("pid"))
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
