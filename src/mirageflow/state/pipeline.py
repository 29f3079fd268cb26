"""What the workflow keeps next to a pipeline's results so reruns, edits and jobs stay honest.

- **The config file**: the config Snakemake was given (after --configfile and --config),
  as JSON, in ``<state_dir>/configs/<sha256 prefix>.json``: content-addressed, written once
  (atomically, only if absent). Every job's command line names it (``python -m
  mirageflow.jobs --config <file> ...``), so a printed command runs as is by hand; the job
  validates it again, expanding ``$VAR`` in its own environment.
- **The records fingerprint**: ``<state_dir>/records.fingerprint`` holds the hash of
  ``config.records_identity`` (what can change a shard's records) and the identity itself
  for humans. It is rewritten only when its content changes, and it is an input of the
  shard rule: an edit of a prompt, schema, model, sampling or dataset makes it newer than
  every status.json, so the shards rerun under any rerun trigger, ``mtime`` included; a
  cosmetic edit (comments, execution_params, shard_params, stats) leaves it alone.
- **The owner marker**: ``<output_dir>/.mirageflow-owner.json`` names the state_dir (and
  config) of the pipeline that writes there. A second pipeline (another state_dir) pointed
  at the same output_dir is refused before any job runs.
- **Derived outputs** (metrics.json, summary.md, report.html, the merge manifests and each
  dataset's ``<output_dir>/merged/``) are removed when a shard job starts, and by the
  driver when a shard's status.json is missing, so they never show a previous
  configuration's or a partial run's results as current, and the next run rebuilds them
  (and reruns the missing shards they depend on).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Iterable

from mirageflow.config.types import PipelineConfig
from mirageflow.files import atomic_write_bytes
from mirageflow.state import layout as L
from mirageflow.errors import InputError

log = logging.getLogger(__name__)

CONFIG_HASH_CHARS = 16


class OwnershipError(InputError, ValueError):
    """An output_dir already belongs to another pipeline (another state_dir)."""


def _utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


# --------------------------------------------------------------------------- the config file


def config_bytes(config: dict) -> bytes:
    """The config as the jobs read it: JSON, keys in the given order (record columns follow it)."""
    return (json.dumps(config, ensure_ascii=False, default=str, indent=1) + "\n").encode()


def config_path(config: dict, state_dir: str | os.PathLike) -> Path:
    """``<state_dir>/configs/<sha256 prefix>.json``: where this exact config is (or will be) stored."""
    digest = hashlib.sha256(config_bytes(config)).hexdigest()[:CONFIG_HASH_CHARS]
    return L.StateLayout(state_dir).configs_dir / f"{digest}.json"


def write_config(config: dict, state_dir: str | os.PathLike) -> Path:
    """Store the config at its content-addressed path (once: an existing file is left alone)."""
    path = config_path(config, state_dir)
    if not path.exists():
        atomic_write_bytes(path, config_bytes(config), only_if_absent=True)
    return path


# --------------------------------------------------------------------------- records fingerprint


def records_fingerprint(cfg: PipelineConfig) -> dict:
    from mirageflow.config import records_identity

    identity = records_identity(cfg)
    digest = hashlib.sha256(json.dumps(identity, default=str, separators=(",", ":")).encode()).hexdigest()
    return {
        "sha256": digest,
        "note": (
            "What can change a shard's records. The workflow rewrites this file only when it "
            "changes; the shards depend on it, so a change reruns them."
        ),
        "identity": identity,
    }


def fingerprint_path(state_dir: str | os.PathLike) -> Path:
    return L.StateLayout(state_dir).fingerprint


def write_records_fingerprint(cfg: PipelineConfig) -> bool:
    """Write ``<state_dir>/records.fingerprint`` when its content differs (only then: its mtime
    is what reruns the shards). Returns whether it was written."""
    path = fingerprint_path(cfg.state_dir)
    data = (json.dumps(records_fingerprint(cfg), indent=1, default=str) + "\n").encode()
    try:
        if path.read_bytes() == data:
            return False
    except FileNotFoundError:
        pass
    atomic_write_bytes(path, data)
    return True


# --------------------------------------------------------------------------- output_dir owners


def owner_path(output_dir: str | os.PathLike) -> Path:
    return L.owner_marker(output_dir)


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


def check_output_owners(cfg: PipelineConfig) -> None:
    """Raise OwnershipError when a dataset's output_dir belongs to a pipeline with another state_dir."""
    problems = []
    for ds in cfg.datasets:
        marker = owner_path(ds.output_dir)
        try:
            owner = json.loads(marker.read_text())
            state_dir = owner["state_dir"]
        except FileNotFoundError:
            continue
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(
                f"loading_params.datasets[{ds.index}].output_dir: '{ds.output_dir}' has an unreadable owner "
                f"marker {marker} ({e}); delete it if this pipeline should own the directory"
            )
            continue
        if not _same_dir(state_dir, cfg.state_dir):
            problems.append(
                f"loading_params.datasets[{ds.index}].output_dir: '{ds.output_dir}' belongs to another pipeline "
                f"(state_dir '{state_dir}', config {owner.get('config')}, claimed {owner.get('claimed_at')}); "
                f"this pipeline's state_dir is '{os.path.abspath(cfg.state_dir)}'. Two pipelines writing one "
                f"output_dir destroy each other's results: give this one its own output_dir, or delete "
                f"{marker} if the other pipeline is gone (or was moved here)"
            )
    if problems:
        raise OwnershipError("\n".join(problems))


def claim_output_dirs(cfg: PipelineConfig, config_file: str | os.PathLike | None = None, configfiles: Iterable[str] = ()) -> list[Path]:
    """Write each dataset's owner marker where there is none yet (after check_output_owners)."""
    written = []
    for ds in cfg.datasets:
        marker = owner_path(ds.output_dir)
        if marker.exists():
            continue
        owner = {
            "state_dir": os.path.abspath(cfg.state_dir),
            "config": os.path.abspath(config_file) if config_file else None,
            "configfiles": [os.path.abspath(c) for c in configfiles],
            "claimed_at": _utc_now(),
            "host": socket.gethostname(),
            "note": "This output_dir belongs to the mirageflow pipeline with this state_dir; another pipeline is refused.",
        }
        if atomic_write_bytes(marker, (json.dumps(owner, indent=1) + "\n").encode(), only_if_absent=True):
            written.append(marker)
    check_output_owners(cfg)  # another pipeline may have claimed it in between
    return written


# --------------------------------------------------------------------------- derived outputs


def derived_outputs(cfg: PipelineConfig) -> list[Path]:
    """What the aggregate and merge rules build from the shards (files and directories)."""
    paths = L.StateLayout(cfg.state_dir)
    out = [paths.metrics, paths.summary, paths.report_html]
    out += [paths.merge_manifest(ds.index) for ds in cfg.datasets]
    out += [L.merged_dir(ds.output_dir) for ds in cfg.datasets]
    from mirageflow.data.dedup import dedup_outputs

    out += [p for ds in cfg.datasets for p in dedup_outputs(cfg, ds)]  # built from merged/
    return out


def remove_derived_outputs(cfg: PipelineConfig, why: str) -> list[Path]:
    """Remove the metrics report and merged outputs, so none of them outlives the shards it
    summarised. Safe to call from many shard jobs at once. Returns what was removed."""
    removed = []
    for path in derived_outputs(cfg):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)  # another shard job may be removing it too
            if path.exists():
                shutil.rmtree(path)  # what is left, with the error this time
        else:
            try:
                path.unlink()
            except FileNotFoundError:
                continue
        removed.append(path)
    if removed:
        log.info("%s: removed the results built from the previous shards: %s", why, ", ".join(map(str, removed)))
    return removed


def remove_stale_derived_outputs(cfg: PipelineConfig) -> list[Path]:
    """Driver side, at DAG build: when a shard's status.json is missing (it failed, or a job
    died before it could clean up) but metrics or merged outputs exist, remove them, so the
    run rebuilds them and Snakemake reruns the missing shards they depend on."""
    present = [p for p in derived_outputs(cfg) if p.exists()]
    if not present:
        return []
    paths = L.StateLayout(cfg.state_dir)
    missing = next((i for i in range(cfg.num_shards) if not paths.status(i).exists()), None)
    if missing is None:
        return []
    return remove_derived_outputs(cfg, f"shard {missing} has no status.json")


# --------------------------------------------------------------------------- at DAG build


def prepare(config: dict, cfg: PipelineConfig, configfiles: Iterable[str] = ()) -> list[str]:
    """What the driver does when Snakemake parses the workflow (common.smk), before the DAG:
    refuse an output_dir owned by another pipeline, store the config file, claim the
    output_dirs, update the records fingerprint, drop derived outputs that outlived a
    shard. Returns notes for the user (what changed). Raises OwnershipError."""
    notes = []
    check_output_owners(cfg)
    path = write_config(config, cfg.state_dir)
    claim_output_dirs(cfg, path, configfiles)
    if write_records_fingerprint(cfg):
        notes.append(f"mirageflow: {fingerprint_path(cfg.state_dir)} updated (what can change the records changed)")
    removed = remove_stale_derived_outputs(cfg)
    if removed:
        notes.append(
            "mirageflow: a shard has no status.json; removed the results built from earlier shards: "
            + ", ".join(map(str, removed))
        )
    return notes
