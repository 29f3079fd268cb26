"""Benchmark figures: phase timers, GPU allocation, and the seed page's formulas.

Output tokens are completion tokens. Per-GPU rates use the GPUs the job *holds*, not the
engine's tp_size, and a null (not 0 or infinity) where no GPU was held or nothing ran.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from datetime import datetime, timezone

SECONDS_PER_DAY = 86400.0


def utc_now() -> str:
    """UTC ISO 8601 timestamp with offset (comparable across hosts and time zones)."""
    return datetime.now(timezone.utc).isoformat()


def parse_time(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp)


def human_duration(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return (f"{days}d " if days else "") + f"{h:02d}:{m:02d}:{s:02d}"


def allocated_gpus(environ=os.environ) -> int:
    """GPUs this job holds: CUDA_VISIBLE_DEVICES when set (the scheduler's allocation), else all NVML sees."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            if not entry.strip() or entry.strip().startswith("-"):
                break  # CUDA hides every device from the first invalid entry on
            count += 1
        return count
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return pynvml.nvmlDeviceGetCount()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: no GPU
        return 0


def _ratio(num: float, den: float) -> float | None:
    return num / den if den > 0 else None


def tokens_per_sec_per_gpu(output_tokens: int, seconds: float, num_gpus: int) -> float | None:
    """output_tokens / (seconds * num_gpus)."""
    return _ratio(output_tokens, seconds * num_gpus)


def gpu_days_per_billion_tokens(output_tokens: int, seconds: float, num_gpus: int) -> float | None:
    """(num_gpus * seconds / 86400) / (output_tokens / 1e9) = 11574.07 / tokens_per_sec_per_gpu."""
    if num_gpus <= 0 or output_tokens <= 0:
        return None
    return (num_gpus * seconds / SECONDS_PER_DAY) / (output_tokens / 1e9)


def rate_figures(output_tokens: int, seconds: float, num_gpus: int) -> dict:
    return {
        "tokens_per_sec": _ratio(output_tokens, seconds),
        "tokens_per_sec_per_gpu": tokens_per_sec_per_gpu(output_tokens, seconds, num_gpus),
        "gpu_days_per_billion_tokens": gpu_days_per_billion_tokens(output_tokens, seconds, num_gpus),
    }


class PhaseTimer:
    """Accumulates monotonic seconds per named phase (load, prepare, generate, write)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        start = time.monotonic()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - start


class InflightTracker:
    """Engine occupancy seen from the runner: generation window, busy time, idle gaps.

    The generation window runs from the first request to the last completion; an idle gap
    is a stretch inside it with no request in flight (the engine waited for Python).
    """

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.inflight = 0
        self.peak = 0
        self.first: float | None = None
        self.last: float | None = None
        self.busy_seconds = 0.0
        self.idle_gaps = 0
        self._busy_since = 0.0

    def submitted(self) -> None:
        now = self.clock()
        if self.inflight == 0:
            if self.first is None:
                self.first = now
            else:
                self.idle_gaps += 1
            self._busy_since = now
        self.inflight += 1
        self.peak = max(self.peak, self.inflight)

    def completed(self) -> None:
        now = self.clock()
        self.inflight -= 1
        if self.inflight == 0:
            self.busy_seconds += now - self._busy_since
        self.last = now

    @property
    def window_seconds(self) -> float:
        if self.first is None or self.last is None:
            return 0.0
        return self.last - self.first

    def summary(self) -> dict:
        busy = self.busy_seconds + (self.clock() - self._busy_since if self.inflight else 0.0)
        return {
            "engine_busy_seconds": busy,
            "engine_idle_seconds": max(0.0, self.window_seconds - busy),
            "engine_idle_gaps": self.idle_gaps,
            "peak_inflight": self.peak,
        }


def wall_rate_figures(output_tokens: int, wall_seconds: float, num_gpus: int) -> dict:
    """The per-GPU figures over the shard's whole wall time: idle allocated GPUs are charged."""
    return {
        "tokens_per_sec_per_gpu_wall": tokens_per_sec_per_gpu(output_tokens, wall_seconds, num_gpus),
        "gpu_days_per_billion_tokens_wall": gpu_days_per_billion_tokens(output_tokens, wall_seconds, num_gpus),
    }


def joules_per_1k_tokens(joules: float | None, output_tokens: int) -> float | None:
    if joules is None or output_tokens <= 0:
        return None
    return joules / (output_tokens / 1000)


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


# --------------------------------------------------------------------------- roofline

# HBM bandwidth in bytes/s by NVML device name, first match wins (order matters: "H100 PCIe"
# before "H100", "H200" before "H20"). Datasheet figures; MIG slices have no entry.
GPU_HBM_BANDWIDTH: list[tuple[str, float]] = [
    (r"\bGH200\b", 4.0e12),
    (r"\bH200\b", 4.8e12),
    (r"\bH100\b.*\bNVL\b", 3.9e12),
    (r"\bH100\b.*\bPCIe\b", 2.0e12),
    (r"\bH100\b", 3.35e12),  # SXM5 (NVML: "NVIDIA H100 80GB HBM3")
    (r"\bH800\b.*\bPCIe\b", 2.0e12),
    (r"\bH800\b", 3.35e12),
    (r"\bH20\b", 4.0e12),
    (r"\bB200\b", 8.0e12),
    (r"\bB100\b", 8.0e12),
    (r"\bA100\b.*80GB.*PCIe|\bA100\b.*PCIe.*80GB", 1.935e12),
    (r"\bA100\b.*80GB", 2.039e12),
    (r"\bA100\b", 1.555e12),  # 40GB
    (r"\bA800\b.*80GB", 2.039e12),
    (r"\bA800\b", 1.555e12),
    (r"\bL40S\b", 0.864e12),
    (r"\bL40\b", 0.864e12),
    (r"\bL4\b", 0.3e12),
    (r"\bA40\b", 0.696e12),
    (r"\bA10G\b", 0.6e12),
    (r"\bA10\b", 0.6e12),
    (r"\bV100\b", 0.9e12),
    (r"RTX 6000 Ada", 0.96e12),
]


def hbm_bandwidth(gpu_name: str | None) -> float | None:
    """Memory bandwidth (bytes/s) of a GPU from its NVML name; None when unknown or a MIG slice."""
    import re

    if not gpu_name or "MIG" in gpu_name:
        return None
    for pattern, bw in GPU_HBM_BANDWIDTH:
        if re.search(pattern, gpu_name, re.IGNORECASE):
            return bw
    return None


def decode_roofline_tokens_per_sec(
    weight_bytes: float, kv_bytes_per_token: float, batch: float, mean_context: float, hbm_bytes_per_sec: float
) -> float:
    """Memory-bound decode ceiling: B / ((weight_bytes + B * mean_ctx * kv_bytes_per_token) / HBM_BW).

    Each decode step reads the weights once and every sequence's KV cache, and yields one
    token per sequence.
    """
    step_bytes = weight_bytes + batch * mean_context * kv_bytes_per_token
    return batch * hbm_bytes_per_sec / step_bytes


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float8_e4m3fn": 1, "fp8": 1, "int8": 1}


def model_memory_facts(model_path: str | os.PathLike | None) -> dict | None:
    """Weight bytes (the safetensors/bin files' sizes) and KV-cache bytes per token of a model dir.

    kv_bytes_per_token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes, from
    config.json. None when the path is not a local model directory.
    """
    from pathlib import Path

    from mirageflow import model_config

    if not model_path:
        return None
    path = Path(model_path)
    if not path.is_dir():
        return None
    files = sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))
    facts: dict = {"path": str(path), "weight_bytes": sum(f.stat().st_size for f in files) or None, "kv_bytes_per_token": None}
    cfg = model_config.read(path)
    if cfg is None:
        return facts
    cfg = model_config.language_config(cfg)  # multimodal configs nest the language model
    layers = cfg.get("num_hidden_layers")
    heads = cfg.get("num_attention_heads")
    kv_heads = cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or (cfg["hidden_size"] // heads if cfg.get("hidden_size") and heads else None)
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    dtype_bytes = _DTYPE_BYTES.get(dtype, 2)
    facts.update(num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    if layers and kv_heads and head_dim:
        facts["kv_bytes_per_token"] = 2 * layers * kv_heads * head_dim * dtype_bytes
    return facts


def roofline_figures(
    model: dict | None, gpu_name: str | None, peak_inflight: int, input_tokens: int, output_tokens: int,
    requests: int, tokens_per_sec_per_gpu: float | None, sequences_per_gpu: float | None = None,
) -> dict:  # fmt: skip
    """Per-shard roofline: the decode ceiling per GPU and the fraction of it reached (or nulls).

    B = sequences in flight per GPU (peak in-flight requests, divided among data-parallel
    replicas by the caller), mean context = input tokens per request + half the output
    tokens per request (the context grows while a sequence decodes).
    """
    empty = {"roofline_tokens_per_sec_per_gpu": None, "roofline_fraction": None, "roofline_batch": None, "roofline_mean_context": None}
    bw = hbm_bandwidth(gpu_name)
    batch = sequences_per_gpu if sequences_per_gpu is not None else peak_inflight
    if not model or not model.get("weight_bytes") or not model.get("kv_bytes_per_token") or bw is None or not requests or not batch:
        return empty
    ctx = input_tokens / requests + output_tokens / requests / 2
    ceiling = decode_roofline_tokens_per_sec(model["weight_bytes"], model["kv_bytes_per_token"], batch, ctx, bw)
    return {
        "roofline_tokens_per_sec_per_gpu": ceiling,
        "roofline_fraction": tokens_per_sec_per_gpu / ceiling if tokens_per_sec_per_gpu is not None else None,
        "roofline_batch": batch,
        "roofline_mean_context": ctx,
    }


# --------------------------------------------------------------------------- token histogram


class TokenHistogram:
    """Compact, mergeable histogram of tokens per row: exact below 16, then 8 buckets per power of two."""

    EXACT = 16
    SUB = 8

    def __init__(self):
        self.counts: dict[int, int] = {}  # bucket low -> rows
        self.rows = 0
        self.sum = 0
        self.min: int | None = None
        self.max: int | None = None
        self._values: dict[int, int] = {}  # exact value -> rows, not yet in the buckets

    @classmethod
    def bucket(cls, value: int) -> tuple[int, int]:
        """[low, high) of the bucket holding value."""
        if value < cls.EXACT:
            return value, value + 1
        power = 1 << (value.bit_length() - 1)
        width = power // cls.SUB
        low = power + (value - power) // width * width
        return low, low + width

    def add(self, value: int) -> None:
        # Called for every row: one dict update. Token counts take few distinct values
        # (at most max_new_tokens + 1), so they are bucketed when the histogram is read.
        self._values[value] = self._values.get(value, 0) + 1

    def _fold(self) -> None:
        for value, n in self._values.items():
            value = max(0, int(value))
            low, _ = self.bucket(value)
            self.counts[low] = self.counts.get(low, 0) + n
            self.rows += n
            self.sum += value * n
            self.min = value if self.min is None else min(self.min, value)
            self.max = value if self.max is None else max(self.max, value)
        self._values.clear()

    def to_json(self) -> dict:
        self._fold()
        return {
            "buckets": [[low, self.bucket(low)[1], n] for low, n in sorted(self.counts.items())],
            "rows": self.rows,
            "sum": self.sum,
            "min": self.min,
            "max": self.max,
            "mean": self.sum / self.rows if self.rows else None,
        }

    @classmethod
    def merge(cls, hists: list[dict | None]) -> dict:
        """Several to_json() results into one."""
        out = cls()
        for h in hists:
            if not h:
                continue
            for low, _high, n in h["buckets"]:
                out.counts[low] = out.counts.get(low, 0) + n
            out.rows += h["rows"]
            out.sum += h["sum"]
            if h["min"] is not None:
                out.min = h["min"] if out.min is None else min(out.min, h["min"])
                out.max = h["max"] if out.max is None else max(out.max, h["max"])
        return out.to_json()
