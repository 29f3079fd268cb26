"""The HTTP engines against real sockets: ``sglang_server`` launching a stand-in server
process (tests/fakes/fake_sglang_server.py), and ``openai`` against a fake server in a thread."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

from fakes import alive, drive, stand_in_command
from fakes.fake_http import Behaviour, FakeServer
from fakes.http_engines import processor, req
from mirageflow.config import ConfigError, load_config
from mirageflow.engines.wire import Request
from mirageflow.engines.http import EngineError, backoff_delay, parse_prometheus, redact
from mirageflow.engines.openai_engine import OpenAIEngine
from mirageflow.engines.sglang_server import SGLangServerEngine, ServerDied, server_flags
from mirageflow.engines.base import EngineStopped

SCHEMA = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<|no_think|>{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture
def fast(monkeypatch):
    """Short waits: quick health polls, retries and kill grace."""
    monkeypatch.setattr(SGLangServerEngine, "health_poll_interval", 0.05)
    monkeypatch.setattr(SGLangServerEngine, "retry_base_delay", 0.01)
    monkeypatch.setattr(SGLangServerEngine, "kill_grace", 2.0)
    monkeypatch.setattr(OpenAIEngine, "retry_base_delay", 0.01)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A tiny local tokenizer with a chat template (what AutoTokenizer loads from the model path)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out = tmp_path_factory.mktemp("tok")
    vocab = {"<unk>": 0, "</s>": 1, **{w: i + 2 for i, w in enumerate("hello world question be brief".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def bos_tokenizer_dir(tmp_path_factory) -> Path:
    """A tokenizer that adds a BOS (like Llama's) and a chat template that starts with it."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    out = tmp_path_factory.mktemp("bos_tok")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate("hello world user assistant".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(out / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %} {{ m['role'] }} {{ m['content'] }}{% endfor %} assistant"
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "chat_template": template}  # fmt: skip
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def child_pid(log: Path) -> int:
    return int(re.search(r"scheduler child pid (\d+)", log.read_text()).group(1))


# --------------------------------------------------------------------------- sglang_server


def test_server_flags():
    assert server_flags({"tp_size": 2, "enable_metrics": True, "disable_custom_all_reduce": False, "context_length": None,
                         "json_model_override_args": {"a": 1}, "cuda_graph_bs": [1, 2]}) == [
        "--tp-size", "2", "--enable-metrics", "--json-model-override-args", '{"a": 1}', "--cuda-graph-bs", "1", "2",
    ]  # fmt: skip
    engine = SGLangServerEngine(processor(server_command=None, server_args={"tp_size": None}), log_dir=None)
    cmd = engine.build_command(1234)
    assert cmd[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert cmd[3:] == ["--model-path", "org/model", "--host", "127.0.0.1", "--port", "1234",
                       "--tp-size", "1", "--dp-size", "1", "--trust-remote-code"]  # fmt: skip


def test_sglang_server_end_to_end(fast, monkeypatch, tmp_path, tokenizer_dir):
    monkeypatch.setenv("FAKE_SGLANG_UNHEALTHY_FOR", "0.4")
    monkeypatch.setenv("FAKE_SGLANG_SPAWN_CHILD", "1")
    monkeypatch.setenv("FAKE_SGLANG_LATENCY", "0.01")
    monkeypatch.setenv("FAKE_SGLANG_HOLD_UNTIL", "8")  # answers wait until the whole window is there
    extra = {"enable_metrics": True, "max_running_requests": 4, "mem_fraction_static": 0.7}
    proc = processor(model=str(tokenizer_dir), extra=extra, apply_chat_template=True, server_args={"tp_size": 2})
    engine = SGLangServerEngine(proc, 32, log_dir=tmp_path / "logs")
    t0 = time.monotonic()
    engine.load()
    try:
        assert time.monotonic() - t0 >= 0.4  # waited through the 503s
        log = tmp_path / "logs" / "sglang_server.log"
        argv = json.loads(re.search(r"fake sglang argv: (.*)", log.read_text()).group(1))
        assert argv == ["--model-path", str(tokenizer_dir), "--host", "127.0.0.1", "--port", str(engine.port),
                        "--tp-size", "2", "--dp-size", "1", "--trust-remote-code", "--enable-metrics",
                        "--max-running-requests", "4", "--mem-fraction-static", "0.7"]  # fmt: skip
        server_pid, scheduler_pid = engine.process.pid, child_pid(log)
        assert alive(server_pid) and alive(scheduler_pid)
        assert engine.max_inflight == 8

        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
        prompt = engine.chat_prompt(messages, {"enable_thinking": False})
        assert prompt == "<|system|>be brief\n<|user|>hello world\n<|no_think|><|assistant|>"
        requests = [req(i, prompt + str(i), SCHEMA if i % 3 == 0 else None, max_new_tokens=5) for i in range(24)]
        completions = drive(engine, requests)
        import httpx2

        peak = httpx2.get(f"{engine.base_url}/get_server_info").json()["peak_in_flight"]
        assert peak == engine.max_inflight  # the window reached the server
        assert engine.info.versions["sglang"] == "0.5.23+fake"
        assert engine.info.details["log"] == str(log)
    finally:
        engine.close()
    assert [c.id for c in completions] == list(range(24))
    assert all(c.text == '{"answer": "yes"}' for c in completions if c.id % 3 == 0)
    assert all(c.finish_reason in ("stop", "length") and c.error_kind is None for c in completions)
    generated = sum(c.completion_tokens for c in completions)
    metrics = engine.info.details["server_metrics"]  # the server's counters: differences over the run
    assert metrics["server"] == "sglang" and metrics["complete"] and metrics["errors"] == []
    assert metrics["generation_tokens"] == generated
    assert metrics["prompt_tokens"] == sum(c.prompt_tokens for c in completions)
    assert metrics["requests"] == 24 and metrics["prefix_cache_hits"] == 0 and metrics["prefix_cache_hit_rate"] == 0
    assert not alive(server_pid) and not alive(scheduler_pid)  # the whole tree is gone


def test_server_that_never_gets_healthy(fast, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_SGLANG_NEVER_HEALTHY", "1")
    monkeypatch.setenv("FAKE_SGLANG_SPAWN_CHILD", "1")
    engine = SGLangServerEngine(processor(server_start_timeout=1.0), log_dir=tmp_path)
    t0 = time.monotonic()
    with pytest.raises(EngineError) as err:
        engine.load()
    assert time.monotonic() - t0 < 5
    message = str(err.value)
    assert "did not become healthy within server_start_timeout=1 s" in message
    assert "fake sglang: loading weights..." in message  # the log tail
    assert str(tmp_path / "sglang_server.log") in message
    assert not alive(engine.process.pid) and not alive(child_pid(tmp_path / "sglang_server.log"))
    engine.close()  # the runner closes after a failed load: harmless


def test_server_that_exits_at_start(fast, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_SGLANG_EXIT_AT_START", "3")
    engine = SGLangServerEngine(processor(), log_dir=tmp_path)
    with pytest.raises(EngineError, match="exited with code 3 before it became healthy") as err:
        engine.load()
    assert "not enough memory for the KV cache" in str(err.value)


def test_server_dying_mid_run_fails_the_requests(fast, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_SGLANG_CRASH_AFTER", "5")
    monkeypatch.setenv("FAKE_SGLANG_LATENCY", "0.05")
    monkeypatch.setenv("FAKE_SGLANG_SPAWN_CHILD", "1")
    engine = SGLangServerEngine(processor(extra={"max_running_requests": 2}, max_restarts=0), log_dir=tmp_path)
    engine.load()
    try:
        with pytest.raises(ServerDied) as err:
            drive(engine, [req(i) for i in range(30)])
        message = str(err.value)
        assert "exited with code 7 during the run" in message
        assert "illegal memory access" in message
        t0 = time.monotonic()
        with pytest.raises(ServerDied, match="exited with code 7"):
            engine.generate([req(99)])
        assert time.monotonic() - t0 < 0.5  # new requests fail at once
    finally:
        engine.close()
    assert not alive(child_pid(tmp_path / "sglang_server.log"))  # the orphaned scheduler too


def test_server_killed_then_frozen_is_restarted_and_every_request_answered(fast, monkeypatch, tmp_path):
    """sglang_server heals as vllm_server does (engines/server_restarts.py): the first server
    kills itself, the second freezes (SIGSTOP) and is killed after hang_seconds; the third
    answers the rest. Each dead server's scheduler child is killed with it."""
    from mirageflow.engines.server_restarts import ServerSupervisor

    monkeypatch.setattr(ServerSupervisor, "restart_base_delay", 0.05)
    monkeypatch.setenv("FAKE_SGLANG_DEATHS", "kill:4,freeze:3")
    monkeypatch.setenv("FAKE_SGLANG_STARTS", str(tmp_path / "starts"))
    monkeypatch.setenv("FAKE_SGLANG_LATENCY", "0.05")
    monkeypatch.setenv("FAKE_SGLANG_SPAWN_CHILD", "1")
    engine = SGLangServerEngine(processor(max_restarts=2, hang_seconds=1.0, max_retries=0), log_dir=tmp_path)
    engine.load()
    try:
        done = drive(engine, [req(i) for i in range(16)], window=3)
        deaths, restarts = engine.deaths(), engine.restarts()
    finally:
        engine.close()
    assert [c.id for c in done] == list(range(16)) and all(c.error_kind is None and c.completion_tokens > 0 for c in done)
    assert restarts == 2 and [d["class"] for d in deaths] == ["killed_by_signal", "frozen"]
    assert all(1 <= d["requests_resent"] <= 3 for d in deaths)
    pids = [int(p) for p in (tmp_path / "starts").read_text().split()]
    children = [int(c) for c in re.findall(r"scheduler child pid (\d+)", (tmp_path / "sglang_server.log").read_text())]
    assert len(pids) == len(children) == 3 and not any(alive(p) for p in pids + children)


def test_retries_and_row_errors_on_generate(fast, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_SGLANG_PLAN", "503,drop,ok,ok")
    with SGLangServerEngine(processor(), log_dir=tmp_path) as engine:
        (ok,) = engine.generate([req(0)])  # survives a 503 and a dropped connection
        (too_long,) = engine.generate([req(1, "TOO_LONG prompt")])
    assert ok.error_kind is None and ok.completion_tokens > 0
    assert (too_long.finish_reason, too_long.error_kind) == ("abort", "context_length")
    assert "HTTP 400" in too_long.error


def test_grammar_length_and_parameter_failures_are_row_errors_without_retries(fast, tmp_path):
    import httpx2

    prompts = ["GRAMMAR_FAIL", "SCHED_TOO_LONG", "fine"]
    with SGLangServerEngine(processor(max_retries=3), log_dir=tmp_path) as engine:
        out = engine.generate([req(i, p, SCHEMA) for i, p in enumerate(prompts)])
        (bad_param,) = engine.generate([req(3, "fine", bogus_param=1)])
        sent = httpx2.get(f"{engine.base_url}/server_info").json()["generate_requests"]
    assert [c.error_kind for c in out] == ["grammar_error", "context_length", None]
    assert "HTTP 500" in out[0].error and "Grammar accept_token failed" in out[0].error
    assert bad_param.error_kind == "invalid_request" and "unknown field `bogus_param`" in bad_param.error
    assert sent == 4  # the 500 of a grammar failure is the request's answer: not retried


def test_sglang_server_constrains_json_after_a_response_prefix(fast, tmp_path):
    """A prefix that opens the JSON object: the server gets the continuation's grammar
    (ebnf; the stand-in compiles it with xgrammar), so prefix + answer is the JSON."""
    prefix = '{"answer": '
    with SGLangServerEngine(processor(), log_dir=tmp_path) as engine:
        plain, prefixed = engine.generate([
            req(0, schema=SCHEMA),
            Request(1, None, "prompt " + prefix, {}, json.dumps(SCHEMA), response_prefix=prefix),
        ])  # fmt: skip
    assert plain.text == '{"answer": "yes"}'  # the schema's grammar starts a whole object
    assert prefixed.error_kind is None and json.loads(prefix + prefixed.text) == {"answer": "yes"}


def test_one_bos_in_the_token_ids_sent(fast, tmp_path, bos_tokenizer_dir):
    import httpx2

    with SGLangServerEngine(processor(model=str(bos_tokenizer_dir), apply_chat_template=True), log_dir=tmp_path) as engine:
        prompt = engine.chat_prompt([{"role": "user", "content": "hello world"}], {})
        assert prompt.startswith("<s>")
        bos = engine.tokenizer.bos_token_id
        assert engine.tokenizer(prompt)["input_ids"][:2] == [bos, bos]  # what SGLang would do with the text
        (c,) = engine.generate([req(0, prompt)])
        (ids,) = httpx2.get(f"{engine.base_url}/server_info").json()["input_ids"]
    assert ids[0] == bos and ids.count(bos) == 1 and c.prompt_tokens == len(ids)


def test_the_stand_in_takes_sglangs_own_flags(tmp_path):
    """The stand-in's parser is SGLang 0.5.23's flag list: flags SGLang has pass, others fail."""
    import subprocess

    env = {**os.environ, "FAKE_SGLANG_EXIT_AT_START": "5"}  # exit once the flags parsed
    base = [*stand_in_command(), "--model-path", "m", "--port", "0"]
    for flags, rc in ((["--schedule-policy", "lpm", "--random-seed", "1", "--enable-metrics"], 5), (["--no-such-flag"], 2)):
        assert subprocess.run([*base, *flags], capture_output=True, env=env).returncode == rc


def test_sigterm_ignored_means_sigkill(fast, monkeypatch, tmp_path):
    monkeypatch.setenv("FAKE_SGLANG_IGNORE_SIGTERM", "1")
    monkeypatch.setattr(SGLangServerEngine, "kill_grace", 0.3)
    engine = SGLangServerEngine(processor(), log_dir=tmp_path)
    engine.load()
    pid = engine.process.pid
    engine.stop()
    with pytest.raises(EngineStopped):
        engine.generate([req(0)])
    engine.close()
    assert not alive(pid)
    assert "ignoring SIGTERM" in (tmp_path / "sglang_server.log").read_text()


# --------------------------------------------------------------------------- openai


@pytest.fixture
def server():
    servers = []

    def start(**behaviour) -> FakeServer:
        s = FakeServer(Behaviour(**behaviour)).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def openai(server: FakeServer, **fields) -> OpenAIEngine:
    fields.setdefault("apply_chat_template", True)
    engine = OpenAIEngine(processor("openai", base_url=server.url + "/v1", **fields))
    engine.load()
    return engine


def test_openai_request_shape_key_and_usage(fast, server, monkeypatch):
    monkeypatch.setenv("MIRAGEFLOW_TEST_KEY", "sk-secret-123")
    s = server()
    engine = openai(s, model="served-name", api_key_env="MIRAGEFLOW_TEST_KEY",
                    chat_template_kwargs={"enable_thinking": False}, sampling_params={"temperature": 0.5})  # fmt: skip
    assert engine.templates_server_side is True
    try:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        requests = [Request(i, messages, None, {"max_new_tokens": 7, "temperature": 0, "top_k": 5, "stop": ["\n"]},
                            json.dumps(SCHEMA) if i == 0 else None) for i in range(4)]  # fmt: skip
        completions = drive(engine, requests)
    finally:
        engine.close()
    assert len(s.records) == 4
    for record in s.records:
        assert record["path"] == "/v1/chat/completions"
        assert record["headers"]["Authorization"] == "Bearer sk-secret-123"
        body = record["body"]
        assert body["model"] == "served-name" and body["messages"] == messages
        assert body["chat_template_kwargs"] == {"enable_thinking": False}
        assert (body["max_tokens"], body["temperature"], body["top_k"], body["stop"]) == (7, 0, 5, ["\n"])
        assert "max_new_tokens" not in body
    json_bodies = [r["body"] for r in s.records if "response_format" in r["body"]]
    assert json_bodies == [json_bodies[0]] and json_bodies[0]["response_format"] == {
        "type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}}  # fmt: skip
    assert completions[0].text == '{"answer": "yes"}'
    assert sum(c.completion_tokens for c in completions) == s.generation_tokens
    assert sum(c.prompt_tokens for c in completions) == s.prompt_tokens > 0
    assert "sk-secret-123" not in json.dumps(vars(engine.info))
    assert "continue_final_message" not in s.records[0]["body"]


def test_openai_response_prefix_continues_the_assistant_message(fast, server):
    s = server()
    engine = openai(s)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Answer:"}]
    try:
        engine.generate([Request(0, messages, None, {})])
    finally:
        engine.close()
    body = s.records[0]["body"]
    assert body["messages"] == messages
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)


def test_openai_sends_the_response_prefix_as_the_message_to_continue(fast, server):
    """Request.response_prefix (here one that opens a JSON object) is the last assistant
    message, continued by the server; the request's own messages are left as they were,
    and no response_format restarts the JSON object after the prefix."""
    s = server()
    engine = openai(s)
    messages = [{"role": "user", "content": "hi"}]
    try:
        engine.generate([Request(0, messages, None, {}, json.dumps(SCHEMA), response_prefix='{"answer": ')])
    finally:
        engine.close()
    body = s.records[0]["body"]
    assert body["messages"] == [*messages, {"role": "assistant", "content": '{"answer": '}]
    assert messages == [{"role": "user", "content": "hi"}]
    assert (body["continue_final_message"], body["add_generation_prompt"]) == (True, False)
    # no schema grammar: the server would apply it from the start of the continuation
    assert "response_format" not in body


def test_openai_reasoning_content_is_kept_apart_from_the_answer(fast, server):
    """A server's reasoning parser answers message.reasoning_content beside the content:
    the Completion carries it as reasoning, never in text (the answer parsed as JSON)."""
    s = server(reasoning='thinking: {"answer": "no"}?')
    engine = openai(s)
    messages = [{"role": "user", "content": "hi"}]
    try:
        (c,) = engine.generate([Request(0, messages, None, {}, json.dumps(SCHEMA))])
    finally:
        engine.close()
    assert c.text == '{"answer": "yes"}' and c.reasoning == 'thinking: {"answer": "no"}?'
    plain = server()
    engine = openai(plain)
    try:
        (c,) = engine.generate([Request(0, messages, None, {})])
    finally:
        engine.close()
    assert c.reasoning is None


def test_openai_missing_api_key_fails_at_load(fast, server, monkeypatch):
    monkeypatch.delenv("MIRAGEFLOW_TEST_KEY", raising=False)
    s = server()
    with pytest.raises(EngineError, match="MIRAGEFLOW_TEST_KEY .*not set"):
        openai(s, api_key_env="MIRAGEFLOW_TEST_KEY")
    assert s.records == []


def test_openai_retries_then_succeeds(fast, server):
    s = server(plan=["429", "503", "drop", "ok"])
    with_engine = openai(s, max_retries=5)
    try:
        (c,) = with_engine.generate([req(0, max_new_tokens=4)])
    finally:
        with_engine.close()
    assert c.error_kind is None and c.text
    assert len(s.records) == 4


def test_openai_gives_up_after_max_retries(fast, server):
    s = server(plan=["503"] * 10)
    engine = openai(s, max_retries=2)
    try:
        with pytest.raises(EngineError, match=r"gave up after 2 retries .*HTTP 503"):
            engine.generate([req(0)])
    finally:
        engine.close()
    assert len(s.records) == 3


def test_openai_timeout_is_retried_then_fails(fast, server):
    s = server(latency=0.5)
    engine = openai(s, request_timeout=0.1, max_retries=1)
    try:
        with pytest.raises(EngineError, match="no answer within request_timeout=0.1 s"):
            engine.generate([req(0)])
    finally:
        engine.close()


def test_openai_row_errors_and_fatal_statuses(fast, server):
    s = server(plan=["ok", "400", "401"])
    engine = openai(s)
    try:
        (too_long,) = engine.generate([req(0, messages=[{"role": "user", "content": "TOO_LONG"}])])
        (bad,) = engine.generate([req(1)])
        with pytest.raises(EngineError, match="HTTP 401"):
            engine.generate([req(2)])
    finally:
        engine.close()
    assert (too_long.error_kind, bad.error_kind) == ("context_length", "invalid_request")
    assert too_long.finish_reason == bad.finish_reason == "abort"


def test_openai_usage_that_is_no_count_fails_that_request_only(fast, server):
    s = server()
    engine = openai(s)
    try:
        bad, good = engine.generate([req(0, messages=[{"role": "user", "content": "USAGE_NEGATIVE"}]), req(1)])
    finally:
        engine.close()
    assert (bad.error_kind, bad.completion_tokens, bad.prompt_tokens) == ("bad_answer", 0, 0)
    assert "usage.completion_tokens is -12000" in bad.error
    assert good.error_kind is None and good.completion_tokens > 0


def test_openai_without_chat_template_uses_completions(fast, server):
    s = server()
    engine = openai(s, apply_chat_template=False)
    try:
        (c,) = engine.generate([Request(0, [{"role": "user", "content": "raw"}], "raw model input", {"max_new_tokens": 3})])
    finally:
        engine.close()
    assert s.records[0]["path"] == "/v1/completions"
    assert s.records[0]["body"]["prompt"] == "raw model input"
    assert c.completion_tokens > 0 and c.text


def test_openai_base_url_with_a_query_and_a_password_works_and_is_never_shown(fast, server, caplog):
    """The query string goes on every request (not before the path), the userinfo becomes
    Basic auth, and neither the password nor a query value reaches a log line, an error or
    the engine info, at any log level."""
    import base64
    import logging

    caplog.set_level(logging.DEBUG)
    s = server(plan=["503", "html", "ok", "503", "503", "503"])
    engine = OpenAIEngine(processor("openai", base_url=s.url.replace("http://", "http://me:hunter2@") + "/v1?api-key=sk-query-1",
                                    apply_chat_template=True, max_retries=2))  # fmt: skip
    engine.load()
    try:
        (c,) = engine.generate([req(0)])  # after a 503 and an HTML page
        with pytest.raises(EngineError) as err:
            engine.generate([req(1)])
    finally:
        engine.close()
    assert c.error_kind is None and c.text
    assert [(r["path"], r["query"]) for r in s.records] == [("/v1/chat/completions", "api-key=sk-query-1")] * 6
    assert s.records[0]["headers"]["Authorization"] == "Basic " + base64.b64encode(b"me:hunter2").decode()
    shown = caplog.text + str(err.value) + json.dumps(vars(engine.info), default=str)
    assert "retry 1/2" in caplog.text and "not JSON" in caplog.text  # the retries were logged...
    assert "hunter2" not in shown and "sk-query-1" not in shown  # ...without the secrets
    assert f"me:***@127.0.0.1:{s.url.rsplit(':', 1)[1]}/v1/chat/completions?api-key=***" in str(err.value)


def test_openai_a_non_json_answer_is_retried_then_fails_naming_the_url(fast, server):
    s = server(plan=["html"] * 5)
    engine = openai(s, max_retries=2)
    try:
        with pytest.raises(EngineError, match=r"POST http://127\.0\.0\.1:\d+/v1/chat/completions: gave up after 2 retries .*"
                                              r"HTTP 200 with a body that is not JSON: .*502 Bad Gateway"):  # fmt: skip
            engine.generate([req(0)])
    finally:
        engine.close()
    assert len(s.records) == 3


def test_openai_stop_fails_the_requests_in_flight_at_once(fast, server):
    import threading

    s = server(latency=5.0)
    engine = openai(s)
    threading.Timer(0.3, engine.stop).start()
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineStopped):
            engine.generate([req(i) for i in range(4)])
    finally:
        engine.close()
    assert time.monotonic() - t0 < 2.0 and engine.queue_depth() == 0


# --------------------------------------------------------------------------- helpers, config


def test_prometheus_parsing_and_backoff():
    text = '# TYPE a counter\na{x="1"} 2.0\na{x="2"} 3\nb 1e3\nc_other 9\n'
    assert parse_prometheus(text, ["a", "b", "c"]) == {"a": 5.0, "b": 1000.0, "c": None}
    delays = [backoff_delay(k, 0.5, 4.0) for k in range(6)]
    assert all(0.25 * 2**k / 2 <= d <= min(4.0, 0.5 * 2**k) for k, d in enumerate(delays[:3]))
    assert max(delays) <= 4.0
    assert backoff_delay(0, 0.5, 30.0, retry_after="7") == 7.0
    argv = ["--model-path", "m", "--api-key", "sk-1", "--tokenizer-path", "t", "--hf-token", "hf-2"]
    assert redact(argv) == ["--model-path", "m", "--api-key", "***", "--tokenizer-path", "t", "--hf-token", "***"]
    assert redact({"api_key": "sk-1", "tp_size": 2, "tokenizer_path": "t"}) == {"api_key": "***", "tp_size": 2, "tokenizer_path": "t"}


def test_config_keys_and_openai_needs_base_url(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"q": "x"}\n')
    cfg = {
        "processors": [{"type": "llm", "backend": "openai", "server_args": {"model_path": "m"}}],
        "loading_params": {"datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "o")}]},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}],
                              "outputs": [{"name": "a", "type": "llm", "output_type": "plain", "prompt": "{{ q }}"}]},
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"processors\[0\]\.base_url: required by backend openai"):
        load_config(cfg)
    cfg["processors"][0].update(base_url="http://h:1/v1", api_key_env="KEY", max_retries="2", server_command=["x", "y"])
    loaded = load_config(cfg)
    proc = loaded.processors["llm"]
    assert (proc.base_url, proc.api_key_env, proc.max_retries, proc.launch) == ("http://h:1/v1", "KEY", 2, None)
    assert [w for w in loaded.warnings if "server_command" in w] == [
        "processors[0].server_command: changes nothing for backend openai (only sglang_server and vllm_server launch a server)"
    ]
    assert (proc.request_timeout, proc.model) == (600, None)


def test_a_password_in_base_url_and_an_api_key_flag_are_never_shown():
    from mirageflow.engines.http import redact

    assert redact(["python", "-m", "sglang.launch_server", "--api-key=sk-1", "--api-key", "sk-2"]) == [
        "python", "-m", "sglang.launch_server", "--api-key=***", "--api-key", "***",
    ]  # fmt: skip
    from mirageflow.engines.openai_engine import OpenAIEngine
    from mirageflow.config import load_config

    cfg = load_config({
        "processors": [{"type": "llm", "backend": "openai", "base_url": "http://me:hunter2@127.0.0.1:9/v1", "server_args": {"model_path": "m"}}],
        "loading_params": {"datasets": [{"path": "x.jsonl", "type": "JSONL", "output_dir": "o"}], "state_dir": "s"},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}]},
    }, check_paths=False)  # fmt: skip
    engine = OpenAIEngine(cfg.processors["llm"], 1)
    engine.load()  # opens a client; nothing is sent
    try:
        shown = json.dumps(vars(engine.info), default=str)
        assert "hunter2" not in shown and "me:***@127.0.0.1" in shown
    finally:
        engine.close()
