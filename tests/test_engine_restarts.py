"""A launched server that dies or freezes is restarted inside the job (engines/server_restarts.py):
a shard on ``backend: vllm_server`` whose stand-in server (tests/fakes/fake_vllm_server.py) kills
itself three times and freezes once goes on to the end in one attempt, every row once, only
the requests the dead servers held sent again, with the same seeds and ``n``; a server that
cannot be brought back fails the shard after ``max_restarts`` naming each death. The real vLLM:
tests/test_real_vllm.py."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import pytest

from fakes import alive, vllm_stand_in_command
from fakes.configs import pipeline_config
from mirageflow.cli import _status_line as status_line
from mirageflow.cli import by_failure_class, retry_plan, status_summary
from mirageflow.cli import main as cli_main
from mirageflow.config import load_config
from mirageflow.engines.base import EngineError
from mirageflow.engines.model_reloads import ModelReloads
from mirageflow.engines.server_process import classify_crash, classify_engine_error, classify_exit
from mirageflow.engines.server_restarts import ServerSupervisor
from mirageflow.engines.transformers_engine import TransformersEngine
from mirageflow.engines.vllm_server import VLLMServerEngine
from mirageflow.errors import EngineDeathClass as D
from mirageflow.shard.samples import sample_seed
from mirageflow.report.aggregate import write_report
from mirageflow.shard import ShardFailed
from mirageflow.shard.runner import index_datasets, run_shard

ROWS = 24
SEED = 11


@pytest.fixture
def fast(monkeypatch):
    monkeypatch.setattr(VLLMServerEngine, "health_poll_interval", 0.05)
    monkeypatch.setattr(VLLMServerEngine, "kill_grace", 2.0)
    monkeypatch.setattr(ServerSupervisor, "restart_base_delay", 0.05)
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy", "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)


def _shard(tmp_path: Path, monkeypatch, deaths: str, max_restarts: int):
    """One shard of ROWS rows, two samples each (one request with n=2), on a stand-in vLLM
    whose k-th start dies as ``deaths`` says (FAKE_VLLM_DEATHS)."""
    monkeypatch.setenv("FAKE_VLLM_DEATHS", deaths)
    monkeypatch.setenv("FAKE_VLLM_STARTS", str(tmp_path / "starts"))
    monkeypatch.setenv("FAKE_VLLM_REQUEST_LOG", str(tmp_path / "requests.jsonl"))
    monkeypatch.setenv("FAKE_VLLM_LATENCY", "0.05")
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"row {i}"}) + "\n" for i in range(ROWS)))
    cfg = load_config({
        "processors": [{"type": "llm", "backend": "vllm_server", "server_args": {"model_path": "m"},
                        "server_command": vllm_stand_in_command(), "server_start_timeout": 30, "max_retries": 0,
                        "max_restarts": max_restarts, "hang_seconds": 2,
                        "default_sampling_params": {"temperature": 0.7, "seed": SEED}}],
        "loading_params": {"state_dir": str(tmp_path / "state"),
                           "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out"), "output_format": "jsonl"}]},
        "shard_params": {"max_inflight": 6, "checkpoint_rows": 2, "checkpoint_min_seconds": 0},
        "processing_params": {"inputs": [{"name": "q", "key": "q"}], "outputs": [{"name": "a", "prompt": "{{ q }}"}],
                              "n_samples": 2, "remove_columns": True, "output_schema": {"q": "{{ q }}", "a": "{{ a }}"}},
    }, check_paths=False)  # fmt: skip
    index_datasets(cfg)
    return cfg


def _requests(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]


def _records(tmp_path: Path) -> list[dict]:
    return [json.loads(line) for p in sorted((tmp_path / "out" / "shard_0").glob("part-*.jsonl")) for line in p.read_text().splitlines()]


def test_a_server_killed_three_times_and_frozen_once_is_restarted_and_the_shard_goes_on(fast, monkeypatch, tmp_path):
    cfg = _shard(tmp_path, monkeypatch, "kill:3,kill:4,freeze:3,kill:2", max_restarts=4)
    status = run_shard(cfg, 0)

    st = status["stats"]
    assert [(a["attempt"], a["outcome"]) for a in st["attempts"]] == [(1, "success")]  # one job attempt
    assert st["engine_restarts"] == 4 and st["rows_failed"] == 0
    deaths = st["engine_deaths"]
    assert [d["class"] for d in deaths] == ["killed_by_signal", "killed_by_signal", "frozen", "killed_by_signal"]
    assert all(d["processor"] == "llm" and d["attempt"] == 1 and d["restarted_after_seconds"] is not None for d in deaths)
    assert deaths[0]["cause"] == "killed by SIGKILL" and "hang_seconds=2" in deaths[2]["cause"]
    assert all(d["first_answer_after_seconds"] >= d["restarted_after_seconds"] >= d["successor_start_seconds"] > 0 for d in deaths)
    pids = [int(p) for p in (tmp_path / "starts").read_text().split()]
    assert [d["pid"] for d in deaths] == pids[:4] and len(pids) == 5 and not any(alive(p) for p in pids)

    # every row's two samples once, with the seeds its row always gets (choice k of the one request: seed + k)
    records = _records(tmp_path)
    assert sorted((r["source_index"], r["sample_index"]) for r in records) == [(i, k) for i in range(ROWS) for k in range(2)]
    for r in records:
        assert r["a"].endswith(f" s={sample_seed(SEED, 0, r['source_index'], r['sample_index'])}"), r

    # only the requests the dead servers held were sent again, the same request each time
    log = _requests(tmp_path)
    asked, answered = defaultdict(list), defaultdict(list)
    for line in log:
        (asked if line["event"] == "asked" else answered)[line["prompt"]].append(line)
    # never answered twice (a server killed by another request's thread may not log an answer it sent)
    assert len(asked) == ROWS and all(len(a) == 1 for a in answered.values()) and len(answered) >= ROWS - 4
    resent = Counter()
    for prompt, asks in asked.items():
        assert all((a["seed"], a["n"]) == (asks[0]["seed"], 2) for a in asks)  # seeds and native n unchanged
        # each ask but the last went to a server that died holding it, each to a later server
        dead_holders = [a["pid"] for a in asks[:-1]]
        assert all(pid in pids[:4] for pid in dead_holders)
        assert all(a["pid"] == asks[-1]["pid"] for a in answered[prompt])  # an answered request is never asked again
        assert [pids.index(a["pid"]) for a in asks] == sorted({pids.index(a["pid"]) for a in asks})
        resent.update(dead_holders)
    # a death's requests sent again: those it was seen holding, and at most the 3 requests in
    # flight (6 samples, 2 a request); those it refused at connect time were never logged
    assert all(resent[pid] <= d["requests_resent"] <= 3 for d, pid in zip(deaths, pids)), (deaths, resent)
    assert sum(resent.values()) >= 4  # each death held at least the request that killed it

    # mmirage status and the report show them
    summary = status_summary(cfg)
    assert summary["shards"][0]["engine_restarts"] == 4
    metrics = write_report(tmp_path / "state", 1)
    assert metrics["aggregate"]["engine_restarts"] == 4
    assert "engines restarted or reloaded inside their jobs" in (tmp_path / "state" / "report.html").read_text()


def test_a_server_that_cannot_come_back_fails_the_shard_naming_each_death(fast, monkeypatch, tmp_path, capsys):
    """Killed, then two restarts that exit before serving (out of memory at start): after
    max_restarts=2 the shard fails; failure.json names the last death's class and lists them all."""
    cfg = _shard(tmp_path, monkeypatch, "kill:2,exit,exit", max_restarts=2)
    with pytest.raises(ShardFailed) as err:
        run_shard(cfg, 0)
    message = str(err.value)
    assert "the vLLM server died 3 times during the run and was restarted 2 times" in message
    assert "1. " in message and "killed_by_signal: killed by SIGKILL" in message
    assert "failed_to_start: the vLLM server exited with code 4 before it became healthy" in message
    failure = json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())
    assert failure["failure_class"] == "failed_to_start"
    assert [d["class"] for d in failure["stats"]["engine_deaths"]] == ["killed_by_signal", "failed_to_start", "failed_to_start"]
    assert failure["stats"]["engine_restarts"] == 2
    pids = [int(p) for p in (tmp_path / "starts").read_text().split()]
    assert len(pids) == 3 and not any(alive(p) for p in pids)
    summary = status_summary(cfg)
    assert summary["shards"][0]["engine_restarts"] == 2 and summary["shards"][0]["failure_class"] == "failed_to_start"
    line = status_line(summary["shards"][0])
    assert "[failed_to_start], 2 engine restarts" in line and "died 3 times" in line
    (failed,) = write_report(tmp_path / "state", 1)["aggregate"]["failed_shards"]
    assert (failed["engine_restarts"], failed["failure_class"]) == (2, "failed_to_start")
    # mmirage retry --failure-class picks the failed shards by their death's class
    plan = retry_plan(cfg, failed_rows=False)
    assert plan["unfinished"] == [0] and by_failure_class(plan, ["failed_to_start", "frozen"])["unfinished"] == [0]
    assert by_failure_class(plan, ["frozen"])["unfinished"] == [] and by_failure_class(plan, None) is plan
    with pytest.raises(SystemExit):  # not a class: argparse says which are
        cli_main(["retry", "--config", "c.yaml", "--failure-class", "oom"])
    assert "invalid choice: 'oom'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("rc", "tail", "death_class", "cause"),
    [
        (-9, "INFO serving", D.KILLED_BY_SIGNAL, "killed by SIGKILL"),
        (137, "", D.KILLED_BY_SIGNAL, "killed by SIGKILL"),  # a shell's 128 + 9
        (
            1,
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate",
            D.OUT_OF_MEMORY,
            "exited with code 1; its log says 'out of memory'",
        ),
        (
            -6,
            "terminate called after throwing an instance of 'std::bad_alloc'",
            D.OUT_OF_MEMORY,
            "killed by SIGABRT; its log says 'std::bad_alloc'",
        ),
        (7, "RuntimeError: CUDA error: an illegal memory access", D.EXITED_WITH_ERROR, "exited with code 7"),
        (0, "", D.EXITED_WITH_ERROR, "exited with code 0"),
    ],
)
def test_a_death_is_classified_from_its_exit_and_its_log(rc, tail, death_class, cause):
    assert classify_exit(rc, tail) == (death_class, cause)


@pytest.mark.parametrize(
    ("tail", "death_class", "cause"),
    [
        # SGLang's subprocess watchdog: a child that died without a traceback, its exit code logged
        (
            "Subprocess scheduler_0 (pid=812) crashed with exit code -9. Triggering SIGQUIT for cleanup...",
            D.KILLED_BY_SIGNAL,
            "a subprocess killed by SIGKILL",
        ),
        (
            "Subprocess detokenizer (pid=9) crashed with exit code 3. Triggering SIGQUIT",
            D.EXITED_WITH_ERROR,
            "a subprocess exited with code 3",
        ),
        # the scheduler's own traceback (it signals, then returns): the line that says why
        (
            "Scheduler hit an exception: Traceback\n  x\ntorch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB\ndone",
            D.OUT_OF_MEMORY,
            "a subprocess failed; the log says: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB",
        ),
        (
            "Scheduler hit an exception: RuntimeError: CUDA error: an illegal memory access was encountered",
            D.DEVICE_ERROR,
            "a subprocess failed; the log says: Scheduler hit an exception: RuntimeError: CUDA error: an illegal memory access was encountered",
        ),
        ("Scheduler hit an exception: ValueError: bad config", D.EXITED_WITH_ERROR, "a subprocess failed"),
        (None, D.EXITED_WITH_ERROR, "a subprocess failed (no job log to tell why: stderr is not a file)"),
    ],
)
def test_an_in_process_engines_subprocess_crash_is_classified_from_the_job_log(tail, death_class, cause):
    """In-process SGLang's SIGQUIT: what the job log's tail shows is all there is to tell why."""
    assert classify_crash(tail) == (death_class, cause)


# --------------------------------------------------------------------------- in-process engines reload


class ModelThatFails(TransformersEngine):
    """The real transformers engine whose first ``failing_loads`` loaded models raise ``failure``
    on their third forward call (mid-batch: after some decoding steps), at the model's boundary."""

    failure: BaseException = RuntimeError("CUDA error: an illegal memory access was encountered")
    failing_loads = 1
    loads = 0

    def _load_model(self, *args) -> None:
        super()._load_model(*args)
        type(self).loads += 1
        if type(self).loads > self.failing_loads:
            return
        forward, calls = self.model.forward, [0]

        def fails_on_the_third_call(*a, **kw):
            calls[0] += 1
            if calls[0] == 3:
                raise self.failure
            return forward(*a, **kw)

        self.model.forward = fails_on_the_third_call


class ManagerThatFails(ModelThatFails):
    """As ModelThatFails, on the continuous-batching path: the first ``failing_loads`` loaded
    models raise ``failure`` at the third step of the manager's model (mid-run), at the
    model's boundary (its input embeddings, which the manager's module tree shares)."""

    def _load_model(self, *args) -> None:
        TransformersEngine._load_model(self, *args)
        type(self).loads += 1
        if type(self).loads > self.failing_loads:
            return
        calls = [0]

        def fails_at_the_third_step(module, inputs):
            calls[0] += 1
            if calls[0] == 3:
                raise self.failure

        self.model.get_input_embeddings().register_forward_pre_hook(fails_at_the_third_step)


def _transformers_shard(tmp_path: Path, tiny_model: Path, max_restarts: int = 3, continuous: bool = False):
    tmp_path.mkdir(exist_ok=True)
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"Tell me about the number {i}"}) + "\n" for i in range(7)))
    cfg = load_config(pipeline_config(
        data, model=tiny_model, state_dir=tmp_path / "state", output_dir=tmp_path / "out",
        processor={"backend": "transformers", "torch_threads": 1, "max_restarts": max_restarts,
                   "default_sampling_params": {"temperature": 0, "max_new_tokens": 6},
                   "server_args": {"model_path": str(tiny_model),
                                   "extra_engine_args": {"continuous_batching": continuous, "max_running_requests": 3}}},
        dataset={"output_format": "jsonl"},
        loading={"batch_size": 3},
        processing={"remove_columns": True, "output_schema": {"q": "{{ q }}", "a": "{{ a }}"}},
        shard_params={"checkpoint_rows": 2, "checkpoint_min_seconds": 0},
    ))  # fmt: skip
    index_datasets(cfg)
    return cfg


def _failing(cls_failure=None, failing_loads: int = 1, base: type = ModelThatFails):
    attrs = {"loads": 0, "failing_loads": failing_loads}
    if cls_failure is not None:
        attrs["failure"] = cls_failure
    engine_class = type("ModelThatFailsHere", (base,), attrs)
    return lambda processor, batch_size, log_dir=None: engine_class(processor, batch_size)


def _one_device_error_reload(status: dict) -> dict:
    """The death of a shard that went on after one reload of its model (a CUDA error, injected)."""
    st = status["stats"]
    assert [(a["attempt"], a["outcome"]) for a in st["attempts"]] == [(1, "success")] and st["rows_failed"] == 0
    assert st["engine_restarts"] == 1
    (death,) = st["engine_deaths"]
    assert (death["class"], death["processor"]) == ("device_error", "llm")
    assert death["cause"] == "RuntimeError: CUDA error: an illegal memory access was encountered"
    return death


def test_a_transformers_model_with_a_device_error_is_reloaded_and_its_batch_runs_again(tmp_path, tiny_model):
    reference = run_shard(_transformers_shard(tmp_path / "ref", tiny_model), 0)
    expected = _records(tmp_path / "ref")
    assert reference["stats"]["engine_restarts"] == 0

    status = run_shard(_transformers_shard(tmp_path, tiny_model), 0, engine_factory=_failing())
    death = _one_device_error_reload(status)
    assert 1 <= death["requests_resent"] <= 3  # only the rows of the batch in flight, not handed back yet
    records = _records(tmp_path)  # every row once, the same greedy text as without the failure
    assert sorted(r["q"] for r in records) == sorted(r["q"] for r in expected)
    assert {r["q"]: r["a"] for r in records} == {r["q"]: r["a"] for r in expected}


@pytest.mark.parametrize(
    ("failure", "failing_loads", "death_classes", "reloads"),
    [
        # a device error on every model: reloaded max_restarts=1 times, then the shard fails
        (RuntimeError("CUDA error: device-side assert triggered"), 9, ["device_error", "device_error"], 1),
        # out of memory in the process: its own class, not reloaded (the same batch would run out again)
        (None, 1, ["out_of_memory"], 0),
    ],
)
def test_a_transformers_model_that_cannot_be_healed_fails_the_shard_with_its_class(
    tmp_path, tiny_model, failure, failing_loads, death_classes, reloads
):
    import torch

    failure = failure or torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    cfg = _transformers_shard(tmp_path, tiny_model, max_restarts=1)
    with pytest.raises(ShardFailed, match=f"the transformers model died {len(death_classes)} times and was reloaded {reloads} times"):
        run_shard(cfg, 0, engine_factory=_failing(failure, failing_loads))
    failure_json = json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())
    assert failure_json["failure_class"] == death_classes[-1]
    assert [d["class"] for d in failure_json["stats"]["engine_deaths"]] == death_classes
    assert failure_json["stats"]["engine_restarts"] == reloads


def test_the_continuous_batching_path_reloads_its_model_after_a_device_error_and_sends_its_requests_again(tmp_path, tiny_model):
    reference = run_shard(_transformers_shard(tmp_path / "ref", tiny_model, continuous=True), 0)
    expected = _records(tmp_path / "ref")
    cb = reference["engines"]["llm"]["details"]["continuous_batching"]
    assert cb["enabled"] and cb["requests"] == 7 and reference["stats"]["engine_restarts"] == 0  # all on the manager

    status = run_shard(_transformers_shard(tmp_path, tiny_model, continuous=True), 0, engine_factory=_failing(base=ManagerThatFails))
    death = _one_device_error_reload(status)
    assert 1 <= death["requests_resent"] <= 7  # the requests the dead manager held, not those answered before
    cb = status["engines"]["llm"]["details"]["continuous_batching"]
    assert cb["enabled"] and cb["static_path_requests"] == {}  # the rebuilt manager served them, counting on
    records = _records(tmp_path)  # every row once, the same greedy text as without the failure
    assert sorted(r["q"] for r in records) == sorted(r["q"] for r in expected)
    assert {r["q"]: r["a"] for r in records} == {r["q"]: r["a"] for r in expected}


def test_a_continuous_batching_model_that_dies_at_every_load_fails_the_shard_after_max_restarts(tmp_path, tiny_model):
    cfg = _transformers_shard(tmp_path, tiny_model, max_restarts=1, continuous=True)
    failure = RuntimeError("CUDA error: device-side assert triggered")
    with pytest.raises(
        ShardFailed, match="the transformers model died 2 times and was reloaded 1 times .processors...max_restarts=1 spent"
    ):
        run_shard(cfg, 0, engine_factory=_failing(failure, failing_loads=9, base=ManagerThatFails))
    failure_json = json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())
    assert failure_json["failure_class"] == "device_error"
    assert [d["class"] for d in failure_json["stats"]["engine_deaths"]] == ["device_error", "device_error"]
    assert failure_json["stats"]["engine_restarts"] == 1


def test_a_death_both_transformers_paths_see_is_one_reload():
    """The static batches and the continuous-batching manager share one model: the failures a
    death causes on both reload it once, and what each ran sends again counts in that death."""
    loaded = []
    stopped = threading.Event()
    reloads = ModelReloads(3, lambda: loaded.append(reloads.generation), stopped)
    death = RuntimeError("CUDA error: an illegal memory access was encountered")
    first = reloads.generation
    reloads.heal(death, 2, first)  # the static batch's two rows not handed back: reloaded
    reloads.heal(EngineError("the continuous batching manager is rebuilt on the reloaded model"), 3, first)  # its requests
    assert loaded == [first] and reloads.count == 1 and reloads.generation == first + 1
    assert [(d["class"], d["requests_resent"]) for d in reloads.deaths] == [("device_error", 5)]
    with pytest.raises(ValueError, match="bad shape"):  # a bug on the new model is no death
        reloads.heal(ValueError("bad shape"), 1, reloads.generation)
    stopped.set()
    with pytest.raises(RuntimeError, match="CUDA error"):  # a stopped engine is not reloaded
        reloads.heal(death, 1, reloads.generation)
    assert loaded == [first] and len(reloads.deaths) == 1


def test_only_errors_that_leave_an_engine_unusable_are_deaths():
    import torch

    assert classify_engine_error(RuntimeError("CUDA error: an illegal memory access was encountered"))[0] is D.DEVICE_ERROR
    assert classify_engine_error(RuntimeError("CUDA error: device-side assert triggered"))[0] is D.DEVICE_ERROR
    assert classify_engine_error(torch.OutOfMemoryError("CUDA out of memory."))[0] is D.OUT_OF_MEMORY
    assert classify_engine_error(RuntimeError("CUDA error: out of memory"))[0] is D.OUT_OF_MEMORY
    assert classify_engine_error(ValueError("bad shape")) is None  # a bug: raised as it is


def test_the_real_vllm_api_server_below_a_job_is_found_for_the_test_and_the_bench_to_kill():
    """real_vllm_env.api_server_below: the one finder of tests/test_real_vllm.py and
    scripts/bench/engine_restarts.py (a stand-in tree: a shell whose child's command line names
    vLLM's API server module)."""
    import subprocess
    import sys

    import real_vllm_env

    child = f"{sys.executable} -c 'import time; time.sleep(60)' vllm.entrypoints.openai.api_server"
    job = subprocess.Popen(["sh", "-c", f"{child}; true"])
    try:
        for _ in range(100):
            found = real_vllm_env.api_server_below(job.pid)
            if found is not None:
                break
            time.sleep(0.05)
        assert found is not None and found.ppid() == job.pid and "api_server" in found.cmdline()[-1]
        assert real_vllm_env.api_server_below(found.pid) is None  # nothing below the server itself
    finally:
        for p in [found] if found is not None else []:
            p.kill()
        job.wait(10)
    assert real_vllm_env.api_server_below(job.pid) is None  # a job that ended
