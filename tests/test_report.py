"""report.html: self-contained (embedded PNGs, nothing fetched), with the metrics and each plot or its note."""

from __future__ import annotations

import base64
import json
import math
import os
import random
import re
import stat
from pathlib import Path

import pytest

from mirageflow.numbers import fmt
from mirageflow.report import aggregate as report
from mirageflow.stats import formulas as stats
from mirageflow.files import atomic_write_json

GPU = "NVIDIA H100 80GB HBM3"


def make_state(root: Path, num_shards: int = 6, gpu_samples: bool = True, seed: int = 1) -> Path:
    """A finished-looking GPU run, by hand: shard 4 a straggler, the last shard failed."""
    rng = random.Random(seed)
    state = root / "state"
    for shard in range(num_shards - 1):
        runtime = 1800.0 if shard == 4 else 600.0 + 20 * shard
        load, gen = 60.0, runtime - 80.0
        hist = stats.TokenHistogram()
        for _ in range(500):
            hist.add(int(rng.lognormvariate(5.3, 0.5)))
        util = 92.0 - 3 * shard
        status = {
            "shard_id": shard, "num_shards": num_shards, "status": "success", "attempt": 1,
            "hostname": f"gpu{shard:03d}", "started_at": f"2025-03-01T10:{shard:02d}:00+00:00",
            "finished_at": f"2025-03-01T{10 + int((shard * 60 + runtime) // 3600):02d}:{int((shard * 60 + runtime) % 3600 // 60):02d}:00+00:00",
            "hardware": {"gpu_name": GPU, "driver_version": "570.86.15"},
            "stats": {
                "runtime_seconds": runtime, "model_load_seconds": load, "warmup_seconds": 5.0,
                "generation_seconds": gen, "inference_runtime_seconds": gen - 2, "write_seconds": 3.0,
                "engine_idle_seconds": 4.0, "rows_processed": 500, "rows_failed": shard % 3,
                "rows_failed_by_class": {"json_parse": shard % 3} if shard % 3 else {},
                "input_tokens": 500 * 300, "output_tokens": hist.sum, "num_gpus": 2,
                "tokens_per_sec": hist.sum / (gen - 2),
                "tokens_per_sec_per_gpu": hist.sum / (gen - 2) / 2,
                "gpu_util_mean": util, "gpu_util_min": 0.0, "gpu_util_max": 100.0, "gpu_util_samples": 2 * int(gen / 0.5),
                "gpu_sampled_seconds": gen, "gpu_energy_joules": 700.0 * 2 * gen,
                "gpus": [{"index": i, "uuid": f"GPU-{shard}-{i}", "name": GPU, "util_mean": util} for i in range(2)],
                "roofline_tokens_per_sec_per_gpu": 400.0,
                "output_tokens_per_row_hist": hist.to_json(),
            },
        }  # fmt: skip
        atomic_write_json(state / f"shard_{shard}" / "status.json", status)
        if gpu_samples:
            n = 120
            t = [gen * i / n for i in range(n)]
            series = [
                [max(0.0, min(100.0, util + 6 * math.sin(i / 7 + g) - (40 if i in (30, 31, 80) else 0))) for i in range(n)]
                for g in range(2)
            ]
            atomic_write_json(state / f"shard_{shard}" / "gpu_samples.json", {
                "shard_id": shard, "started_at": f"2025-03-01T10:{shard:02d}:{int(load):02d}+00:00"
                if load < 60 else f"2025-03-01T10:{shard + 1:02d}:00+00:00",
                "interval_seconds": 0.5, "gpus": [{"index": g, "uuid": f"GPU-{shard}-{g}", "name": GPU} for g in range(2)],
                "t": t, "duration": [gen / n] * n, "util": series, "memory_used_mb": [[70000.0] * n] * 2,
            })  # fmt: skip
    atomic_write_json(state / f"shard_{num_shards - 1}" / "failure.json", {
        "shard_id": num_shards - 1, "status": "failed", "attempt": 3, "hostname": "gpu099", "slurm_job_id": "77",
        "error": "EngineCrashed: the SGLang server exited with status -9 (out of memory?)", "signal": None,
    })  # fmt: skip
    return state


def _images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_report_html_embeds_plots_and_metrics(tmp_path):
    state = make_state(tmp_path)
    metrics = report.write_report(state, 6)
    page = (state / "report.html").read_text()
    images = _images(page)
    assert len(images) == 4  # shards, GPU utilisation, tokens per row, errors
    assert all(img.startswith(b"\x89PNG\r\n\x1a\n") and len(img) > 2000 for img in images)
    agg = metrics["aggregate"]
    for key in ("tokens_per_sec_per_gpu", "gpu_days_per_billion_tokens", "mean_gpu_util_pct", "p95_shard_runtime_seconds", "roofline_fraction"):
        assert f"<code>{key}</code>" in page
    assert fmt(agg["total_output_tokens"]) in page
    assert "EngineCrashed: the SGLang server exited" in page  # the failed shard, with its error
    assert "shard 4 (" in page  # the straggler
    assert agg["failed_shards"][0]["shard_id"] == 5 and [s["shard_id"] for s in agg["stragglers"]] == [4]
    assert agg["mean_gpu_util_pct"] == pytest.approx(report.mean_gpu_util(metrics["per_shard"]))


def test_report_html_is_self_contained(tmp_path):
    state = make_state(tmp_path)
    report.write_report(state, 6)
    page = (state / "report.html").read_text()
    assert not re.search(r'(src|href)="(?!data:)', page)  # nothing to fetch: no scripts, styles or images by URL
    assert "<script" not in page and "@import" not in page and "url(" not in page


def test_report_without_gpu_samples_says_so(tmp_path):
    state = make_state(tmp_path, gpu_samples=False)
    report.write_report(state, 6)
    page = (state / "report.html").read_text()
    assert "No GPU samples" in page
    assert len(_images(page)) == 3


def test_report_of_an_empty_state_dir(tmp_path):
    report.write_report(tmp_path, 2)
    page = (tmp_path / "report.html").read_text()
    assert "No completed shard yet" in page and "No GPU samples" in page and "No failed rows" in page
    assert _images(page) == []
    assert "pending: 0, 1" in page


def test_metrics_json_matches_what_the_page_shows(tmp_path):
    state = make_state(tmp_path)
    report.write_report(state, 6)
    metrics = json.loads((state / "metrics.json").read_text())
    assert metrics["aggregate"]["gpu_names"] == [GPU]
    assert metrics["aggregate"]["output_tokens_per_row_hist"]["rows"] == 5 * 500
    assert metrics["aggregate"]["rows_failed_by_class"] == {"json_parse": 1 + 2 + 1}
    summary = (state / "summary.md").read_text()
    assert "## Failed shards" in summary and "EngineCrashed" in summary


# --------------------------------------------------------------------------- failed shards' rows, attempts, atomic files


def _fail_shard(state: Path, shard: int, num_shards: int, rows_ok: int, rows_failed: int, by_class: dict, attempts: int | None = None):
    """failure.json as the runner writes it: with stats (totals over the attempts when ``attempts`` is given)."""
    st = {"runtime_seconds": 30.0, "inference_runtime_seconds": 20.0, "output_tokens": 0, "num_gpus": 1,
          "rows_processed": rows_ok, "rows_failed": rows_failed, "rows_failed_by_class": by_class}  # fmt: skip
    if attempts is not None:
        st["attempts"] = [
            {"attempt": i + 1, "started_at": "2025-03-01T10:00:00+00:00", "finished_at": "2025-03-01T10:01:00+00:00",
             "outcome": "failed", "rows_computed": 0, "output_tokens": 0, "runtime_seconds": 10.0}
            for i in range(attempts)
        ]  # fmt: skip
    atomic_write_json(state / f"shard_{shard}" / "failure.json", {
        "shard_id": shard, "num_shards": num_shards, "status": "failed", "attempt": attempts or 1, "hostname": "gpu042",
        "finished_at": "2025-03-01T10:01:00+00:00", "signal": None, "stats": st,
        "error": f"ShardFailed: every row of shard {shard}: {rows_failed} of {rows_failed} rows failed (empty_output: {rows_failed})",
    })  # fmt: skip


def test_a_failed_shards_rows_count_as_failed_rows(tmp_path):
    """The failed rows of a shard that failed (failure.json's stats) are in every failed-rows figure."""
    state = tmp_path / "state"
    _fail_shard(state, 0, 1, 0, 25, {"empty_output": 25})
    metrics = report.write_report(state, 1)
    agg = metrics["aggregate"]
    assert agg["total_rows_failed"] == 25 and agg["rows_failed_by_class"] == {"empty_output": 25}
    assert (agg["rows_failed_completed_shards"], agg["rows_failed_failed_shards"]) == (0, 25)
    assert agg["failed_shards"][0]["rows_failed"] == 25 and agg["failed_shards"][0]["rows_processed"] == 0
    assert agg["total_rows_processed"] == 0 and agg["completed_shards"] == 0  # completed-shard figures as before
    page = (state / "report.html").read_text()
    assert "every row of shard 0: 25 of 25 rows failed" in page
    assert "No failed rows" not in page and len(_images(page)) == 1  # the failed-rows plot
    assert '<div class="v">25</div><div class="k">rows failed' in page
    summary = (state / "summary.md").read_text()
    assert "| `total_rows_failed` | 25 |" in summary and "empty_output 25" in summary
    assert json.loads((state / "metrics.json").read_text())["aggregate"]["rows_failed_by_class"] == {"empty_output": 25}


def test_failed_rows_add_completed_and_failed_shards_and_say_which_figure_covers_what(tmp_path):
    state = make_state(tmp_path)  # shards 0-4 completed (json_parse 1 + 2 + 1), shard 5 failed
    _fail_shard(state, 5, 6, 7, 25, {"empty_output": 20, "json_parse": 5})
    metrics = report.write_report(state, 6)
    agg = metrics["aggregate"]
    assert agg["total_rows_failed"] == 4 + 25
    assert agg["rows_failed_by_class"] == {"json_parse": 4 + 5, "empty_output": 20}
    assert (agg["rows_failed_completed_shards"], agg["rows_failed_failed_shards"], agg["rows_processed_failed_shards"]) == (4, 25, 7)
    # completed-shard figures are unchanged by the failed shard
    assert agg["total_rows_processed"] == 5 * 500 and agg["completed_shards"] == 5
    assert agg["total_output_tokens"] == sum(s["stats"]["output_tokens"] for s in metrics["per_shard"])
    assert set(agg["figure_scope"]) == {"completed and failed shards", "failed shards", "completed shards"}
    assert "total_rows_failed" in agg["figure_scope"]["completed and failed shards"]
    for text in ((state / "summary.md").read_text(), (state / "report.html").read_text()):
        assert "count completed and failed shards: 4 in completed shards, 25 in 1 failed shard(s)" in text
        assert "every other figure covers the 5 completed shard(s) only" in text


def _attempts(n: int) -> list[dict]:
    return [
        {"attempt": i + 1, "started_at": f"2025-03-01T1{i}:00:00+00:00", "finished_at": f"2025-03-01T1{i}:30:00+00:00",
         "outcome": "success" if i == n - 1 else "failed", "rows_computed": 100, "output_tokens": 1000, "runtime_seconds": 1800.0}
        for i in range(n)
    ]  # fmt: skip


def test_attempts_per_shard_from_new_and_old_status_files(tmp_path):
    state = make_state(tmp_path)
    path = state / "shard_1" / "status.json"
    status = json.loads(path.read_text())
    status["stats"]["attempts"] = _attempts(3)  # the new runner: stats are totals over these
    atomic_write_json(path, status)
    _fail_shard(state, 5, 6, 0, 3, {"timeout": 3}, attempts=2)
    metrics = report.write_report(state, 6)
    by_id = {s["shard_id"]: s for s in metrics["per_shard"]}
    assert by_id[1]["attempts"] == 3 and by_id[0]["attempts"] is None  # an older status.json: unknown
    assert metrics["aggregate"]["failed_shards"][0]["attempts"] == 2
    assert json.loads((state / "metrics.json").read_text())["per_shard"][1]["attempts"] == 3
    page = (state / "report.html").read_text()
    table = page.split("<h2>Per shard</h2>")[1]
    assert "<th>shard</th><th>attempts</th>" in table
    assert re.search(r"<td class=n>1</td><td class=n>3</td>", table) and re.search(r"<td class=n>0</td><td class=n>n/a</td>", table)
    assert "| 1 | 3 | 500 |" in (state / "summary.md").read_text()


def test_report_files_go_through_the_atomic_writers(tmp_path, monkeypatch):
    from mirageflow import files

    written = []
    real = files.atomic_write_bytes

    def spy(path, data, durable=True):
        written.append(Path(path).name)
        return real(path, data, durable)

    state = make_state(tmp_path, gpu_samples=False)
    before = {p for p in state.rglob("*")}
    monkeypatch.setattr(files, "atomic_write_bytes", spy)
    report.write_report(state, 6)
    assert sorted(written) == ["metrics.json", "report.html", "summary.md"]
    assert {p.name for p in state.rglob("*")} - {p.name for p in before} == {"metrics.json", "report.html", "summary.md"}


def test_report_files_follow_the_umask(tmp_path):
    """Written through mirageflow.files, which create files as open() would (mode 0666 & ~umask), not mkstemp's 0600."""
    state = make_state(tmp_path, gpu_samples=False)
    old = os.umask(0o022)
    try:
        report.write_report(state, 6)
    finally:
        os.umask(old)
    for name in ("metrics.json", "summary.md", "report.html"):
        assert stat.S_IMODE((state / name).stat().st_mode) == 0o644, name


# --------------------------------------------------------------------------- issue 15: histogram, throughput, examples, table


def test_tokens_per_row_bins_have_one_width_and_keep_every_row():
    from mirageflow.report.html import equal_width_bins

    hist = stats.TokenHistogram()
    rng = random.Random(3)
    values = [int(rng.lognormvariate(4.5, 0.8)) for _ in range(3000)] + [0, 1, 7, 15, 16, 17]
    for v in values:
        hist.add(v)
    h = hist.to_json()
    width, bins = equal_width_bins(h)
    assert {hi - lo for lo, hi, _ in bins} == {width} and width & (width - 1) == 0  # one width, a power of two
    assert all(b[1] == c[0] for b, c in zip(bins, bins[1:]))  # contiguous
    assert sum(n for _, _, n in bins) == len(values)
    for lo, hi, n in bins:  # exact: every value counted in the bin that holds it
        assert n == sum(1 for v in values if lo <= v < hi)
    assert len(bins) <= 64
    small = stats.TokenHistogram()
    for v in (3, 3, 5, 9):
        small.add(v)
    assert equal_width_bins(small.to_json()) == (1, [(3, 4, 2), (4, 5, 0), (5, 6, 1), (6, 7, 0), (7, 8, 0), (8, 9, 0), (9, 10, 1)])


def test_row_token_limit_from_the_records_identity(tmp_path):
    from mirageflow.report.html import load_identity, row_token_limit

    identity = {
        "processors": [{"default_sampling_params": {"max_new_tokens": 256}}],
        "processing_params": {"outputs": [{"name": "a", "sampling_params": {}}, {"name": "b", "sampling_params": {"max_new_tokens": 64}}]},
    }
    atomic_write_json(tmp_path / "records.fingerprint", {"sha256": "x", "identity": identity})
    assert row_token_limit(load_identity(tmp_path)) == 256 + 64
    assert row_token_limit(None) is None and load_identity(tmp_path / "nowhere") is None


def _with_progress_and_records(state: Path, num_shards: int = 6) -> None:
    for shard in range(num_shards - 1):
        history = [[5.0 * i, 4 * i if i != 6 else 20, 400 * i if i != 6 else 2000] for i in range(12)]  # a stall at i=6
        atomic_write_json(state / f"shard_{shard}" / "progress.json", {
            "shard_id": shard, "phase": "done", "started_at": f"2025-03-01T10:{shard:02d}:00+00:00", "history": history,
        })  # fmt: skip
    out = state.parent / "out" / "shard_0"
    out.mkdir(parents=True)
    (out / "part-00000.jsonl").write_text("".join(json.dumps({"q": f"question {i}", "a": f"answer <{i}>", "source_index": i}) + "\n" for i in range(5)))
    atomic_write_json(state / "shard_0" / "checkpoint.json", {
        "format": 2, "datasets": {"0": {"out_dir": str(out), "fmt": "jsonl", "parts": [{"name": "part-00000.jsonl"}]}},
    })  # fmt: skip
    (state / "shard_2" / "errors.jsonl").write_text(
        "".join(json.dumps({"dataset": 0, "source_index": 40 + i, "stage": "output", "error": "json_parse",
                            "message": f"output 'card': answer is not valid JSON #{i}", "raw": "{oops"}) + "\n" for i in range(8))
    )  # fmt: skip
    atomic_write_json(state / "records.fingerprint", {"identity": {"processors": [{"default_sampling_params": {"max_new_tokens": 512}}],
                                                                  "processing_params": {"outputs": [{"name": "card"}]}}})  # fmt: skip


def test_report_has_throughput_over_time_examples_and_failed_rows(tmp_path):
    state = make_state(tmp_path)
    _with_progress_and_records(state)
    report.write_report(state, 6)
    page = (state / "report.html").read_text()
    assert len(_images(page)) == 5  # + throughput over time
    assert 'alt="rows/s and tokens/s per shard over time"' in page
    assert "<h2>Example records</h2>" in page and "answer &lt;0&gt;" in page and "answer &lt;2&gt;" in page
    assert "answer &lt;3&gt;" not in page  # a few, not all
    assert "<h2>Failed rows (examples)</h2>" in page and "answer is not valid JSON #0" in page and "JSON #4" in page and "JSON #5" not in page
    assert "{oops" in page


def test_throughput_series_are_rates_between_samples_on_a_common_clock():
    from mirageflow.report.html import throughput_series

    series = throughput_series([
        {"shard_id": 0, "started_at": "2025-03-01T10:00:00+00:00", "history": [[0, 0, 0], [10, 20, 1000], [20, 20, 1000]]},
        {"shard_id": 1, "started_at": "2025-03-01T10:01:00+00:00", "history": [[0, 0, 0], [30, 30, 600]]},
    ])  # fmt: skip
    (s0, x0, r0, k0), (s1, x1, r1, k1) = series
    assert (s0, x0, r0, k0) == (0, [0, 10 / 60, 10 / 60, 20 / 60], [2.0, 2.0, 0.0, 0.0], [100.0, 100.0, 0.0, 0.0])
    assert (s1, x1, r1, k1) == (1, [1.0, 1.5], [1.0, 1.0], [20.0, 20.0])


def test_metrics_table_pairs_seconds_with_human_and_says_rows_ok(tmp_path):
    from mirageflow.report.html import metrics_table_rows

    state = make_state(tmp_path)
    metrics = report.write_report(state, 6)
    agg = metrics["aggregate"]
    assert "wall_clock_runtime_human" in agg and "total_rows_processed" in agg  # metrics.json keeps the seed's keys
    rows = {key: (label, value) for label, key, value in metrics_table_rows(agg)}
    assert not any(k.endswith("_human") for k in rows)
    assert rows["wall_clock_runtime_seconds"][1] == f"{fmt(agg['wall_clock_runtime_seconds'])} s ({agg['wall_clock_runtime_human']})"
    assert rows["total_rows_processed"][0] == "rows ok (completed shards)"
    assert rows["total_rows_failed"][0].startswith("rows failed")
    page = (state / "report.html").read_text()
    assert "<code>wall_clock_runtime_human</code>" not in page and "rows ok (completed shards)" in page
    assert "rows processed" not in page
    summary = (state / "summary.md").read_text()
    assert "`wall_clock_runtime_human`" not in summary and "| `total_rows_processed` | 2,500 | rows ok |" in summary


def test_a_cpu_runs_remaining_gpu_hours_are_unknown_not_zero():
    statuses = [{"shard_id": 0, "stats": {"num_gpus": 0, "runtime_seconds": 60.0}}]
    assert report.gpu_hours_remaining(statuses, [], 2) is None
    assert report.gpu_hours_remaining(statuses, [], 1) == 0.0  # nothing left


def test_with_several_samples_the_report_counts_samples_and_says_so(tmp_path):
    """60 rows x 2 samples: the tokens histogram holds 120 records, "120 samples (60 rows x 2)", not "120 rows"."""
    from mirageflow.report.html import tokens_hist_labels

    hist = {"rows": 120, "mean": 40.0, "max": 64}
    title, xlabel, ylabel = tokens_hist_labels(hist, 2, 8)
    assert title == "tokens per sample: 120 samples (60 rows x 2), mean 40.0, max 64" and ylabel == "samples"
    assert tokens_hist_labels(hist, 1, 8)[0] == "tokens per row: 120 rows, mean 40.0, max 64"
    state = make_state(tmp_path)
    for path in state.glob("shard_*/status.json"):
        status = json.loads(path.read_text())
        status["stats"]["n_samples"] = 2
        path.write_text(json.dumps(status))
    metrics = report.write_report(state, 6)
    assert metrics["aggregate"]["n_samples"] == 2
    summary = (state / "summary.md").read_text()
    assert "| `total_rows_processed` |" in summary and "rows ok (samples: 2 records per source row)" in summary
    assert "each source row makes 2 records (samples)" in (state / "report.html").read_text()

