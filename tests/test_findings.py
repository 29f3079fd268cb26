"""The report's findings (report/findings.py): each rule fires on a crafted state directory that
shows its symptom, and stays silent on a healthy one and on a near miss."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mirageflow.errors import RowError, RowErrorClass as E
from mirageflow.files import atomic_write_json
from mirageflow.prompts.json_output import OutputError, OutputSchema, parse_answer
from mirageflow.report import aggregate, findings as F
from mirageflow.state.layout import StateLayout
from mirageflow.state.records import check_status, read

NUM_SHARDS = 4
GPU = "NVIDIA H100 80GB HBM3"


def healthy_stats(shard: int) -> dict:
    """A shard that needs no change: busy engine and GPUs, big batch, few cut answers, short load."""
    runtime, load, gen = 1000.0 + 10 * shard, 60.0, 900.0
    return {
        "runtime_seconds": runtime, "model_load_seconds": load, "warmup_seconds": 5.0, "generation_seconds": gen,
        "inference_runtime_seconds": gen, "write_seconds": 3.0, "engine_busy_seconds": 0.97 * gen,
        "engine_idle_seconds": 0.03 * gen, "rows_processed": 1000, "rows_failed": 0, "rows_filtered": 0,
        "rows_failed_by_class": {}, "input_tokens": 300_000, "output_tokens": 200_000, "num_gpus": 1,
        "answers": 1000, "answers_length_cut": 10, "json_answers": 1000, "requests": 1000,
        "record_answers": 1000, "record_answers_length_cut": 10, "record_json_answers": 1000,
        "gpu_util_mean": 93.0, "gpu_sampled_seconds": gen, "peak_inflight": 256,
        "roofline_tokens_per_sec_per_gpu": 300.0, "roofline_fraction": 0.74, "roofline_batch": 256,
    }  # fmt: skip


def write_run(root: Path, change=lambda shard, st: None, errors: dict[int, list[dict]] | None = None) -> Path:
    """A finished run's state directory, written as the shard jobs write it; ``change(shard, stats)``
    edits a shard's stats first, ``errors`` adds errors.jsonl lines."""
    state = root / "state"
    paths = StateLayout(state)
    for shard in range(NUM_SHARDS):
        st = healthy_stats(shard)
        change(shard, st)
        end = st["runtime_seconds"]
        status = {
            "status": "success", "shard_id": shard, "num_shards": NUM_SHARDS, "attempt": 1, "hostname": f"gpu{shard}",
            "started_at": "2026-01-01T10:00:00+00:00", "finished_at": f"2026-01-01T{10 + int(end // 3600):02d}:{int(end % 3600 // 60):02d}:{int(end % 60):02d}+00:00",
            "hardware": {"gpu_name": GPU}, "stats": st,
        }  # fmt: skip
        assert check_status(status, shard) is None  # the crafted file is one the state contract accepts
        atomic_write_json(paths.status(shard), status)
        assert read(paths.status(shard))[1] is None
    for shard, lines in (errors or {}).items():
        paths.errors(shard).write_text("".join(json.dumps(e) + "\n" for e in lines), encoding="utf-8")
    return state


def fired(state: Path) -> dict[str, dict]:
    metrics = aggregate.full_metrics(state, NUM_SHARDS)
    return {f["id"]: f for f in metrics["findings"]}


def schema_error_entry(output: str, answer: str, schema: dict, row: int) -> dict:
    """An errors.jsonl entry as the shard writes it for a JSON answer that fails its schema."""
    try:
        parse_answer(answer, OutputSchema.parse(schema, "output_schema").validator(), truncated=False)
    except OutputError as e:
        exc = RowError("output", e.kind, f"output '{output}': {e}", raw=answer)
    else:
        raise AssertionError("the answer is valid")
    return {"dataset": 0, "source_index": row, "stage": exc.stage, "error": exc.kind, "message": str(exc), "raw": exc.raw}


SCHEMA = {"title": "string", "year": "integer", "tags": "string"}


def _starved(shard, st):
    st.update(engine_busy_seconds=0.5 * 900, engine_idle_seconds=0.5 * 900, gpu_util_mean=35.0)


def _starved_but_gpu_busy(shard, st):  # idle gaps, yet the GPUs were busy: not starved
    st.update(engine_busy_seconds=0.5 * 900, engine_idle_seconds=0.5 * 900, gpu_util_mean=85.0)


def _small_window(shard, st):
    st.update(roofline_batch=8, peak_inflight=8)  # 200,000 tokens in 900 s = 74 % of the 300 tokens/s ceiling


def _small_window_far_from_roofline(shard, st):  # small batch, but the engine is far below its ceiling
    st.update(roofline_batch=8, peak_inflight=8, roofline_tokens_per_sec_per_gpu=1200.0, roofline_fraction=0.19)


def _length_cut(shard, st):
    st.update(record_answers_length_cut=120)


def _length_cut_at_threshold(shard, st):
    st.update(record_answers_length_cut=int(F.LENGTH_CUT_MAX_SHARE * st["record_answers"]))


def _skew(shard, st):
    if shard == 3:
        st.update(runtime_seconds=3000.0, input_tokens=900_000, output_tokens=500_000)


def _slow_node(shard, st):  # a straggler whose rows are ordinary: not skew
    if shard == 3:
        st.update(runtime_seconds=3000.0)


def _load(shard, st):
    st.update(runtime_seconds=200.0, model_load_seconds=120.0, generation_seconds=70.0, inference_runtime_seconds=70.0,
              engine_busy_seconds=68.0, engine_idle_seconds=2.0, gpu_sampled_seconds=70.0)  # fmt: skip


def _load_short(shard, st):
    st.update(model_load_seconds=0.2 * st["runtime_seconds"])


def _deterministic(shard, st):
    st.update(rows_failed=7, rows_failed_by_class={"context_length": 5, "json_parse": 2})


def _transient(shard, st):
    st.update(rows_failed=7, rows_failed_by_class={"json_parse": 4, "aborted": 3})


ONE_FIELD = {0: [schema_error_entry("meta", '{"title": "a", "tags": "x"}', SCHEMA, i) for i in range(6)]
             + [schema_error_entry("meta", '{"title": 3, "year": 1, "tags": "x"}', SCHEMA, 10)]}  # fmt: skip
SPREAD = {0: [schema_error_entry("meta", '{"title": "a", "tags": "x"}', SCHEMA, i) for i in range(3)]
          + [schema_error_entry("meta", '{"title": 1, "year": 2, "tags": "x"}', SCHEMA, 10 + i) for i in range(3)]
          + [schema_error_entry("meta", '{"title": "t", "year": 2, "tags": 5}', SCHEMA, 20 + i) for i in range(3)]}  # fmt: skip

CASES = {  # rule id: (state where it must fire, near miss where it must not)
    "engine_starved": ((_starved, None), (_starved_but_gpu_busy, None)),
    "window_too_small": ((_small_window, None), (_small_window_far_from_roofline, None)),
    "length_cut": ((_length_cut, None), (_length_cut_at_threshold, None)),
    "json_field": ((lambda s, st: None, ONE_FIELD), (lambda s, st: None, SPREAD)),
    "skew_stragglers": ((_skew, None), (_slow_node, None)),
    "load_dominates": ((_load, None), (_load_short, None)),
    "repeating_errors": ((_deterministic, None), (_transient, None)),
}


def test_every_rule_has_a_case():
    assert set(CASES) == {r.id for r in F.RULES}


def test_a_healthy_run_has_no_findings(tmp_path):
    state = write_run(tmp_path)
    assert fired(state) == {}
    assert "None: no figure crossed a threshold" in (aggregate.write_report(state, NUM_SHARDS) and (state / "summary.md").read_text())


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_fires_on_its_symptom(tmp_path, rule):
    change, errors = CASES[rule][0]
    found = fired(write_run(tmp_path, change, errors))
    assert rule in found, found
    f = found[rule]
    assert f["evidence"] and f["threshold"] and f["config_key"] and f["remedy"]


@pytest.mark.parametrize("rule", sorted(CASES))
def test_rule_is_silent_on_a_near_miss(tmp_path, rule):
    change, errors = CASES[rule][1]
    assert rule not in fired(write_run(tmp_path, change, errors))


def test_json_field_names_the_output_and_the_field(tmp_path):
    f = fired(write_run(tmp_path, errors=ONE_FIELD))["json_field"]
    assert "6 of 7 JSON schema failures" in f["evidence"] and "field 'year' of output 'meta'" in f["evidence"]
    assert f["config_key"].startswith("processing_params.outputs[meta].output_schema ('year')")


def test_repeating_errors_name_each_deterministic_class_and_its_key(tmp_path):
    f = fired(write_run(tmp_path, _deterministic))["repeating_errors"]
    assert "context_length 20" in f["evidence"] and "json_parse" not in f["evidence"]  # 4 shards x 5
    assert E.CONTEXT_LENGTH.deterministic and not E.JSON_PARSE.deterministic
    assert "context_length: server_args.extra_engine_args.context_length" in f["config_key"]


def test_evidence_quotes_the_figure_and_threshold(tmp_path):
    f = fired(write_run(tmp_path, _length_cut))["length_cut"]
    assert f["evidence"] == "12.0 % of answers (480 of 4,000) stopped at max_new_tokens"
    assert f["threshold"] == "share cut > 5.0 %"
    assert f["config_key"] == "sampling_params.max_new_tokens"


def test_findings_come_first_in_summary_and_report(tmp_path):
    state = write_run(tmp_path, _load)
    aggregate.write_report(state, NUM_SHARDS)
    summary = (state / "summary.md").read_text()
    assert summary.index("## Findings") < summary.index("| metric | value | what |")
    assert "**Model load dominates short shards** (load_dominates)" in summary
    assert "`execution_params.shards_per_engine`" in summary
    page = (state / "report.html").read_text()
    assert page.index('<h2 id="findings">') < page.index("<h2", page.index('<h2 id="findings">') + 1)
    assert "execution_params.shards_per_engine" in page
    assert json.loads((state / "metrics.json").read_text())["findings"][0]["id"] == "load_dominates"


def test_findings_escape_what_the_data_wrote(tmp_path):
    hostile = {0: [schema_error_entry("m<b>", '{"title": "a", "tags": "x"}', SCHEMA, i) for i in range(6)]}
    state = write_run(tmp_path, errors=hostile)
    aggregate.write_report(state, NUM_SHARDS)
    page = (state / "report.html").read_text()
    assert "of output &#x27;m&lt;b&gt;&#x27;" in page and "m<b>" not in page


def test_damaged_errors_lines_are_skipped_not_fatal(tmp_path):
    state = write_run(tmp_path, errors=ONE_FIELD)
    with open(StateLayout(state).errors(0), "a", encoding="utf-8") as f:
        f.write('{"error": "json_schema", "message": \n\x00garbage json_schema\n[1, 2]\n')
    assert "6 of 7 JSON schema failures" in fired(state)["json_field"]["evidence"]


def test_mmirage_stats_diagnose(tmp_path):
    state = write_run(tmp_path, _starved)
    config = tmp_path / "config.yaml"
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"q": f"x{i}"}) + "\n" for i in range(NUM_SHARDS)))
    config.write_text(yaml.safe_dump({
        "processors": [{"type": "llm", "backend": "openai", "base_url": "http://127.0.0.1:9/v1", "server_args": {"model_path": "m"}}],
        "loading_params": {"state_dir": str(state), "num_shards": NUM_SHARDS,
                           "datasets": [{"path": str(data), "type": "jsonl", "output_dir": str(tmp_path / "out")}]},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}]},
    }))  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "mirageflow.cli", "stats", "--config", str(config), "--diagnose"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("The engine is starved [engine_starved]")
    assert "change:    shard_params.max_inflight, loading_params.batch_size" in out.stdout


def test_docs_list_every_threshold_with_its_value():
    readme = (Path(__file__).resolve().parents[1] / "docs" / "report.md").read_text()
    names = [n for n in vars(F) if n.isupper() and isinstance(getattr(F, n), (int, float))]
    assert len(names) >= 12
    for name in names:
        value = getattr(F, name)
        shown = f"{value:g}" if isinstance(value, float) and value >= 1 else (f"{value:.2f}" if isinstance(value, float) else str(value))
        assert f"`{name}` = {shown}" in readme, name
