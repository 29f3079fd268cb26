"""Benchmark formulas, GPU allocation, durations, and the run report (metrics.json, summary.md)."""

from __future__ import annotations

import json
import sys
from datetime import timezone

import pytest

from mirageflow.report import aggregate as report
from mirageflow.state.remaining import gpu_hours_remaining
from mirageflow.state.shards import ShardState, shard_states
from mirageflow.stats import formulas as stats
from mirageflow.files import atomic_write_json

# --------------------------------------------------------------------------- formulas


def test_tokens_per_sec_per_gpu_by_hand():
    assert stats.tokens_per_sec_per_gpu(1_000_000, 100.0, 2) == pytest.approx(5000.0)
    assert stats.tokens_per_sec_per_gpu(1_000_000, 100.0, 1) == pytest.approx(10000.0)


def test_gpu_days_per_billion_tokens_by_hand():
    # 2 GPUs x 100 s = 200 GPU-s = 0.0023148 GPU-days for 1e6 tokens -> x1000 for 1e9
    assert stats.gpu_days_per_billion_tokens(1_000_000, 100.0, 2) == pytest.approx(2.3148148, rel=1e-6)


def test_the_two_figures_multiply_to_a_constant():
    for tokens, seconds, gpus in [(1_000_000, 100.0, 2), (12345, 7.5, 8), (10**9, 86400.0, 4)]:
        product = stats.tokens_per_sec_per_gpu(tokens, seconds, gpus) * stats.gpu_days_per_billion_tokens(tokens, seconds, gpus)
        assert product == pytest.approx(1e9 / 86400)  # 11574.07


def test_seed_page_example_is_6_26_gpu_days_not_0_63():
    rate = 1850.3  # tok/s/GPU: one GPU producing 1850.3 tokens per second for 1000 s
    days = stats.gpu_days_per_billion_tokens(int(rate * 1000), 1000.0, 1)
    assert days == pytest.approx(6.255, abs=0.001)
    assert round(days, 2) == 6.26
    assert days != pytest.approx(0.63, abs=0.1)


def test_no_gpu_gives_none_not_zero_or_infinity():
    assert stats.tokens_per_sec_per_gpu(1000, 10.0, 0) is None
    assert stats.gpu_days_per_billion_tokens(1000, 10.0, 0) is None


def test_no_time_or_no_tokens():
    assert stats.tokens_per_sec_per_gpu(1000, 0.0, 2) is None
    assert stats.tokens_per_sec_per_gpu(0, 10.0, 1) == 0
    assert stats.gpu_days_per_billion_tokens(0, 10.0, 1) is None


def test_rate_figures():
    figures = stats.rate_figures(1_000_000, 100.0, 2)
    assert figures["tokens_per_sec"] == pytest.approx(10000.0)
    assert figures["tokens_per_sec_per_gpu"] == pytest.approx(5000.0)
    assert figures["gpu_days_per_billion_tokens"] == pytest.approx(2.3148148, rel=1e-6)
    assert stats.rate_figures(100, 1.0, 0) == {"tokens_per_sec": 100.0, "tokens_per_sec_per_gpu": None, "gpu_days_per_billion_tokens": None}


# --------------------------------------------------------------------------- GPUs, durations, timers


@pytest.mark.parametrize(
    "visible, expected",
    [("0,1", 2), ("GPU-abc,GPU-def", 2), ("3", 1), ("", 0), ("-1", 0), (" 0 , 1 ,", 2), ("0,1,2,3,4,5,6,7", 8)],
)
def test_allocated_gpus_from_cuda_visible_devices(visible, expected):
    assert stats.allocated_gpus({"CUDA_VISIBLE_DEVICES": visible}) == expected


def test_allocated_gpus_without_nvml_is_zero(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails as on a machine without the library
    assert stats.allocated_gpus({}) == 0


@pytest.mark.parametrize(
    "seconds, text",
    [
        (None, None),
        (0, "00:00:00"),
        (59.4, "00:00:59"),
        (59.6, "00:01:00"),
        (3661, "01:01:01"),
        (86399, "23:59:59"),
        (86400 + 3723, "1d 01:02:03"),
        (3 * 86400, "3d 00:00:00"),
    ],
)
def test_human_duration(seconds, text):
    assert stats.human_duration(seconds) == text


def test_utc_now_has_an_offset():
    assert stats.parse_time(stats.utc_now()).utcoffset() == timezone.utc.utcoffset(None)


def test_phase_timer_accumulates(monkeypatch):
    clock = iter([10.0, 12.5, 20.0, 21.0, 30.0, 30.25])
    monkeypatch.setattr(stats.time, "monotonic", lambda: next(clock))
    timer = stats.PhaseTimer()
    with timer.phase("generate"):
        pass
    with timer.phase("generate"):
        pass
    with pytest.raises(KeyError):
        with timer.phase("write"):
            raise KeyError("timed even when it fails")
    assert timer.seconds == {"generate": 3.5, "write": 0.25}


# --------------------------------------------------------------------------- report


def shard_status(shard_id, started, finished, runtime, load, inference, rows, in_tok, out_tok, gpus, failed=0, num_shards=3):
    return {
        "shard_id": shard_id,
        "num_shards": num_shards,
        "status": "success",
        "hostname": f"node{shard_id}",
        "started_at": started,
        "finished_at": finished,
        "stats": {
            "runtime_seconds": runtime,
            "model_load_seconds": load,
            "inference_runtime_seconds": inference,
            "rows_processed": rows,
            "rows_failed": failed,
            "input_tokens": in_tok,
            "output_tokens": out_tok,
            "num_gpus": gpus,
            "tokens_per_sec": out_tok / inference,
        },
    }


# Shard 0 runs 10:00-10:10 UTC. Shard 1 started in a +02:00 zone: 11:55+02:00 is 09:55 UTC,
# *before* shard 0, although its string sorts after; it ends 12:20+02:00 = 10:20 UTC.
SHARD_0 = shard_status(0, "2025-01-01T10:00:00+00:00", "2025-01-01T10:10:00+00:00", 600.0, 60.0, 500.0, 100, 50_000, 1_000_000, 2, failed=3)
SHARD_1 = shard_status(1, "2025-01-01T11:55:00+02:00", "2025-01-01T12:20:00+02:00", 1500.0, 100.0, 1200.0, 300, 70_000, 2_000_000, 1)


def test_aggregate_two_shards():
    agg = report.aggregate([SHARD_0, SHARD_1], 3, [2])
    assert agg["total_shards"] == 3
    assert agg["completed_shards"] == 2
    assert agg["missing_shards"] == [2]
    # 09:55 UTC to 10:20 UTC; comparing the strings would give 10:00 -> 10:20 = 1200 s
    assert agg["wall_clock_runtime_seconds"] == 1500.0
    assert agg["wall_clock_runtime_human"] == "00:25:00"
    assert agg["sum_shard_runtime_seconds"] == 2100.0
    assert agg["sum_shard_runtime_human"] == "00:35:00"
    assert (agg["min_shard_runtime_seconds"], agg["max_shard_runtime_seconds"]) == (600.0, 1500.0)
    assert (agg["min_shard_runtime_human"], agg["max_shard_runtime_human"]) == ("00:10:00", "00:25:00")
    assert agg["total_rows_processed"] == 400
    assert agg["total_rows_failed"] == 3
    assert agg["overall_throughput_rows_per_sec"] == pytest.approx(400 / 1500)
    assert agg["total_input_tokens"] == 120_000
    assert agg["total_output_tokens"] == 3_000_000
    assert agg["sum_model_load_seconds"] == 160.0
    assert agg["sum_inference_runtime_seconds"] == 1700.0
    assert agg["num_gpus"] == 2
    assert agg["mean_gpu_util_pct"] is None


def test_aggregate_generation_time_gpu_figures():
    agg = report.aggregate([SHARD_0, SHARD_1], 3, [2])
    gpu_gen_seconds = 2 * 500.0 + 1 * 1200.0  # each shard's GPUs x its generation time
    assert agg["tokens_per_sec"] == pytest.approx(3_000_000 / 1700)
    assert agg["tokens_per_sec_per_gpu"] == pytest.approx(3_000_000 / gpu_gen_seconds)  # 1363.6
    assert agg["gpu_days_per_billion_tokens"] == pytest.approx(gpu_gen_seconds / 86400 / 0.003)  # 8.49
    assert agg["tokens_per_sec_per_gpu"] * agg["gpu_days_per_billion_tokens"] == pytest.approx(1e9 / 86400)


def test_aggregate_allocated_gpu_figures():
    agg = report.aggregate([SHARD_0, SHARD_1], 3, [2])
    gpu_alloc_seconds = 2 * 600.0 + 1 * 1500.0  # each shard's GPUs x its whole runtime
    assert agg["gpu_hours_allocated"] == pytest.approx(0.75)
    assert agg["tokens_per_sec_per_gpu_allocated"] == pytest.approx(3_000_000 / gpu_alloc_seconds)  # 1111.1
    assert agg["gpu_days_per_billion_tokens_allocated"] == pytest.approx(gpu_alloc_seconds / 86400 / 0.003)  # 10.42


def test_aggregate_cpu_only_run_has_no_per_gpu_figures():
    cpu = shard_status(0, "2025-01-01T10:00:00+00:00", "2025-01-01T10:01:40+00:00", 100.0, 5.0, 80.0, 10, 100, 800, 0)
    agg = report.aggregate([cpu], 1, [])
    assert agg["tokens_per_sec"] == pytest.approx(10.0)
    assert agg["tokens_per_sec_per_gpu"] is None
    assert agg["gpu_days_per_billion_tokens"] is None
    assert agg["tokens_per_sec_per_gpu_allocated"] is None
    assert agg["gpu_hours_allocated"] == 0
    assert agg["num_gpus"] == 0


def test_aggregate_nothing_completed():
    agg = report.aggregate([], 2, [0, 1])
    assert agg["completed_shards"] == 0
    assert agg["wall_clock_runtime_seconds"] is None
    assert agg["min_shard_runtime_seconds"] is None
    assert agg["overall_throughput_rows_per_sec"] is None
    assert agg["tokens_per_sec_per_gpu"] is None
    assert agg["total_output_tokens"] == 0


def write_status(state_dir, status: dict) -> None:
    atomic_write_json(state_dir / f"shard_{status['shard_id']}" / "status.json", status)


def test_write_report(tmp_path):
    state = tmp_path / "state"
    write_status(state, {**SHARD_0, "num_shards": 4})
    write_status(state, {**SHARD_1, "num_shards": 4})
    failed = shard_status(3, "2025-01-01T10:00:00+00:00", "2025-01-01T10:00:01+00:00", 1.0, 1.0, 1.0, 0, 0, 1, 1, num_shards=4)
    write_status(state, {**failed, "status": "failed"})  # shard 2 has no status at all

    metrics = report.write_report(state, 4)

    on_disk = json.loads((state / "metrics.json").read_text())
    assert on_disk == json.loads(json.dumps(metrics))
    assert {"per_shard", "aggregate", "cluster_accounting"} <= set(on_disk)
    assert on_disk["cluster_accounting"] == {"available": False, "reason": "no shard recorded a SLURM job (not a SLURM run)"}
    assert [s["shard_id"] for s in on_disk["per_shard"]] == [0, 1]
    assert on_disk["per_shard"][1]["hostname"] == "node1"
    assert on_disk["per_shard"][1]["started_at"] == "2025-01-01T11:55:00+02:00"
    assert on_disk["per_shard"][0]["stats"]["output_tokens"] == 1_000_000
    agg = on_disk["aggregate"]
    assert (agg["total_shards"], agg["completed_shards"], agg["missing_shards"]) == (4, 2, [2, 3])
    assert agg["wall_clock_runtime_seconds"] == 1500.0

    summary = (state / "summary.md").read_text()
    assert "2 of 4 shards completed; missing: [2, 3]." in summary
    assert "| `total_output_tokens` | 3,000,000 |" in summary
    assert "| `tokens_per_sec_per_gpu` | n/a |" not in summary
    shard_lines = [line for line in summary.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(shard_lines) == 2
    assert sorted(p.name for p in state.iterdir()) == ["metrics.json", "report.html", "shard_0", "shard_1", "shard_3", "summary.md"]


def test_summary_without_missing_shards(tmp_path):
    write_status(tmp_path, {**SHARD_0, "num_shards": 1})
    report.write_report(tmp_path, 1)
    summary = (tmp_path / "summary.md").read_text()
    assert "1 of 1 shards completed." in summary
    assert "missing" not in summary


def test_report_refuses_status_from_another_num_shards(tmp_path):
    write_status(tmp_path, {**SHARD_0, "num_shards": 8})
    with pytest.raises(ValueError, match="num_shards=8"):
        report.compute_metrics(tmp_path, 2)


# --------------------------------------------------------------------------- wall-time figures, percentiles, roofline


def test_wall_time_figures_charge_idle_allocated_gpus():
    # 2 GPUs held for a 1000 s shard that generated 1e6 tokens in 500 s
    gen = stats.rate_figures(1_000_000, 500.0, 2)
    wall = stats.wall_rate_figures(1_000_000, 1000.0, 2)
    assert gen["tokens_per_sec_per_gpu"] == pytest.approx(1000.0)
    assert wall["tokens_per_sec_per_gpu_wall"] == pytest.approx(500.0)
    assert wall["gpu_days_per_billion_tokens_wall"] == pytest.approx(2 * 1000 / 86400 / 1e-3)  # 23.148
    assert wall["tokens_per_sec_per_gpu_wall"] * wall["gpu_days_per_billion_tokens_wall"] == pytest.approx(1e9 / 86400)
    assert stats.wall_rate_figures(1000, 10.0, 0) == {"tokens_per_sec_per_gpu_wall": None, "gpu_days_per_billion_tokens_wall": None}


def test_seed_page_example_wall_variant_by_hand():
    # one GPU at 1850.3 tok/s for 1000 s of generation inside a 2000 s shard: half the rate, twice the cost
    wall = stats.wall_rate_figures(1_850_300, 2000.0, 1)
    assert wall["tokens_per_sec_per_gpu_wall"] == pytest.approx(925.15)
    assert wall["gpu_days_per_billion_tokens_wall"] == pytest.approx(12.51, abs=0.01)


def test_joules_per_1k_tokens():
    assert stats.joules_per_1k_tokens(500.0, 2000) == pytest.approx(250.0)
    assert stats.joules_per_1k_tokens(None, 2000) is None
    assert stats.joules_per_1k_tokens(500.0, 0) is None


def test_percentile_matches_linear_interpolation():
    assert stats.percentile([], 50) is None
    assert stats.percentile([7.0], 95) == 7.0
    assert stats.percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert stats.percentile(list(range(1, 101)), 95) == pytest.approx(95.05)
    assert stats.percentile([10, 1, 5], 50) == 5


def test_decode_roofline_reproduces_the_reference_qwen3_4b_h200_figure():
    # mmirage-format.md: Qwen3-4B (8.04 GB bf16, 147,456 KV bytes/token) on an H200 (4.8 TB/s):
    # ~45k tok/s at 256 sequences and 512 mean context; a batch of 64 caps near 24k.
    at_256 = stats.decode_roofline_tokens_per_sec(8.04e9, 147_456, 256, 512, 4.8e12)
    at_64 = stats.decode_roofline_tokens_per_sec(8.04e9, 147_456, 64, 512, 4.8e12)
    assert at_256 == pytest.approx(45_000, rel=0.01)  # 44,901
    assert at_64 == pytest.approx(24_000, rel=0.01)  # 23,868
    # by hand: 256 x 4.8e12 / (8.04e9 + 256 x 512 x 147456)
    assert at_256 == pytest.approx(256 * 4.8e12 / (8.04e9 + 256 * 512 * 147_456))


@pytest.mark.parametrize(
    "name, bandwidth",
    [
        ("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA H100 NVL", 3.9e12), ("NVIDIA A100-SXM4-80GB", 2.039e12), ("NVIDIA A100 80GB PCIe", 1.935e12),
        ("NVIDIA A100-SXM4-40GB", 1.555e12), ("NVIDIA A100-PCIE-40GB", 1.555e12), ("NVIDIA L40S", 0.864e12),
        ("NVIDIA H20", 4.0e12), ("NVIDIA GH200 480GB", 4.0e12),
        ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None), ("Intel(R) Xeon(R)", None), (None, None),
    ],
)  # fmt: skip
def test_hbm_bandwidth_by_nvml_name(name, bandwidth):
    assert stats.hbm_bandwidth(name) == bandwidth


def test_model_memory_facts_from_a_model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "hidden_size": 2560, "torch_dtype": "bfloat16",
    }))  # fmt: skip
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(b"x" * 24)
    facts = stats.model_memory_facts(tmp_path)
    assert facts["weight_bytes"] == 1024
    assert facts["kv_bytes_per_token"] == 2 * 36 * 8 * 128 * 2 == 147_456
    assert stats.model_memory_facts(tmp_path / "missing") is None
    assert stats.model_memory_facts("Qwen/Qwen3-4B") is None  # a hub id: not known here


def test_model_memory_facts_defaults_head_dim_and_kv_heads(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256, "torch_dtype": "float32"})
    )
    assert stats.model_memory_facts(tmp_path)["kv_bytes_per_token"] == 2 * 2 * 4 * 64 * 4
    assert stats.model_memory_facts(tmp_path)["weight_bytes"] is None


def test_roofline_figures_null_when_unknown():
    model = {"weight_bytes": 8.04e9, "kv_bytes_per_token": 147_456}
    known = stats.roofline_figures(model, "NVIDIA H200", 256, 256 * 100, 256 * 824, 256, 9000.0)
    assert known["roofline_mean_context"] == pytest.approx(100 + 412)
    assert known["roofline_tokens_per_sec_per_gpu"] == pytest.approx(
        stats.decode_roofline_tokens_per_sec(8.04e9, 147_456, 256, 512, 4.8e12)
    )
    assert known["roofline_fraction"] == pytest.approx(9000.0 / known["roofline_tokens_per_sec_per_gpu"])
    for args in [(None, "NVIDIA H200"), (model, None), (model, "NVIDIA H100 80GB HBM3 MIG 3g.40gb")]:
        assert stats.roofline_figures(*args, 256, 100, 100, 10, 9000.0)["roofline_fraction"] is None
    cpu = stats.roofline_figures(model, "NVIDIA H200", 256, 100, 100, 10, None)  # no GPU held: no rate
    assert cpu["roofline_fraction"] is None


def test_token_histogram_buckets_and_merge():
    h = stats.TokenHistogram()
    for v in [0, 3, 15, 16, 17, 100, 1000, 1000]:
        h.add(v)
    assert stats.TokenHistogram.bucket(15) == (15, 16)
    assert stats.TokenHistogram.bucket(17) == (16, 18)
    assert stats.TokenHistogram.bucket(100) == (96, 104)
    assert stats.TokenHistogram.bucket(1000) == (960, 1024)
    data = h.to_json()
    assert data["rows"] == 8 and data["sum"] == 2151 and (data["min"], data["max"]) == (0, 1000)
    assert [960, 1024, 2] in data["buckets"]
    merged = stats.TokenHistogram.merge([data, data, None])
    assert merged["rows"] == 16 and merged["mean"] == pytest.approx(2151 / 8)
    assert [960, 1024, 4] in merged["buckets"]
    assert stats.TokenHistogram.merge([])["rows"] == 0


# --------------------------------------------------------------------------- aggregate additions


def with_gpu(status: dict, util: float | None, sampled_seconds: float, gpus: int) -> dict:
    st = {**status["stats"], "gpu_util_mean": util, "gpu_sampled_seconds": sampled_seconds,
          "gpus": [{"index": i, "util_mean": util} for i in range(gpus)]}  # fmt: skip
    return {**status, "stats": st}


def test_mean_gpu_util_is_weighted_by_sampled_time_and_gpus_not_rows():
    # shard 0: 2 GPUs x 500 s at 90 %, 100 rows; shard 1: 1 GPU x 1200 s at 40 %, 300 rows
    a, b = with_gpu(SHARD_0, 90.0, 500.0, 2), with_gpu(SHARD_1, 40.0, 1200.0, 1)
    agg = report.aggregate([a, b], 2, [])
    assert agg["mean_gpu_util_pct"] == pytest.approx((90 * 1000 + 40 * 1200) / 2200)  # 62.7
    assert agg["mean_gpu_util_pct"] != pytest.approx((90 * 100 + 40 * 300) / 400)  # MMIRAGE's by-rows: 52.5
    assert report.aggregate([a, with_gpu(SHARD_1, None, 0, 0)], 2, [])["mean_gpu_util_pct"] == 90.0


def test_runtime_percentiles_and_stragglers():
    shards = [shard_status(i, "2025-01-01T10:00:00+00:00", "2025-01-01T11:00:00+00:00", rt, 1.0, rt - 2, 10, 1, 100, 1, num_shards=5)
              for i, rt in enumerate([100.0, 110.0, 90.0, 160.0, 400.0])]  # fmt: skip
    agg = report.aggregate(shards, 5, [])
    assert agg["p50_shard_runtime_seconds"] == 110.0
    assert agg["p95_shard_runtime_seconds"] == pytest.approx(352.0)  # 160 + 0.8 x 240
    assert [s["shard_id"] for s in agg["stragglers"]] == [4]  # 160 is not > 1.5 x 110 = 165
    assert agg["stragglers"][0]["x_median"] == pytest.approx(400 / 110)


def test_energy_and_roofline_aggregate_over_the_shards_that_know_them():
    a = {**SHARD_0, "stats": {**SHARD_0["stats"], "gpu_energy_joules": 1000.0, "roofline_tokens_per_sec_per_gpu": 2000.0}}
    agg = report.aggregate([a, SHARD_1], 2, [])
    assert agg["gpu_energy_joules"] == 1000.0
    assert agg["joules_per_1k_output_tokens"] == pytest.approx(1000.0 / 1000)  # shard 0's 1e6 tokens
    # shard 0: 1e6 tokens in 500 s on 2 GPUs whose ceiling is 2000 tok/s each
    assert agg["roofline_fraction"] == pytest.approx(1_000_000 / (2000 * 2 * 500))
    assert report.aggregate([SHARD_1], 2, [])["roofline_fraction"] is None


def _done(shard_id, runtime, gpus, num_shards):
    return shard_status(
        shard_id,
        "2025-01-01T10:00:00+00:00",
        "2025-01-01T11:00:00+00:00",
        runtime,
        1.0,
        runtime - 1,
        10,
        1,
        100,
        gpus,
        num_shards=num_shards,
    )


def test_gpu_hours_remaining_projection():
    done = [_done(0, 3600.0, 2, 4), _done(1, 1800.0, 2, 4)]  # mean 5400 GPU-s
    states = [
        ShardState(0, "done"), ShardState(1, "done"),
        ShardState(2, "running", progress={"fraction_done": 0.25, "elapsed_seconds": 600, "num_gpus": 2}),
        ShardState(3, "pending"),
    ]  # fmt: skip
    assert gpu_hours_remaining(done, states, 4) == pytest.approx((5400 * 0.75 + 5400) / 3600)
    assert gpu_hours_remaining(done + [_done(2, 2.0, 2, 4), _done(3, 2.0, 2, 4)], states, 4) == 0.0
    # nothing done yet: the running shard extrapolates itself (2 GPUs x 600 s / 0.25 = 4800 GPU-s)
    assert gpu_hours_remaining([], states, 4) == pytest.approx(4800 * (0.75 + 1 + 1 + 1) / 3600)
    assert gpu_hours_remaining([], [ShardState(0, "pending")], 1) is None


def test_the_runs_eta_is_its_units_left_over_its_rate_now():
    """`mmirage status` and the live line take the run's ETA from one derivation (state/remaining.py): the units
    left (the done shards' status.json, the others' progress.json, resumed rows included) over the generating
    shards' summed rates; the shards not started are in the units left. No rate, no ETA; 0 when all are done."""
    from mirageflow.state.remaining import eta_seconds, status_progress

    done = ShardState(0, "done", status={**_done(0, 600.0, 1, 4), "shard_id": 0})  # 10 rows
    # resumed: 6 of its 8 rows came from a checkpoint; its rate is over its window, not since the start
    running = ShardState(1, "running", progress={"phase": "generating", "rows_done": 8, "rows_total": 10, "rows_per_sec": 0.5,
                                                 "tokens_per_sec": 20.0, "elapsed_seconds": 10.0, "fraction_done": 0.8})  # fmt: skip
    states = [done, running, ShardState(2, "pending"), ShardState(3, "failed")]
    progress = status_progress(states, 1, rows_total=40)
    assert (progress.rows_done, progress.rate, progress.tokens_rate) == (18, 0.5, 20.0)
    assert progress.eta_seconds == pytest.approx((40 - 18) / 0.5)  # the two shards not started at the rate now
    assert progress.eta_text() == "ETA 00:00:44" and progress.rate_text() == "0.50 rows/s, 20.0 tok/s"
    assert status_progress(states, 1, rows_total=None).eta_text() == "ETA n/a (the run's size is not indexed yet)"
    assert status_progress([done], 1, rows_total=10).eta_seconds == 0.0  # all done
    # nothing done and the running shard has no rate yet: unknown, not a guess (its elapsed time over its fraction)
    waiting = ShardState(0, "running", progress={"phase": "generating", "rows_done": 2, "elapsed_seconds": 60.0, "fraction_done": 0.2})
    assert status_progress([waiting, ShardState(1, "pending")], 1, 20).eta_text() == "ETA n/a (no rate yet)"
    assert status_progress([ShardState(0, "pending")], 1, 20).eta_text() == "ETA n/a (no shard running)"
    assert (eta_seconds(30, 2.0), eta_seconds(-5, 2.0), eta_seconds(30, None), eta_seconds(30, 0.0)) == (15.0, 0.0, None, None)


def test_shard_states_from_files(tmp_path):
    now = 1_800_000_000.0
    write_status(tmp_path, {**SHARD_0, "num_shards": 6})
    atomic_write_json(
        tmp_path / "shard_1" / "failure.json", {"error": "ShardFailed: budget", "signal": None, "attempt": 2, "hostname": "n1"}
    )
    atomic_write_json(
        tmp_path / "shard_2" / "progress.json", {"phase": "generating", "updated_at_unix": now - 3, "rows_done": 5, "rows_total": 10}
    )
    atomic_write_json(tmp_path / "shard_3" / "progress.json", {"phase": "generating", "updated_at_unix": now - 3600, "hostname": "n3"})
    atomic_write_json(tmp_path / "shard_4" / "lease.json", {"hostname": "n4", "pid": 1, "heartbeat": now - 10})
    atomic_write_json(tmp_path / "shard_4" / "failure.json", {"error": "an earlier attempt", "signal": "SIGTERM"})  # retried now
    states = {s.shard_id: s for s in shard_states(tmp_path, 6, lease_timeout=300, now=now)}
    assert {k: v.state for k, v in states.items()} == {0: "done", 1: "failed", 2: "running", 3: "failed", 4: "running", 5: "pending"}
    assert states[1].error == "ShardFailed: budget" and states[1].attempt == 2
    assert "killed?" in states[3].error and states[3].host == "n3"
    agg = report.aggregate([{**SHARD_0, "num_shards": 6}], 6, [1, 2, 3, 4, 5], list(states.values()))
    assert [f["shard_id"] for f in agg["failed_shards"]] == [1, 3]
    assert (agg["running_shards"], agg["pending_shards"]) == ([2, 4], [5])
