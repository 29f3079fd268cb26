"""MMIRAGE's spellings with MMIRAGE's meaning: api_llm, max_tokens, chat_template, unnamed
filters, {split: path} datasets, source_index in output_schema (issue 21)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import run_workflow
from fakes.fake_http import FakeServer

from mirageflow.config import ConfigError, load_config, records_identity
from mirageflow.prompts.templates import RecordRenderer, RowError


@pytest.fixture
def data(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps({"text": f"sentence number {i}" + "!" * i}) + "\n" for i in range(6)))
    return path


def _cfg(tmp_path: Path, data: Path, processor: dict, **pp) -> dict:
    return {
        "processors": [processor],
        "loading_params": {"datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out")}]},
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}],
            "outputs": [{"name": "answer", "type": processor["type"], "prompt": "Say: {{ text }}"}],
            **pp,
        },
    }


def _problems(cfg: dict, **environ) -> list[str]:
    with pytest.raises(ConfigError) as err:
        load_config(cfg, environ=environ)
    return err.value.problems


API_LLM = {
    "type": "api_llm", "model": "openai/gpt-4o-mini", "api_key_env": "OPENROUTER_API_KEY",
    "base_url": "https://openrouter.ai/api/v1", "default_sampling_params": {"temperature": 0.1, "max_tokens": 64},
    "max_concurrency": 4,
}  # fmt: skip


# --------------------------------------------------------------------------- api_llm and max_tokens


def test_api_llm_is_our_openai_engine_with_mmirages_defaults(tmp_path, data):
    proc = load_config(_cfg(tmp_path, data, dict(API_LLM)), environ={}).processors["api_llm"]
    assert (proc.backend, proc.model, proc.base_url, proc.api_key_env) == (
        "openai", "openai/gpt-4o-mini", "https://openrouter.ai/api/v1", "OPENROUTER_API_KEY",
    )  # fmt: skip
    assert proc.sampling_params == {"temperature": 0.1, "max_new_tokens": 64}  # OpenAI's max_tokens, our name
    assert (proc.api.max_concurrency, proc.max_retries, proc.api.retry_base_delay) == (4, 3, 1.0)
    bare = load_config(_cfg(tmp_path, data, {"type": "api_llm", "model": "m"}), environ={}).processors["api_llm"]
    assert (bare.base_url, bare.api_key_env, bare.api.max_concurrency, bare.max_retries) == (
        "https://api.openai.com/v1",
        "OPENAI_API_KEY",
        8,
        3,
    )
    from mirageflow.engines.openai_engine import OpenAIEngine

    engine = OpenAIEngine(proc)
    assert (engine.max_inflight, engine.retry_base_delay) == (4, 1.0)
    assert OpenAIEngine(bare).max_inflight == 8


def test_api_llm_mistakes_name_the_key(tmp_path, data):
    problems = _problems(_cfg(tmp_path, data, {"type": "api_llm", "backend": "sglang", "server_args": {"model_path": "x"}}))
    assert "processors[0].backend: an api_llm processor is an OpenAI-compatible endpoint (backend openai), not 'sglang'" in problems
    assert any(p.startswith("processors[0].model: required by type api_llm") for p in problems)
    assert any(p.startswith("processors[0].server_args: an api_llm processor has no server_args") for p in problems)


def test_max_tokens_belongs_to_openai_endpoints_only(tmp_path, data, tiny_model):
    llm = {"type": "llm", "server_args": {"model_path": str(tiny_model)}, "default_sampling_params": {"max_tokens": 8}}
    (p,) = _problems(_cfg(tmp_path, data, llm))
    assert p.startswith("processors[0].default_sampling_params.max_tokens: not a sampling parameter of this engine (SGLang rejects it")
    both = dict(API_LLM, default_sampling_params={"max_tokens": 8, "max_new_tokens": 8})
    (p,) = _problems(_cfg(tmp_path, data, both))
    assert p.startswith("processors[0].default_sampling_params.max_tokens: and max_new_tokens both set")
    cfg = _cfg(tmp_path, data, dict(API_LLM))
    cfg["processing_params"]["outputs"][0]["sampling_params"] = {"max_tokens": 5}
    assert load_config(cfg, environ={}).outputs[0].sampling_params == {"max_new_tokens": 5}
    openai = {"type": "llm", "backend": "openai", "base_url": "http://h/v1", "server_args": {"model_path": "m"},
              "default_sampling_params": {"max_tokens": 7}}  # fmt: skip
    assert load_config(_cfg(tmp_path, data, openai), environ={}).processors["llm"].sampling_params == {"max_new_tokens": 7}


def test_api_llm_check_needs_its_key_in_the_environment(tmp_path, data):
    from mirageflow.config.preflight import validate

    with pytest.raises(ConfigError) as err:
        validate(_cfg(tmp_path, data, {"type": "api_llm", "model": "m"}), environ={})
    assert err.value.problems == [
        "processors[0].api_key_env: environment variable $OPENAI_API_KEY is not set (or empty) here; the jobs inherit this "
        "environment: export OPENAI_API_KEY=... before starting the run"
    ]
    validate(_cfg(tmp_path, data, {"type": "api_llm", "model": "m"}), environ={"OPENAI_API_KEY": "sk"})


def test_api_llm_end_to_end_against_an_openai_compatible_server(tmp_path, data):
    server = FakeServer().start()
    try:
        proc = dict(API_LLM, base_url=f"{server.url}/v1", api_key_env="MIRAGEFLOW_TEST_KEY")
        cfg = _cfg(tmp_path, data, proc, output_schema={"text": "{{ text }}", "answer": "{{ answer }}"})
        cfg["loading_params"]["num_shards"] = 2
        os.environ["MIRAGEFLOW_TEST_KEY"] = "sk-test"
        run_workflow(tmp_path, cfg)
    finally:
        os.environ.pop("MIRAGEFLOW_TEST_KEY", None)
        server.stop()
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "out" / "merged").to_pylist()
    assert [r["source_index"] for r in rows] == list(range(6)) and all(r["answer"] for r in rows)
    status = json.loads((tmp_path / "out/.mirageflow-state/shard_0/status.json").read_text())
    details = status["engines"]["api_llm"]["details"]
    assert status["engines"]["api_llm"]["backend"] == "openai" and details["max_inflight"] == 4 and details["max_retries"] == 3


# --------------------------------------------------------------------------- chat_template


def test_chat_template_is_accepted_with_a_warning(tmp_path, data, tiny_model):
    llm = {"type": "llm", "server_args": {"model_path": str(tiny_model)}, "chat_template": "qwen2-vl"}
    cfg = load_config(_cfg(tmp_path, data, llm), environ={})
    (w,) = cfg.warnings
    assert w.startswith("processors[0].chat_template: 'qwen2-vl' changes nothing here: in MMIRAGE it only picks the image placeholder")
    assert w.endswith("(and this pipeline has no image inputs)")
    plain = load_config(_cfg(tmp_path, data, {"type": "llm", "server_args": {"model_path": str(tiny_model)}}), environ={})
    assert plain.warnings == ()


# --------------------------------------------------------------------------- unnamed filters


def test_an_unnamed_filter_is_mmirages_form(tmp_path, data, tiny_model):
    llm = {"type": "llm", "server_args": {"model_path": str(tiny_model)}}
    cfg = _cfg(tmp_path, data, llm)
    cfg["processing_params"]["outputs"].insert(0, {"type": "filter", "predicate": "text | length > 18"})
    loaded = load_config(cfg, environ={})
    assert [(o.name, o.kind) for o in loaded.outputs] == [("filter_0", "filter"), ("answer", "llm")]
    del cfg["processing_params"]["outputs"][1]["name"]
    assert _problems(cfg) == ["processing_params.outputs[1].name: required key is missing (the variable that holds the output)"]


# --------------------------------------------------------------------------- {split: path}


def test_a_split_mapping_is_one_dataset_per_split(tmp_path, data, tiny_model):
    test = tmp_path / "test.jsonl"
    test.write_text(json.dumps({"text": "held out"}) + "\n")
    cfg = _cfg(tmp_path, data, {"type": "llm", "server_args": {"model_path": str(tiny_model)}})
    cfg["loading_params"]["datasets"][0]["path"] = {"train": str(data), "test": str(test)}
    loaded = load_config(cfg, environ={})
    assert [(d.index, d.path, d.output_dir, d.key) for d in loaded.datasets] == [
        (0, str(data), str(tmp_path / "out" / "train"), "loading_params.datasets[0]"),
        (1, str(test), str(tmp_path / "out" / "test"), "loading_params.datasets[0]"),
    ]
    assert loaded.state_dir == str(tmp_path / "out" / ".mirageflow-state")  # above the splits
    assert [d["output_dir"] for d in records_identity(loaded)["datasets"]] == [str(tmp_path / "out" / s) for s in ("train", "test")]
    cfg["loading_params"]["datasets"][0]["path"] = {"train": str(tmp_path / "missing.jsonl"), "../up": str(test)}
    problems = _problems(cfg)
    missing = f"loading_params.datasets[0].path: JSONL file '{tmp_path / 'missing.jsonl'}' does not exist"
    assert any(p.startswith(missing) for p in problems), problems  # a "did you mean" may follow
    assert any(p.startswith("loading_params.datasets[0].path.../up: '../up' cannot name the split's output folder") for p in problems)


def test_splits_run_end_to_end_each_into_its_own_folder(tmp_path, data):
    test = tmp_path / "test.jsonl"
    test.write_text("".join(json.dumps({"text": f"held out {i}"}) + "\n" for i in range(3)))
    script = tmp_path / "steps.py"
    script.write_text("def shout(row):\n    return row['text'].upper()\n")
    cfg = _cfg(tmp_path, data, {"type": "custom", "script_path": str(script), "function_name": "shout"},
               output_schema={"text": "{{ text }}", "loud": "{{ answer }}", "source_index": "{{ source_index }}"})  # fmt: skip
    del cfg["processing_params"]["outputs"][0]["prompt"]
    cfg["loading_params"]["datasets"][0].update(path={"train": str(data), "test": str(test)}, output_format="jsonl")
    run_workflow(tmp_path, cfg)
    for split, n in (("train", 6), ("test", 3)):
        lines = (tmp_path / "out" / split / "merged" / "part-00000.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        assert [r["source_index"] for r in records] == list(range(n)) and records[0]["loud"] == records[0]["text"].upper()


# --------------------------------------------------------------------------- source_index


def test_source_index_is_a_builtin_of_output_schema(tmp_path, data, tiny_model):
    cfg = _cfg(tmp_path, data, {"type": "llm", "server_args": {"model_path": str(tiny_model)}},
               output_schema={"id": "row-{{ source_index }}", "source_index": "{{ source_index }}"})  # fmt: skip
    load_config(cfg, environ={})
    render = RecordRenderer(cfg["processing_params"]["output_schema"], True, ["answer"])
    assert render(7, {"text": "x"}, {"text": "x", "answer": "a"}) == {"id": "row-7", "source_index": 7}
    # an input named source_index (mmirage_recovery.yaml) shadows it: its value must be the row's index
    assert render(3, {}, {"source_index": "3", "answer": "a"})["source_index"] == 3
    with pytest.raises(RowError) as err:
        render(3, {}, {"source_index": 12, "answer": "a"})
    assert err.value.kind == "template_error"
    assert "processing_params.output_schema.source_index: 12 is not this row's source_index 3" in str(err.value)
    cfg["processing_params"]["outputs"][0]["prompt"] = "{{ source_index }}"  # in prompts it is not a variable
    assert any("source_index" in p for p in _problems(cfg))
