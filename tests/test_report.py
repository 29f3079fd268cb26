"""report.html: self-contained (embedded PNGs, nothing fetched), with the metrics and each plot or its note."""

from __future__ import annotations

import json
import os
import random
import re
import stat
from pathlib import Path

import pytest
from fakes.runs import GPU, make_state, report_images
from browser import dom, near, pixels, screenshot

from mirageflow.numbers import fmt
from mirageflow.report import aggregate as report
from mirageflow.stats import formulas as stats
from mirageflow.files import atomic_write_json


def test_report_html_embeds_plots_and_metrics(tmp_path):
    state = make_state(tmp_path)
    metrics = report.write_report(state, 6)
    page = (state / "report.html").read_text()
    images = report_images(page)
    assert len(images) == 4  # shards, GPU utilisation, tokens per row, errors
    assert all(img.startswith(b'<svg xmlns="http://www.w3.org/2000/svg"') and img.endswith(b"</svg>") and len(img) > 1500 for img in images)
    for img in images:  # well-formed XML, nothing fetched
        import xml.etree.ElementTree as ET

        ET.fromstring(img)
        assert b"href" not in img and b"<script" not in img
    agg = metrics["aggregate"]
    for key in (
        "tokens_per_sec_per_gpu",
        "gpu_days_per_billion_tokens",
        "mean_gpu_util_pct",
        "p95_shard_runtime_seconds",
        "roofline_fraction",
    ):
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
    assert len(report_images(page)) == 3


def test_report_of_an_empty_state_dir(tmp_path):
    report.write_report(tmp_path, 2)
    page = (tmp_path / "report.html").read_text()
    assert "No completed shard yet" in page and "No GPU samples" in page and "No failed rows" in page
    assert report_images(page) == []
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
    assert "No failed rows" not in page and len(report_images(page)) == 1  # the failed-rows plot
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


def test_output_token_limits_from_the_records_identity(tmp_path):
    from mirageflow.report.html import load_identity, output_token_limits

    identity = {
        "processors": [{"default_sampling_params": {"max_new_tokens": 256}}],
        "processing_params": {"outputs": [{"name": "a", "sampling_params": {}}, {"name": "b", "sampling_params": {"max_new_tokens": 64}}]},
    }
    atomic_write_json(tmp_path / "records.fingerprint", {"sha256": "x", "identity": identity})
    assert output_token_limits(load_identity(tmp_path)) == [("a", 256), ("b", 64)]
    assert output_token_limits(None) is None and load_identity(tmp_path / "nowhere") is None


def _with_progress_and_records(state: Path, num_shards: int = 6) -> None:
    for shard in range(num_shards - 1):
        history = [[5.0 * i, 4 * i if i != 6 else 20, 400 * i if i != 6 else 2000] for i in range(12)]  # a stall at i=6
        atomic_write_json(state / f"shard_{shard}" / "progress.json", {
            "shard_id": shard, "phase": "done", "started_at": f"2025-03-01T10:{shard:02d}:00+00:00", "history": history,
        })  # fmt: skip
    out = state.parent / "out" / "shard_0"
    out.mkdir(parents=True)
    (out / "part-00000.jsonl").write_text(
        "".join(json.dumps({"q": f"question {i}", "a": f"answer <{i}>", "source_index": i}) + "\n" for i in range(5))
    )
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
    assert len(report_images(page)) == 5  # + throughput over time
    assert 'alt="rows done and output tokens/s per shard over time"' in page
    assert "A step at zero is a window in which no tokens were added" in page  # the caption says what zero means
    assert "<h2>Example records</h2>" in page and "answer &lt;0&gt;" in page and "answer &lt;2&gt;" in page
    assert "answer &lt;3&gt;" not in page  # a few, not all
    assert (
        "<h2>Failed rows (examples)</h2>" in page and "answer is not valid JSON #0" in page and "JSON #4" in page and "JSON #5" not in page
    )
    assert "{oops" in page


def test_throughput_series_are_rates_over_windows_with_work_on_a_common_clock():
    from mirageflow.report.html import ROWS, throughput_series

    histories = [
        {"shard_id": 0, "started_at": "2025-03-01T10:00:00+00:00", "history": [[0, 0, 0], [10, 20, 1000], [20, 20, 1000]]},
        {"shard_id": 1, "started_at": "2025-03-01T10:01:00+00:00", "history": [[0, 0, 0], [30, 30, 600]]},
    ]  # fmt: skip
    (s0, x0, k0), (s1, x1, k1) = throughput_series(histories)
    assert (s0, x0, k0) == (0, [0, 10 / 60, 10 / 60, 20 / 60], [100.0, 100.0, 0.0, 0.0])  # zero: nothing after the last row
    assert (s1, x1, k1) == (1, [1.0, 1.5], [20.0, 20.0])
    (_, _, r0), (_, _, r1) = throughput_series(histories, ROWS)
    assert r0 == [2.0, 2.0, 0.0, 0.0] and r1 == [1.0, 1.0]


def test_a_small_batch_is_drawn_at_its_rate_over_the_time_it_ran_not_as_a_spike_after_zeros():
    """12 rows in one batch: generation starts at 4 s, 2 bad rows fail at once (no tokens),
    the other 10 finish at 14 s (sampled at 15 s)."""
    from mirageflow.report.html import ROWS, throughput_series, work_windows

    history = [[0, 0, 0], [4, 0, 0], [5, 2, 0], [10, 2, 0], [15, 12, 1200], [16, 12, 1200]]
    assert work_windows(history, generation_started=4) == [(4.0, 15.0, 1200.0), (15.0, 16.0, 0.0)]
    assert work_windows(history, 4, ROWS) == [(4.0, 5.0, 2.0), (5.0, 15.0, 10.0), (15.0, 16.0, 0.0)]
    ((_, xs, tokens),) = throughput_series([{"shard_id": 0, "started_at": "2025-03-01T10:00:00+00:00", "history": history,
                                             "generation_started": 4}])  # fmt: skip
    assert tokens == [1200 / 11] * 2 + [0.0] * 2  # not 0 for the failed rows' window, then 1200 / 5 = 240
    assert xs[0] == 4 / 60  # nothing drawn during the model load
    # batches finishing every 20 s in 5 s samples: each batch over its 20 s, no zero between them
    steady = [[5.0 * i, 8 * (i // 4), 800 * (i // 4)] for i in range(17)]
    assert [w for w in work_windows(steady, 0.0, ROWS) if w[2] == 0] == []
    assert {round(r / (t1 - t0), 6) for t0, t1, r in work_windows(steady, 0.0, ROWS)} == {0.4}


def test_progress_json_says_when_generation_started(tmp_path):
    from mirageflow.shard.progress import ProgressReporter
    from mirageflow.state.records import check_progress

    now = [100.0]
    reporter = ProgressReporter(tmp_path / "progress.json", 0, 10, lambda: {"rows_done": 0}, clock=lambda: now[0])
    reporter.write()
    assert json.loads((tmp_path / "progress.json").read_text())["generation_started_seconds"] is None
    now[0] = 107.5
    reporter.set_phase("generating")
    state = json.loads((tmp_path / "progress.json").read_text())
    assert state["generation_started_seconds"] == 7.5 and check_progress(state) is None


def test_token_limit_marker_says_per_output_and_per_row():
    from mirageflow.report.html import output_token_limits, token_limit_label

    two = {"processors": [{"default_sampling_params": {"max_new_tokens": 64}}],
           "processing_params": {"outputs": [{"name": "a"}, {"name": "b"}], "n_samples": 2}}  # fmt: skip
    assert token_limit_label(output_token_limits(two), "sample") == "max_new_tokens 64 per output x 2 outputs = 128 per sample"
    assert token_limit_label([("a", 64)]) == "max_new_tokens 64 (1 output per row)"
    assert token_limit_label([("grade", 256), ("summary", 64)]) == "max_new_tokens 256 (grade) + 64 (summary) = 320 per row"


def test_summary_does_not_open_with_failures_when_nothing_failed(tmp_path):
    state = make_state(tmp_path, num_shards=3)
    (state / "shard_2" / "failure.json").unlink()
    atomic_write_json(state / "shard_2" / "status.json", {**json.loads((state / "shard_1" / "status.json").read_text()), "shard_id": 2})
    for shard in range(3):  # no failed row either
        path = state / f"shard_{shard}" / "status.json"
        status = json.loads(path.read_text())
        status["stats"].update(rows_failed=0, rows_failed_by_class={})
        atomic_write_json(path, status)
    report.write_report(state, 3)
    summary = (state / "summary.md").read_text()
    opening = summary.split("|")[0]
    assert "failed shard(s)" not in opening and "Failed rows" not in opening
    assert "No row and no shard failed; the figures cover the 3 completed shard(s)." in opening
    assert "No row and no shard failed" in (state / "report.html").read_text()


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
    from mirageflow.state.remaining import gpu_hours_remaining

    assert gpu_hours_remaining(statuses, [], 2) is None
    assert gpu_hours_remaining(statuses, [], 1) == 0.0  # nothing left


def test_svg_plots_have_round_ticks_and_break_lines_at_missing_samples():
    import xml.etree.ElementTree as ET

    from mirageflow.report.svg import Figure, Panel, nice_ticks, viridis

    assert nice_ticks(0, 1730) == [0, 500, 1000, 1500]
    assert nice_ticks(0, 9, integer=True) == [0, 2, 4, 6, 8] and nice_ticks(0.0, 0.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert (viridis(0), viridis(100), viridis(-5)) == ("#440154", "#fde725", "#440154")
    panel = Panel("t <&>", "x", "y")
    panel.line([0, 1, 2, 3, 4], [1, 2, None, 4, float("nan")], "#000", label="series")
    panel.bars([0, 1], [3, 5], 0.8, color="#123456", edges=["#b42318", None], label="bars")
    svg = Figure(600, 300, [panel], legend_width=80).svg()
    root = ET.fromstring(svg)  # well-formed, the title escaped
    ns = "{http://www.w3.org/2000/svg}"
    assert len(root.findall(f".//{ns}polyline")) == 1  # the run after None has one point: not drawn as a line
    assert "t &lt;&amp;&gt;" in svg and svg.count('stroke="#b42318"') == 1


def test_report_of_many_shards_renders_in_a_browser(tmp_path):
    """Headless Chromium renders the page of a 48-shard run: every plot drawn, with its caption."""
    state = make_state(tmp_path, num_shards=48)
    rng = random.Random(5)
    for shard in range(47):  # batches finishing at random, generation from 30-50 s on
        started = 30 + 20 * rng.random()
        history, rows = [[0, 0, 0], [started, 0, 0]], 0
        for i in range(1, 120):
            rows += rng.choice((0, 0, 4, 8))
            history.append([started + 5 * i, rows, 90 * rows])
        atomic_write_json(state / f"shard_{shard}" / "progress.json", {
            "shard_id": shard, "phase": "done", "started_at": f"2025-03-01T10:{shard:02d}:00+00:00",
            "history": history, "generation_started_seconds": started,
        })  # fmt: skip
    report.write_report(state, 48)
    page = state / "report.html"
    html_images = len(report_images(page.read_text()))
    parsed = dom(page)
    assert parsed.count("<img ") == html_images == 5 and parsed.count("<figcaption>") == 5  # each plot with its caption
    assert "A step at zero is a window in which no tokens were added" in parsed and "both panels show the run" in parsed
    assert "0 % is a GPU that ran no kernel in that interval" in parsed and "a bar at zero is a shard that generated no tokens" in parsed
    size, colours = pixels(screenshot(page, tmp_path / "report.png"))
    assert size == (1280, 3000) and len(colours) > 500  # text, plots and tables, not a blank or error page
    assert near(colours, "#3b6fb6") > 20_000  # the plots' bars (per-shard throughput, runtime, tokens) are drawn
    assert near(colours, "#b42318") > 500  # the straggler's outline, the failed shard's error, the errors plot


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


# --------------------------------------------------------------------------- golden: the report of a fixed state

GOLDEN = Path(__file__).resolve().parent / "golden" / "report"


def _golden_text(text: str, root: Path) -> str:
    """The report with what differs between two renderings of one state made equal: the temporary
    directory, the time it was generated, and the SVG clip-path ids (each plot's object id); the
    plots are decoded, so a difference in one shows as text."""
    import base64

    text = text.replace(str(root), "<ROOT>")
    text = re.sub(r"generated \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d UTC", "generated <TIME> UTC", text)

    def plot(m: re.Match) -> str:
        return "data:image/svg+xml;utf8," + re.sub(r"clip\d+", "clip", base64.b64decode(m[1]).decode())

    return re.sub(r"data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)", plot, text)


def test_the_report_of_a_fixed_state_is_byte_identical_to_its_golden_files(tmp_path, monkeypatch):
    """metrics.json, summary.md and report.html of a fixed state (make_state: a straggler, a failed
    shard, GPU samples, progress histories, example records and failed rows) as the tests/golden/report
    files pin them: a refactoring of the aggregate or the page changes no byte. A deliberate change
    rewrites them: MIRAGEFLOW_UPDATE_GOLDEN=1 python -m pytest tests/test_report.py -k golden.
    The state's SLURM job ids go to a `sacct` that knows none of them (a process boundary): the
    machine's own accounting (the test cluster's jobs 77, 78, ... once it has run them) is not
    the fixed state's."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "sacct").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    state = make_state(tmp_path)
    _with_progress_and_records(state)
    report.write_report(state, 6)
    for name in ("metrics.json", "summary.md", "report.html"):
        got = _golden_text((state / name).read_text(), tmp_path)
        if os.environ.get("MIRAGEFLOW_UPDATE_GOLDEN") == "1":
            GOLDEN.mkdir(parents=True, exist_ok=True)
            (GOLDEN / name).write_text(got)
        assert got == (GOLDEN / name).read_text(), f"{name} differs from {GOLDEN / name}"
