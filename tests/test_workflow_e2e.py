"""End to end: the workflow as a user runs it, on JSONL, Parquet and loadable data, with a real tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from browser import dom, near, pixels, screenshot
from conftest import run_workflow

NUM_SHARDS = 3
MMIRAGE_AGGREGATE_KEYS = {
    "total_shards", "completed_shards", "total_rows_processed", "wall_clock_runtime_seconds",
    "wall_clock_runtime_human", "sum_shard_runtime_seconds", "sum_shard_runtime_human",
    "min_shard_runtime_seconds", "min_shard_runtime_human", "max_shard_runtime_seconds",
    "max_shard_runtime_human", "overall_throughput_rows_per_sec", "mean_gpu_util_pct", "num_gpus",
    "total_input_tokens", "total_output_tokens", "sum_model_load_seconds",
    "sum_inference_runtime_seconds", "tokens_per_sec_per_gpu", "gpu_days_per_billion_tokens",
}  # fmt: skip
SHARD_STATS_KEYS = {
    "runtime_seconds", "model_load_seconds", "inference_runtime_seconds", "rows_processed", "rows_failed",
    "throughput_rows_per_sec", "input_tokens", "output_tokens", "num_gpus", "tokens_per_sec",
    "tokens_per_sec_per_gpu", "gpu_days_per_billion_tokens", "gpu_util_mean", "gpu_util_min",
    "gpu_util_max", "gpu_util_samples", "write_seconds",
}  # fmt: skip


def _rows(n: int, offset: int = 0) -> list[dict]:
    return [{"doc": {"title": f"Title {i}", "body": f"Body text number {i}."}, "n": i} for i in range(offset, offset + n)]


def _make_datasets(root: Path) -> dict:
    """7 JSONL rows (one malformed line, one row without the key), 11 Parquet rows in 2 files, 5 loadable rows."""
    jsonl = root / "in.jsonl"
    lines = [json.dumps(r) for r in _rows(5)]
    lines.insert(2, "{not json")
    lines.insert(4, json.dumps({"n": 99}))  # no doc.title
    lines.insert(1, "")  # blank lines are not rows
    jsonl.write_text("\n".join(lines) + "\n")

    pq_dir = root / "pq"
    pq_dir.mkdir()
    pq.write_table(pa.Table.from_pylist(_rows(6)), pq_dir / "a.parquet", row_group_size=4)
    pq.write_table(pa.Table.from_pylist(_rows(5, 6)), pq_dir / "b.parquet", row_group_size=2)

    hf_dir = root / "hf"
    datasets.Dataset.from_list(_rows(5, 100)).save_to_disk(str(hf_dir))
    return {"jsonl": jsonl, "parquet": pq_dir, "loadable": hf_dir}


def _config(root: Path, model: Path, data: dict) -> dict:
    return {
        "processors": [
            {
                "type": "llm",
                "backend": "transformers",
                "server_args": {"model_path": str(model)},
                "default_sampling_params": {"temperature": 0.0, "max_new_tokens": 8},
            }
        ],
        "loading_params": {
            "state_dir": "state",
            "datasets": [
                {"path": str(data["jsonl"]), "type": "JSONL", "output_dir": "out/jsonl"},
                {"path": str(data["parquet"]), "type": "parquet", "output_dir": "out/parquet"},
                {"path": str(data["loadable"]), "type": "loadable", "output_dir": "out/hf", "output_format": "jsonl"},
            ],
            "num_shards": NUM_SHARDS,
            "batch_size": 4,
        },
        "shard_params": {"max_error_rate": 0.5},  # the JSONL data has 2 bad rows on purpose
        "processing_params": {
            "inputs": [{"name": "title", "key": "doc.title"}, {"name": "n", "key": "n"}],
            "outputs": [
                {"name": "headline", "type": "llm", "output_type": "plain", "prompt": "Write a headline for {{ title }}."},
                {"name": "tagline", "type": "llm", "output_type": "plain", "prompt": "Shorten: {{ headline }}",
                 "sampling_params": {"max_new_tokens": 4}},
            ],
            "remove_columns": True,
            "output_schema": {"title": "{{ title }}", "n": "{{ n }}", "texts": ["{{ headline }}", "{{ tagline }}"]},
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    data = _make_datasets(root)
    proc = run_workflow(root, _config(root, tiny_model, data))
    return root, proc


def test_every_shard_writes_status_with_stats(finished_run):
    root, _ = finished_run
    total_ok = total_failed = 0
    for shard in range(NUM_SHARDS):
        status = json.loads((root / "state" / f"shard_{shard}" / "status.json").read_text())
        assert status["status"] == "success" and status["shard_id"] == shard and status["attempt"] == 1
        assert status["started_at"].endswith("+00:00") and status["finished_at"] >= status["started_at"]
        st = status["stats"]
        assert SHARD_STATS_KEYS <= set(st)
        assert st["num_gpus"] == 0 and st["tokens_per_sec_per_gpu"] is None and st["gpu_days_per_billion_tokens"] is None
        assert st["output_tokens"] > 0 and st["input_tokens"] > st["output_tokens"] / 12
        assert st["tokens_per_sec"] == pytest.approx(st["output_tokens"] / st["inference_runtime_seconds"])
        assert st["model_load_seconds"] > 0 and st["inference_runtime_seconds"] < st["runtime_seconds"]
        assert len(status["datasets"]) == 3
        total_ok += st["rows_processed"]
        total_failed += st["rows_failed"]
    assert (total_ok, total_failed) == (5 + 11 + 5, 2)


def test_bad_rows_are_recorded_not_dropped_silently(finished_run):
    root, _ = finished_run
    errors = [
        json.loads(line) for s in range(NUM_SHARDS) for line in (root / "state" / f"shard_{s}" / "errors.jsonl").read_text().splitlines()
    ]
    by_index = {e["source_index"]: e for e in errors}
    assert set(by_index) == {2, 4}
    assert by_index[2]["error"] == "bad_row" and "in.jsonl:4" in by_index[2]["message"]
    assert by_index[4]["error"] == "missing_variable" and "doc.title" in by_index[4]["message"]


def test_merged_outputs_have_every_good_row_once_in_source_order(finished_run):
    root, _ = finished_run
    jsonl = datasets.load_dataset("parquet", data_dir=str(root / "out/jsonl/merged"), split="train")
    assert jsonl["source_index"] == [0, 1, 3, 5, 6]
    assert jsonl["n"] == [0, 1, 2, 3, 4]  # numbers stay numbers
    assert all(isinstance(t, list) and len(t) == 2 for t in jsonl["texts"])

    parquet = pd.read_parquet(root / "out/parquet/merged")
    assert parquet["source_index"].tolist() == list(range(11))
    assert parquet["title"].tolist() == [f"Title {i}" for i in range(11)]

    hf = [json.loads(line) for p in sorted((root / "out/hf/merged").glob("*.jsonl")) for line in p.read_text().splitlines()]
    assert [r["source_index"] for r in hf] == list(range(5))
    assert set(hf[0]) == {"title", "n", "texts", "source_index"}  # remove_columns


def test_metrics_report_aggregates_all_shards(finished_run):
    root, _ = finished_run
    metrics = json.loads((root / "state" / "metrics.json").read_text())
    agg = metrics["aggregate"]
    assert MMIRAGE_AGGREGATE_KEYS <= set(agg)
    assert agg["completed_shards"] == agg["total_shards"] == NUM_SHARDS and agg["missing_shards"] == []
    assert agg["total_rows_processed"] == 21 and agg["total_rows_failed"] == 2
    assert agg["total_output_tokens"] == sum(s["stats"]["output_tokens"] for s in metrics["per_shard"])
    assert agg["wall_clock_runtime_seconds"] >= agg["max_shard_runtime_seconds"]
    assert "| `total_rows_processed` | 21 |" in (root / "state" / "summary.md").read_text()


def test_rerun_does_nothing(finished_run, tiny_model):
    root, _ = finished_run
    cfg = (root / "pipeline.yaml").read_text()
    import yaml

    proc = run_workflow(root, yaml.safe_load(cfg))
    assert "Nothing to be done" in proc.stdout + proc.stderr


def test_invalid_config_fails_before_any_job(tmp_path, tiny_model):
    data = _make_datasets(tmp_path)
    cfg = _config(tmp_path, tiny_model, data)
    cfg["processing_params"]["outputs"][1]["prompt"] = "Shorten: {{ headlin }}"
    cfg["loading_params"]["num_shard"] = 2
    proc = run_workflow(tmp_path, cfg, check=False)
    assert proc.returncode != 0
    assert "loading_params.num_shard: unknown key (did you mean 'num_shards'?)" in proc.stderr
    del cfg["loading_params"]["num_shard"]
    proc = run_workflow(tmp_path, cfg, check=False)
    assert proc.returncode != 0
    assert "processing_params.outputs[1].prompt: unknown variable 'headlin' (did you mean 'headline'?)" in proc.stderr
    # the message alone: not Snakemake's WorkflowError at common.smk's line, nor a traceback line
    assert "WorkflowError" not in proc.stderr and "common.smk" not in proc.stderr and 'File "' not in proc.stderr
    assert proc.stderr.lstrip().startswith("invalid pipeline config:"), proc.stderr[:500]
    assert not (tmp_path / "state").exists()


def test_configfile_replaces_the_demo_config(tmp_path, tiny_model):
    """Only the user's pipeline runs: the demo's output_schema (which names 'quiz') must not leak in."""
    data = _make_datasets(tmp_path)
    cfg = _config(tmp_path, tiny_model, data)
    cfg["loading_params"]["datasets"] = cfg["loading_params"]["datasets"][2:]
    cfg["processing_params"]["output_schema"] = {}
    cfg["processing_params"]["remove_columns"] = False
    cfg["loading_params"]["num_shards"] = 1
    run_workflow(tmp_path, cfg, "--dry-run")
    proc = run_workflow(tmp_path, cfg)
    assert "smollm2_model" not in proc.stdout + proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "out/hf/shard_0/part-00000.jsonl").read_text().splitlines()]
    assert set(rows[0]) == {"doc", "n", "headline", "tagline", "source_index"}


def test_local_run_prints_no_cluster_resources(finished_run):
    """`snakemake --cores 1` shows what a local run uses, not the SLURM request (profiles/slurm only)."""
    _, proc = finished_run
    shown = [line.strip() for line in (proc.stdout + proc.stderr).splitlines() if line.strip().startswith("resources:")]
    assert shown, "snakemake printed no resources line"
    for line in shown:
        for cluster_only in ("gpu=", "cpus_per_task=", "slurm_extra=", "runtime=", "slurm_account", "slurm_partition", "mem_mb="):
            assert cluster_only not in line, line


def test_small_batch_run_report_draws_rates_over_windows_with_work_in_a_browser(finished_run, tmp_path):
    """Each shard's rows fit a batch or two: the rates start when generation starts (no zero
    line for the model load) and add up to the shard's tokens; the page renders in Chromium."""
    from mirageflow.report.html import load_histories, throughput_series

    root, _ = finished_run
    state = root / "state"
    histories = load_histories(state, list(range(NUM_SHARDS)))
    assert len(histories) == NUM_SHARDS
    for h, (shard, xs, tokens) in zip(histories, throughput_series(histories)):
        started = h["generation_started"]
        assert started is not None and started > 0  # progress.json says when generation began, after the load
        offset = xs[0] * 60 - started  # the shard's start on the common clock
        assert all(x * 60 >= offset + started - 1e-6 for x in xs)  # nothing drawn during the model load
        assert all(t > 0 for t in tokens[:-2])  # a zero is only the last window (after the last row finished)
        drawn = sum(tokens[i] * (xs[i + 1] - xs[i]) * 60 for i in range(0, len(xs), 2))
        assert drawn == pytest.approx(h["history"][-1][2], rel=1e-6)  # every token of the attempt, once (none before)
    page = state / "report.html"
    parsed = dom(page)
    assert parsed.count("<figcaption>") == parsed.count("<img ") >= 3  # shards, throughput, tokens (+ errors)
    assert "A step at zero is a window in which no tokens were added" in parsed and "a flat stretch is time in" in parsed
    size, colours = pixels(screenshot(page, tmp_path / "report.png"))
    assert size == (1280, 3000) and len(colours) > 300 and near(colours, "#3b6fb6") > 5_000
