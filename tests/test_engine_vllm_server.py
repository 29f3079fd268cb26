"""``backend: vllm_server`` launching a stand-in server process (tests/fakes/fake_vllm_server.py):
flags, environment, health wait, the openai client behind it, the server's metrics, a death
mid-run, SIGTERM ignored, and a shard through the runner. The real vLLM: tests/test_real_vllm.py."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from pathlib import Path

import pytest

from fakes import alive, drive, vllm_stand_in_command
from fakes.http_engines import processor as http_processor
from mirageflow.config import ProcessorConfig, load_config
from mirageflow.engines.base import EngineError, EngineStopped
from mirageflow.engines.registry import create_engine
from mirageflow.engines.wire import Request
from mirageflow.engines.openai_engine import OpenAIEngine
from mirageflow.engines.server_metrics import reconcile
from mirageflow.engines.vllm_server import ServerDied, VLLMServerEngine, iomp_preload
from mirageflow.shard.runner import index_datasets, run_shard

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}


def processor(extra=None, **fields) -> ProcessorConfig:
    """A vllm_server processor on the vLLM stand-in (fakes/http_engines.processor's, chat-templated on the server)."""
    fields = {"server_command": vllm_stand_in_command(), **fields}
    server_args = {"trust_remote_code": False, **fields.pop("server_args", {})}
    served_name = fields.pop("model", None)  # processors[].model (the name the server answers to), not model_path
    made = http_processor("vllm_server", "/models/m", extra, True, server_args=server_args, **fields)
    return dataclasses.replace(made, model=served_name)


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(VLLMServerEngine, "health_poll_interval", 0.05)
    monkeypatch.setattr(VLLMServerEngine, "kill_grace", 2.0)
    monkeypatch.setattr(OpenAIEngine, "retry_base_delay", 0.01)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"question {i}"}]


def test_flags_from_server_args_and_extra_engine_args():
    engine = VLLMServerEngine(processor(
        extra={"max_num_seqs": 8, "enforce_eager": True, "enable_prefix_caching": False, "port": 1, "reasoning_parser": "granite"},
        server_args={"tp_size": 2, "dp_size": 2, "trust_remote_code": True}, model="served", server_command=None,
    ))  # fmt: skip
    cmd = engine.build_command(1234)
    assert cmd[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert cmd[3:] == ["--model", "/models/m", "--host", "127.0.0.1", "--port", "1234", "--tensor-parallel-size", "2",
                       "--data-parallel-size", "2", "--trust-remote-code", "--served-model-name", "served",
                       "--max-num-seqs", "8", "--enforce-eager", "--reasoning-parser", "granite"]  # fmt: skip
    assert engine.max_inflight == 16  # 2 x max_num_seqs
    assert VLLMServerEngine(processor()).max_inflight == 256


def test_intel_openmp_is_preloaded_from_the_servers_environment(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "lib").mkdir()
    (venv / "bin" / "python").write_text("")
    assert iomp_preload([str(venv / "bin" / "python"), "-m", "x"]) is None  # not the CPU build
    (venv / "lib" / "libiomp5.so").write_text("")
    assert iomp_preload([str(venv / "bin" / "python"), "-m", "x"]) == str(venv / "lib" / "libiomp5.so")
    assert iomp_preload(["/usr/bin/env", "vllm"]) is None
    engine = VLLMServerEngine(processor(server_command=[str(venv / "bin" / "python"), "-m", "x"], server_env={"VLLM_CPU_KVCACHE_SPACE": 2}))
    assert engine.server_env() == {"VLLM_CPU_KVCACHE_SPACE": "2", "LD_PRELOAD": str(venv / "lib" / "libiomp5.so")}
    mine = VLLMServerEngine(processor(server_command=[str(venv / "bin" / "python")], server_env={"LD_PRELOAD": "/my/lib.so"}))
    assert mine.server_env() == {"LD_PRELOAD": "/my/lib.so"}  # a given one wins


def test_launch_feed_scrape_and_stop(fast, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_VLLM_UNHEALTHY_FOR", "0.4")
    proc = processor(extra={"max_num_seqs": 4}, server_env={"VLLM_CPU_KVCACHE_SPACE": 2}, native_n=None)
    engine = create_engine(proc, 8, log_dir=tmp_path / "logs")
    assert isinstance(engine, VLLMServerEngine) and engine.templates_server_side
    t0 = time.monotonic()
    engine.load()
    try:
        assert time.monotonic() - t0 >= 0.4  # waited through the 503s
        log = (tmp_path / "logs" / "vllm_server.log").read_text()
        argv = json.loads(re.search(r"fake vllm argv: (.*)", log).group(1))
        assert argv == ["--model", "/models/m", "--host", "127.0.0.1", "--port", str(engine.port),
                        "--tensor-parallel-size", "1", "--max-num-seqs", "4"]  # fmt: skip
        assert json.loads(re.search(r"fake vllm env: (.*)", log).group(1)) == {"VLLM_CPU_KVCACHE_SPACE": "2"}
        server_pid = engine.process.pid
        one = drive(
            engine, [Request(i, messages(i), None, {"max_new_tokens": 5}, json.dumps(SCHEMA) if i == 0 else None) for i in range(6)]
        )
        three = drive(engine, [Request(10, messages(10), None, {"max_new_tokens": 5}, seed=40), Request(11, messages(0), None, {})])
        import asyncio

        samples = asyncio.run(engine.generate_samples(Request(20, messages(20), None, {"max_new_tokens": 9}, seed=70), 3))
        info = engine.info
        assert info.backend == "vllm_server" and info.versions["vllm"] == "0.32.0+fake"
        assert info.details["server_env"] == ["VLLM_CPU_KVCACHE_SPACE"] and info.details["max_inflight"] == 8
    finally:
        engine.close()
    assert not alive(server_pid)
    assert one[0].text == '{"answer": "yes"}' and all(c.error_kind is None for c in one + three + samples)
    assert [c.id for c in samples] == [20, 21, 22] and [c.text.rsplit("s=", 1)[1] for c in samples] == ["70", "71", "72"]
    figures = engine.info.details["server_metrics"]
    assert figures["server"] == "vllm" and figures["complete"] and figures["errors"] == []
    ours_in = sum(c.prompt_tokens for c in one + three + samples)
    assert figures["generation_tokens"] == sum(c.completion_tokens for c in one + three + samples)
    # vLLM counts the prompt of the request with n=3 once per choice; we count it once
    assert figures["prompt_tokens"] == ours_in + 2 * samples[0].prompt_tokens
    assert figures["requests"] == 6 + 2 + 3 and figures["prefix_cache_hits"] == three[1].prompt_tokens > 0  # the prompt asked twice
    assert figures["prefix_cache_hit_rate"] == pytest.approx(figures["prefix_cache_hits"] / figures["prefix_cache_queries"])


def test_token_totals_reconciled_or_explained():
    server = {"prompt_tokens": 300, "generation_tokens": 50}
    assert reconcile(300, 50, 300, server) | {} == {
        "input_tokens": 300, "server_prompt_tokens": 300, "output_tokens": 50, "server_generation_tokens": 50,
        "reconciled": True, "note": None}  # fmt: skip
    native = reconcile(100, 50, 300, server)
    assert native["reconciled"] is True and native["note"].startswith("the server counts a request's prompt once per choice (native n)")
    off = reconcile(290, 50, 290, server)
    assert off["reconciled"] is False and "prompt tokens differ: ours 290, the server's 300" in off["note"]
    assert reconcile(1, 1, 1, {"prompt_tokens": None, "generation_tokens": 3})["reconciled"] is None


def test_a_server_that_never_gets_healthy_or_exits_at_start(fast, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_VLLM_UNHEALTHY_FOR", "60")
    engine = VLLMServerEngine(processor(server_start_timeout=1.0), log_dir=tmp_path)
    with pytest.raises(EngineError, match=r"the vLLM server did not become healthy within server_start_timeout=1 s \(GET /health") as err:
        engine.load()
    assert "Loading weights took" in str(err.value) and not alive(engine.process.pid)
    monkeypatch.setenv("FAKE_VLLM_EXIT_AT_START", "4")
    engine = VLLMServerEngine(processor(), log_dir=tmp_path)
    with pytest.raises(EngineError, match="the vLLM server exited with code 4 before it became healthy") as err:
        engine.load()
    assert "No available memory for the cache blocks" in str(err.value)


def test_a_server_dying_mid_run_fails_the_requests_at_once(fast, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_VLLM_CRASH_AFTER", "3")
    monkeypatch.setenv("FAKE_VLLM_LATENCY", "0.05")
    engine = VLLMServerEngine(processor(max_retries=50, max_restarts=0), log_dir=tmp_path)  # retries would take minutes
    engine.load()
    try:
        t0 = time.monotonic()
        with pytest.raises(
            ServerDied, match=r"the vLLM server .* exited with code 7 during the run \(processors\[\].max_restarts=0: not restarted\)"
        ) as err:
            drive(engine, [Request(i, messages(i), None, {}) for i in range(20)], window=2)
        assert time.monotonic() - t0 < 5
        assert "illegal memory access" in str(err.value)  # the log's tail
        with pytest.raises(ServerDied):
            engine.generate([Request(99, messages(99), None, {})])
    finally:
        engine.close()
    assert engine.info.details["server_metrics"]["complete"] is False  # no last scrape of a dead server


def test_sigterm_ignored_means_sigkill(fast, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_VLLM_IGNORE_SIGTERM", "1")
    monkeypatch.setattr(VLLMServerEngine, "kill_grace", 0.3)
    engine = VLLMServerEngine(processor(), log_dir=tmp_path)
    engine.load()
    pid = engine.process.pid
    engine.stop()
    with pytest.raises(EngineStopped):
        engine.generate([Request(0, messages(0), None, {})])
    engine.close()
    assert not alive(pid)
    assert "ignoring SIGTERM" in (tmp_path / "vllm_server.log").read_text()


def _shard_on_vllm_server(tmp_path) -> dict:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"row {i}"}) + "\n" for i in range(5)))
    cfg = load_config({
        "processors": [{"type": "llm", "backend": "vllm_server", "server_args": {"model_path": "m"},
                        "server_command": vllm_stand_in_command(), "server_start_timeout": 30,
                        "default_sampling_params": {"temperature": 0.7}}],
        "loading_params": {"state_dir": str(tmp_path / "state"),
                           "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out")}]},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}],
                              "n_samples": 2, "remove_columns": True, "output_schema": {"a": "{{ a }}"}},
    }, check_paths=False)  # fmt: skip
    index_datasets(cfg)
    return run_shard(cfg, 0)


def test_a_shard_on_vllm_server_reports_the_engine_and_the_servers_figures(fast, tmp_path):
    status = _shard_on_vllm_server(tmp_path)
    assert status["engines"]["llm"]["backend"] == "vllm_server"
    assert (tmp_path / "state" / "logs" / "shard_0" / "vllm_server.log").exists()
    figures = status["server_metrics"]["llm"]
    st = status["stats"]
    assert figures["backend"] == "vllm_server" and figures["attempt"] == 1
    assert figures["generation_tokens"] == st["output_tokens"]
    assert st["input_tokens_each_choice"] == 2 * st["input_tokens"] == figures["prompt_tokens"]  # native n: one request per row
    tokens = figures["tokens"]
    assert tokens["reconciled"] is True and "once per choice (native n)" in tokens["note"]
    assert st["requests"] == 5


def test_the_report_names_the_engine_and_shows_the_servers_figures(fast, tmp_path):
    from mirageflow.report.aggregate import write_report

    _shard_on_vllm_server(tmp_path)
    metrics = write_report(tmp_path / "state", 1)
    shard = metrics["per_shard"][0]
    assert shard["engines"] == {"llm": "vllm_server (vllm 0.32.0+fake)"}
    agg = metrics["aggregate"]
    assert agg["total_input_tokens_each_choice"] == 2 * agg["total_input_tokens"] > 0  # both counts stated
    servers = metrics["aggregate"]["inference_servers"]
    assert servers["engines"] == 1 and servers["token_totals_reconciled"] == 1
    html = (tmp_path / "state" / "report.html").read_text()
    assert "Inference servers&#x27; own figures" in html or "Inference servers' own figures" in html
    assert "vllm_server (vllm 0.32.0+fake)" in html and "once per choice (native n)" in html
    assert "Inference servers' own figures" in (tmp_path / "state" / "summary.md").read_text()


def test_config_refuses_nothing_new_and_keeps_fingerprints(tmp_path):
    """server_env is operational (not part of the records identity): adding it reruns nothing."""
    from mirageflow.config.loading import records_identity

    base = {"processors": [{"type": "llm", "backend": "vllm_server", "server_args": {"model_path": "m"}}],
            "loading_params": {"datasets": [{"path": str(tmp_path / "x.jsonl"), "type": "JSONL", "output_dir": str(tmp_path / "o")}]},
            "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}],
                                  "n_samples": 2, "output_schema": {"a": "{{ a }}"}, "remove_columns": True}}  # fmt: skip
    a = load_config(json.loads(json.dumps(base)), check_paths=False)
    base["processors"][0]["server_env"] = {"VLLM_CPU_KVCACHE_SPACE": 2}
    base["processors"][0]["native_n"] = True  # allowed on vllm_server
    b = load_config(base, check_paths=False)
    assert records_identity(a) == records_identity(b) and b.processors["llm"].launch.env == {"VLLM_CPU_KVCACHE_SPACE": 2}
    assert Path(vllm_stand_in_command()[1]).exists()


def test_an_engine_service_serves_a_launched_vllm_to_its_shards(fast, tmp_path):
    """shards_per_engine: the service launches one vLLM; its shards send chat messages
    (the server templates them), not prompts rendered in the shard."""
    import os
    import subprocess

    import yaml

    from mirageflow.engines.shared import SharedEngine

    data = tmp_path / "in.jsonl"
    data.write_text(json.dumps({"q": "x"}) + "\n" + json.dumps({"q": "y"}) + "\n")
    raw = {
        "processors": [{"type": "llm", "backend": "vllm_server", "server_args": {"model_path": "m"},
                        "server_command": vllm_stand_in_command(), "server_start_timeout": 30}],
        "loading_params": {"state_dir": str(tmp_path / "state"), "num_shards": 2,
                           "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out")}]},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}]},
        "execution_params": {"shards_per_engine": 2, "merge": False},
    }  # fmt: skip
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(raw))
    endpoint = tmp_path / "state" / "engines" / "engine_0.json"
    cmd = [
        sys.executable,
        "-m",
        "mirageflow.jobs",
        "--config",
        str(path),
        "--log",
        str(tmp_path / "engine.log"),
        "engine",
        "0",
        str(endpoint),
    ]
    proc = subprocess.Popen(cmd, env=os.environ.copy())
    try:
        client = SharedEngine(load_config(raw, check_paths=False).processors["llm"], 4, endpoint=endpoint)
        client.load()
        assert client.templates_server_side and client.info.backend == "vllm_server"
        (c,) = client.generate([Request(0, messages(0), None, {"max_new_tokens": 3})])
        client.close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0
    assert c.error_kind is None and c.text and c.prompt_tokens > 0
    log = (tmp_path / "state" / "logs" / "engine_0" / "vllm_server.log").read_text()
    assert "fake vllm argv" in log
