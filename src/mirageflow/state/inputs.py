"""Edits seen whatever the clock says: reruns decided by file contents, not only by mtimes.

Snakemake reruns a job when an input is newer than its outputs (or, with its default
triggers, when its set of inputs, params or code changed). A dataset copied with ``cp -p``
or ``rsync -a`` keeps its old mtime, an image file can change under a path no rule knows
of, and a clock can be skewed. So what a job read is also identified by content:

- **datasets**: the index rule records, per file, its stat identity (inode, size, mtime,
  ctime) and the SHA-256 of its bytes (``data/readers.write_index``). This is the
  cheap per-file content hash: at DAG build the driver compares each file's stat identity
  with the recorded one (a ``stat`` per file) and hashes only a file whose identity
  changed (``cp -p`` makes a new inode or ctime), through a cache
  (``<state_dir>/datasets/content.json``) so an unchanged copy is hashed once;
- **images**: a shard appends every image file it reads, with its stat identity and the
  SHA-256 of the bytes it read, to ``<state_dir>/shard_<id>/images.jsonl`` (an attempt
  that resumes keeps the earlier lines); at DAG build each finished shard's files are
  checked the same way;
- **the records identity** (mirageflow.config.records_identity: prompts, schemas, model,
  sampling, datasets): each shard writes the digest it ran with to
  ``<state_dir>/shard_<id>/inputs.json``;
- **dedup parameters**: the counts file records them.

A job whose inputs changed is *forced* (``ContentChanges.force``: its outputs go into the
set of forced files of the DAG being built, as ``--forcerun FILE`` would), in memory: it
reruns under every rerun trigger, ``mtime`` included, ``snakemake -n`` shows it, and
nothing is written to decide it (dry runs and ``--lint`` change nothing). A forced index
reruns the shards that read the dataset (their input is newer), and their checkpoints
start over (the datasets' content digests are part of the checkpoint fingerprint); a shard
forced for its images starts over too (its committed rows were made from the old images).
The content cache is saved by ``pipeline.prepare`` in the driver's onstart hook.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from mirageflow.files import atomic_write_bytes, open_regular

log = logging.getLogger(__name__)

DIGEST_CHARS = 16
CONTENT_CACHE = "content.json"
IMAGES_FILE = "images.jsonl"


def stat_key(st: os.stat_result) -> list[int]:
    """What identifies a file's version without reading it: inode, size, mtime, ctime (the
    kernel sets ctime on every write, rename and ``utime``, so ``cp -p`` changes it). Not the
    device: an NFS mount has another one on each node, the inode and times are the server's."""
    return [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def file_sha256(path: str | os.PathLike) -> str:
    with open_regular(path) as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def digest_of(value) -> str:
    """A short digest of a JSON-able value (a stamp's name)."""
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:DIGEST_CHARS]


class ContentCache:
    """path -> (stat identity, sha256): a file is hashed again only when its stat identity changed."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = Path(path) if path else None
        self.entries: dict[str, list] = {}
        self.changed = False
        if self.path is not None:
            try:
                data = json.loads(self.path.read_text())
                self.entries = {k: v for k, v in data.get("files", {}).items() if isinstance(v, list) and len(v) == 2}
            except (OSError, ValueError, AttributeError):
                self.entries = {}  # absent or damaged: rebuilt

    def digest(self, path: str, known: tuple[list, str] | None = None) -> str | None:
        """The file's SHA-256 (None when it cannot be read). ``known``: a (stat identity,
        sha256) recorded elsewhere (an index) that spares the hash when it still holds."""
        try:
            key = stat_key(os.stat(path))
        except (OSError, ValueError):
            return None
        if known is not None and list(known[0]) == key:
            return known[1]
        cached = self.entries.get(path)
        if cached is not None and cached[0] == key:
            return cached[1]
        try:
            sha = file_sha256(path)
        except (OSError, ValueError):
            return None
        self.entries[path] = [key, sha]
        self.changed = True
        return sha

    def save(self) -> None:
        if self.path is not None and self.changed:
            data = {"note": "SHA-256 of input files by stat identity (inode, size, mtime_ns, ctime_ns)", "files": self.entries}
            atomic_write_bytes(self.path, (json.dumps(data) + "\n").encode(), durable=False)
            self.changed = False


# --------------------------------------------------------------------------- datasets


def dataset_changed(ds, cache: ContentCache, index_path: str | os.PathLike) -> str | None:
    """Why dataset ``ds``'s index is out of date by content (None: it is not, or it runs anyway)."""
    from mirageflow.data.readers import dataset_files

    try:
        header = json.loads(Path(index_path).read_text())
    except (OSError, ValueError):
        return None  # not indexed yet (or damaged: its rule runs anyway)
    recorded = header.get("content") if isinstance(header, dict) else None
    if not isinstance(recorded, dict):
        return None  # an index from before content hashes: mtimes only
    files = dataset_files(ds)
    if sorted(files) != sorted(recorded):
        return None  # files added or removed: Snakemake sees the new set of inputs
    for f in files:
        known = recorded[f]
        if not (isinstance(known, list) and len(known) == 2):
            return f"{f}: its recorded content is unreadable"
        if cache.digest(f, (known[0], known[1])) != known[1]:
            return f"{f} changed since it was indexed (by content, whatever its mtime)"
    return None


# --------------------------------------------------------------------------- images


class ImageRecorder:
    """The image files a shard reads, appended to ``shard_<id>/images.jsonl`` (thread-safe:
    images load in threads). One line per file version: [real path, stat identity, sha256]."""

    def __init__(self, shard_dir: str | os.PathLike, fresh: bool):
        import threading

        self.path = Path(shard_dir) / IMAGES_FILE
        self._seen: set = set()
        self._lock = threading.Lock()
        if fresh:  # a shard starting over: the files of earlier attempts are not its inputs any more
            self.path.unlink(missing_ok=True)
        else:
            for path, key, _ in read_image_records(self.path):
                self._seen.add((path, tuple(key)))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def __call__(self, path: str, key: list[int], data: bytes) -> None:
        ident = (path, tuple(key))
        if ident in self._seen:
            return
        line = json.dumps([path, key, hashlib.sha256(data).hexdigest()]) + "\n"
        with self._lock:
            if ident in self._seen:
                return
            self._seen.add(ident)
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            self._file.close()


def read_image_records(path: str | os.PathLike) -> list[tuple[str, list, str]]:
    out = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    p, key, sha = json.loads(line)
                except (ValueError, TypeError):
                    continue  # a line cut by a crash
                out.append((p, key, sha))
    except OSError:
        pass
    return out


def images_changed(shard_dir: str | os.PathLike, cache: ContentCache) -> str | None:
    """Why a shard's records are out of date for the image files it read (None: they are not)."""
    records = read_image_records(Path(shard_dir) / IMAGES_FILE)
    then: dict[str, set] = {}
    for path, key, sha in records:
        then.setdefault(path, set()).add(sha)
    latest = {path: (key, sha) for path, key, sha in records}  # the last version read of each file
    for path, (key, sha) in latest.items():
        now = cache.digest(path, (key, sha))
        if then[path] != {now}:  # changed since, or two versions read by two attempts
            return f"image {path} changed since the shard read it" if now is not None else f"image {path} is gone"
    return None


# --------------------------------------------------------------------------- at DAG build

INPUTS_FILE = "inputs.json"


def records_digest(cfg) -> str:
    from mirageflow.state import pipeline

    return pipeline.records_fingerprint(cfg)["sha256"][:DIGEST_CHARS]


def write_shard_inputs(cfg, shard_id: int) -> None:
    """What a finished shard's records were made from (its runner, before status.json)."""
    data = {"records": records_digest(cfg), "note": "the records identity digest this shard ran with (state/inputs.py)"}
    atomic_write_bytes(cfg.shard_dir(shard_id) / INPUTS_FILE, (json.dumps(data) + "\n").encode())


class ContentChanges:
    """Which jobs must rerun because what they read changed (common.smk's input functions).

    Only in the driver (``main``): a cluster job re-parsing the Snakefile runs one job that
    the driver already decided to run, and computes nothing here.
    """

    def __init__(self, cfg, main: bool):
        self.cfg, self.main = cfg, main
        self.state = Path(cfg.state_dir)
        self.cache = ContentCache(self.state / "datasets" / CONTENT_CACHE) if main else None
        self.images = any(getattr(v, "type", "text") == "image" for v in cfg.inputs)
        self._records: str | None = None
        self._legacy: str | None | bool = False

    def shard(self, shard_id: int) -> str | None:
        """Why a finished shard must rerun: the records identity or an image it read changed."""
        shard_dir = self.cfg.shard_dir(shard_id)
        if not self.main or not (shard_dir / "status.json").exists():
            return None  # runs anyway
        if self._records is None:
            self._records = records_digest(self.cfg)
        try:
            recorded = json.loads((shard_dir / INPUTS_FILE).read_text())["records"]
        except (OSError, ValueError, KeyError, TypeError):
            recorded = self._legacy_digest()  # a shard from before inputs.json: the pipeline's fingerprint file
        if recorded is not None and recorded != self._records:
            return "what can change its records changed (prompt, schema, model, sampling, dataset)"
        if self.images:
            return images_changed(shard_dir, self.cache)
        return None

    def _legacy_digest(self) -> str | None:
        if self._legacy is False:
            from mirageflow.state import pipeline

            try:
                self._legacy = json.loads(pipeline.fingerprint_path(self.state).read_text())["sha256"][:DIGEST_CHARS]
            except (OSError, ValueError, KeyError, TypeError):
                self._legacy = None
        return self._legacy

    def dataset(self, ds_index: int) -> str | None:
        """Why a dataset must be indexed again: its files changed by content."""
        if not self.main:
            return None
        index = self.state / "datasets" / f"dataset_{ds_index}.index.json"
        return dataset_changed(self.cfg.datasets[ds_index], self.cache, index)

    def derived(self) -> str | None:
        """Why the report and merged outputs must be made again: a shard has no status.json
        (it failed, or it was deleted) while they exist (built from earlier shards)."""
        if not self.main:
            return None
        from mirageflow.state import pipeline

        if not any(p.exists() for p in pipeline.derived_outputs(self.cfg)):
            return None
        missing = next((i for i in range(self.cfg.num_shards) if not (self.cfg.shard_dir(i) / "status.json").exists()), None)
        return None if missing is None else f"shard {missing} has no status.json: they were built from earlier shards"

    def dedup(self, ds_index: int) -> str | None:
        """Why a dataset must be deduplicated again: deduplication_params changed."""
        if not self.main or self.cfg.dedup is None:
            return None
        from mirageflow.data.dedup import dedup_params_changed

        return "deduplication_params changed" if dedup_params_changed(self.cfg, self.cfg.datasets[ds_index])[1] else None

    @staticmethod
    def force(workflow, path: str, why: str | None, logger=None) -> None:
        """Make the job writing ``path`` rerun, as ``--forcerun path`` would: in memory, in
        the DAG being built (nothing is written)."""
        if not why:
            return
        files = getattr(getattr(workflow, "dag", None), "forcefiles", None)
        if not isinstance(files, set):  # a Snakemake whose DAG keeps them elsewhere: say so, never ignore it
            raise RuntimeError(f"mirageflow: {path} must be made again ({why}), but this Snakemake's DAG has no forcefiles")
        if path not in files:
            files.add(path)
            if logger is not None:
                logger.info(f"mirageflow: {path} is made again: {why}")

    def save(self) -> None:
        """Keep the hashes computed at DAG build (the driver's onstart: never in a dry run)."""
        if self.cache is not None:
            self.cache.save()
