"""GPU utilisation, memory and energy of the GPUs a job holds, sampled through NVML.

``GpuInventory`` resolves the job's GPUs (``CUDA_VISIBLE_DEVICES`` entries: integer indices,
or ``GPU-...``/``MIG-...`` UUIDs through ``nvmlDeviceGetHandleByUUID``; unset = every GPU;
NVML itself ignores that variable) and records their names and the driver version;
``GpuSampler`` uses it and, when sampling is on, polls them from a thread: the first sample right at ``start()``, then every
``interval`` seconds until ``stop()``.

Means are time-weighted: each sample stands for the time until the next one (the last
one until ``stop()``), so a late or skipped tick does not skew them. Energy is the
difference of ``nvmlDeviceGetTotalEnergyConsumption`` (mJ) between start and stop.

Nothing here fails a job: no ``pynvml`` module, no driver (``NVMLError_LibraryNotFound``,
``NVMLError_DriverNotLoaded``), MIG devices or ``NVMLError_NotSupported`` give nulls and
one log line each.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

log = logging.getLogger(__name__)

MIB = 1024 * 1024
DEFAULT_MAX_POINTS = 2000  # timeline points kept for plots; older ones are merged pairwise


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible_entries(environ: Mapping[str, str]) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (None when unset); CUDA stops at the first invalid entry."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return None
    entries = []
    for entry in visible.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        entries.append(entry)
    return entries


@dataclass
class _Device:
    index: int  # as the job sees it: cuda:<index>
    entry: str  # the CUDA_VISIBLE_DEVICES entry (or the NVML index when the variable is unset)
    handle: Any
    uuid: str | None = None
    name: str | None = None
    util_supported: bool = True
    memory_supported: bool = True
    energy_start_mj: int | None = None
    energy_joules: float | None = None
    # samples: (time, util %, memory MiB); util/memory None where unsupported
    samples: list[tuple[float, float | None, float | None]] = field(default_factory=list)


class _Timeline:
    """Per-GPU utilisation over time for plots, bounded: pairs of points merge when it grows.

    Each point is (start offset s, duration s, util % per GPU, memory MiB per GPU), the
    values averaged over the point's duration.
    """

    def __init__(self, n: int, max_points: int):
        self.n, self.max_points = n, max(2, max_points)
        self.points: list[list] = []

    def add(self, t: float, duration: float, utils: list, mems: list) -> None:
        self.points.append([t, duration, list(utils), list(mems)])
        if len(self.points) > self.max_points:
            merged = []
            for i in range(0, len(self.points) - 1, 2):
                merged.append(self._merge(self.points[i], self.points[i + 1]))
            if len(self.points) % 2:
                merged.append(self.points[-1])
            self.points = merged

    @staticmethod
    def _merge(a: list, b: list) -> list:
        da, db = a[1], b[1]
        total = da + db

        def avg(x, y):
            if x is None or y is None:
                return x if y is None else y
            return (x * da + y * db) / total if total > 0 else (x + y) / 2

        return [a[0], total, [avg(x, y) for x, y in zip(a[2], b[2])], [avg(x, y) for x, y in zip(a[3], b[3])]]


class GpuInventory:
    """The job's GPUs as NVML sees them (``CUDA_VISIBLE_DEVICES`` in ``environ`` resolved), the
    driver version, and why there is nothing to sample (``unavailable``); ``close`` releases NVML."""

    def __init__(self, environ: Mapping[str, str]):
        self.environ = environ
        self.nvml = None  # the pynvml module once initialised
        self.devices: list[_Device] = []
        self.driver_version: str | None = None
        self.unavailable: str | None = None  # why there are no samples
        self.nvml_ok = False  # nvmlInit succeeded

    def open(self) -> bool:
        """Start NVML and resolve the job's GPUs; False when NVML is not there (``unavailable`` says why)."""
        try:
            import pynvml
        except ImportError as e:
            self.unavailable = f"the pynvml module (nvidia-ml-py) is not installed: {e}"
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:  # LibraryNotFound, DriverNotLoaded, ...
            self.unavailable = f"NVML is not available ({type(e).__name__}: {e})"
            return False
        except Exception as e:  # a broken library must not fail the shard either
            self.unavailable = f"NVML failed to start ({type(e).__name__}: {e})"
            return False
        self.nvml = pynvml
        self.nvml_ok = True
        try:
            self.driver_version = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            pass
        self.devices = self._resolve()
        if not self.devices:
            self.unavailable = self.unavailable or "no GPU is visible to this job"
        return True

    def _resolve(self) -> list[_Device]:
        nv = self.nvml
        entries = visible_entries(self.environ)
        if entries is None:
            try:
                entries = [str(i) for i in range(nv.nvmlDeviceGetCount())]
            except nv.NVMLError as e:
                self.unavailable = f"cannot count GPUs ({type(e).__name__}: {e})"
                return []
        devices = []
        for position, entry in enumerate(entries):
            try:
                handle = self._handle(entry)
            except (nv.NVMLError, ValueError) as e:
                log.warning("GPU sampling: CUDA_VISIBLE_DEVICES entry %r has no NVML device (%s); not sampled", entry, e)
                continue
            dev = _Device(position, entry, handle)
            for attr, fn in (("uuid", "nvmlDeviceGetUUID"), ("name", "nvmlDeviceGetName")):
                try:
                    setattr(dev, attr, _text(getattr(nv, fn)(handle)))
                except nv.NVMLError:
                    pass
            devices.append(dev)
        return devices

    def _handle(self, entry: str):
        nv = self.nvml
        if entry.startswith(("GPU-", "MIG-")):
            try:
                return nv.nvmlDeviceGetHandleByUUID(entry)
            except nv.NVMLError:
                # CUDA also accepts a unique UUID prefix; NVML wants the whole UUID.
                for i in range(nv.nvmlDeviceGetCount()):
                    handle = nv.nvmlDeviceGetHandleByIndex(i)
                    if _text(nv.nvmlDeviceGetUUID(handle)).startswith(entry):
                        return handle
                raise
        # An integer is an NVML (PCI bus) index; CUDA's own order matches it only with
        # CUDA_DEVICE_ORDER=PCI_BUS_ID, which is what schedulers assume when they set indices.
        return nv.nvmlDeviceGetHandleByIndex(int(entry))

    def close(self) -> None:
        if self.nvml is not None:
            try:
                self.nvml.nvmlShutdown()
            except Exception:
                pass
            self.nvml = None


class GpuSampler:
    """Samples the job's GPUs in a thread; ``summary()`` gives status.json's GPU stats.

    ``sample=False`` only records the GPUs' names and the driver version (no thread).
    ``clock`` and ``background=False`` (then call ``sample_now()`` yourself) are for tests.
    """

    def __init__(
        self,
        interval: float = 0.5,
        *,
        sample: bool = True,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_points: int = DEFAULT_MAX_POINTS,
    ):
        self.interval = float(interval)
        self.sample_enabled = sample
        self.environ = os.environ if environ is None else environ
        self.clock = clock
        self.max_points = max_points
        self.gpus = GpuInventory(self.environ)  # which GPUs, through which NVML
        self.t_start: float | None = None
        self.t_stop: float | None = None
        self.started_at: str | None = None
        self.timeline: _Timeline | None = None
        self._last_tick: tuple[float, list, list] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    @property
    def devices(self) -> list[_Device]:
        """The GPUs sampled (GpuInventory's, known after ``start``)."""
        return self.gpus.devices

    def _warn_once(self, key: str, message: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    # ------------------------------------------------------------------ sampling

    def start(self, background: bool = True) -> None:
        from mirageflow.stats.formulas import utc_now

        opened = self.gpus.open()
        if not (opened and self.sample_enabled and self.devices):
            if self.sample_enabled:  # one line, then nulls
                log.warning("GPU sampling off: %s; GPU figures are null", self.gpus.unavailable)
            self.gpus.close()
            return
        nv = self.gpus.nvml
        for dev in self.devices:
            try:
                dev.energy_start_mj = int(nv.nvmlDeviceGetTotalEnergyConsumption(dev.handle))
            except nv.NVMLError as e:  # MIG slices have no energy counter: their utilisation line says so
                if dev.entry.startswith("MIG-") or "MIG" in (dev.name or ""):
                    log.debug("no energy counter on %s: %s", dev.entry, e)
                else:
                    self._warn_once("energy", "GPU energy not measured on %s: %s", dev.name or dev.entry, e)
        self.timeline = _Timeline(len(self.devices), self.max_points)
        self.started_at = utc_now()
        self.t_start = self.clock()
        self.sample_now()  # the first sample at once, not one interval later
        if background:
            self._thread = threading.Thread(target=self._loop, name="gpu-sampler", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.sample_now()
            except Exception:  # never let the sampler kill anything; keep the samples so far
                log.exception("GPU sampling failed; stopping the sampler")
                return

    def sample_now(self) -> None:
        nv = self.gpus.nvml
        if nv is None or not self.devices:
            return
        t = self.clock()
        utils, mems = [], []
        for dev in self.devices:
            util = mem = None
            if dev.util_supported:
                try:
                    util = float(nv.nvmlDeviceGetUtilizationRates(dev.handle).gpu)
                except nv.NVMLError as e:
                    if (
                        isinstance(e, getattr(nv, "NVMLError_NotSupported", ()))
                        or "MIG" in (dev.name or "")
                        or dev.entry.startswith("MIG-")
                    ):
                        dev.util_supported = False
                        self._warn_once(
                            f"util:{dev.entry}", "GPU utilisation and energy are not available on %s (%s; MIG slices have neither): null",
                            dev.name or dev.entry, e,
                        )  # fmt: skip
                    else:  # a transient failure: skip this sample
                        self._warn_once(f"utilerr:{dev.entry}", "GPU utilisation sample failed on %s: %s", dev.name or dev.entry, e)
            if dev.memory_supported:
                try:
                    mem = nv.nvmlDeviceGetMemoryInfo(dev.handle).used / MIB
                except nv.NVMLError as e:
                    dev.memory_supported = False
                    self._warn_once(f"mem:{dev.entry}", "GPU memory not available on %s: %s", dev.name or dev.entry, e)
            utils.append(util)
            mems.append(mem)
        with self._lock:
            for dev, util, mem in zip(self.devices, utils, mems):
                if util is not None or mem is not None:
                    dev.samples.append((t, util, mem))
            self._tick(t, utils, mems)

    def _tick(self, t: float, utils: list, mems: list) -> None:
        """Close the previous timeline point (it lasts until this tick)."""
        if self._last_tick is not None:
            t0, u0, m0 = self._last_tick
            self.timeline.add(t0 - self.t_start, t - t0, u0, m0)
        self._last_tick = (t, utils, mems)

    def stop(self) -> None:
        """Stop sampling; read the energy counters; release NVML. Safe to call twice."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join(timeout=max(5.0, 2 * self.interval))
            self._thread = None
        if self.gpus.nvml is None:
            return
        nv = self.gpus.nvml
        self.t_stop = self.clock()
        with self._lock:
            if self._last_tick is not None:
                self._tick(self.t_stop, [], [])
                self._last_tick = None
        for dev in self.devices:
            if dev.energy_start_mj is None:
                continue
            try:
                dev.energy_joules = (int(nv.nvmlDeviceGetTotalEnergyConsumption(dev.handle)) - dev.energy_start_mj) / 1000.0
            except nv.NVMLError:
                pass
        self.gpus.close()

    # ------------------------------------------------------------------ results

    def _device_stats(self, dev: _Device) -> dict:
        end = self.t_stop if self.t_stop is not None else self.clock()
        util = [(t, u) for t, u, _ in dev.samples if u is not None]
        weighted = total = 0.0
        for i, (t, u) in enumerate(util):
            nxt = util[i + 1][0] if i + 1 < len(util) else end
            weighted += u * max(0.0, nxt - t)
            total += max(0.0, nxt - t)
        mems = [m for _, _, m in dev.samples if m is not None]
        values = [u for _, u in util]
        if values:
            mean = weighted / total if total > 0 else sum(values) / len(values)
        else:
            mean = None
        return {
            "index": dev.index,
            "uuid": dev.uuid,
            "name": dev.name,
            "util_mean": mean,
            "util_min": min(values) if values else None,
            "util_max": max(values) if values else None,
            "samples": len(values),
            "sampled_seconds": total if values else None,
            "memory_used_max_mb": max(mems) if mems else None,
            "energy_joules": dev.energy_joules,
        }

    def summary(self) -> dict:
        """status.json's GPU figures: over all held GPUs, then per GPU (nulls when not sampled)."""
        with self._lock:
            gpus = [self._device_stats(d) for d in self.devices] if self.t_start is not None else []
        sampled = [g for g in gpus if g["util_mean"] is not None]
        weight = sum(g["sampled_seconds"] or 0 for g in sampled)
        if sampled:
            if weight > 0:
                mean = sum(g["util_mean"] * (g["sampled_seconds"] or 0) for g in sampled) / weight
            else:
                mean = sum(g["util_mean"] for g in sampled) / len(sampled)
        else:
            mean = None
        energies = [g["energy_joules"] for g in gpus]
        mems = [g["memory_used_max_mb"] for g in gpus if g["memory_used_max_mb"] is not None]
        return {
            "gpu_util_mean": mean,
            "gpu_util_min": min((g["util_min"] for g in sampled), default=None),
            "gpu_util_max": max((g["util_max"] for g in sampled), default=None),
            "gpu_util_samples": sum(g["samples"] for g in sampled) if sampled else None,
            "gpu_sampled_seconds": max((g["sampled_seconds"] for g in sampled), default=None),
            "gpu_sample_interval_seconds": self.interval if self.t_start is not None else None,
            "gpu_memory_used_max_mb": max(mems, default=None),
            "gpu_energy_joules": sum(energies) if energies and all(e is not None for e in energies) else None,
            "gpus": gpus,
        }

    def hardware(self) -> dict:
        """GPU names and the driver version, for status.json's ``hardware`` block."""
        names = [d.name for d in self.devices if d.name]
        return {
            "gpu_name": names[0] if names and len(set(names)) == 1 else (", ".join(sorted(set(names))) or None),
            "gpu_count": len(self.devices),
            "gpus": [{"index": d.index, "uuid": d.uuid, "name": d.name} for d in self.devices],
            "driver_version": self.gpus.driver_version,
            "cuda_visible_devices": self.environ.get("CUDA_VISIBLE_DEVICES"),
            "nvml": self.gpus.nvml_ok,
            "nvml_unavailable_reason": self.gpus.unavailable,
        }

    def timeline_json(self) -> dict | None:
        """The utilisation timeline (gpu_samples.json), or None when nothing was sampled."""
        with self._lock:
            if self.timeline is None or not self.timeline.points:
                return None
            points = list(self.timeline.points)
        return {
            "started_at": self.started_at,
            "interval_seconds": self.interval,
            "gpus": [{"index": d.index, "uuid": d.uuid, "name": d.name} for d in self.devices],
            "t": [round(p[0], 3) for p in points],
            "duration": [round(p[1], 3) for p in points],
            "util": [[None if p[2][i] is None else round(p[2][i], 2) for p in points] for i in range(len(self.devices))],
            "memory_used_mb": [[None if p[3][i] is None else round(p[3][i], 1) for p in points] for i in range(len(self.devices))],
        }
