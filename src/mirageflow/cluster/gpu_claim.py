"""A shard job claims its own GPU(s) when it sees more than it asked for.

Snakemake assigns no GPU ids to jobs: a local run with ``--cores 8 --resources gpu=8`` on
an 8-GPU node, or several shard jobs in one SLURM allocation, starts shard jobs that all see
every GPU of the node (or allocation), and every engine would pick the first one. So before
its engine is imported, a shard job that sees more GPUs than it needs (``execution_params.gpus``,
else ``tp_size x dp_size``) claims that many: it takes an exclusive ``flock`` on
``<lock dir>/mirageflow-gpu-<GPU>.lock`` for the first free ones among the visible GPUs, in
order, and sets ``CUDA_VISIBLE_DEVICES`` to them. The engine, ``stats.allocated_gpus``
(num_gpus in the report) and the NVML sampler (mirageflow.stats.gpu) then see only the claimed
GPUs. The locks belong to the process: the kernel releases them when it exits, however it
exits (no stale claims after a crash or SIGKILL).

- The lock directory is ``$MIRAGEFLOW_GPU_LOCK_DIR``, default ``/tmp``: node-local, shared
  by every job on the node (other runs and other users' mirageflow jobs included; files
  are created world-writable).
- A GPU is named in the lock by its NVML UUID when NVML can tell it (``GPU-...``, the same
  whatever ``CUDA_VISIBLE_DEVICES`` numbering a job sees), else by its
  ``CUDA_VISIBLE_DEVICES`` entry, prefixed with ``$SLURM_JOB_ID`` inside a SLURM job
  (two allocations on one node may both number their own GPUs from 0).
- With ``CUDA_VISIBLE_DEVICES`` unset the visible GPUs are NVML's, and the claim sets the
  variable to their UUIDs (an index would depend on ``CUDA_DEVICE_ORDER``).
- No GPU free (a claim of 2 needs 2 free at once; a partial set is never held while
  waiting): it retries every second for ``$MIRAGEFLOW_GPU_CLAIM_WAIT`` seconds (default
  120; a shard of the same allocation may be finishing), then fails naming the holders.
- Nothing is claimed when the job sees as many GPUs as it asked for or fewer (SLURM gave it
  exactly its own), or asks for none.

Called by the shard job's entry point (mirageflow.jobs.run_shard) after reading the config
and before the shard runner starts: ``claim_for_shard(cfg)``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import re
import socket
import time
from pathlib import Path
from typing import Callable, MutableMapping, Sequence

from mirageflow.config.types import PipelineConfig
from mirageflow.errors import MirageflowError

log = logging.getLogger(__name__)

LOCK_DIR_ENV = "MIRAGEFLOW_GPU_LOCK_DIR"
WAIT_ENV = "MIRAGEFLOW_GPU_CLAIM_WAIT"
DEFAULT_LOCK_DIR = "/tmp"
DEFAULT_WAIT_SECONDS = 120.0
LOCK_PREFIX = "mirageflow-gpu-"

_HELD: list["GpuClaim"] = []  # the process's claim: its locks live as long as the process


class GpuClaimError(MirageflowError, RuntimeError):
    pass


class GpuClaim:
    """Exclusive flocks on ``count`` GPUs; ``devices`` are their CUDA_VISIBLE_DEVICES entries."""

    def __init__(self, devices: list[str], keys: list[str], paths: list[Path], fds: list[int]):
        self.devices, self.keys, self.paths, self._fds = devices, keys, paths, fds

    def release(self) -> None:
        for fd in self._fds:
            try:
                os.close(fd)  # closing the only descriptor drops the flock
            except OSError:
                pass
        self._fds = []

    def __enter__(self) -> "GpuClaim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"GpuClaim(devices={self.devices}, locks={[str(p) for p in self.paths]})"


def lock_path(lock_dir: str | os.PathLike, key: str) -> Path:
    return Path(lock_dir) / f"{LOCK_PREFIX}{re.sub(r'[^A-Za-z0-9._-]', '_', key)}.lock"


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive flock on ``path``, or None when another holds it."""
    old = os.umask(0)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    finally:
        os.umask(old)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fd


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return "unknown"
    job = f", SLURM job {info['slurm_job_id']}" if info.get("slurm_job_id") else ""
    return f"host {info.get('hostname')} pid {info.get('pid')}{job}"


def _record(fd: int, device: str) -> None:
    """Who holds the lock, for the error message of a job that finds no free GPU."""
    info = {
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "device": device,
        "since": time.time(),
    }
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    except OSError:
        pass  # the lock is what matters


def claim_gpus(
    visible: Sequence[str],
    count: int,
    lock_dir: str | os.PathLike = DEFAULT_LOCK_DIR,
    *,
    keys: Sequence[str] | None = None,
    wait_seconds: float = 0.0,
    poll_seconds: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> GpuClaim:
    """Lock the first ``count`` free GPUs of ``visible`` (CUDA_VISIBLE_DEVICES entries), in order.

    ``keys`` name the GPUs in the lock files (default: the entries themselves). Only a full
    set is kept: when fewer than ``count`` are free, whatever was locked is released, and
    the claim retries every ``poll_seconds`` until ``wait_seconds`` have passed, then
    raises GpuClaimError naming the holders.
    """
    visible = list(visible)
    keys = list(keys) if keys is not None else visible
    if len(keys) != len(visible):
        raise ValueError("keys must name every visible GPU")
    if not 1 <= count <= len(visible):
        raise ValueError(f"cannot claim {count} GPU(s) among {len(visible)} visible")
    Path(lock_dir).mkdir(parents=True, exist_ok=True)
    deadline = clock() + wait_seconds
    while True:
        held: list[tuple[str, str, Path, int]] = []
        for entry, key in zip(visible, keys):
            path = lock_path(lock_dir, key)
            fd = _try_lock(path)
            if fd is not None:
                held.append((entry, key, path, fd))
                if len(held) == count:
                    break
        if len(held) == count:
            for entry, _, _, fd in held:
                _record(fd, entry)
            return GpuClaim([h[0] for h in held], [h[1] for h in held], [h[2] for h in held], [h[3] for h in held])
        for *_, fd in held:  # never sit on a partial set: two 2-GPU claims could block each other
            os.close(fd)
        if clock() >= deadline:
            taken = [f"{entry} ({_holder(lock_path(lock_dir, key))})" for entry, key in zip(visible, keys)
                     if key not in {h[1] for h in held}]  # fmt: skip
            raise GpuClaimError(
                f"no {count} free GPU(s) among the {len(visible)} visible ({', '.join(visible)}) after "
                f"{wait_seconds:.0f}s; held: {', '.join(taken) or 'none'} (locks in {lock_dir}, ${LOCK_DIR_ENV})"
            )
        sleep(poll_seconds)


# --------------------------------------------------------------------------- the job's GPUs


def _nvml():
    """The initialised pynvml module, or None (no module, no driver)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml
    except Exception:
        return None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible_gpus(environ: MutableMapping[str, str], nvml=None) -> tuple[list[str], list[str]]:
    """(the job's GPUs as CUDA_VISIBLE_DEVICES entries, the lock key of each).

    From CUDA_VISIBLE_DEVICES when set (up to CUDA's first invalid entry), else every GPU
    NVML sees, named by UUID. Keys are NVML UUIDs where NVML resolves the entry, else the
    entry itself (prefixed ``slurm<job id>-`` inside a SLURM job).
    """
    from mirageflow.stats.gpu import visible_entries

    nvml = nvml or None  # False: do not ask NVML (tests)
    entries = visible_entries(environ)
    if entries is None:
        if nvml is None:
            return [], []
        try:
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
            uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        except Exception:
            return [], []
        return uuids, list(uuids)
    keys = []
    scope = f"slurm{environ['SLURM_JOB_ID']}-" if environ.get("SLURM_JOB_ID") else ""
    for entry in entries:
        key = entry if entry.startswith(("GPU-", "MIG-")) else None
        if key is None and nvml is not None and entry.isdigit():
            try:
                key = _text(nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(int(entry))))
            except Exception:
                key = None
        keys.append(key or scope + entry)
    return entries, keys


def claim_for_job(
    count: int,
    environ: MutableMapping[str, str] | None = None,
    *,
    lock_dir: str | os.PathLike | None = None,
    wait_seconds: float | None = None,
    nvml=None,
    **kwargs,
) -> GpuClaim | None:
    """Claim ``count`` GPUs when more are visible, and point CUDA_VISIBLE_DEVICES at them.

    Returns the claim (also kept for the life of the process), or None when there was
    nothing to claim. ``nvml`` is for tests (False: no NVML); by default pynvml is used
    when it works.
    """
    environ = os.environ if environ is None else environ
    if count < 1:
        return None
    own = nvml is None
    if own:
        nvml = _nvml()
    try:
        visible, keys = visible_gpus(environ, nvml)
    finally:
        if own and nvml is not None:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass
    if len(visible) <= count:
        return None
    lock_dir = lock_dir or environ.get(LOCK_DIR_ENV) or DEFAULT_LOCK_DIR
    if wait_seconds is None:
        wait_seconds = float(environ.get(WAIT_ENV, DEFAULT_WAIT_SECONDS))
    claim = claim_gpus(visible, count, lock_dir, keys=keys, wait_seconds=wait_seconds, **kwargs)
    previous = environ.get("CUDA_VISIBLE_DEVICES")
    environ["CUDA_VISIBLE_DEVICES"] = ",".join(claim.devices)
    _HELD.append(claim)
    log.info(
        "claimed GPU(s) %s of %d visible (CUDA_VISIBLE_DEVICES was %s); locks %s",
        ",".join(claim.devices), len(visible), "unset" if previous is None else repr(previous),
        ", ".join(str(p) for p in claim.paths),
    )  # fmt: skip
    return claim


def claim_for_shard(cfg: PipelineConfig, environ: MutableMapping[str, str] | None = None, **kwargs) -> GpuClaim | None:
    """``claim_for_job`` with the shard's GPU count (execution_params.gpus, else tp_size x dp_size)."""
    from mirageflow.cluster.resources import shard_gpus

    return claim_for_job(shard_gpus(cfg), environ, **kwargs)
