"""A shard's manifest, ``checkpoint.json`` (the format: shard/checkpoint.py): what it records of
each dataset (``DatasetProgress``: committed parts, done, failed and filtered rows as
[start, stop) ranges) and the file itself (``ManifestFile``: read and checked, a damaged one
renamed aside; rewritten whole at every commit from pre-encoded pieces).
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from mirageflow.errors import MirageflowError
from mirageflow.files import atomic_write_text
from mirageflow.shard.tally import valid_entry

log = logging.getLogger(__name__)

# Layout of checkpoint.json: 1 = part names only; 2 = per-part size, sha256 and row ranges,
# plus "format" and "attempts".
MANIFEST_VERSION = 2


class CheckpointError(MirageflowError, RuntimeError):
    """The checkpoint cannot be used as it is; the message names the file and what to do."""


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


def utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def unique_path(path: Path) -> Path:
    """``path``, or ``path-1``, ``path-2``... whichever does not exist yet."""
    candidate, n = path, 0
    while candidate.exists():
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


_PART_NAME = re.compile(r"part-\d+\.[A-Za-z0-9]+")
_SHA256 = re.compile(r"[0-9a-f]{64}")


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def bad_ranges(ranges) -> bool:
    return not isinstance(ranges, list) or not all(
        isinstance(r, list) and len(r) == 2 and is_int(r[0]) and is_int(r[1]) and 0 <= r[0] < r[1] for r in ranges
    )


def json_dumps(obj) -> str:
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
        self._part_json.append(json_dumps(info))
        m = re.fullmatch(r"part-(\d+)\..*", name)
        if m:
            self.next_part = max(self.next_part, int(m.group(1)) + 1)

    def manifest_json(self) -> str:
        return (
            f'{{"out_dir":{json_dumps(str(self.out_dir))},"fmt":{json_dumps(self.fmt)},'
            f'"parts":[{",".join(self._part_json)}],'
            f'"done":{json_dumps(self.ranges("done"))},"failed":{json_dumps(self.ranges("failed"))},'
            f'"filtered":{json_dumps(self.ranges("filtered"))}}}'
        )


class ManifestFile:
    """``checkpoint.json`` of one shard made under ``fingerprint`` with the datasets ``dataset_keys``."""

    def __init__(self, path: Path, fingerprint: str, dataset_keys):
        self.path, self.fingerprint, self.dataset_keys = Path(path), fingerprint, set(dataset_keys)

    def load(self) -> dict | None:
        """The manifest, checked; None when there is none or it is damaged (renamed aside, WARNING)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        try:
            saved = json.loads(raw.decode("utf-8"))
            problem = self.problem(saved)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            problem = f"not JSON: {e}"
        if problem is None:
            return saved
        aside = unique_path(self.path.with_name(f"{self.path.name}.damaged-{utc_stamp()}"))
        os.replace(self.path, aside)
        log.warning(
            "%s is damaged (%s): renamed to %s; the shard's committed part files are moved aside and their rows recomputed",
            self.path, problem, aside,
        )  # fmt: skip
        return None

    def problem(self, saved) -> str | None:
        """What is wrong with a parsed manifest (None: nothing). A newer format raises."""
        if not isinstance(saved, dict):
            return f"a JSON {type(saved).__name__}, not an object"
        version = saved.get("format", 1)
        if not is_int(version):
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
            if int(key) not in self.dataset_keys and saved["fingerprint"] == self.fingerprint:  # else: config changed
                return f"unknown dataset {key!r}"
            if not isinstance(d, dict) or not isinstance(d.get("parts"), list):
                return f"dataset {key}: no 'parts' list"
            for name in ("done", "failed", "filtered"):
                if bad_ranges(d.get(name, [] if name == "filtered" else None)):  # manifests before filters have none
                    return f"dataset {key}: '{name}' is not a list of [start, stop) ranges"
            for part in d["parts"]:
                if version == 1:
                    if not (isinstance(part, str) and _PART_NAME.fullmatch(part)):
                        return f"dataset {key}: bad part name {part!r}"
                elif not (
                    isinstance(part, dict)
                    and isinstance(part.get("name"), str) and _PART_NAME.fullmatch(part["name"])
                    and is_int(part.get("bytes")) and part["bytes"] >= 0
                    and isinstance(part.get("sha256"), str) and _SHA256.fullmatch(part["sha256"])
                    and not bad_ranges(part.get("rows"))
                    and valid_entry(part.get("records"))
                ):  # fmt: skip
                    return f"dataset {key}: bad part entry {str(part)[:200]}"
        attempts = saved.get("attempts", [])
        if not isinstance(attempts, list) or not all(isinstance(a, dict) for a in attempts):
            return "'attempts' is not a list of objects"
        return None

    def write(self, datasets: dict[int, DatasetProgress], attempts: list[dict]) -> None:
        """The whole manifest, atomically."""
        # built from pre-encoded pieces: rewritten at every commit, and each part's entry is
        # encoded once, when committed (attempts are few and may be changed in place: encoded each time)
        datasets = ",".join(f'"{k}":{p.manifest_json()}' for k, p in datasets.items())
        text = (
            f'{{"format":{MANIFEST_VERSION},"fingerprint":{json_dumps(self.fingerprint)},'
            f'"datasets":{{{datasets}}},"attempts":{json_dumps(attempts)}}}\n'
        )
        atomic_write_text(self.path, text)
