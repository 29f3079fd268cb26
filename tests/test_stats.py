"""Benchmark formulas, GPU allocation, durations, and the run report (metrics.json, summary.md)."""

from __future__ import annotations

import json
import sys
from datetime import timezone

import pytest

from mirageflow import report, stats
from mirageflow.data.writers import atomic_write_json

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
    assert set(on_disk) == {"per_shard", "aggregate"}
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
    assert sorted(p.name for p in state.iterdir()) == ["metrics.json", "shard_0", "shard_1", "shard_3", "summary.md"]


def test_summary_without_missing_shards(tmp_path):
    write_status(tmp_path, {**SHARD_0, "num_shards": 1})
    report.write_report(tmp_path, 1)
    summary = (tmp_path / "summary.md").read_text()
    assert "1 of 1 shards completed." in summary
    assert "missing" not in summary


def test_report_refuses_status_from_another_num_shards(tmp_path):
    write_status(tmp_path, {**SHARD_0, "num_shards": 8})
    with pytest.raises(ValueError, match="num_shards=8"):
        report.load_statuses(tmp_path, 2)
