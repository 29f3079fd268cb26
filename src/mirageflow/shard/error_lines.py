"""A shard's row errors, ``errors.jsonl`` (a part of shard/checkpoint.py): one line per failed
row, appended (fsynced) at each commit; at restore a damaged line (a kill mid-append cuts the
last one) is skipped with a WARNING naming file:line, and the lines are made to agree with
the manifest's failed rows.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

from mirageflow.shard.manifest import DatasetProgress, is_int
from mirageflow.shard.samples import record_unit

log = logging.getLogger(__name__)


def error_line(entry: dict) -> str:
    """One errors.jsonl line: UTF-8 text, or \\u escapes where a value holds a lone surrogate."""
    line = json.dumps(entry, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:
        line = json.dumps(entry)
    return line


class ErrorLines:
    """``errors.jsonl`` of a shard with the datasets ``dataset_keys`` and ``samples`` records per row."""

    def __init__(self, path: Path, dataset_keys, samples: int):
        self.path, self.dataset_keys, self.samples = Path(path), set(dataset_keys), samples

    def append(self, entries: list[dict]) -> None:
        self._write([error_line(e) for e in entries], mode="a")

    def classes(self) -> Counter:
        """Failed rows per error class (the committed failures)."""
        return Counter(entry["error"] for _, _, entry in self.read())

    def read(self):
        """(line number, text, entry) of each readable line of errors.jsonl; a damaged line
        (a kill mid-append cuts the last one) is skipped with a WARNING naming file:line."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        for n, chunk in enumerate(raw.split(b"\n"), 1):
            if not chunk.strip():
                continue
            try:
                text = chunk.decode("utf-8")
                entry = json.loads(text)
                ok = (
                    isinstance(entry, dict) and is_int(entry.get("dataset")) and entry["dataset"] in self.dataset_keys
                    and is_int(entry.get("source_index")) and isinstance(entry.get("error"), str)
                    and (self.samples == 1 or is_int(entry.get("sample_index")) and 0 <= entry["sample_index"] < self.samples)
                )  # fmt: skip
            except (UnicodeDecodeError, json.JSONDecodeError):
                ok = False
            if not ok:
                log.warning("%s:%d is damaged (not a row error of this shard): skipped", self.path, n)
                continue
            yield n, text, entry

    def restore(self, datasets: dict[int, DatasetProgress], manifest_path: Path) -> None:
        """Keep one error line per row the manifest lists as failed; a failed row without one
        is recomputed (failed rows == error lines, always)."""
        kept: list[str] = []
        seen: dict[int, set[int]] = {k: set() for k in datasets}
        for _, text, entry in self.read():
            ds, index = entry["dataset"], record_unit(entry, self.samples)
            if index in datasets[ds].failed and index not in seen[ds]:
                seen[ds].add(index)
                kept.append(text)
        for key, prog in datasets.items():
            missing = len(prog.failed) - len(seen[key])
            if missing:
                log.warning(
                    "%d row(s) of dataset %d listed as failed in %s have no readable line in %s: they will be recomputed",
                    missing, key, manifest_path, self.path,
                )  # fmt: skip
                prog.failed = seen[key]
        self._write(kept, mode="w")

    def _write(self, lines: list[str], mode: str) -> None:
        with open(self.path, mode, encoding="utf-8") as f:
            f.writelines(line + "\n" for line in lines)
            f.flush()
            os.fsync(f.fileno())
