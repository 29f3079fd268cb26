"""GPU sampling through a fake ``pynvml`` (NVIDIA's real function and error names), with a fake clock."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time
import types
from types import SimpleNamespace

import pytest

from mirageflow.config import ServerArgs
from mirageflow.stats import gpu
from mirageflow.stats import formulas as stats

H200 = "NVIDIA H200"


class FakeNVML(types.ModuleType):
    """``pynvml`` with scripted devices: utilisation values are consumed one per sample."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    class NVMLError_LibraryNotFound(NVMLError):
        pass

    class NVMLError_DriverNotLoaded(NVMLError):
        pass

    class NVMLError_NotFound(NVMLError):
        pass

    class NVMLError_InvalidArgument(NVMLError):
        pass

    def __init__(self, devices: list[dict], init_error: type | None = None, driver: str = "570.86.15"):
        super().__init__("pynvml")
        self.devices = devices
        self.init_error = init_error
        self.driver = driver
        self.inits = self.shutdowns = 0
        self.by_index_calls: list[int] = []
        self.by_uuid_calls: list[str] = []

    def nvmlInit(self):
        if self.init_error is not None:
            raise self.init_error("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlDeviceGetCount(self):
        return sum(1 for d in self.devices if not d.get("mig"))

    def nvmlDeviceGetHandleByIndex(self, i):
        self.by_index_calls.append(i)
        physical = [d for d in self.devices if not d.get("mig")]
        if not 0 <= i < len(physical):
            raise self.NVMLError_InvalidArgument("Invalid Argument")
        return physical[i]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.by_uuid_calls.append(uuid)
        for d in self.devices:
            if d["uuid"] == uuid:
                return d
        raise self.NVMLError_NotFound("Not Found")

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetUtilizationRates(self, h):
        if h.get("mig") or h.get("util") is None:
            raise self.NVMLError_NotSupported("Not Supported")
        values = h["util"]
        value = values[min(h.setdefault("_i", 0), len(values) - 1)]
        h["_i"] += 1
        return SimpleNamespace(gpu=value, memory=0)

    def nvmlDeviceGetMemoryInfo(self, h):
        values = h.get("mem", [0])
        value = values[min(h.setdefault("_m", 0), len(values) - 1)]
        h["_m"] += 1
        return SimpleNamespace(used=value, total=141 * 2**30, free=0)

    def nvmlDeviceGetTotalEnergyConsumption(self, h):
        if h.get("energy") is None:
            raise self.NVMLError_NotSupported("Not Supported")
        values = h["energy"]
        value = values[min(h.setdefault("_e", 0), len(values) - 1)]
        h["_e"] += 1
        return value


def device(uuid, util=(50,), mem=(0,), energy=None, name=H200, mig=False):
    return {"uuid": uuid, "name": name, "util": list(util) if util is not None else None, "mem": list(mem), "energy": energy, "mig": mig}


@pytest.fixture
def nvml(monkeypatch):
    def install(devices, **kw):
        fake = FakeNVML(devices, **kw)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        return fake

    return install


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def sampled(sampler: gpu.GpuSampler, clock: Clock, times: list[float], stop_at: float):
    """Start at clock 0 (first sample), sample at each time, stop at stop_at."""
    clock.now = 0.0
    sampler.start(background=False)
    for t in times:
        clock.now = t
        sampler.sample_now()
    clock.now = stop_at
    sampler.stop()
    return sampler.summary()


# --------------------------------------------------------------------------- means, memory, energy


def test_means_are_time_weighted_not_per_sample(nvml):
    # 100 % for 1 s, 0 % for 3 s, 50 % for 1 s: 150 / 5 = 30 %, where the plain mean says 50 %.
    nvml([device("GPU-a", util=[100, 0, 50], mem=[1 * 2**30, 3 * 2**30, 2 * 2**30], energy=[1_000_000, 1_250_000])])
    clock = Clock()
    s = sampled(gpu.GpuSampler(0.5, environ={}, clock=clock), clock, [1.0, 4.0], 5.0)
    assert s["gpu_util_mean"] == pytest.approx(30.0)
    assert (s["gpu_util_min"], s["gpu_util_max"], s["gpu_util_samples"]) == (0, 100, 3)
    assert s["gpu_sampled_seconds"] == pytest.approx(5.0)
    [g] = s["gpus"]
    assert g["index"] == 0 and g["uuid"] == "GPU-a" and g["name"] == H200
    assert g["memory_used_max_mb"] == pytest.approx(3 * 1024)
    assert g["energy_joules"] == pytest.approx(250.0)  # (1,250,000 - 1,000,000) mJ
    assert s["gpu_energy_joules"] == pytest.approx(250.0)
    assert stats.joules_per_1k_tokens(s["gpu_energy_joules"], 5000) == pytest.approx(50.0)


def test_first_sample_is_taken_at_start(nvml):
    nvml([device("GPU-a", util=[77])])
    clock = Clock()
    sampler = gpu.GpuSampler(0.5, environ={}, clock=clock)
    sampler.start(background=False)
    assert sampler.devices[0].samples == [(0.0, 77.0, 0.0)]
    clock.now = 2.0
    sampler.stop()
    assert sampler.summary()["gpu_util_mean"] == 77.0


def test_all_gpus_pooled_per_gpu_listed(nvml):
    nvml([device("GPU-a", util=[100, 100], energy=[0, 1000]), device("GPU-b", util=[0, 50], energy=[5000, 8000])])
    clock = Clock()
    s = sampled(gpu.GpuSampler(0.5, environ={}, clock=clock), clock, [2.0], 4.0)
    a, b = s["gpus"]
    assert (a["util_mean"], b["util_mean"]) == (100.0, 25.0)
    assert s["gpu_util_mean"] == pytest.approx(62.5)
    assert (s["gpu_util_min"], s["gpu_util_max"], s["gpu_util_samples"]) == (0, 100, 4)
    assert s["gpu_energy_joules"] == pytest.approx(1.0 + 3.0)


def test_background_thread_samples_at_the_interval(nvml):
    nvml([device("GPU-a", util=[10, 20, 30, 40, 50, 60, 70, 80, 90])])
    sampler = gpu.GpuSampler(0.1, environ={})
    sampler.start()
    assert len(sampler.devices[0].samples) == 1  # at once, not one interval later
    time.sleep(0.45)
    sampler.stop()
    n = len(sampler.devices[0].samples)
    assert 3 <= n <= 7
    assert sampler.summary()["gpu_util_samples"] == n
    sampler.stop()  # twice is fine


def test_long_timelines_are_downsampled_keeping_the_mean(nvml):
    utils = [(i * 37) % 101 for i in range(50)]
    nvml([device("GPU-a", util=utils)])
    clock = Clock()
    sampler = gpu.GpuSampler(0.5, environ={}, clock=clock, max_points=8)
    times = [0.5 * i + (0.2 if i % 3 == 0 else 0) for i in range(1, 50)]
    s = sampled(sampler, clock, times, 26.0)
    tl = sampler.timeline_json()
    assert len(tl["t"]) <= 8
    assert sum(tl["duration"]) == pytest.approx(26.0)
    weighted = sum(u * d for u, d in zip(tl["util"][0], tl["duration"])) / sum(tl["duration"])
    assert weighted == pytest.approx(s["gpu_util_mean"], abs=0.05)
    assert tl["gpus"] == [{"index": 0, "uuid": "GPU-a", "name": H200}]


# --------------------------------------------------------------------------- which GPUs


def test_cuda_visible_devices_indices_map_to_nvml_handles(nvml):
    fake = nvml([device("GPU-0"), device("GPU-1"), device("GPU-2"), device("GPU-3")])
    sampler = gpu.GpuSampler(environ={"CUDA_VISIBLE_DEVICES": "2,0"})
    sampler.start(background=False)
    sampler.stop()
    assert [(g["index"], g["uuid"]) for g in sampler.summary()["gpus"]] == [(0, "GPU-2"), (1, "GPU-0")]
    assert fake.by_index_calls[:2] == [2, 0]


def test_cuda_visible_devices_uuids_and_prefixes(nvml):
    fake = nvml([device("GPU-aaaa-1111"), device("GPU-bbbb-2222"), device("GPU-cccc-3333")])
    sampler = gpu.GpuSampler(environ={"CUDA_VISIBLE_DEVICES": "GPU-cccc-3333,GPU-aaaa"})
    sampler.start(background=False)
    sampler.stop()
    assert [g["uuid"] for g in sampler.summary()["gpus"]] == ["GPU-cccc-3333", "GPU-aaaa-1111"]
    assert fake.by_uuid_calls == ["GPU-cccc-3333", "GPU-aaaa"]  # the prefix fell back to a scan


def test_no_cuda_visible_devices_means_every_gpu(nvml):
    nvml([device("GPU-0"), device("GPU-1")])
    sampler = gpu.GpuSampler(environ={})
    sampler.start(background=False)
    sampler.stop()
    assert [g["uuid"] for g in sampler.summary()["gpus"]] == ["GPU-0", "GPU-1"]
    hw = sampler.hardware()
    assert hw["gpu_name"] == H200 and hw["driver_version"] == "570.86.15" and hw["gpu_count"] == 2 and hw["nvml"] is True


def test_cuda_stops_at_the_first_invalid_entry_and_unknown_devices_are_skipped(nvml, caplog):
    nvml([device("GPU-0"), device("GPU-1")])
    assert gpu.visible_entries({"CUDA_VISIBLE_DEVICES": "1,-1,0"}) == ["1"]
    assert gpu.visible_entries({"CUDA_VISIBLE_DEVICES": ""}) == []
    assert gpu.visible_entries({}) is None
    sampler = gpu.GpuSampler(environ={"CUDA_VISIBLE_DEVICES": "1,7"})
    with caplog.at_level(logging.WARNING, logger="mirageflow.stats.gpu"):
        sampler.start(background=False)
        sampler.stop()
    assert [g["uuid"] for g in sampler.summary()["gpus"]] == ["GPU-1"]
    assert "'7' has no NVML device" in caplog.text


# --------------------------------------------------------------------------- nulls, never a crash


def test_mig_device_gives_null_utilisation_and_one_log_line(nvml, caplog):
    nvml([device("GPU-0"), device("MIG-5e2f", name="NVIDIA H100 80GB HBM3 MIG 1g.10gb", mem=[5 * 2**30], mig=True)])
    clock = Clock()
    with caplog.at_level(logging.WARNING, logger="mirageflow.stats.gpu"):
        s = sampled(gpu.GpuSampler(0.5, environ={"CUDA_VISIBLE_DEVICES": "MIG-5e2f"}, clock=clock), clock, [1.0, 2.0], 3.0)
    assert (s["gpu_util_mean"], s["gpu_util_min"], s["gpu_util_max"], s["gpu_util_samples"]) == (None, None, None, None)
    [g] = s["gpus"]
    assert g["uuid"] == "MIG-5e2f" and g["util_mean"] is None and g["samples"] == 0
    assert g["memory_used_max_mb"] == pytest.approx(5 * 1024)  # memory works on MIG
    assert g["energy_joules"] is None and s["gpu_energy_joules"] is None
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1  # once, not once per sample
    assert "not available on NVIDIA H100 80GB HBM3 MIG 1g.10gb" in caplog.text


def test_energy_not_supported_is_null_but_utilisation_is_kept(nvml):
    nvml([device("GPU-0", util=[40], energy=None)])
    clock = Clock()
    s = sampled(gpu.GpuSampler(0.5, environ={}, clock=clock), clock, [1.0], 2.0)
    assert s["gpu_util_mean"] == 40.0 and s["gpu_energy_joules"] is None


@pytest.mark.parametrize("error", ["NVMLError_LibraryNotFound", "NVMLError_DriverNotLoaded"])
def test_no_driver_gives_nulls_and_one_log_line(nvml, caplog, error):
    nvml([], init_error=getattr(FakeNVML, error))
    sampler = gpu.GpuSampler(0.5, environ={})
    with caplog.at_level(logging.INFO, logger="mirageflow.stats.gpu"):
        sampler.start()
        sampler.sample_now()
        sampler.stop()
    s = sampler.summary()
    assert s["gpu_util_mean"] is None and s["gpu_util_samples"] is None and s["gpus"] == []
    assert sampler.timeline_json() is None
    assert len(caplog.records) == 1 and error in caplog.records[0].getMessage()
    hw = sampler.hardware()
    assert hw["nvml"] is False and hw["gpu_name"] is None and hw["driver_version"] is None


def test_no_pynvml_module_gives_nulls_and_one_log_line(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "pynvml", None)
    sampler = gpu.GpuSampler(0.5, environ={})
    with caplog.at_level(logging.INFO, logger="mirageflow.stats.gpu"):
        sampler.start()
        sampler.stop()
    assert sampler.summary()["gpu_util_mean"] is None
    assert len(caplog.records) == 1 and "pynvml" in caplog.records[0].getMessage()


def test_stats_off_records_hardware_without_sampling_or_logging(nvml, caplog):
    fake = nvml([device("GPU-0")])
    sampler = gpu.GpuSampler(0.5, sample=False, environ={})
    with caplog.at_level(logging.INFO, logger="mirageflow.stats.gpu"):
        sampler.start()
        sampler.stop()
    assert sampler.summary()["gpu_util_mean"] is None and sampler.devices[0].samples == []
    assert sampler.hardware()["gpu_name"] == H200
    assert fake.shutdowns == fake.inits == 1
    assert caplog.records == []


# --------------------------------------------------------------------------- in the shard runner


def test_shard_records_gpu_stats_hardware_samples_and_roofline(tmp_path, nvml, monkeypatch):
    from fakes.configs import PLAIN, shard_config
    from fakes.engines import ScriptedEngine

    from mirageflow.shard.runner import run_shard

    nvml([device("GPU-0", util=[90, 80, 70, 60], mem=[70 * 2**30], energy=[0, 120_000, 120_000]), device("GPU-1")])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    model = tmp_path / "qwen3-4b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN3_4B_CONFIG))
    with open(model / "model.safetensors", "wb") as f:  # sparse: the size is what counts
        f.truncate(8_044_936_192)
    cfg = shard_config(tmp_path, [{"q": f"r{i}"} for i in range(6)], PLAIN)
    object.__setattr__(cfg, "stats", True)
    object.__setattr__(cfg, "processors", {"llm": dataclasses.replace(cfg.processors["llm"], server_args=ServerArgs(str(model)))})
    status = run_shard(cfg, 0, engine_factory=lambda p, b, **kw: ScriptedEngine(lambda p: "one two three"))
    st = status["stats"]
    assert st["num_gpus"] == 1
    assert st["gpu_util_mean"] is not None and 60 <= st["gpu_util_mean"] <= 90 and st["gpu_util_samples"] >= 1
    assert [g["uuid"] for g in st["gpus"]] == ["GPU-0"]  # only the held GPU
    assert st["gpus"][0]["memory_used_max_mb"] == pytest.approx(70 * 1024)
    assert st["gpu_energy_joules"] == pytest.approx(120.0)
    assert st["joules_per_1k_output_tokens"] == pytest.approx(120.0 / (st["output_tokens"] / 1000))
    assert st["tokens_per_sec_per_gpu_wall"] == pytest.approx(st["output_tokens"] / st["runtime_seconds"])
    assert status["hardware"]["gpu_name"] == H200 and status["hardware"]["driver_version"] == "570.86.15"
    assert status["model"]["llm"]["kv_bytes_per_token"] == 147_456
    # roofline: the formula with the shard's own batch and context, on an H200
    expected = stats.decode_roofline_tokens_per_sec(8_044_936_192, 147_456, st["roofline_batch"], st["roofline_mean_context"], 4.8e12)
    assert st["roofline_tokens_per_sec_per_gpu"] == pytest.approx(expected)
    assert st["roofline_fraction"] == pytest.approx(st["tokens_per_sec_per_gpu"] / expected)
    assert st["roofline_mean_context"] == pytest.approx(st["input_tokens"] / st["requests"] + st["output_tokens"] / st["requests"] / 2)
    samples = json.loads((cfg.shard_dir(0) / "gpu_samples.json").read_text())
    assert samples["shard_id"] == 0 and samples["gpus"][0]["uuid"] == "GPU-0" and samples["util"][0][0] == 90
    assert st["output_tokens_per_row_hist"]["rows"] == 6 and st["output_tokens_per_row_hist"]["mean"] == 3


QWEN3_4B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "torch_dtype": "bfloat16",
}
