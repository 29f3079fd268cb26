"""Hugging Face Hub model ids (``server_args.model_path: Qwen/Qwen3-4B``, and an image_gen
processor's diffusers pipeline: ``sglang.model_path: Qwen/Qwen-Image``): looked up by the
driver, fetched once before any shard job, read offline by the jobs.

- ``look_up`` (the driver's preflight and ``mmirage check``): is the model in the cache at
  the wanted revision (``cached``), can it be fetched from here (``download``), or not
  (``cannot``: offline, an unknown id or revision, a gated repo without access, a hub that
  does not answer), with the key and the fix. Read-only: it never writes the cache.
- ``download`` (the ``hub_model`` rule, a ``localrule``: it runs in the driver's process
  tree on the login node): huggingface_hub's own ``snapshot_download`` into the configured
  cache, which resumes what an earlier, killed attempt finished (each complete file is
  kept; huggingface_hub 2.4 restarts the file that was cut, and resumes a dropped
  connection of a large file with a Range request), then a marker with the commit.
- ``resolve_local`` (every shard and engine job): the snapshot directory of that commit,
  with ``HF_HUB_OFFLINE=1``; a job never downloads, so a model missing on a compute node
  fails the job at once, naming the cache it looked in.

The cache is ``<execution_params.hf_home>/hub``, else the environment's (``HF_HUB_CACHE``,
``HF_HOME``/hub, ``~/.cache/huggingface/hub``); the endpoint is ``HF_ENDPOINT``, the token
``HF_TOKEN`` (or ``hf auth login``), as huggingface_hub reads them.
"""

from __future__ import annotations

import json
import os
import re
import socket
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Mapping
from urllib.parse import quote

from mirageflow.state import layout

if TYPE_CHECKING:
    from mirageflow.config.types import PipelineConfig

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
DEFAULT_ENDPOINT = "https://huggingface.co"
LOOKUP_TIMEOUT = 10.0  # seconds per request of the driver's look-up
MARKERS_DIR = layout.HUB_MODELS
# Model directories the workflow builds itself (workflow/rules/models.smk)
WORKFLOW_BUILT_MODELS = ("resources/models/SmolLM2-135M-Instruct",)


@dataclass(frozen=True)
class HubModel:
    processor_index: int
    repo_id: str
    revision: str | None  # server_args.revision (a branch, tag or commit); None: main
    block: str = "server_args"  # the processor's key holding model_path (image_gen: pipeline_args, sglang)
    index_file: str = "config.json"  # what a complete snapshot holds (a diffusers pipeline: model_index.json)

    @property
    def key(self) -> str:
        return f"processors[{self.processor_index}].{self.block}.model_path"

    @property
    def slug(self) -> str:
        """File-name-safe name of repo and revision: ``Qwen--Qwen3-4B`` or ``Qwen--Qwen3-4B@v1``."""
        base = self.repo_id.replace("/", "--")
        return base + (f"@{quote(self.revision, safe='')}" if self.revision else "")

    @property
    def label(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


@dataclass(frozen=True)
class ModelState:
    model: HubModel
    state: str  # cached | download | cannot
    detail: str
    snapshot: Path | None = None  # cached: the snapshot directory
    config: dict | None = None  # the model's config.json (cached, or read from the hub)


def is_hub_id(model_path: str, built_models: tuple[str, ...] = WORKFLOW_BUILT_MODELS) -> bool:
    """``org/name`` that is not a path here (nor a model directory the workflow builds)."""
    path = os.path.expanduser(model_path)
    if os.path.normpath(path) in {os.path.normpath(m) for m in built_models} or os.path.lexists(path):
        return False
    return bool(HUB_ID.match(model_path)) and not model_path.startswith(".")


def revision_hint(model_path: str, key: str) -> str:
    """For a model_path that is no directory: how to ask for a hub id at a revision, when it
    looks like ``org/name@rev`` (the hub's own URLs and some tools spell it so), else ""."""
    repo, at, revision = model_path.partition("@")
    if not at or not revision or not is_hub_id(repo, ()):
        return ""
    return f"; a Hugging Face model id at a revision is written model_path: {repo} with {key}: {revision} (model_path takes no @revision)"


def hub_models(cfg: PipelineConfig, built_models: tuple[str, ...] = WORKFLOW_BUILT_MODELS) -> list[HubModel]:
    """The processors whose model is a hub id and is loaded here (a remote server's model is a name it serves)."""
    from mirageflow.engines import registry

    found = []
    for proc in sorted(cfg.processors.values(), key=lambda p: p.index):
        path = proc.server_args.model_path
        if registry.capabilities(proc.backend).loads_model and path and is_hub_id(path, built_models):
            found.append(HubModel(proc.index, path, proc.server_args.revision))
    for proc in sorted(cfg.image_processors.values(), key=lambda p: p.index):
        model = image_hub_model(proc)
        if model is not None:
            found.append(model)
    return found


def image_hub_model(proc) -> HubModel | None:
    """An image_gen processor's diffusers pipeline when it is a hub id (diffusers, sglang;
    an external server's model is a name it serves): fetched by the driver as LLM ids are."""
    path = proc.model_path
    if proc.backend == "external" or not path or not is_hub_id(path, ()):
        return None
    block = "pipeline_args" if proc.backend == "diffusers" else "sglang"
    return HubModel(proc.index, path, proc.revision, block=block, index_file="model_index.json")


def cache_dir(cfg: PipelineConfig, environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    hf_home = cfg.execution.hf_home
    if hf_home:
        return Path(os.path.expanduser(hf_home)) / "hub"
    if environ.get("HF_HUB_CACHE"):
        return Path(os.path.expanduser(environ["HF_HUB_CACHE"]))
    return Path(os.path.expanduser(environ.get("HF_HOME") or "~/.cache/huggingface")) / "hub"


def marker_path(state_dir: str, model: HubModel) -> Path:
    return layout.StateLayout(state_dir).hub_model_marker(model.slug)


def _true(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def cached_snapshot(model: HubModel, cache: Path, revision: str | None = None) -> Path | None:
    """The complete snapshot of the model at ``revision`` (default: the model's) in ``cache``, or None.

    huggingface_hub's own lookup without network (``local_files_only``): a branch or tag is
    read from ``refs/``, and a snapshot its tree listing shows incomplete is not one.
    """
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    try:
        path = Path(snapshot_download(model.repo_id, revision=revision or model.revision, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, IncompleteSnapshotError, OSError):
        return None
    return path if (path / model.index_file).is_file() else None


def damaged_weights(snapshot: Path) -> list[tuple[Path, str]]:
    """Each ``*.safetensors`` file of a snapshot whose bytes its own header does not describe
    (cut, overwritten, damaged after the download: huggingface_hub trusts a file it has),
    with why. Reads each file's header only (8 bytes of length, then its JSON)."""
    damaged = []
    for path in sorted(snapshot.glob("*.safetensors")):
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                length = int.from_bytes(head, "little") if len(head) == 8 else -1
                if length < 2 or 8 + length > size:
                    why = f"its header announces {length} bytes of metadata, the file has {size} bytes"
                else:
                    header = json.loads(f.read(length))
                    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
                    why = None if 8 + length + end == size else f"holds {size} bytes, its header describes {8 + length + end}"
        except (OSError, ValueError, TypeError, KeyError, IndexError) as e:
            why = f"its header cannot be read ({type(e).__name__}: {e})"
        if why:
            damaged.append((path, why))
    return damaged


def _said(damaged: list[tuple[Path, str]]) -> str:
    """``damaged_weights``' answer in words: each file and why."""
    return "; ".join(f"{p} is damaged ({why})" for p, why in damaged)


def _remove_damaged(snapshot: Path) -> list[Path]:
    """Delete the damaged weights files of a cached snapshot (the link and the blob it points
    to), so huggingface_hub downloads them again instead of trusting them."""
    removed = []
    for path, _why in damaged_weights(snapshot):
        blob = path.resolve()
        path.unlink(missing_ok=True)
        if blob != path:
            blob.unlink(missing_ok=True)
        removed.append(path)
    return removed


_LOOKUPS: dict[tuple, ModelState] = {}  # one look-up per model and place in a process (preflight, then its notes)


def look_up(model: HubModel, cache: Path, environ: Mapping[str, str] | None = None, timeout: float = LOOKUP_TIMEOUT) -> ModelState:
    """Where the model stands for this run: cached, to be downloaded, or not obtainable (and why)."""
    environ = os.environ if environ is None else environ
    endpoint = (environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    key = (model, str(cache), endpoint, _true(environ.get("HF_HUB_OFFLINE")))
    if key not in _LOOKUPS:
        _LOOKUPS[key] = _look_up(model, cache, environ, endpoint, timeout)
    return _LOOKUPS[key]


def _look_up(model: HubModel, cache: Path, environ: Mapping[str, str], endpoint: str, timeout: float) -> ModelState:
    snapshot = cached_snapshot(model, cache)
    damaged = damaged_weights(snapshot) if snapshot is not None else []
    if snapshot is not None and not damaged:
        return ModelState(model, "cached", f"in the cache {snapshot}", snapshot, _read_json(snapshot / model.index_file))
    fetch_fix = (
        f"download it where the hub is reachable (hf download {model.repo_id}"
        + (f" --revision {model.revision}" if model.revision else "") + f" --cache-dir {cache}"
        + (" --force-download" if damaged else "") + "), or set model_path to a local model directory"
    )  # fmt: skip
    where = f"is not in the cache {cache}"
    if damaged:
        path, why = damaged[0]
        where = f"is in the cache, but its file {path} is damaged ({why}; {len(damaged)} file(s) in all)"
    if _true(environ.get("HF_HUB_OFFLINE")):
        return ModelState(model, "cannot", f"{where}, and HF_HUB_OFFLINE is set here, so it cannot be downloaded: {fetch_fix}")
    from huggingface_hub import HfApi, hf_hub_url
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    token = environ.get("HF_TOKEN") or None
    page = f"{endpoint}/{model.repo_id}"
    try:
        info = HfApi(endpoint=endpoint, token=token).model_info(model.repo_id, revision=model.revision, timeout=timeout)
        # model_info answers for a gated repo too: reading config.json (model_index.json) shows whether we may download
        url = hf_hub_url(model.repo_id, model.index_file, revision=info.sha, endpoint=endpoint)
        response = get_session().get(url, headers=build_hf_headers(token=token), timeout=timeout, follow_redirects=True)
        hf_raise_for_status(response)
        config = response.json()
    except GatedRepoError:
        return ModelState(
            model, "cannot",
            f"is a gated model on {endpoint}: accept its conditions at {page} with your account, then set HF_TOKEN "
            "(or run `hf auth login`) in the environment the workflow starts from",
        )  # fmt: skip
    except RevisionNotFoundError:
        return ModelState(
            model,
            "cannot",
            f"has no revision '{model.revision}' on {endpoint} (server_args.revision): use a branch, tag or commit of {page}",
        )
    except RepositoryNotFoundError:
        return ModelState(
            model, "cannot",
            f"is not a model on {endpoint} (a typo? a private repo needs HF_TOKEN), and not a local directory",
        )  # fmt: skip
    except Exception as e:  # connection refused, timeout, DNS, a 5xx, not JSON: the driver says so, never crashes
        if not (
            isinstance(e, (HfHubHTTPError, OSError, ValueError)) or type(e).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore")
        ):
            raise
        what = type(e).__name__ + (f": {str(e).splitlines()[0]}" if str(e) else "")
        return ModelState(
            model, "cannot",
            f"{where}, and the hub {endpoint} does not answer from {socket.gethostname()} ({what}): {fetch_fix}",
        )  # fmt: skip
    files = len(info.siblings or [])
    again = f"{where}: its damaged files " if damaged else ""
    return ModelState(
        model, "download",
        f"{again}will be downloaded from {endpoint} (commit {str(info.sha)[:12]}, {files} files) into {cache} by the driver "
        "(rule hub_model) before any shard starts",
        config=config if isinstance(config, dict) else None,
    )  # fmt: skip


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


# --------------------------------------------------------------------------- the driver's download


def download(cfg, slug: str, output: str) -> dict:
    """Fetch one hub model into the cache (huggingface_hub's snapshot_download), then write its marker."""
    from huggingface_hub import snapshot_download

    from mirageflow.files import atomic_write_json

    model = next((m for m in hub_models(cfg) if m.slug == slug), None)
    if model is None:
        raise ValueError(f"no processor of this config names the hub model '{slug}'")
    cache = cache_dir(cfg)
    cache.mkdir(parents=True, exist_ok=True)
    earlier = cached_snapshot(model, cache)
    if earlier is not None:
        _remove_damaged(earlier)  # else huggingface_hub keeps them: it trusts a file it has
    path = Path(snapshot_download(model.repo_id, revision=model.revision, cache_dir=cache))
    damaged = damaged_weights(path)
    if damaged:
        raise RuntimeError(
            f"{model.key}: '{model.label}' was downloaded, but {_said(damaged)}: the hub serves it so, or the disk is failing"
        )
    marker = {
        "repo_id": model.repo_id,
        "revision": model.revision,
        "commit": path.name,
        "snapshot": str(path),
        "cache": str(cache),
        "fetched_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "hostname": socket.gethostname(),
    }
    atomic_write_json(output, marker)
    return marker


# --------------------------------------------------------------------------- the jobs: offline


def offline_environment(cfg: PipelineConfig) -> None:
    """A job's environment before anything imports huggingface_hub: the cache, and no download."""
    hf_home = cfg.execution.hf_home
    if hf_home:
        os.environ["HF_HOME"] = os.path.expanduser(hf_home)
    os.environ["HF_HUB_OFFLINE"] = "1"


def resolve_local(cfg: PipelineConfig, built_models: tuple[str, ...] = WORKFLOW_BUILT_MODELS) -> PipelineConfig:
    """The config with each hub id replaced by its local snapshot directory (the commit the driver fetched).

    Raises RuntimeError naming the model, the cache and the way out when it is not there:
    a job never downloads.
    """
    models = hub_models(cfg, built_models)
    if not models:
        return cfg
    cache = cache_dir(cfg)
    processors, images = dict(cfg.processors), dict(cfg.image_processors)
    by_index = {p.index: name for name, p in processors.items()}
    images_by_index = {p.index: name for name, p in images.items()}
    for model in models:
        marker = _read_json(marker_path(cfg.state_dir, model)) or {}
        path = cached_snapshot(model, cache, revision=marker.get("commit"))
        if path is None:
            raise RuntimeError(
                f"{model.key}: '{model.label}' is not in the Hugging Face cache {cache} on {socket.gethostname()}"
                + (f" (commit {marker['commit']}, fetched by the driver on {marker.get('hostname')})" if marker.get("commit") else "")
                + ". Jobs never download (HF_HUB_OFFLINE=1): is execution_params.hf_home on a filesystem this node "
                "shares with the login node? Delete the marker "
                f"{marker_path(cfg.state_dir, model)} and run again to fetch it anew"
            )
        damaged = damaged_weights(path)
        if damaged:
            raise RuntimeError(
                f"{model.key}: '{model.label}' in the Hugging Face cache {cache}: {_said(damaged)}. Start the workflow again "
                "(snakemake, mmirage run or mmirage retry): the driver sees the damage and downloads those files anew "
                "(rule hub_model) before any shard"
            )
        # the snapshot is that revision: the engine (or image generator) gets a directory
        if model.processor_index in images_by_index:
            name = images_by_index[model.processor_index]
            images[name] = replace(images[name], model_path=str(path), revision=None)
            continue
        name = by_index[model.processor_index]
        proc = processors[name]
        processors[name] = replace(proc, server_args=replace(proc.server_args, model_path=str(path), revision=None))
    return replace(cfg, processors=processors, image_processors=images)


def describe(states: list[ModelState]) -> list[str]:
    """One line per hub model for the driver's log and `mmirage check`."""
    return [f"{s.model.key}: '{s.model.label}' {s.detail}" for s in states]
