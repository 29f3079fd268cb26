"""The in-process SGLang engine against a fake ``sglang`` module (no GPU, no sglang install)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import pytest

from fakes import drive
from mirageflow.config import ProcessorConfig, ServerArgs
from mirageflow.engines.base import EngineError
from mirageflow.engines.registry import BACKENDS, create_engine
from mirageflow.engines.wire import Request
from mirageflow.engines.sglang_common import completion_from_output, engine_kwargs, resolve_parallelism
from mirageflow.engines.sglang_engine import SGLangCrashed, SGLangEngine
from mirageflow.engines.base import EngineStopped
from mirageflow.engines.server_restarts import ServerSupervisor

SCHEMA = json.dumps({"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]})


def processor(model="org/model", extra=None, max_restarts=3, **server_args) -> ProcessorConfig:
    args = {"model_path": model, "tp_size": 1, "dp_size": 1, "trust_remote_code": True,
            "disable_custom_all_reduce": False, "extra_engine_args": extra or {}}  # fmt: skip
    args.update(server_args)
    return ProcessorConfig(
        type="llm", backend="sglang", server_args=ServerArgs(**args), sampling_params={}, chat_template_kwargs={},
        apply_chat_template=True, torch_threads=None, max_restarts=max_restarts,
    )  # fmt: skip


@contextlib.contextmanager
def job_log(path: Path):
    """This process's stderr (fd 2) is the file ``path``, as in a job: SGLang's children write
    their tracebacks there, and the engine reads its tail to tell why one failed. (Inside the
    test: pytest puts its capture file back on fd 2 at each phase.)"""
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield path
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@pytest.fixture
def fast_reloads(monkeypatch):
    monkeypatch.setattr(ServerSupervisor, "restart_base_delay", 0.05)  # the backoff reloads share with restarts


def req(i, prompt=None, schema=None, **params) -> Request:
    return Request(i, [{"role": "user", "content": f"q{i}"}], prompt or f"prompt number {i}", params, schema)


def test_json_after_a_response_prefix_is_constrained_from_the_prefix_on(fake_sglang):
    """The prompt ends with a prefix that opens the JSON object: SGLang gets the grammar of
    the continuation (ebnf), not the schema, whose grammar would restart the object."""
    with create_engine(processor(), 32) as engine:
        (fake,) = fake_sglang.ENGINES
        prefix = '{"answer": '
        plain, prefixed = engine.generate([
            req(0, schema=SCHEMA, max_new_tokens=16),
            Request(1, [{"role": "user", "content": "q"}], "prompt " + prefix, {"max_new_tokens": 16}, SCHEMA, response_prefix=prefix),
        ])  # fmt: skip
    sent = [c["sampling_params"] for c in fake.calls]
    assert sent[0]["json_schema"] == SCHEMA and "ebnf" not in sent[0]
    assert "json_schema" not in sent[1] and sent[1]["ebnf"].startswith("root ::= ")
    assert plain.text == '{"answer": "fake"}'
    assert prefixed.text == '"fake"}' and json.loads(prefix + prefixed.text) == {"answer": "fake"}


def test_a_shard_with_a_prefixed_json_output_on_sglang_keeps_every_row(fake_sglang, tmp_path):
    """Through the shard runner: the output's prefix opens the object, the engine constrains
    the continuation, and prefix + answer is each row's valid JSON value."""
    from mirageflow.config import load_config
    from mirageflow.shard.runner import index_datasets, run_shard

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(6)))
    cfg = load_config({
        "processors": [{"type": "llm", "backend": "sglang", "server_args": {"model_path": "org/model", "tp_size": 1}}],
        "loading_params": {"state_dir": str(tmp_path / "state"), "num_shards": 1,
                           "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out"), "output_format": "jsonl"}]},
        "processing_params": {
            "inputs": [{"name": "q", "key": "q"}],
            "outputs": [{"name": "a", "output_type": "JSON", "prompt": "{{ q }}", "output_schema": {"answer": "str"},
                         "response_prefix": '{"answer": '}],
            "remove_columns": True, "output_schema": {"q": "{{ q }}", "a": "{{ a }}"},
        },
    })  # fmt: skip
    index_datasets(cfg)
    status = run_shard(cfg, 0)
    records = [json.loads(line) for p in sorted((tmp_path / "out" / "shard_0").glob("*.jsonl")) for line in p.read_text().splitlines()]
    assert status["stats"]["rows_failed"] == 0 and len(records) == 6
    assert all(r["a"] == {"answer": "fake"} for r in records), records
    (fake,) = fake_sglang.ENGINES
    assert all("ebnf" in c["sampling_params"] and "json_schema" not in c["sampling_params"] for c in fake.calls)


def test_engine_args_are_forwarded_with_extra_args_verbatim(fake_sglang):
    extra = {"max_running_requests": 8, "mem_fraction_static": 0.8, "chunked_prefill_size": 4096, "grammar_backend": "xgrammar"}
    engine = SGLangEngine(processor(tp_size=2, extra=extra), batch_size=32)
    engine.load()
    try:
        (fake,) = fake_sglang.ENGINES
        handler = fake.server_args.pop("custom_sigquit_handler")
        assert handler == engine._on_sigquit  # a crash of SGLang's scheduler must not kill the shard
        assert fake.server_args == {
            "model_path": "org/model", "tp_size": 2, "dp_size": 1, "trust_remote_code": True,
            "disable_custom_all_reduce": False, "max_running_requests": 8, "mem_fraction_static": 0.8,
            "chunked_prefill_size": 4096, "grammar_backend": "xgrammar", "log_level": "error",
        }  # fmt: skip
        json.dumps(engine.info.details)  # status.json material: no handler object in it
        assert engine.max_inflight == 16  # 2 x max_running_requests
        assert engine.info.backend == "sglang"
        assert engine.info.versions["sglang"] == "0.5.23+fake"
        assert engine.info.details["engine_args"]["mem_fraction_static"] == 0.8
    finally:
        engine.close()
    assert fake.shutdown_calls == 1
    engine.close()  # idempotent
    assert fake.shutdown_calls == 1


def test_default_window_and_parallelism_from_the_allocation(fake_sglang, monkeypatch):
    assert SGLangEngine(processor()).max_inflight == 512
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert resolve_parallelism(ServerArgs("m", tp_size=None, dp_size=2)) == (2, 2)
    assert resolve_parallelism(ServerArgs("m", tp_size=None, dp_size=None)) == (4, 1)
    assert resolve_parallelism(ServerArgs("m", tp_size=1, dp_size=1)) == (1, 1)
    assert resolve_parallelism(ServerArgs("m", tp_size=None), {"CUDA_VISIBLE_DEVICES": ""}) == (1, 1)
    kwargs = engine_kwargs(ServerArgs("m", tp_size=None, dp_size=None, extra_engine_args={"tp_size": 3}))
    # extra args win, verbatim
    assert kwargs == {"model_path": "m", "tp_size": 3, "dp_size": 1, "trust_remote_code": False, "disable_custom_all_reduce": False}


def test_generation_json_schema_chat_template_and_tokens(fake_sglang):
    engine = create_engine(processor(extra={"max_running_requests": 4}), 32)
    assert isinstance(engine, SGLangEngine)
    with engine:
        (fake,) = fake_sglang.ENGINES
        requests = []
        for i in range(10):
            messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"question {i}"}]
            prompt = engine.chat_prompt(messages, {"enable_thinking": False})
            requests.append(Request(i, messages, prompt, {"max_new_tokens": 16, "temperature": 0}, SCHEMA if i % 2 else None))
        completions = drive(engine, requests)
    calls = fake.tokenizer_manager.tokenizer.calls
    assert len(calls) == 10  # once per request
    assert all(c["kwargs"] == {"enable_thinking": False} and c["add_generation_prompt"] and not c["tokenize"] for c in calls)
    tok = fake.tokenizer_manager.tokenizer
    sent = {tok.decode(c["input_ids"]): c["sampling_params"] for c in fake.calls}
    assert all(c["prompt"] is None for c in fake.calls)  # token ids, not text
    assert len(sent) == 10 and all(p.endswith("<|no_think|><|assistant|>") for p in sent)
    for r in requests:
        params = sent[" ".join(tok.decode(tok(r.prompt, add_special_tokens=False)["input_ids"]).split())]
        if r.json_schema:
            assert isinstance(params["json_schema"], str) and params["json_schema"] == SCHEMA
        else:
            assert "json_schema" not in params
        assert params["max_new_tokens"] == 16 and params["temperature"] == 0
    assert [c.id for c in completions] == list(range(10))
    assert all(c.text == '{"answer": "fake"}' for c in completions if c.id % 2)
    assert all(c.finish_reason in ("stop", "length") and c.error_kind is None for c in completions)
    assert all(
        c.completion_tokens > 0 and c.prompt_tokens == len(tok(requests[c.id].prompt, add_special_tokens=False)["input_ids"])
        for c in completions
    )
    assert fake.shutdown_calls == 1


def test_the_window_keeps_the_engine_full(fake_sglang):
    engine = SGLangEngine(processor(extra={"max_running_requests": 4}))
    engine.load()
    try:
        (fake,) = fake_sglang.ENGINES
        completions = drive(engine, [req(i) for i in range(64)])
    finally:
        engine.close()
    assert len(completions) == 64
    assert fake.peak_in_flight == engine.max_inflight == 8  # the whole window reached the engine
    assert fake.peak_running == 4  # and it ran at capacity, queueing the rest
    # token counts come from meta_info; the fake's lengths vary
    assert len({c.completion_tokens for c in completions}) > 3


def test_aborts_and_rejections_become_failed_completions(fake_sglang):
    with SGLangEngine(processor()) as engine:
        aborted, too_long, ok = engine.generate([req(0, "please ABORT"), req(1, "TOO_LONG prompt"), req(2)])
    assert (aborted.finish_reason, aborted.error_kind) == ("abort", "aborted")
    assert "fake abort" in aborted.error
    assert (too_long.finish_reason, too_long.error_kind, too_long.completion_tokens) == ("abort", "context_length", 0)
    assert "context length" in too_long.error
    assert ok.error_kind is None


def test_one_bos_where_sglang_would_add_a_second(fake_sglang):
    """The template starts with <s>; SGLang tokenizes text with add_special_tokens=True."""
    with SGLangEngine(processor()) as engine:
        (fake,) = fake_sglang.ENGINES
        tok = fake.tokenizer_manager.tokenizer
        prompt = engine.chat_prompt([{"role": "user", "content": "hi"}], {})
        assert prompt.startswith("<s>")
        assert tok(prompt)["input_ids"][:2] == [1, 1]  # what sending the text would do
        engine.generate([Request(0, None, prompt, {}), Request(1, None, "a raw prompt", {})])
    templated, raw = (c["input_ids"] for c in fake.calls)
    assert templated[0] == 1 and templated[1] != 1 and templated.count(1) == 1
    assert raw[0] == 1 and raw.count(1) == 1  # a raw prompt gets the tokenizer's one BOS


def test_grammar_and_length_failures_are_row_errors(fake_sglang):
    prompts = ["GRAMMAR_FAIL here", "SCHED_TOO_LONG", "KV_BUDGET", "TOO_LONG", "fine"]
    with SGLangEngine(processor()) as engine:
        out = engine.generate([req(i, p, schema=SCHEMA) for i, p in enumerate(prompts)])
    assert [c.error_kind for c in out] == ["grammar_error", "context_length", "context_length", "context_length", None]
    assert "Grammar accept_token failed" in out[0].error and "status 500" in out[0].error
    assert all(c.finish_reason == "abort" for c in out[:4])


def test_a_scheduler_crash_without_reloads_fails_the_shard_with_its_cause(fake_sglang, tmp_path):
    """SGLang's scheduler signals SIGQUIT and never answers; max_restarts=0: every request fails at once."""
    t0 = time.monotonic()
    expected = (
        r"the SGLang engine died 1 times and was reloaded 0 times \(processors\[\].max_restarts=0: not reloaded\): "
        r"1\. \S+ device_error: an SGLang subprocess failed and signalled SIGQUIT: a subprocess failed; the log says: "
        r"fake sglang scheduler: Scheduler hit an exception: RuntimeError: CUDA error"
    )
    with pytest.raises(SGLangCrashed, match=expected) as raised, job_log(tmp_path / "job.log"):
        with SGLangEngine(processor(extra={"max_running_requests": 2}, max_restarts=0)) as engine:
            drive(engine, [req(i) for i in range(5)] + [req(5, "CRASH now")] + [req(i) for i in range(6, 30)])
    assert time.monotonic() - t0 < 5
    assert raised.value.death_class == "device_error" and "this job's log" in str(raised.value)
    (fake,) = fake_sglang.ENGINES
    assert fake.shutdown_calls == 1 and fake.scheduler.poll() is not None
    assert engine.queue_depth() == 0
    with pytest.raises(SGLangCrashed):  # and later requests too
        engine.generate([req(99)])
    import signal

    assert signal.getsignal(signal.SIGQUIT) != engine._on_sigquit  # handler restored on close


def _reload_shard(tmp_path, rows, word_row, word, max_restarts):
    """A shard of ``rows`` questions on backend sglang; row ``word_row``'s question carries ``word``."""
    from mirageflow.config import load_config
    from mirageflow.shard.runner import index_datasets

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}" + (f" {word}" if i == word_row else "")}) + "\n" for i in range(rows)))
    cfg = load_config({
        "processors": [{"type": "llm", "backend": "sglang", "max_restarts": max_restarts,
                        "server_args": {"model_path": "org/model", "tp_size": 1, "extra_engine_args": {"max_running_requests": 2}}}],
        "loading_params": {"state_dir": str(tmp_path / "state"), "num_shards": 1,
                           "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out"), "output_format": "jsonl"}]},
        "shard_params": {"max_inflight": 6, "checkpoint_rows": 2, "checkpoint_min_seconds": 0},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}],
                              "remove_columns": True, "output_schema": {"q": "{{ q }}", "a": "{{ a }}"}},
    })  # fmt: skip
    index_datasets(cfg)
    return cfg


def _rows(engine, prompts) -> list[int]:
    return [int(re.search(r"question (\d+)", p).group(1)) for p in prompts]


def test_a_scheduler_crash_mid_shard_reloads_the_engine_and_the_shard_goes_on(fake_sglang, fast_reloads, monkeypatch, tmp_path):
    """Issue 36: the scheduler of the first engine hits a CUDA error on row 20 and signals
    SIGQUIT; the job reloads SGLang (a new sglang.Engine, the same arguments), sends it only
    the requests the dead one held, and the shard ends in one attempt with every row once."""
    from mirageflow.shard.runner import run_shard

    monkeypatch.setattr(fake_sglang, "CRASHING_ENGINES", 1)
    with job_log(tmp_path / "job.log"):
        status = run_shard(_reload_shard(tmp_path, 40, 20, "CRASH", max_restarts=2), 0)

    st = status["stats"]
    assert [(a["attempt"], a["outcome"]) for a in st["attempts"]] == [(1, "success")]
    assert st["engine_restarts"] == 1 and st["rows_failed"] == 0
    (death,) = st["engine_deaths"]
    assert (death["class"], death["processor"], death["pid"]) == ("device_error", "llm", os.getpid())
    assert death["cause"].startswith("an SGLang subprocess failed and signalled SIGQUIT: a subprocess failed; the log says: ")
    assert "CUDA error: an illegal memory access" in death["cause"]
    assert 1 <= death["requests_resent"] <= 6  # the crashing row and the others in flight, no more than the window
    assert death["first_answer_after_seconds"] >= death["restarted_after_seconds"] >= death["successor_start_seconds"] > 0

    records = [json.loads(line) for p in sorted((tmp_path / "out" / "shard_0").glob("*.jsonl")) for line in p.read_text().splitlines()]
    assert sorted(_rows(None, [r["q"] for r in records])) == list(range(40))  # every row exactly once
    dead, successor = fake_sglang.ENGINES
    assert dead.server_args == successor.server_args  # the same arguments (our SIGQUIT handler included)
    assert dead.shutdown_calls == 1 and successor.shutdown_calls == 1 and dead.scheduler.poll() is not None
    tok = successor.tokenizer_manager.tokenizer
    asked_again = _rows(None, [tok.decode(c["input_ids"]) for c in successor.calls])
    answered_before = _rows(None, dead.answered)
    assert answered_before and 20 not in answered_before and 20 in asked_again
    assert not set(answered_before) & set(asked_again)  # an answered row is never asked again
    assert sorted(answered_before + _rows(None, successor.answered)) == list(range(40))
    assert len(asked_again) == len(set(asked_again))


def test_a_scheduler_killed_every_time_stops_after_max_restarts_naming_the_class(fake_sglang, fast_reloads, tmp_path):
    """The scheduler is killed (SIGKILL, no traceback) in every engine: SGLang's watchdog logs
    its exit code and signals; after max_restarts=2 reloads the shard fails, failure.json
    naming the class of each death."""
    from mirageflow.shard import ShardFailed
    from mirageflow.shard.runner import run_shard

    cfg = _reload_shard(tmp_path, 12, 5, "SCHEDULER_KILLED", max_restarts=2)
    died = r"the SGLang engine died 3 times and was reloaded 2 times \(processors\[\].max_restarts=2 spent\)"
    with job_log(tmp_path / "job.log"), pytest.raises(ShardFailed, match=died):
        run_shard(cfg, 0)
    failure = json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())
    assert failure["failure_class"] == "killed_by_signal"
    deaths = failure["stats"]["engine_deaths"]
    assert [d["class"] for d in deaths] == ["killed_by_signal"] * 3
    assert all(d["cause"] == "an SGLang subprocess failed and signalled SIGQUIT: a subprocess killed by SIGKILL" for d in deaths)
    assert failure["stats"]["engine_restarts"] == 2
    assert len(fake_sglang.ENGINES) == 3 and all(e.shutdown_calls == 1 and e.scheduler.poll() == -9 for e in fake_sglang.ENGINES)


def test_a_device_error_raised_from_generate_reloads_the_engine(fake_sglang, fast_reloads, monkeypatch):
    """A CUDA error out of async_generate leaves the engine unusable: reloaded, the request
    sent again to the successor (other row errors stay row errors)."""
    monkeypatch.setattr(fake_sglang, "CRASHING_ENGINES", 1)
    with SGLangEngine(processor(max_restarts=1)) as engine:
        out = engine.generate([req(0), req(1, "DEVICE_ERROR here"), req(2, "TOO_LONG prompt")])
        (death,) = engine.deaths()
        dead, successor = (e.tokenizer_manager.asyncio_tasks for e in fake_sglang.ENGINES)
        assert all(t.cancelled() for t in dead) and not any(t.done() for t in successor)  # the dead one's loop task went
    assert [c.error_kind for c in out] == [None, None, "context_length"]
    assert engine.restarts() == 1 and death["class"] == "device_error"
    assert 1 <= death["requests_resent"] <= 2  # the failed request, and req(0) if it was still running
    assert death["cause"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    assert [e.shutdown_calls for e in fake_sglang.ENGINES] == [1, 1]


def test_a_stop_during_a_reload_fails_the_waiting_requests_and_starts_no_engine(fake_sglang, monkeypatch, tmp_path):
    """SIGTERM while the job waits to reload: no new sglang.Engine, requests fail with EngineStopped."""
    monkeypatch.setattr(ServerSupervisor, "restart_base_delay", 30.0)  # the reload waits in its backoff
    engine = SGLangEngine(processor(max_restarts=3))
    engine.load()
    try:

        def stop_once_dying():
            deadline = time.monotonic() + 30
            while not engine.deaths() and time.monotonic() < deadline:
                time.sleep(0.005)
            engine.stop()

        threading.Thread(target=stop_once_dying, daemon=True).start()
        with pytest.raises(EngineStopped), job_log(tmp_path / "job.log"):
            drive(engine, [req(i) for i in range(3)] + [req(3, "CRASH now")] + [req(i) for i in range(4, 12)])
    finally:
        engine.close()
    assert not engine._reload_thread.is_alive()  # it gave up, with no successor started
    assert len(fake_sglang.ENGINES) == 1 and engine.restarts() == 0 and len(engine.deaths()) == 1
    assert fake_sglang.ENGINES[0].shutdown_calls == 1


def test_a_crash_while_starting_is_a_load_error(fake_sglang):
    engine = SGLangEngine(processor(model="crash-at-load"))
    with pytest.raises(EngineError, match=r"SGLang failed to start: RuntimeError: Rank 0 scheduler died.*SIGQUIT"):
        engine.load()
    engine.close()


def test_shutdown_when_load_fails_after_the_engine_started(fake_sglang):
    engine = SGLangEngine(processor(model="no-tokenizer"))
    with pytest.raises(AttributeError):
        engine.load()
    (fake,) = fake_sglang.ENGINES
    assert fake.shutdown_calls == 1


def test_a_failed_constructor_needs_no_shutdown(fake_sglang):
    engine = SGLangEngine(processor(model="fail-load"))
    with pytest.raises(RuntimeError, match="failed to load"):
        engine.load()
    engine.close()  # the runner closes anyway: harmless
    assert fake_sglang.ENGINES[0].shutdown_calls == 0


def test_requests_from_several_event_loops(fake_sglang):
    """SGLang binds to the first loop that generates; the engine's own loop makes that safe."""
    with SGLangEngine(processor()) as engine:
        first = engine.generate([req(0), req(1)])
        second = engine.generate([req(2)])  # a second asyncio.run
    assert [c.id for c in first + second] == [0, 1, 2]
    # the fake does enforce the binding
    fake = fake_sglang.Engine(model_path="m")
    asyncio.run(fake.async_generate(prompt="a", sampling_params={}))
    with pytest.raises(RuntimeError, match="another event loop"):
        asyncio.run(fake.async_generate(prompt="b", sampling_params={}))


def test_stop_fails_outstanding_and_later_requests(fake_sglang, monkeypatch):
    monkeypatch.setattr(fake_sglang, "TOKEN_SECONDS", 0.05)
    engine = SGLangEngine(processor(extra={"max_running_requests": 2}))
    engine.load()
    try:

        def stop_once_running():  # not on a timer: under load the timer fired before any request
            deadline = time.monotonic() + 30
            while not (fake_sglang.ENGINES and fake_sglang.ENGINES[0].running) and time.monotonic() < deadline:
                time.sleep(0.005)
            stopped_at.append(time.monotonic())
            engine.stop()

        stopped_at = []
        threading.Thread(target=stop_once_running, daemon=True).start()
        with pytest.raises(EngineStopped):
            drive(engine, [req(i) for i in range(20)])
        assert time.monotonic() - stopped_at[0] < 2
        with pytest.raises(EngineStopped):
            engine.generate([req(99)])
    finally:
        engine.close()
    (fake,) = fake_sglang.ENGINES
    assert fake.shutdown_calls == 1
    assert fake.tokenizer_manager.aborts == [{"rid": "", "abort_all": True}]  # SGLang drops the running ones


def test_missing_sglang_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(EngineError, match=r"pip install -r requirements-gpu.txt"):
        SGLangEngine(processor()).load()


def test_every_backend_is_registered():
    assert set(BACKENDS) == {"transformers", "sglang", "sglang_server", "vllm_server", "openai", "batch_api", "shared"}
    for name, cls in (("sglang_server", "SGLangServerEngine"), ("openai", "OpenAIEngine")):
        proc = processor()
        proc = ProcessorConfig(**{**vars(proc), "backend": name, "base_url": "http://127.0.0.1:1/v1"})
        assert type(create_engine(proc, 8, log_dir=None)).__name__ == cls


@pytest.mark.parametrize("tokens", [float("inf"), float("nan"), -3, 2.5, "12"])
def test_token_counts_in_meta_info_that_are_no_counts_fail_the_request_not_the_shard(tokens):
    """SGLang's meta_info goes through wire.usage_counts like every provider's usage: a
    figure that is not a finite, non-negative integer is the row error bad_answer."""
    completion = completion_from_output(7, {"text": "hi", "meta_info": {"prompt_tokens": 4, "completion_tokens": tokens}})
    assert (completion.id, completion.error_kind, completion.completion_tokens, completion.finish_reason) == (7, "bad_answer", 0, "abort")
    assert "meta_info.completion_tokens" in completion.error
    fine = completion_from_output(7, {"text": "hi", "meta_info": {"prompt_tokens": 4, "completion_tokens": 2.0}})
    assert (fine.error_kind, fine.prompt_tokens, fine.completion_tokens) == (None, 4, 2)
