"""State a shard keeps beside its checkpoint for work that outlives one attempt: the provider
batches it submitted (``BatchLedger``) and the images it wrote (``ImageLedger``).

Both belong to the checkpoint (``Checkpoint.batches``, ``Checkpoint.images``; restored with
it, under the shard's lease). Like the request cache (shard/request_cache.py) they are kept
across edits of the config: what an entry is for is said by the request's identity, not
by the config's fingerprint. A batch request's ``custom_id`` holds the SHA-256 of its
bytes, so a rerun after any edit waits for (or reads the saved result of) every request
whose bytes did not change and submits only the others: nothing is paid twice. An image's
line holds the SHA-256 of its request (``request``): a rerun reuses the image of a row
whose request did not change and replaces exactly those of the rows it changed.

**batches.json** (``BatchLedger``)::

    {"format": 1, "fingerprint": "9f2c...", "next": 3,
     "batches": {"s0-9f2c1a2b-c00000": {"provider": "openai", "state": "submitted",
                 "batch_id": "batch_abc", "requests": 500, "bytes": 81234, "round": 0,
                 "sealed_at": "...", "submitted_at": "...", "status": "in_progress", ...}}}

A chunk is recorded (``state: sealed``, its requests in ``batches/<key>.jsonl``) before it is
sent, and its batch id (``state: submitted``) as soon as the provider answers, before
anything waits on it; ``state: ended`` once its results are in ``batches/<key>.results.jsonl``.
Each write is atomic and fsynced, so a killed shard's rerun knows every batch it paid for
and waits for those instead of submitting them again (engines/batch_api.py).

**images.jsonl** (``ImageLedger``): a header line ``{"fingerprint": ...}`` (the config it
was begun under), then one line per image written ``{"output", "dataset", "unit", "path",
"bytes", "sha256", "seed", "request"}`` (``path`` relative to the dataset's output_dir:
state/layout.py ``image_file``; ``request`` the SHA-256 of what determines the image),
appended and fsynced before the image is put in place (shard/steps/image.py); the last
line of a unit is its image. A rerun, after an edit too, reuses an image whose request is
the same and whose file still has that size and hash; replaces the image of a unit whose
request changed (the file is this unit's, as its size and hash say); and never replaces a
file it did not write.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path

from mirageflow.files import atomic_write_text
from mirageflow.state import layout as L

log = logging.getLogger(__name__)

LEDGER_FORMAT = 1


def _utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def _aside(path: Path, what: str) -> Path:
    """Rename ``path`` to ``<name>.<what>-<UTC stamp>`` (a free name) and return it."""
    dest = path.with_name(f"{path.name}.{what}-{_utc_stamp()}")
    n = 0
    while dest.exists():
        n += 1
        dest = path.with_name(f"{path.name}.{what}-{_utc_stamp()}-{n}")
    os.replace(path, dest)
    return dest


class BatchLedger:
    """The provider batches of one shard, across its attempts."""

    def __init__(self, shard_dir: Path, fingerprint: str):
        self.path = Path(shard_dir) / L.BATCH_LEDGER
        self.dir = Path(shard_dir) / L.BATCH_SPOOL
        self.fingerprint = fingerprint
        self.entries: dict[str, dict] = {}
        self._next = 0
        self._lock = threading.Lock()

    def restore(self) -> None:
        """Load the ledger; a damaged one is set aside (WARNING: its batches are not waited
        for). One made under another fingerprint (an edit) is kept: its requests are known
        by their custom_ids (the hash of their bytes), so those a rerun sends unchanged are
        answered by the batches already paid for."""
        self.entries, self._next = {}, 0
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return
        try:
            saved = json.loads(raw.decode("utf-8"))
            ok = isinstance(saved, dict) and isinstance(saved.get("batches"), dict) and isinstance(saved.get("fingerprint"), str)
        except (UnicodeDecodeError, json.JSONDecodeError):
            saved, ok = None, False
        if not ok:
            aside = _aside(self.path, "damaged")
            log.warning("%s is damaged: renamed to %s; batches it listed are not waited for (submitted again if needed)", self.path, aside)
            return
        self.entries = {k: v for k, v in saved["batches"].items() if isinstance(v, dict)}
        if saved["fingerprint"] != self.fingerprint:
            log.info(
                "%s was made before an edit of the config: its %d batch(es) are kept; requests whose bytes did not change "
                "are answered by them, the others are submitted", self.path, len(self.entries),
            )  # fmt: skip
        self._next = int(saved.get("next") or len(self.entries))

    def new_key(self, shard_id: int) -> str:
        """A chunk key unique to this shard and config (also the provider's metadata)."""
        with self._lock:
            key = f"s{shard_id}-{self.fingerprint[:8]}-c{self._next:05d}"
            self._next += 1
            return key

    def record(self, key: str, **fields) -> None:
        """Create or update one chunk's entry, durably, before the caller goes on."""
        with self._lock:
            self.entries.setdefault(key, {}).update(fields)
            text = json.dumps(
                {"format": LEDGER_FORMAT, "fingerprint": self.fingerprint, "next": self._next, "batches": self.entries},
                indent=1,
                default=str,
            )
            self.dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, text + "\n")

    def spool(self, key: str) -> Path:
        return self.dir / f"{key}.jsonl"

    def results(self, key: str) -> Path:
        return self.dir / f"{key}.results.jsonl"

    def summary(self) -> list[dict]:
        """Each batch for status.json (engines.<name>.details.batches): ids, states, counts, tokens."""
        keys = (
            "batch_id",
            "state",
            "status",
            "requests",
            "bytes",
            "round",
            "submitted_at",
            "ended_at",
            "input_tokens",
            "output_tokens",
            "counts",
            "duplicate_results",
            "unknown_results",
        )
        with self._lock:
            return [{"chunk": k, **{f: e.get(f) for f in keys if f in e}} for k, e in self.entries.items()]


def abandon_batch(ledger_path: Path, batch_id: str) -> list[str]:
    """Mark the chunks of ``batch_id`` in one shard's batches.json ``abandoned`` (atomically),
    so that the shard's next attempt no longer waits for that batch and submits its requests
    again (``mmirage retry --resubmit-batch``: a batch the provider no longer knows or lets
    this key read). Returns the chunk keys marked; [] when the file does not list it."""
    try:
        saved = json.loads(Path(ledger_path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    batches = saved.get("batches") if isinstance(saved, dict) else None
    if not isinstance(batches, dict):
        raise ValueError(f"{ledger_path} is not a batch ledger (no batches)")
    keys = [k for k, e in batches.items() if isinstance(e, dict) and e.get("batch_id") == batch_id]
    for key in keys:
        batches[key].update(
            state="abandoned", abandoned_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), abandoned_by="resubmit-batch"
        )
    if keys:
        atomic_write_text(Path(ledger_path), json.dumps(saved, indent=1, default=str) + "\n")
    return keys


class ImageLedger:
    """The images one shard wrote, with their size, hash and seed (resume reuses them)."""

    def __init__(self, shard_dir: Path, fingerprint: str):
        self.path = Path(shard_dir) / L.IMAGE_LEDGER
        self.fingerprint = fingerprint
        self.entries: dict[tuple[str, int, int], dict] = {}
        self._lock = threading.Lock()
        self._fresh = True  # no header written yet (written with the first image)

    def restore(self) -> None:
        """Load the ledger, whatever config it was begun under: its entries say which request
        made each image, so a rerun after an edit replaces exactly the images of the units
        whose request changed. One without a readable header is set aside (its images are
        then not this shard's: never replaced)."""
        self.entries, self._fresh = {}, True
        try:
            lines = self.path.read_bytes().split(b"\n")
        except FileNotFoundError:
            return
        try:
            header = json.loads(lines[0])
            ok = isinstance(header, dict) and isinstance(header.get("fingerprint"), str)
        except (ValueError, UnicodeDecodeError):
            ok = False
        if not ok:
            aside = _aside(self.path, "damaged")
            log.warning("%s has no readable header: renamed to %s; its images are not reused", self.path, aside)
            return
        for n, line in enumerate(lines[1:], 2):
            if not line.strip():
                continue
            try:
                e = json.loads(line)
                self.entries[(e["output"], int(e["dataset"]), int(e["unit"]))] = e
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                log.warning("%s:%d is damaged (a kill mid-append?): skipped", self.path, n)
        self._fresh = False

    def get(self, output: str, dataset: int, unit: int) -> dict | None:
        return self.entries.get((output, dataset, unit))

    def add(self, entry: dict) -> None:
        """Append one image's line, fsynced (before the image is linked into place)."""
        line = json.dumps(entry, ensure_ascii=False) + "\n"
        with self._lock:
            if self._fresh:
                atomic_write_text(self.path, json.dumps({"format": LEDGER_FORMAT, "fingerprint": self.fingerprint}) + "\n")
                self._fresh = False
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
                f.flush()
                os.fsync(f.fileno())
            self.entries[(entry["output"], int(entry["dataset"]), int(entry["unit"]))] = entry

    def count(self) -> int:
        return len(self.entries)


def image_matches(path: Path, entry: dict) -> bool:
    """Whether the file at ``path`` is the image ``entry`` describes (size, then SHA-256)."""
    try:
        if path.stat().st_size != entry.get("bytes"):
            return False
        with open(path, "rb") as f:
            return hashlib.file_digest(f, "sha256").hexdigest() == entry.get("sha256")
    except OSError:
        return False
