"""`mmirage preview`: variables, prompts as the engine receives them and records for the first rows,
answers with --generate; never the pipeline's state_dir or outputs."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from fakes.configs import pipeline_config

from mirageflow import cli
from mirageflow.shard import preview
from mirageflow.config import load_config


def _config(model, outputs=None, rows=None) -> dict:
    return pipeline_config(
        model=model, num_shards=2, loading={"batch_size": 4},
        inputs=["q", {"name": "level", "key": "meta.level"}],
        outputs=outputs or [
            {"name": "a", "prompt": "Answer briefly: {{ q }}", "system": "You are terse (level {{ level }})."},
            {"name": "b", "prompt": "Rephrase: {{ a }}"},
        ],
        processor={"backend": "transformers", "default_sampling_params": {"temperature": 0.0, "max_new_tokens": 5}},
        processing={"remove_columns": True, "output_schema": {"question": "{{ q }}", "answer": "{{ a }}", "again": "{{ b }}"}},
    )  # fmt: skip


def _workdir(root: Path, cfg: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"q": f"question {i}", "meta": {"level": i}} for i in range(5)]
    rows[1] = {"q": "no meta here"}  # missing_variable
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "pipeline.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return root


def mmirage(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "mirageflow.cli", *args], cwd=cwd, capture_output=True, text=True, env=env)


def test_preview_shows_variables_prompts_with_the_chat_template_and_records(tmp_path, tiny_model, monkeypatch):
    root = _workdir(tmp_path / "p", _config(tiny_model))
    monkeypatch.chdir(root)
    import transformers

    def no_model(*a, **kw):
        raise AssertionError("preview without --generate must not load the model")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_model)
    cfg = load_config("pipeline.yaml")
    result = preview.preview(cfg, rows=3)
    rows = result["datasets"][0]["rows"]
    assert [r["source_index"] for r in rows] == [0, 1, 2] and result["generated"] is False
    assert rows[0]["variables"] == {"q": "question 0", "level": 0}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tiny_model))
    messages = [{"role": "system", "content": "You are terse (level 0)."}, {"role": "user", "content": "Answer briefly: question 0"}]
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    a, b = rows[0]["outputs"]
    assert a["prompt"] == expected and a["messages"] == messages  # exactly what the engine receives
    assert "<|im_start|>" in a["prompt"]
    assert "Rephrase: <a: not generated>" in b["prompt"]  # a later prompt shows where the answer goes
    assert rows[0]["record"] == {"question": "question 0", "answer": "<a: not generated>", "again": "<b: not generated>", "source_index": 0}
    assert rows[1]["error"]["error"] == "missing_variable" and "meta.level" in rows[1]["error"]["message"] and rows[1]["record"] is None
    assert not (root / "state").exists() and not (root / "out").exists()


def test_preview_command_prints_and_never_touches_the_pipelines_state_or_outputs(tmp_path, tiny_model):
    root = _workdir(tmp_path / "p", _config(tiny_model))
    (root / "state/shard_0").mkdir(parents=True)
    (root / "state/shard_0/status.json").write_text('{"status": "success"}')
    (root / "out").mkdir()

    def snapshot():
        return sorted((str(p.relative_to(root)), p.stat().st_mtime_ns) for p in root.rglob("*") if "state" in p.parts or "out" in p.parts)

    before = snapshot()
    proc = mmirage(root, "preview", "--config", "pipeline.yaml", "--rows", "2")
    assert proc.returncode == cli.EXIT_FAILED, proc.stderr  # row 1 has no meta.level
    out = proc.stdout
    assert "=== dataset 0: in.jsonl (first 2 row(s)) ===" in out and "--- row 0 ---" in out
    assert "prompt as the engine receives it:" in out and "| <|im_start|>system" in out
    assert "ROW ERROR (extract, missing_variable)" in out and "record (as a shard writes it):" in out and "--generate" in out
    proc = mmirage(root, "preview", "--config", "pipeline.yaml", "--rows", "3", "--generate", "--json")
    assert "Loading weights" not in proc.stderr + proc.stdout  # no raw progress bars
    result = json.loads(proc.stdout)
    rows = result["datasets"][0]["rows"]
    assert result["generated"] is True and len(rows) == 3
    first = rows[0]
    assert first["outputs"][0]["completion_tokens"] > 0 and isinstance(first["outputs"][0]["answer"], str)
    assert first["record"]["answer"] == first["outputs"][0]["value"] == first["outputs"][0]["answer"]
    assert (
        first["record"]["again"] == first["outputs"][1]["answer"]
        and "Rephrase: " + first["outputs"][0]["answer"] in first["outputs"][1]["prompt"]
    )
    assert rows[1]["error"]["error"] == "missing_variable"
    assert snapshot() == before  # state_dir and output_dir exactly as they were
    assert sorted(p.name for p in root.iterdir()) == ["in.jsonl", "out", "pipeline.yaml", "state"]


def test_preview_generate_shows_parsed_json_and_row_errors(tmp_path, tiny_model):
    outputs = [{
        "name": "card", "prompt": "Describe {{ q }} as JSON", "output_type": "JSON",
        "output_schema": {"title": "string"},
    }]  # fmt: skip
    cfg = _config(tiny_model, outputs=outputs)
    cfg["processing_params"]["output_schema"] = {"q": "{{ q }}", "card": "{{ card }}"}
    root = _workdir(tmp_path / "j", cfg)
    proc = mmirage(root, "preview", "--config", "pipeline.yaml", "--rows", "1", "--generate")
    # the tiny random model writes no JSON: the row's error is shown, with the model's text
    assert proc.returncode == cli.EXIT_FAILED, proc.stderr
    assert "answer (" in proc.stdout and "ROW ERROR (output, json_" in proc.stdout and "model text:" in proc.stdout


def test_preview_of_a_json_output_without_generating_keeps_later_templates_working(tmp_path, tiny_model, monkeypatch):
    outputs = [
        {"name": "card", "prompt": "Describe {{ q }}", "output_type": "JSON",
         "output_schema": {"title": "string"}},
        {"name": "b", "prompt": "Title: {{ card.title }}"},
    ]  # fmt: skip
    cfg = _config(tiny_model, outputs=outputs)
    cfg["processing_params"]["output_schema"] = {"title": "{{ card.title }}", "b": "{{ b }}"}
    root = _workdir(tmp_path / "k", cfg)
    monkeypatch.chdir(root)
    result = preview.preview(load_config("pipeline.yaml"), rows=1)
    row = result["datasets"][0]["rows"][0]
    assert row["error"] is None
    assert "Title: <card.title: not generated>" in row["outputs"][1]["prompt"]
    assert row["record"]["title"] == "<card.title: not generated>"


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "loadable"])
def test_first_rows_of_jsonl_parquet_and_loadable_datasets(tmp_path, fmt):
    import datasets
    import pandas as pd

    frame = pd.DataFrame({"q": [f"r{i}" for i in range(10)]})
    if fmt == "jsonl":  # more rows asked than the file has: the rows there are
        path = tmp_path / "d.jsonl"
        path.write_text("".join(json.dumps({"q": q}) + "\n\n" for q in frame["q"]))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        frame.to_parquet(path)
    else:
        path = tmp_path / "hf"
        datasets.Dataset.from_pandas(frame).save_to_disk(str(path))
    from types import SimpleNamespace

    ds = SimpleNamespace(path=str(path), type=fmt, split=None, index=0)
    rows = preview.first_rows(ds, 3)
    assert [(r.index, r.value["q"]) for r in rows] == [(0, "r0"), (1, "r1"), (2, "r2")]
    assert len(preview.first_rows(ds, 50)) == 10


# --------------------------------------------------------------------------- preview is the record


def _sampled_pipeline(root: Path, server_url: str, native_n: bool) -> dict:
    """n_samples 2, preserve_columns, a filter before the first LLM output, a second output on the
    first one's answer; rows: kept, kept, filtered, missing the input (a row error)."""
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"q": "alpha", "id": "A", "extra": 1}, {"q": "beta", "id": "B"}, {"q": "drop", "id": "C"}, {"id": "D"}]
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "processors": [{"type": "llm", "backend": "openai", "base_url": server_url + "/v1", "native_n": native_n,
                        "server_args": {"model_path": "m"}}],
        "loading_params": {
            "state_dir": str(root / "state"),
            "datasets": [{"path": str(root / "in.jsonl"), "type": "JSONL", "output_dir": str(root / "out"), "output_format": "jsonl"}],
        },
        "shard_params": {"max_error_rate": 1.0, "checkpoint_rows": 2, "checkpoint_min_seconds": 0},
        "processing_params": {
            "inputs": [{"name": "q", "key": "q"}],
            "outputs": [
                {"name": "keep", "type": "filter", "predicate": "q != 'drop'"},
                {"name": "a", "prompt": "Answer {{ q }}"},
                {"name": "b", "prompt": "Again: {{ a }}"},
            ],
            "n_samples": 2, "remove_columns": True, "preserve_columns": ["id"],
            "output_schema": {"answer": "{{ a }}", "again": "{{ b }}"},
        },
    }  # fmt: skip


@pytest.mark.parametrize("native_n", [True, False])
def test_preview_records_are_exactly_what_a_shard_writes(tmp_path, native_n):
    from fakes.fake_http import Behaviour, FakeServer

    from mirageflow.shard.runner import index_datasets, run_shard

    server = FakeServer(Behaviour(seed_in_text=True)).start()  # answers name the seed that drew them
    try:
        cfg = load_config(_sampled_pipeline(tmp_path / "p", server.url, native_n))
        generated = preview.preview(cfg, rows=10, generate=True)
        previewed_requests = list(server.records)
        index_datasets(cfg)
        run_shard(cfg, 0)
    finally:
        server.stop()
    written = [json.loads(line) for p in sorted((tmp_path / "p/out/shard_0").glob("part-*.jsonl")) for line in p.read_text().splitlines()]
    written.sort(key=lambda r: (r["source_index"], r["sample_index"]))
    units = generated["datasets"][0]["rows"]
    # one entry per sample, in source order, each with the record the shard wrote, field for field
    assert [(u["source_index"], u["sample_index"]) for u in units] == [(i, k) for i in range(4) for k in range(2)]
    assert [u["record"] for u in units if u["record"] is not None] == written
    assert set(written[0]) == {"id", "answer", "again", "source_index", "sample_index"} and written[0]["id"] == "A"
    assert written[0]["answer"] != written[1]["answer"]  # each sample its own draw (its own seed)
    assert [u.get("filtered", False) for u in units] == [False] * 4 + [True] * 2 + [False] * 2
    errors = [json.loads(line) for line in (cfg.shard_dir(0) / "errors.jsonl").read_text().splitlines()]
    assert (
        sorted((e["source_index"], e["sample_index"], e["error"]) for e in errors)
        == [(u["source_index"], u["sample_index"], u["error"]["error"]) for u in units if u["error"]]
        == [(3, 0, "missing_variable"), (3, 1, "missing_variable")]
    )
    # the first output's prompt, per sample with its seed; with native n one request per row asks for both samples
    first = units[1]["outputs"]
    assert [o["name"] for o in first] == ["keep", "a", "b"] and first[0]["value"] is True
    assert first[1]["seed"] == units[0]["outputs"][1]["seed"] + 1 and units[1]["record"]["answer"].endswith(f"s={first[1]['seed']}")
    asked_a = [r["body"] for r in previewed_requests if "Answer" in json.dumps(r["body"].get("messages"))]
    assert [b.get("n") for b in asked_a] == ([2, 2] if native_n else [None] * 4)
    # without --generate: the same records' fields and samples, the answers as placeholders
    shown = preview.preview(cfg, rows=10)["datasets"][0]["rows"]
    assert [(u["source_index"], u["sample_index"]) for u in shown] == [(u["source_index"], u["sample_index"]) for u in units]
    assert shown[1]["record"] == {
        "id": "A",
        "answer": "<a: not generated>",
        "again": "<b: not generated>",
        "source_index": 0,
        "sample_index": 1,
    }
    assert shown[1]["outputs"][1]["seed"] == first[1]["seed"] and shown[1]["outputs"][1]["messages"] == first[1]["messages"]


def test_preview_text_names_each_sample(tmp_path):
    from fakes.fake_http import FakeServer

    server = FakeServer().start()
    try:
        cfg = load_config(_sampled_pipeline(tmp_path / "p", server.url, True))
        out = io.StringIO()
        preview.print_preview(preview.preview(cfg, rows=2), out)
    finally:
        server.stop()
    text = out.getvalue()
    assert "(first 2 row(s), 2 samples per row: 4 record(s))" in text
    assert "--- row 0 sample 0 of 2 ---" in text and "--- row 1 sample 1 of 2 ---" in text
    assert '"sample_index": 1' in text and '"id": "B"' in text and "record (as a shard writes it):" in text


def test_an_engine_that_raises_stops_the_preview_as_it_fails_a_shard(tmp_path):
    from fakes.fake_http import FakeServer

    from mirageflow.engines.openai_engine import OpenAIEngine
    from mirageflow.shard.rows import EngineFailed

    class Broken(OpenAIEngine):
        async def generate_one(self, request):
            raise ConnectionError("server went away")

        async def generate_samples(self, request, n):
            raise ConnectionError("server went away")

    server = FakeServer().start()
    try:
        cfg = load_config(_sampled_pipeline(tmp_path / "p", server.url, True))
        with pytest.raises(EngineFailed, match=r"engine 'llm' failed on row 0: ConnectionError: server went away"):
            preview.preview(cfg, rows=1, generate=True, engine_factory=lambda p, b, log_dir=None: Broken(p, b, log_dir=log_dir))
    finally:
        server.stop()


def test_export_prompts_writes_each_samples_request_and_a_row_error_once(tmp_path):
    """run --export-prompts with n_samples 2: a line per sample and LLM output, with its sample_index
    and seed (the request each sample sends), the filter not run, and the failed row's error once."""
    from fakes.fake_http import FakeServer

    server = FakeServer().start()
    try:
        cfg = load_config(_sampled_pipeline(tmp_path / "p", server.url, False))
        out = io.StringIO()
        counts = preview.export_prompts(cfg, out)
        asked = list(server.records)
    finally:
        server.stop()
    assert asked == []  # nothing generated
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    requests = [x for x in lines if "error" not in x]
    assert counts == {"rows": 4, "requests": len(requests), "row_errors": 1}
    # rows 0-2 (the filter is not run), each sample asks both outputs, b's prompt names a's placeholder
    assert [(x["source_index"], x["sample_index"], x["output"]) for x in requests] == [
        (i, k, o) for i in range(3) for k in range(2) for o in ("a", "b")
    ]
    a0, a1 = (x for x in requests if x["source_index"] == 0 and x["output"] == "a")
    assert a1["seed"] == a0["seed"] + 1 and a0["messages"] == a1["messages"] and a0["needs"] == []
    assert [x["needs"] for x in requests if x["output"] == "b"][0] == ["a"]
    (error,) = [x for x in lines if "error" in x]
    assert error["source_index"] == 3 and error["error"]["error"] == "missing_variable" and "sample_index" not in error
