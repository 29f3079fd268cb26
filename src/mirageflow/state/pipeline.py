"""What the workflow keeps next to a pipeline's results so reruns, edits and jobs stay honest.

- **The config file**: the config Snakemake was given (after --configfile and --config),
  as JSON, in ``<state_dir>/configs/<sha256 prefix>.json``: content-addressed, written
  atomically, and written again when what is there is not that content (damaged). Every
  job's command line names it (``python -m mirageflow.jobs --config <file> ...``), so a
  printed command runs as is by hand; the job validates it again, expanding ``$VAR`` in its
  own environment. No secret is stored: a password or query value of a processor's URL, a
  key named like a secret, a secret flag's value written literally in the config are moved
  into ``MIRAGEFLOW_SECRET_<n>`` environment variables that the driver exports to its jobs
  (mirageflow.redact.secrets_out_of_config).
- **The records fingerprint**: ``<state_dir>/records.fingerprint`` holds the hash of
  ``config.records_identity`` (what can change a shard's records) and the identity itself
  for humans (the report shows it); each finished shard's status.json records the one it
  ran with (``records_fingerprint``). An edit of a prompt, schema, model, sampling or dataset
  makes the driver force every shard whose digest differs, under any rerun trigger,
  ``mtime`` included; a cosmetic edit (comments, execution_params, shard_params, stats)
  changes nothing (mirageflow.state.inputs). The file is rewritten (onstart) only when its
  content changes, and stays an input of the shard rule (a missing one is written by the
  ``records_fingerprint`` rule).
- **Content changes** (mirageflow.state.inputs): a dataset or image file whose content
  changed, whatever its mtime, reruns the jobs that read it.
- **The owner markers**: ``<output_dir>/.mirageflow-owner.json`` names the state_dir (and
  config) of the pipeline that writes there, and ``<state_dir>/owner.json`` the output_dirs
  (and config files) of the pipeline whose state it holds. A second pipeline pointed at the
  same output_dir (another state_dir) or at the same state_dir (other output_dirs) is
  refused before any job runs, naming the other one's config.
- **Derived outputs** (metrics.json, summary.md, report.html, the merge manifests and each
  dataset's ``<output_dir>/merged/``) of a previous run stay readable until this run's
  replace them (merged/ is swapped in whole, the report files are written atomically), so
  an edit or an interrupt never leaves the user without results. They are marked as the
  previous run's when a shard job starts, and by the driver when a shard's status.json is
  missing: ``<state_dir>/previous_results.json`` says why and since when, report.html shows
  a banner, summary.md a first line, metrics.json a ``previous_run`` key, and the run
  summary names them as the previous run's. An output written after the mark is this
  run's; the mark goes when the run succeeds. The next run rebuilds them (and reruns the
  missing shards they depend on: mirageflow/state/inputs.py).

When Snakemake parses the workflow (also for ``snakemake -n`` and ``--lint``) the driver
only reads: it validates the config, refuses a foreign output_dir and computes which
files the jobs need. What it writes (the config file, owner markers, the previous-run
mark on derived outputs, removal of a killed merge's temp directories, the content cache) it writes in
``prepare``, from the onstart hook, which Snakemake runs only before real jobs.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import logging
import os
import shutil
import socket
import time
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


def stored_config(config: dict) -> tuple[dict, dict[str, str]]:
    """(the config as it is stored: literal secrets replaced by ``${MIRAGEFLOW_SECRET_<n>}``,
    {variable: secret} the jobs need in their environment)."""
    from mirageflow.redact import secrets_out_of_config

    return secrets_out_of_config(config)


def config_bytes(config: dict) -> bytes:
    """The config as the jobs read it: JSON, keys in the given order (record columns follow
    it), without literal secrets (``stored_config``)."""
    return (json.dumps(stored_config(config)[0], ensure_ascii=False, default=str, indent=1) + "\n").encode()


def config_path(config: dict, state_dir: str | os.PathLike) -> Path:
    """``<state_dir>/configs/<sha256 prefix>.json``: where this exact config is (or will be) stored."""
    digest = hashlib.sha256(config_bytes(config)).hexdigest()[:CONFIG_HASH_CHARS]
    return L.StateLayout(state_dir).configs_dir / f"{digest}.json"


def write_config(config: dict, state_dir: str | os.PathLike) -> Path:
    """Store the config at its content-addressed path: written when absent, written again
    when the file there is not that content (damaged, truncated), else left alone."""
    path = config_path(config, state_dir)
    data = config_bytes(config)
    try:
        if path.read_bytes() == data:
            return path
        log.warning("%s is damaged (not the config its name says): writing it again", path)
    except FileNotFoundError:
        atomic_write_bytes(path, data, only_if_absent=True)
        return path
    except OSError as e:
        log.warning("%s cannot be read (%s): writing it again", path, e)
    atomic_write_bytes(path, data)
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


def _fingerprint_bytes(cfg: PipelineConfig) -> bytes:
    from mirageflow.redact import redact

    fp = records_fingerprint(cfg)
    # for humans: secrets in the processors' settings (server_args) are masked; the hash is the real one
    fp["identity"] = {**fp["identity"], "processors": redact(fp["identity"]["processors"])}
    return (json.dumps(fp, indent=1, default=str) + "\n").encode()


def identity_changes(old, new, where: str = "") -> list[str]:
    """The key paths where two records identities differ (``processing_params.outputs[1].prompt``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for k in list(old) + [k for k in new if k not in old]:
            path = f"{where}.{k}" if where else str(k)
            out += [path] if (k in old) != (k in new) else identity_changes(old[k], new[k], path)
        return out
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return [p for i, (a, b) in enumerate(zip(old, new)) for p in identity_changes(a, b, f"{where}[{i}]")]
    return [] if old == new else [where or "(all)"]


def records_changes(cfg: PipelineConfig, recorded_sha256: str) -> list[str] | None:
    """Which keys of the config changed since ``<state_dir>/records.fingerprint`` was written,
    when that file is the one of ``recorded_sha256`` (a shard's status.json's
    ``records_fingerprint``); None when it is not or cannot be read."""
    try:
        recorded = json.loads(fingerprint_path(cfg.state_dir).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(recorded, dict) or recorded.get("sha256") != recorded_sha256:
        return None
    current = json.loads(_fingerprint_bytes(cfg))  # redacted as the file is
    paths = identity_changes(recorded.get("identity"), current["identity"])
    # the identity's top level is the config's, but for processors (processors[i]) and datasets
    renames = {"datasets": "loading_params.datasets", "scripts": "processors[].script_path (the script's content)"}
    return [next((v + p[len(k) :] for k, v in renames.items() if p.startswith(k)), p) for p in paths]


def write_records_fingerprint(cfg: PipelineConfig) -> bool:
    """Write ``<state_dir>/records.fingerprint`` when its content differs (only then: a
    state_dir from before content-addressed fingerprints uses it as the shards' input).
    Returns whether it was written."""
    path = fingerprint_path(cfg.state_dir)
    data = _fingerprint_bytes(cfg)
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


def _output_dirs(cfg: PipelineConfig) -> list[str]:
    """What makes a state_dir's pipeline this one: where its records go (an edit of prompts,
    models or datasets keeps them; another pipeline has its own)."""
    return sorted({os.path.realpath(os.path.expanduser(ds.output_dir)) for ds in cfg.datasets})


def state_owner_problem(cfg: PipelineConfig) -> str | None:
    """Why this pipeline must not use its state_dir: another pipeline (other output_dirs) owns it."""
    marker = L.state_owner_marker(cfg.state_dir)
    try:
        owner = json.loads(marker.read_text())
        theirs = owner["output_dirs"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as e:
        return (
            f"loading_params.state_dir: '{cfg.state_dir}' has an unreadable owner marker {marker} ({e}); "
            "delete it if this pipeline should own the directory"
        )
    written = sorted({ds.output_dir for ds in cfg.datasets})
    if sorted(theirs) == _output_dirs(cfg) or owner.get("output_dirs_as_written") == written:
        return None  # (as written: a relative output_dir read from another directory, e.g. by mmirage stats)
    configs = ", ".join(owner.get("configfiles") or []) or owner.get("config") or "unknown"
    return (
        f"loading_params.state_dir: '{cfg.state_dir}' belongs to another pipeline (config {configs}, writing to "
        f"{', '.join(theirs)}, claimed {owner.get('claimed_at')}); this pipeline writes to {', '.join(_output_dirs(cfg))}. "
        "Two pipelines sharing one state_dir mark each other's shards stale and rerun them: give this one its own "
        f"state_dir, or delete {marker} if the other pipeline is gone (or its output_dirs were moved to these)"
    )


def claim_state_dir(cfg: PipelineConfig, config_file: str | os.PathLike | None = None, configfiles: Iterable[str] = ()) -> bool:
    """Write the state_dir's owner marker where there is none yet (after check_output_owners)."""
    owner = {
        "output_dirs": _output_dirs(cfg),
        "output_dirs_as_written": sorted({ds.output_dir for ds in cfg.datasets}),
        "config": os.path.abspath(config_file) if config_file else None,
        "configfiles": [os.path.abspath(c) for c in configfiles],
        "claimed_at": _utc_now(),
        "host": socket.gethostname(),
        "note": "This state_dir belongs to the mirageflow pipeline writing to these output_dirs; another pipeline is refused.",
    }
    marker = L.state_owner_marker(cfg.state_dir)
    return atomic_write_bytes(marker, (json.dumps(owner, indent=1) + "\n").encode(), only_if_absent=True)


def check_output_owners(cfg: PipelineConfig) -> None:
    """Raise OwnershipError when a dataset's output_dir belongs to a pipeline with another
    state_dir, or the state_dir to a pipeline with other output_dirs."""
    problems = [p for p in [state_owner_problem(cfg)] if p]
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
    """What the aggregate, merge, dedup and card rules build from the shards (files and directories)."""
    paths = L.StateLayout(cfg.state_dir)
    out = [paths.metrics, paths.summary, paths.report_html]
    out += [paths.merge_manifest(ds.index) for ds in cfg.datasets]
    out += [L.merged_dir(ds.output_dir) for ds in cfg.datasets]
    from mirageflow.data.dedup import dedup_outputs

    out += [p for ds in cfg.datasets for p in dedup_outputs(cfg, ds)]  # built from merged/
    out += L.dataset_cards(cfg)  # built from merged/ and metrics.json (rule card)
    return out


def mark_previous_results(cfg: PipelineConfig, why: str) -> list[Path]:
    """Mark the derived outputs that exist as the previous run's (``why``: what made them so),
    leaving them readable: ``previous_results.json``, a banner in report.html, a first line in
    summary.md, a ``previous_run`` key in metrics.json. Safe to call from many shard jobs at
    once (the first mark stays). Returns the outputs marked (none when already marked)."""
    paths = L.StateLayout(cfg.state_dir)
    present = [p for p in derived_outputs(cfg) if p.exists()]
    if not present or paths.previous_results.exists():
        return []
    note = {"why": why, "since": _utc_now()}
    _banner(paths.report_html, "<body>", _html_banner(note))
    _banner(
        paths.summary, "", f"> **The results of a previous run** ({why}, {note['since']}): this run's replace them when it finishes.\n\n"
    )
    try:
        metrics = json.loads(paths.metrics.read_text())
        if isinstance(metrics, dict) and "previous_run" not in metrics:
            atomic_write_bytes(paths.metrics, (json.dumps({"previous_run": note, **metrics}, indent=2, default=str) + "\n").encode())
    except (OSError, ValueError):
        pass  # absent or damaged: its rule makes it again
    record = {
        **note,
        "since_epoch": time.time(),  # an output written after this is the current run's
        "outputs": [str(p) for p in present],
        "note": "These outputs are a previous run's, kept readable until this run's replace them.",
    }
    if not atomic_write_bytes(paths.previous_results, (json.dumps(record, indent=1) + "\n").encode(), only_if_absent=True):
        return []
    log.info("%s: the results of the previous run stay until this run replaces them: %s", why, ", ".join(map(str, present)))
    return present


def _html_banner(note: dict) -> str:
    import html

    return (
        '<div class="previous-run" style="background:#fff3cd;border:1px solid #d39e00;padding:8px;margin:8px 0">'
        f"<b>The results of a previous run</b> ({html.escape(note['why'])}, {html.escape(note['since'])}): "
        "this run's report replaces this page when it finishes.</div>"
    )


def _banner(path: Path, after: str, text: str) -> None:
    """Put ``text`` after the first ``after`` of a text file (at its start when ``after`` is empty), once."""
    try:
        content = path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return
    if text in content:
        return
    at = content.find(after) + len(after) if after and after in content else 0
    atomic_write_bytes(path, (content[:at] + text + content[at:]).encode())


def previous_results(cfg: PipelineConfig) -> dict | None:
    """The derived outputs that are still the previous run's: {why, since, outputs}, or None."""
    try:
        record = json.loads(L.StateLayout(cfg.state_dir).previous_results.read_text())
        since = float(record["since_epoch"])
        listed = [Path(p) for p in record["outputs"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    left = []
    for path in listed:
        try:
            if path.stat().st_mtime <= since + 1e-3:  # not written since the mark
                left.append(path)
        except OSError:
            continue
    return {"why": record.get("why"), "since": record.get("since"), "outputs": left} if left else None


def clear_previous_results(cfg: PipelineConfig) -> bool:
    """After a successful run: drop the mark when every output it listed was replaced (or is
    gone); a run of some targets only keeps it. Returns whether it was dropped."""
    path = L.StateLayout(cfg.state_dir).previous_results
    if not path.exists() or previous_results(cfg) is not None:
        return False
    path.unlink(missing_ok=True)
    return True


def mark_stale_derived_outputs(cfg: PipelineConfig) -> list[Path]:
    """Driver side, before the first job: when a shard's status.json is missing (it failed, or a
    job died before it could mark them) but metrics or merged outputs exist, mark them as the
    previous run's; the run rebuilds them (mirageflow/state/inputs.py: ``derived``)."""
    paths = L.StateLayout(cfg.state_dir)
    missing = next((i for i in range(cfg.num_shards) if not paths.status(i).exists()), None)
    if missing is None:
        return []
    return mark_previous_results(cfg, f"shard {missing} has no status.json")


def remove_temp_dirs(cfg: PipelineConfig) -> list[Path]:
    """Temp directories a killed merge or dedup left next to its output (``.merged.<hex>``,
    ``.merged.old``, ``.deduplicated.<hex>``): no job of this pipeline runs when the driver
    calls this (Snakemake's lock), so none is in use."""
    from mirageflow.data.dedup import DEDUP_SUBDIR

    removed = []
    for ds in cfg.datasets:
        out = Path(ds.output_dir)
        for name in ("merged", DEDUP_SUBDIR):
            for tmp in out.glob(f".{name}.*"):
                suffix = tmp.name[len(name) + 2 :]
                if tmp.is_dir() and not tmp.is_symlink() and (suffix == "old" or (len(suffix) == 12 and suffix.isalnum())):
                    shutil.rmtree(tmp, ignore_errors=True)
                    removed.append(tmp)
    return removed


# --------------------------------------------------------------------------- before the first job


def prepare(config: dict, cfg: PipelineConfig, configfiles: Iterable[str] = (), rerun_inputs=None) -> list[str]:
    """What the driver writes before its first job (the onstart hook, never in a dry run or
    a lint): refuse an output_dir owned by another pipeline, store (or repair) the config
    file, claim the output_dirs, mark derived outputs that outlived a shard and drop the temp
    directories of a killed merge, keep the content hashes computed at DAG build. Returns
    notes for the user (what changed). Raises OwnershipError."""
    notes = []
    check_output_owners(cfg)
    path = write_config(config, cfg.state_dir)
    claim_output_dirs(cfg, path, configfiles)
    claim_state_dir(cfg, path, configfiles)
    check_output_owners(cfg)  # another pipeline may have claimed the state_dir in between
    marked = mark_stale_derived_outputs(cfg)
    if marked:
        notes.append(
            "mirageflow: a shard has no status.json; the results built from earlier shards stay, marked as the previous run's, "
            "until this run replaces them: " + ", ".join(map(str, marked))
        )
    if fingerprint_path(cfg.state_dir).exists() and write_records_fingerprint(cfg):  # a missing one: its rule writes it
        notes.append(f"mirageflow: {fingerprint_path(cfg.state_dir)} updated (what can change the records changed)")
    from mirageflow.data.dedup import remove_stale_dedup_outputs

    notes += remove_stale_dedup_outputs(cfg)
    temps = remove_temp_dirs(cfg)
    if temps:
        notes.append("mirageflow: removed the temp directories of a merge that was killed: " + ", ".join(map(str, temps)))
    if rerun_inputs is not None:
        rerun_inputs.save()
    return notes


def on_start(config: dict, cfg, workflow, rerun_inputs, logger) -> None:
    """The Snakefile's onstart hook (the driver, before its first job; never in a dry run):
    ``prepare``, its notes logged; a failure stops the run naming what could not be written."""
    from snakemake.exceptions import WorkflowError

    from mirageflow.redact import install_log_redaction

    install_log_redaction(logger)  # Snakemake's log handlers exist by now
    try:
        for note in prepare(config, cfg, getattr(workflow, "configfiles", ()), rerun_inputs):
            logger.info(note)
    except (OwnershipError, OSError) as e:
        raise WorkflowError(f"mirageflow: cannot write the pipeline's state files: {e}") from None
