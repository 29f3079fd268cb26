"""What a shard's restore finds on disk (a part of shard/checkpoint.py): every part file the
manifest lists verified (size, then sha256; a format-1 part by reading it back), a damaged
one moved aside to ``<shard state dir>/damaged/<UTC stamp>/``, part files no manifest lists
moved to ``orphaned/<UTC stamp>/`` (deleted only when the config changed), and the temp
files of writes a kill interrupted removed.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import shutil
import time
from pathlib import Path

from mirageflow.shard.manifest import DatasetProgress, from_ranges, is_int, merge_ranges, to_ranges, utc_stamp
from mirageflow.state import layout as L

log = logging.getLogger(__name__)

# Temp files of atomic writes that another thread of this process may be writing right now
# (the lease heartbeat, the progress reporter) are removed only once older than this.
TEMP_GRACE_SECONDS = 10.0


def sha256_and_size(path: Path) -> tuple[str, int]:
    """One read of the file (just written: from the page cache)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
        return digest, os.fstat(f.fileno()).st_size


def _part_indices(data: bytes, fmt: str) -> set[int]:
    """The source_index values of a part file's records (raises when it does not read back)."""
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        column = pq.read_table(pa.BufferReader(data), columns=["source_index"]).column("source_index")
        indices = column.to_pylist()
    else:
        indices = [json.loads(line)["source_index"] for line in io.StringIO(data.decode("utf-8")) if line.strip()]
    if not all(is_int(i) for i in indices):
        raise ValueError("source_index values are not all integers")
    return set(indices)


class PartRecovery:
    """The files of one shard's restore: ``shard_dir`` (its state), ``manifest_path`` (named in
    the warnings). One UTC stamp names whatever one restore moves aside (``begin``)."""

    def __init__(self, shard_dir: Path, manifest_path: Path):
        self.shard_dir, self.manifest_path = Path(shard_dir), Path(manifest_path)
        self._stamp: str | None = None  # of the damaged/ and orphaned/ directories of this restore

    def begin(self) -> None:
        """A new restore: its own stamp for what it moves aside."""
        self._stamp = None

    def restore_dataset(self, key: int, prog: DatasetProgress, entry: dict, retry_failed: bool) -> None:
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
                self.manifest_path, unbacked - lost_in_parts, key,
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
            log.warning("part file %s listed in %s is missing: its %d row(s) will be recomputed", path, self.manifest_path, rows)
            return None
        if size != part["bytes"]:
            self._move_damaged(key, path, f"{size} bytes, {self.manifest_path.name} says {part['bytes']}", rows)
            return None
        digest, _ = sha256_and_size(path)
        if digest != part["sha256"]:
            self._move_damaged(key, path, f"sha256 {digest[:12]}..., {self.manifest_path.name} says {part['sha256'][:12]}...", rows)
            return None
        return part

    def _verify_unrecorded_part(self, key: int, prog: DatasetProgress, name: str) -> dict | None:
        """A format-1 part (no size or checksum on record): intact if it reads back; its rows
        are the source_index values it holds."""
        path = prog.out_dir / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            log.warning("part file %s listed in %s is missing: its rows will be recomputed", path, self.manifest_path)
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
            base, n = utc_stamp(), 0
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

    def set_aside_unlisted(self, key: int, prog: DatasetProgress, discard: bool) -> None:
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
            len(unlisted), prog.out_dir, self.manifest_path, dest,
        )  # fmt: skip

    def remove_temp_files(self, datasets: dict[int, DatasetProgress]) -> None:
        """Temp files of writes that a kill interrupted (part files, manifest, lease, progress...)."""
        now = time.time()
        for prog in datasets.values():
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
