"""Edits seen whatever the clock says: reruns decided by file contents, not only by mtimes.

Snakemake reruns a job when an input is newer than its outputs (or, with its default
triggers, when its set of inputs, params or code changed). A dataset copied with ``cp -p``
or ``rsync -a`` keeps its old mtime, an image file can change under a path no rule knows
of, and a clock can be skewed. So what a job read is also identified by content:

- **datasets**: the index rule records, per file, its stat identity (inode, size, mtime,
  ctime) and its content identity (``data/readers.write_index``: the SHA-256 of its bytes,
  or for a Parquet file of its size and footer). At DAG build the driver compares each
  file's stat identity with the recorded one (a ``stat`` per file) and identifies only a
  file whose stat identity changed (``cp -p`` makes a new inode or ctime), through a cache
  (``<state_dir>/datasets/content.json``) so an unchanged copy is hashed once. Shard jobs
  never hash a dataset file: they trust what the index or this cache recorded
  (``readers.recorded_content_stale``; the rule for a stale record is in docs/data.md);
- **images**: a shard appends every image file it reads, with its stat identity and the
  SHA-256 of the bytes it read, to ``<state_dir>/shard_<id>/input_images.jsonl`` (an attempt
  that resumes keeps the earlier lines); at DAG build each finished shard's files are
  checked the same way;
- **the records identity** (mirageflow.config.records_identity: prompts, schemas, model,
  sampling, datasets): each shard's status.json holds the fingerprint it ran under
  (``records_fingerprint``; mirageflow.state.shards calls one of an earlier config stale);
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

from mirageflow.files import ContentCache, digest_of, stat_key  # noqa: F401 - file identity by content, used here and re-exported
from mirageflow.state import layout as L

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- datasets


def dataset_changed(ds, cache: ContentCache, index_path: str | os.PathLike) -> str | None:
    """Why dataset ``ds``'s index is out of date by content (None: it is not, or it runs anyway)."""
    from mirageflow.data.readers import dataset_files, identify_function

    try:
        header = json.loads(Path(index_path).read_text())
    except (OSError, ValueError):
        return None  # not indexed yet (or damaged: its rule runs anyway)
    if isinstance(header, dict) and header.get("shard_boundaries", "rows") != ds.shard_boundaries:
        return f"it was indexed for shard_boundaries: {header.get('shard_boundaries', 'rows')}, the config says {ds.shard_boundaries}"
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
        if cache.digest(f, (known[0], known[1]), identify_function(ds)) != known[1]:
            return f"{f} changed since it was indexed (by content, whatever its mtime)"
    return None


# --------------------------------------------------------------------------- images


class ImageRecorder:
    """The image files a shard reads, appended to ``shard_<id>/input_images.jsonl`` (thread-safe:
    images load in threads). One line per file version: [real path, stat identity, sha256]."""

    def __init__(self, shard_dir: str | os.PathLike, fresh: bool):
        import threading

        self.path = Path(shard_dir) / L.IMAGE_RECORDS
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
    records = read_image_records(Path(shard_dir) / L.IMAGE_RECORDS)
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


class ContentChanges:
    """Which jobs must rerun because what they read changed (common.smk's input functions).

    Only in the driver (``main``): a cluster job re-parsing the Snakefile runs one job that
    the driver already decided to run, and computes nothing here.
    """

    def __init__(self, cfg, main: bool):
        self.cfg, self.main = cfg, main
        self.paths = L.StateLayout(cfg.state_dir)
        self.cache = ContentCache(self.paths.content_cache) if main else None
        self.images = any(v.type == "image" for v in cfg.inputs)
        self._records: str | None = None
        self._shards: dict[int, str | None] = {}  # asked by two input functions of each shard

    def shard(self, shard_id: int) -> str | None:
        """Why a finished shard must rerun: the records identity it ran under (its status.json's
        ``records_fingerprint``) is not the config's, or an image file it read changed."""
        if shard_id not in self._shards:
            self._shards[shard_id] = self._shard(shard_id)
        return self._shards[shard_id]

    def _shard(self, shard_id: int) -> str | None:
        from mirageflow.state.records import read
        from mirageflow.state.shards import current_fingerprint, stale_reason

        if not self.main:
            return None
        status, _why = read(self.paths.status(shard_id))
        if status is None:
            return None  # runs anyway (absent), or its damage is reported by the shard states
        if self._records is None:
            self._records = current_fingerprint(self.cfg)
        if stale_reason(status, self._records):
            from mirageflow.state.pipeline import records_changes

            changed = records_changes(self.cfg, status["records_fingerprint"])
            if not changed:
                return "what can change its records changed (prompt, schema, model, sampling, dataset)"
            more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
            return f"what can change its records changed: {', '.join(changed[:3])}{more}"
        if self.images:
            return images_changed(self.paths.shard_dir(shard_id), self.cache)
        return None

    def canary(self) -> str | None:
        """Why the canary's verdict must be made again: it judged the records of another config
        (its ``records_fingerprint`` is not this config's) while a shard is still to be made
        under this one. A shard rerun by an edit thus never starts on an earlier config's
        verdict; when every shard is done under this config there is nothing left to hold."""
        from mirageflow.state.records import read
        from mirageflow.state.shards import current_fingerprint, is_done

        if not self.main or not self.cfg.execution.canary_rows:
            return None
        verdict, _why = read(self.paths.canary_verdict)
        if verdict is None:
            return None  # runs anyway (absent), or Snakemake's incomplete-file check names it
        if self._records is None:
            self._records = current_fingerprint(self.cfg)
        theirs = verdict.get("records_fingerprint")
        if theirs == self._records:
            return None
        n = self.cfg.num_shards
        if all(is_done(read(self.paths.status(i))[0], n, self._records) for i in range(n)):
            return None
        return f"it judged an earlier config's records (records fingerprint {str(theirs)[:12]}, now {self._records[:12]})"

    def dataset(self, ds_index: int) -> str | None:
        """Why a dataset must be indexed again: its files changed by content."""
        if not self.main:
            return None
        index = self.paths.dataset_index(ds_index)
        return dataset_changed(self.cfg.datasets[ds_index], self.cache, index)

    def derived(self) -> str | None:
        """Why the report and merged outputs must be made again: a shard has no status.json
        (it failed, or it was deleted) while they exist (built from earlier shards)."""
        if not self.main:
            return None
        from mirageflow.state import pipeline

        if not any(p.exists() for p in pipeline.derived_outputs(self.cfg)):
            return None
        missing = next((i for i in range(self.cfg.num_shards) if not self.paths.status(i).exists()), None)
        return None if missing is None else f"shard {missing} has no status.json: they were built from earlier shards"

    def dedup(self, ds_index: int) -> str | None:
        """Why a dataset must be deduplicated again: deduplication_params changed."""
        if not self.main or self.cfg.dedup is None:
            return None
        from mirageflow.data.dedup import dedup_params_changed

        return "deduplication_params changed" if dedup_params_changed(self.cfg, self.cfg.datasets[ds_index])[1] else None

    def force(self, workflow, path: str, why: str | None, logger=None, complete: bool = False) -> None:
        """Make the job writing ``path`` rerun when ``why`` says it must, as ``--forcerun path``
        would: in memory, in the DAG being built (nothing is written).

        A ``path`` Snakemake marked incomplete (its driver was stopped before it saw the job
        end) is settled here too, so the same command goes on without ``--rerun-incomplete``:
        ``complete`` (a shard's status.json that is a verified success, the canary's verdict a pass
        of this config) keeps it, anything else is made again. A cluster job forces and settles
        nothing: the driver chose the job (docs/cluster.md, what a job trusts)."""
        if not self.main:
            return
        from mirageflow.cluster import snakemake_internals as snakemake

        if snakemake.clear_incomplete(workflow, path) and not why and not complete:
            why = "its job was stopped before Snakemake saw it end"
        if why and snakemake.force(workflow, path) and logger is not None:
            logger.info(f"mirageflow: {path} is made again: {why}")

    def shard_complete(self, shard_id: int) -> bool:
        """Whether the shard's status.json is a success of this config (``state.shards.is_done``)."""
        from mirageflow.state.records import read
        from mirageflow.state.shards import current_fingerprint, is_done

        status, _why = read(self.paths.status(shard_id))
        if status is None:
            return False
        if self._records is None:
            self._records = current_fingerprint(self.cfg)
        return is_done(status, self.cfg.num_shards, self._records)

    def canary_complete(self) -> bool:
        """Whether the canary's verdict is a pass for this config's records and canary_rows (the
        canary writes it, atomically, only when it passed: mirageflow/shard/canary.py)."""
        from mirageflow.state.records import read
        from mirageflow.state.shards import current_fingerprint

        verdict, _why = read(self.paths.canary_verdict)
        if not isinstance(verdict, dict) or verdict.get("passed") is not True:
            return False
        if self._records is None:
            self._records = current_fingerprint(self.cfg)
        return verdict.get("records_fingerprint") == self._records and verdict.get("canary_rows") == self.cfg.execution.canary_rows

    def save(self) -> None:
        """Keep the hashes computed at DAG build (the driver's onstart: never in a dry run)."""
        if self.cache is not None:
            self.cache.save()
