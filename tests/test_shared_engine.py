"""One engine serving several shards (execution_params.shards_per_engine): the engine
service and its client over real HTTP with the real tiny model, the workflow end to end
under `snakemake --cores 1`, an engine service killed mid-run (replaced by its engine job,
or more often than max_restarts), the config checks and the resources."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from conftest import run_workflow
from fakes.configs import pipeline_config

from mirageflow.cluster import resources as cluster
from mirageflow.config import ConfigError, load_config
from mirageflow.engines.base import EngineError
from mirageflow.engines.registry import create_engine
from mirageflow.engines.wire import Request
from mirageflow.engines.shared import SharedEngine


def _pipeline(tmp_path: Path, model: Path, rows: int, shards: int, k: int, new_tokens: int = 4, **processor) -> dict:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"title": f"Title number {i}"}) + "\n" for i in range(rows)))
    return pipeline_config(
        data, model=model, num_shards=shards, loading={"batch_size": 4}, dataset={"output_format": "jsonl"}, inputs=["title"],
        outputs=[{"name": "headline", "type": "llm", "output_type": "plain", "prompt": "Write a headline for {{ title }}."}],
        processor={"backend": "transformers", "default_sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens}, "torch_threads": 1, **processor},
        execution_params={"shards_per_engine": k, "merge": False},
    )  # fmt: skip


def _records(workdir: Path) -> dict[int, str]:
    out = {}
    for f in (workdir / "out").glob("shard_*/*.jsonl"):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            out[r["title"]] = r["headline"]
    return out


def _record_lines(workdir: Path) -> list[str]:
    """Every record's title, as many times as it was written."""
    return [json.loads(line)["title"] for f in (workdir / "out").glob("shard_*/*.jsonl") for line in f.read_text().splitlines()]


def _loads(workdir: Path, group: int = 0) -> list[dict]:
    return json.loads((workdir / "state" / "engines" / f"engine_{group}.stats.json").read_text())["loads"]


# --------------------------------------------------------------------------- protocol


def _start_engine(tmp_path: Path, cfg: dict, env: dict | None = None) -> tuple[subprocess.Popen, Path]:
    """The engine job as the rule runs it: python -m mirageflow.jobs ... engine 0 ENDPOINT."""
    cfg["loading_params"]["state_dir"] = str(tmp_path / "state")
    cfg["loading_params"]["datasets"][0]["output_dir"] = str(tmp_path / "out")
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
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
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    return proc, endpoint


def test_protocol_round_trip_matches_the_in_process_engine(tmp_path, tiny_model):
    cfg = _pipeline(tmp_path, tiny_model, rows=1, shards=2, k=2, new_tokens=6)
    proc, endpoint = _start_engine(tmp_path, cfg)
    try:
        pipeline = load_config(yaml.safe_load((tmp_path / "pipeline.yaml").read_text()), environ={})
        processor = pipeline.processors["llm"]
        client = SharedEngine(processor, 4, endpoint=endpoint)
        client.load()
        assert json.loads(endpoint.read_text())["state"] == "ready"
        messages = [[{"role": "user", "content": f"Say something about {w}."}] for w in ("cats", "boats", "rain")]
        requests = [
            Request(i, m, client.chat_prompt(m, {}), {"temperature": 0.0, "max_new_tokens": 6}) for i, m in enumerate(messages)
        ]  # fmt: skip
        requests.append(Request(9, None, "a raw prompt", {"temperature": 0.0, "max_new_tokens": 3}))
        shared = client.generate(requests)
        info = client.info
        client.close()
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0  # SIGTERM from Snakemake is the normal end
    with create_engine(processor, 4) as local:
        # the shard's template renders here as the engine would (no tokenizer in the shard)
        assert [local.chat_prompt(m, {}) for m in messages] == [r.prompt for r in requests[:3]]
        expected = local.generate(requests)
    assert [vars(c) for c in shared] == [vars(c) for c in expected]
    assert info.backend == "transformers" and info.details["shared_engine"]["endpoint"] == str(endpoint)
    (load,) = _loads(tmp_path)
    assert load["state"] == "stopped" and load["requests"] == 4 and load["model_load_seconds"] > 0
    assert load["output_tokens"] == sum(c.completion_tokens for c in shared)


def _serving_pid(endpoint: Path, other_than: int | None = None, timeout: float = 120) -> int:
    """The pid of the engine job's serving process once it is ready (a successor of ``other_than``)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            ep = json.loads(endpoint.read_text())
        except (OSError, ValueError):
            ep = {}
        if ep.get("state") == "ready" and ep.get("pid") != other_than:
            return ep["pid"]
        time.sleep(0.05)
    raise AssertionError(f"no ready service in {endpoint} after {timeout} s")


def test_the_engine_job_replaces_its_dead_service_and_a_client_fails_with_its_class_when_none_comes(tmp_path, tiny_model):
    """The engine job's serving process dies (SIGKILL) between requests: the job starts a
    successor, the client's requests wait for it and are sent to it with the same answers, and
    the client counts the death (its class from the job: killed_by_signal). When the job itself
    is gone and its serving process dies, nothing names itself within
    $MIRAGEFLOW_ENGINE_RESTART_WAIT: the requests fail with the class engine_service_died."""
    from mirageflow.engines.base import EngineDied

    cfg = _pipeline(tmp_path, tiny_model, rows=1, shards=2, k=2, new_tokens=6)
    proc, endpoint = _start_engine(tmp_path, cfg)
    serving = []
    try:
        pipeline = load_config(yaml.safe_load((tmp_path / "pipeline.yaml").read_text()), environ={})
        client = SharedEngine(pipeline.processors["llm"], 4, endpoint=endpoint)
        client.load()
        requests = [Request(i, None, f"A prompt about {w}", {"temperature": 0.0, "max_new_tokens": 6}) for i, w in enumerate("abc")]
        before = client.generate(requests)
        serving.append(json.loads(endpoint.read_text())["pid"])
        assert serving[0] != proc.pid  # the job loads nothing itself: its serving process does
        os.kill(serving[0], signal.SIGKILL)
        after = client.generate(requests)  # sent to the dead service first, then to its successor
        assert [vars(c) for c in after] == [vars(c) for c in before] and client.generation == 1
        serving.append(_serving_pid(endpoint, other_than=serving[0]))
        assert proc.poll() is None and client.restarts() == 1
        (death,) = client.deaths()
        assert death["class"] == "killed_by_signal" and death["pid"] == serving[0] and death["restarted_after_seconds"] > 0
        assert [entry["replaced"] for entry in _loads(tmp_path)] == [None, json.loads(endpoint.read_text())["deaths"][0]]

        proc.kill()  # the job gone: nothing replaces its serving process any more
        proc.wait()
        os.kill(serving[1], signal.SIGKILL)
        client.restart_wait_seconds = 1.0
        with pytest.raises(EngineDied, match=r"died \(.*\) and no restarted service named itself") as err:
            client.generate(requests)
        assert err.value.death_class == "engine_service_died"
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in serving:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_serving_process_whose_engine_job_is_killed_stops_and_writes_its_stats(tmp_path, tiny_model):
    """The engine job is SIGKILLed (it cannot stop its serving process, which runs in a session of
    its own): the serving process notices its parent is gone and stops as on SIGTERM, within a
    few seconds, not at its idle exit (kept at 600 s here)."""
    from fakes import alive

    cfg = _pipeline(tmp_path, tiny_model, rows=1, shards=2, k=2)
    proc, endpoint = _start_engine(tmp_path, cfg, env={"MIRAGEFLOW_ENGINE_IDLE_EXIT": "600"})
    serving = None
    try:
        serving = _serving_pid(endpoint)
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30  # a generous bound for a loaded machine; it polls every second
        while alive(serving) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(serving)
        (load,) = _loads(tmp_path)
        assert load["pid"] == serving and load["state"] == "stopped" and load["finished_at"] is not None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if serving is not None and alive(serving):
            os.kill(serving, signal.SIGKILL)


def test_a_serving_process_whose_engine_job_died_before_it_started_stops(tmp_path, tiny_model):
    """The engine job passes its pid (``--parent``): a job killed before its serving process got
    to watch it (while Python imported, or the model loaded) is seen gone too, and the process
    stops once loaded instead of serving nobody until its idle exit (kept at 600 s here)."""
    cfg = _pipeline(tmp_path, tiny_model, rows=1, shards=2, k=2)
    cfg["loading_params"]["state_dir"] = str(tmp_path / "state")
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # the engine job, dead already
    endpoint = tmp_path / "state" / "engines" / "engine_0.json"
    endpoint.parent.mkdir(parents=True)
    serving = subprocess.Popen(
        [sys.executable, "-m", "mirageflow.jobs", "--config", str(path), "--log", str(tmp_path / "engine.log"),
         "engine-process", "0", str(endpoint), "--port", "0", "--parent", str(gone.pid)],
        env={**os.environ, "MIRAGEFLOW_ENGINE_IDLE_EXIT": "600"}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        out, _ = serving.communicate(timeout=120)  # loading the tiny model takes seconds; the idle exit 600 s
    finally:
        if serving.poll() is None:
            serving.kill()
            serving.wait()
    assert f"the engine job (process {gone.pid}) that launched this serving process is gone: stopping" in out, out[-3000:]
    (load,) = _loads(tmp_path)
    assert load["state"] == "stopped" and load["finished_at"] is not None


def test_client_names_the_endpoint_when_the_engine_cannot_load(tmp_path, tiny_model):
    cfg = _pipeline(tmp_path, tiny_model, rows=1, shards=2, k=2)
    cfg["processors"][0]["server_args"]["model_path"] = str(tmp_path / "no-model-here")
    proc, endpoint = _start_engine(tmp_path, cfg)
    try:
        pipeline = load_config(yaml.safe_load((tmp_path / "pipeline.yaml").read_text()), environ={}, check_paths=False)
        client = SharedEngine(pipeline.processors["llm"], 4, endpoint=endpoint)
        with pytest.raises(EngineError, match=r"engine service .*engine_0\.json \(its log: .*engine\..*\.log\) failed to load: OSError"):
            client.load()
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0


# --------------------------------------------------------------------------- workflow


def test_shards_share_one_load_and_keep_their_own_state(tmp_path, tiny_model, monkeypatch):
    cfg = _pipeline(tmp_path, tiny_model, rows=9, shards=3, k=3)
    # the allocation's one GPU (torch sees none here, so the model stays on the CPU): the
    # engine holds it, and each of the 3 shards counts a third of it, not all of it
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    # one core is enough: a served shard holds none in Snakemake's count (shard_threads)
    run_workflow(tmp_path, cfg, "--cores", "1")
    (load,) = _loads(tmp_path)  # one engine, loaded once, for three shards
    assert load["state"] == "stopped" and load["requests"] == 9
    runtimes = []
    for shard in range(3):
        d = tmp_path / "state" / f"shard_{shard}"
        status = json.loads((d / "status.json").read_text())
        assert (d / "checkpoint.json").exists() and not (d / "failure.json").exists()
        assert status["engines"]["llm"]["details"]["shared_engine"]["group"] == 0
        assert status["stats"]["rows_processed"] == 3
        assert status["stats"]["num_gpus"] == pytest.approx(1 / 3)
        runtimes.append(status["stats"]["runtime_seconds"])
    assert len(_records(tmp_path)) == 9
    agg = json.loads((tmp_path / "state" / "metrics.json").read_text())["aggregate"]
    assert agg["gpu_hours_allocated"] == pytest.approx(sum(runtimes) / 3 / 3600)
    assert agg["shared_engines"]["engine_loads"] == 1 and agg["shared_engines"]["shards_served"] == 3
    assert agg["sum_model_load_seconds"] == pytest.approx(load["model_load_seconds"])  # counted once, not per shard
    assert not (tmp_path / "state" / "engines" / "engine_0.json").exists()  # Snakemake removes a service's output

    # A rerun with nothing left starts no engine (the killed-engine test below reruns a group).
    proc = run_workflow(tmp_path, cfg, "--cores", "1")
    assert "Nothing to be done" in proc.stdout + proc.stderr and len(_loads(tmp_path)) == 1


def _kill_serving_mid_run(workdir: Path, times: int, killed: list[int], signum: int = signal.SIGKILL) -> threading.Thread:
    """A thread that sends ``signum`` to the engine service's serving process ``times`` times, each
    while its shards generate (the successor of the last one signalled), the pids in ``killed``."""

    def kill_when_generating():
        endpoint = workdir / "state" / "engines" / "engine_0.json"
        deadline, ready = time.time() + 240, None
        while time.time() < deadline and len(killed) < times:
            try:
                ep = json.loads(endpoint.read_text())
                progress = [json.loads((workdir / "state" / f"shard_{i}" / "progress.json").read_text()) for i in (0, 1)]
            except (OSError, ValueError):
                ep, progress = None, []
            if ep and ep.get("state") == "ready" and ep["pid"] not in killed:
                ready = ready or time.time()
                # in the middle of generation: the first as soon as both shards generate (progress.json
                # is written at each phase change; a row count comes only every 5 s, and the tiny
                # model's whole generation may take less), its successors within moments of "ready"
                # (the shards are waiting for them)
                both = len(progress) == 2 and all(p.get("phase") == "generating" for p in progress)
                if (both and not killed) or (killed and time.time() - ready > 0.5):
                    os.kill(ep["pid"], signum)
                    killed.append(ep["pid"])
                    ready = None
            time.sleep(0.1)

    watcher = threading.Thread(target=kill_when_generating)
    watcher.start()
    return watcher


def test_an_engine_service_killed_mid_run_is_replaced_and_its_shards_go_on(tmp_path, tiny_model):
    """The serving process of the engine service is SIGKILLed while its two shards generate:
    the engine job starts a successor, the requests in flight are sent to it, both shards
    succeed in their first attempt with every row once, and each counts the one replacement."""
    cfg = _pipeline(tmp_path, tiny_model, rows=120, shards=2, k=2, new_tokens=24)
    killed: list[int] = []
    watcher = _kill_serving_mid_run(tmp_path, 1, killed)
    # a deadline a replacement must beat by far: the job names its successor at once (state restarting)
    env = {**os.environ, "MIRAGEFLOW_ENGINE_RESTART_WAIT": "2"}
    proc = run_workflow(tmp_path, cfg, "--cores", "3", check=False, env=env)
    watcher.join()
    assert len(killed) == 1 and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    titles = _record_lines(tmp_path)
    assert sorted(titles) == sorted(f"Title number {i}" for i in range(120))  # every row, exactly once
    loads = _loads(tmp_path)
    assert [entry["state"] for entry in loads] == ["ready", "stopped"]  # the killed load never wrote its end
    assert loads[0]["pid"] == killed[0] and loads[1]["replaced"]["class"] == "killed_by_signal"
    aggregate = json.loads((tmp_path / "state" / "metrics.json").read_text())["aggregate"]
    assert aggregate["shared_engines"]["service_replacements"] == 1
    assert aggregate["engine_restarts"] == 1  # one replacement, recorded by both shards, counted once
    resent = 0
    for shard in range(2):
        status = json.loads((tmp_path / "state" / f"shard_{shard}" / "status.json").read_text())
        assert [a["outcome"] for a in status["stats"]["attempts"]] == ["success"]
        assert status["stats"]["engine_restarts"] == 1
        (death,) = status["stats"]["engine_deaths"]
        assert death["class"] == "killed_by_signal" and death["pid"] == killed[0]
        resent += death["requests_resent"]
    assert resent > 0  # the requests the dead service held were sent again (only those: every row once, above)


def test_an_engine_service_frozen_mid_run_is_killed_after_hang_seconds_and_replaced_and_its_shards_go_on(tmp_path, tiny_model):
    """The serving process is SIGSTOPped while its two shards generate (hang_seconds: 3): the
    engine job's watchdog finds it silent, kills it and starts a successor; both shards succeed in
    their first attempt with every row once, and the death's class is frozen everywhere it is
    counted (each shard's status.json, the engine stats file)."""
    cfg = _pipeline(tmp_path, tiny_model, rows=240, shards=2, k=2, new_tokens=48, hang_seconds=3)
    frozen: list[int] = []
    watcher = _kill_serving_mid_run(tmp_path, 1, frozen, signal.SIGSTOP)
    env = {**os.environ, "MIRAGEFLOW_ENGINE_RESTART_WAIT": "2"}
    proc = run_workflow(tmp_path, cfg, "--cores", "3", check=False, env=env)
    watcher.join()
    assert len(frozen) == 1 and proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(_record_lines(tmp_path)) == sorted(f"Title number {i}" for i in range(240))  # every row, exactly once
    loads = _loads(tmp_path)
    assert [entry["state"] for entry in loads] == ["ready", "stopped"]  # the frozen load was SIGKILLed: no end written
    replaced = loads[1]["replaced"]
    assert loads[0]["pid"] == frozen[0] and replaced["class"] == "frozen" and replaced["pid"] == frozen[0]
    assert "processors[].hang_seconds=3" in replaced["cause"]
    for shard in range(2):
        status = json.loads((tmp_path / "state" / f"shard_{shard}" / "status.json").read_text())
        assert [a["outcome"] for a in status["stats"]["attempts"]] == ["success"]
        (death,) = status["stats"]["engine_deaths"]
        assert death["class"] == "frozen" and death["pid"] == frozen[0]
    from fakes import alive

    assert not alive(frozen[0])


def test_an_engine_service_killed_more_often_than_max_restarts_fails_its_shards_naming_each_death(tmp_path, tiny_model):
    cfg = _pipeline(tmp_path, tiny_model, rows=200, shards=2, k=2, new_tokens=24, max_restarts=1)
    killed: list[int] = []
    watcher = _kill_serving_mid_run(tmp_path, 2, killed)
    env = {**os.environ, "MIRAGEFLOW_ENGINE_RESTART_WAIT": "2"}
    proc = run_workflow(tmp_path, cfg, "--cores", "3", check=False, env=env)
    watcher.join()
    assert len(killed) == 2 and proc.returncode != 0
    failures = [json.loads(f.read_text()) for f in (tmp_path / "state").glob("shard_*/failure.json")]
    assert failures, proc.stdout[-3000:] + proc.stderr[-3000:]
    for f in failures:
        assert f["failure_class"] == "engine_service_died", f
        assert "engine service state/engines/engine_0.json (its log: " in f["error"]
        assert "died 2 times during the run and was restarted 1 times, the most processors[].max_restarts=1 allows" in f["error"]
        # each death named: the first while serving; the second, of the successor, killed as it became ready
        # (it may not have answered the job's ready probe yet: then it failed to start)
        assert re.search(r"allows: 1\. \S+ killed_by_signal: killed by SIGKILL; 2\. \S+ (killed_by_signal|failed_to_start): ", f["error"])

    run_workflow(tmp_path, cfg, "--cores", "3")
    assert sorted(_record_lines(tmp_path)) == sorted(f"Title number {i}" for i in range(200))  # resumed: every row once


def test_a_launched_server_of_the_engine_service_is_restarted_and_its_shards_go_on(tmp_path, tiny_model):
    """The engine service of two shards runs a vllm_server (its stand-in) that kills itself after
    three answers: the service restarts it, the shards' requests wait and go on, both shards
    succeed in their first attempt, and the service's stats count the restart."""
    from fakes import alive, vllm_stand_in_command

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"title": f"Title number {i}"}) + "\n" for i in range(12)))
    cfg = pipeline_config(
        data, model=tiny_model, num_shards=2, dataset={"output_format": "jsonl"}, inputs=["title"],
        outputs=[{"name": "headline", "type": "llm", "output_type": "plain", "prompt": "Write a headline for {{ title }}."}],
        processor={"backend": "vllm_server", "server_command": vllm_stand_in_command(), "server_start_timeout": 30},
        execution_params={"shards_per_engine": 2, "merge": False},
        shard_params={"max_inflight": 2},  # 4 requests in flight at most: the server has answered 3 before the 8th arrives
    )  # fmt: skip
    env = {**os.environ, "FAKE_VLLM_DEATHS": "kill:3", "FAKE_VLLM_STARTS": str(tmp_path / "starts"), "FAKE_VLLM_LATENCY": "0.1"}
    env.pop("LD_PRELOAD", None)
    run_workflow(tmp_path, cfg, "--cores", "3", env=env)
    assert len(_records(tmp_path)) == 12
    for shard in range(2):
        status = json.loads((tmp_path / "state" / f"shard_{shard}" / "status.json").read_text())
        assert [a["outcome"] for a in status["stats"]["attempts"]] == ["success"]
    (load,) = _loads(tmp_path)
    assert load["state"] == "stopped" and load["engine_restarts"] == 1
    assert [d["class"] for d in load["engine_deaths"]] == ["killed_by_signal"]
    pids = [int(p) for p in (tmp_path / "starts").read_text().split()]
    assert len(pids) == 2 and not any(alive(p) for p in pids)
    metrics = json.loads((tmp_path / "state" / "metrics.json").read_text())
    assert metrics["aggregate"]["shared_engines"]["engine_restarts"] == 1


def test_a_shared_engine_that_gives_up_names_its_death_class_in_its_shards_failure_json(tmp_path, tiny_model):
    """The service's stand-in vLLM is killed, and its one restart (max_restarts: 1) exits before
    serving: the service gives up and its shards fail with failure_class failed_to_start."""
    from fakes import vllm_stand_in_command

    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"title": f"Title number {i}"}) + "\n" for i in range(12)))
    cfg = pipeline_config(
        data, model=tiny_model, num_shards=2, dataset={"output_format": "jsonl"}, inputs=["title"],
        outputs=[{"name": "headline", "type": "llm", "output_type": "plain", "prompt": "Write a headline for {{ title }}."}],
        processor={"backend": "vllm_server", "server_command": vllm_stand_in_command(), "server_start_timeout": 30,
                   "max_restarts": 1, "max_retries": 0},
        execution_params={"shards_per_engine": 2, "merge": False},
        shard_params={"max_inflight": 2},
    )  # fmt: skip
    env = {**os.environ, "FAKE_VLLM_DEATHS": "kill:3,exit", "FAKE_VLLM_STARTS": str(tmp_path / "starts"), "FAKE_VLLM_LATENCY": "0.1"}
    env.pop("LD_PRELOAD", None)
    proc = run_workflow(tmp_path, cfg, "--cores", "3", env=env, check=False)
    assert proc.returncode != 0
    failures = [json.loads(f.read_text()) for f in sorted((tmp_path / "state").glob("shard_*/failure.json"))]
    assert failures, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert all(f["failure_class"] == "failed_to_start" for f in failures), [(f["error"], f["failure_class"]) for f in failures]
    assert all("was restarted 1 times" in f["error"] for f in failures)


# --------------------------------------------------------------------------- config, resources


def _cfg(tmp_path: Path, **ep) -> dict:
    data = tmp_path / "in.jsonl"
    data.write_text('{"q": "x"}\n')
    return pipeline_config(
        data, model="org/model", state_dir=None, output_dir=tmp_path / "out", num_shards=16, dataset={"type": "jsonl"}, execution_params=ep
    )


@pytest.mark.parametrize("value", [0, -1, 1.5, "two"])
def test_bad_shards_per_engine_is_refused_naming_the_key(tmp_path, value):
    with pytest.raises(ConfigError, match=r"execution_params\.shards_per_engine"):
        load_config(_cfg(tmp_path, shards_per_engine=value), environ={})


def test_shards_per_engine_needs_a_model_to_share(tmp_path):
    cfg = _cfg(tmp_path, shards_per_engine=4)
    cfg["processors"][0].update(backend="openai", base_url="http://127.0.0.1:1/v1")
    with pytest.raises(ConfigError, match=r"execution_params\.shards_per_engine: .*backend openai"):
        load_config(cfg, environ={})


def test_the_engine_gets_the_heavy_resources_and_the_shards_one_cpu(tmp_path):
    ep = {"account": "a1", "gpus": 2, "mem": "100G", "constraint": "h100", "time_limit": "01:00:00"}
    unshared = cluster.cluster_resources(load_config(_cfg(tmp_path, **ep), environ={}), "shard")
    pipeline = load_config(_cfg(tmp_path, shards_per_engine=8, **ep), environ={})
    engine, shard = cluster.cluster_resources(pipeline, "engine"), cluster.cluster_resources(pipeline, "shard")
    assert unshared["gpu"] == engine["gpu"] == 2 and engine["mem_mb"] == 102400 and engine["cpus_per_task"] == 16
    assert "gpu" not in shard and "mem_mb" not in shard and "constraint" not in shard and shard["cpus_per_task"] == 1
    assert shard["slurm_account"] == engine["slurm_account"] == "a1"
    assert "--signal=TERM@" in shard["slurm_extra"] and "--signal=TERM@" in engine["slurm_extra"]
    assert shard["runtime"](None, 2) == engine["runtime"](None, 2) == 120
    assert {k: v for k, v in unshared.items() if k != "runtime"} == {
        k: v for k, v in cluster.cluster_resources(load_config(_cfg(tmp_path, shards_per_engine=1, **ep), environ={}), "shard").items() if k != "runtime"
    }  # fmt: skip


# --------------------------------------------------------------------------- a frozen service


class _StandInService:
    """A service stand-in over real sockets (tests/fakes/raw_http.py) that answers /health, /info
    and /generate until ``frozen`` is set, then nothing (connections stay open, as in a
    SIGSTOPped process) until ``killed`` is set: then it resets them (as the kernel does for a
    SIGKILLed one). ``process``: a live process standing for the serving one (its pid in the
    endpoint file)."""

    INFO = {"group": 0, "stats_file": "s.json", "num_gpus": 0, "shards": 1, "engines": {"llm": {
        "info": {"backend": "transformers", "model_path": "m"}, "max_inflight": 4, "chat_template": None}}}  # fmt: skip

    def __init__(self, text: str = "answer"):
        from fakes.raw_http import RawServer

        self.text, self.frozen, self.killed = text, threading.Event(), threading.Event()
        self.process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        self.server = RawServer(self._handle)

    def _handle(self, conn) -> None:
        from fakes.raw_http import answer

        from mirageflow.engines.wire import Completion

        while (request := conn.read_request()) is not None:
            line = request[0]
            if self.frozen.is_set() or (line.startswith("POST /generate") and self.text is None):
                self.killed.wait(60)
                conn.reset()
                return
            if line.startswith("GET /health"):
                body = {"state": "ready"}
            elif line.startswith("GET /info"):
                body = self.INFO
            else:
                rid = json.loads(request[2])["request"]["id"]
                body = {"completion": vars(Completion(rid, self.text, 1, 1, "stop"))}
            conn.send(answer(body=json.dumps(body).encode()))

    def endpoint(self, deaths: list | None = None) -> dict:
        import socket as socket_module

        return {"state": "ready", "host": "127.0.0.1", "port": self.server.port, "hostname": socket_module.gethostname(),
                "pid": self.process.pid, "deaths": deaths or []}  # fmt: skip

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.killed.set()
        self.server.stop()


def _frozen_service_client(tmp_path: Path, monkeypatch, hang_seconds: float | None, text: str | None = "answer"):
    """A SharedEngine loaded from a stand-in service; its heartbeat is short (0.2 s, deadline 1 s)."""
    from types import SimpleNamespace

    from mirageflow.engines import shared

    monkeypatch.setattr(shared, "HEARTBEAT_SECONDS", 0.2)
    monkeypatch.setattr(shared, "HEARTBEAT_TIMEOUT", 1.0)
    service = _StandInService(text)
    endpoint = tmp_path / "engine_0.json"
    endpoint.write_text(json.dumps(service.endpoint()))
    processor = SimpleNamespace(type="llm", server_args=SimpleNamespace(model_path="m"), hang_seconds=hang_seconds)
    engine = SharedEngine(processor, 4, endpoint=endpoint)
    engine.load()
    return engine, service, endpoint


def test_a_frozen_service_nobody_watches_fails_its_requests_within_the_heartbeat_deadline(tmp_path, monkeypatch):
    """processors[].hang_seconds: null, so the engine job does not watch its service: one that stops
    answering (SIGSTOPped, a stuck GIL) with a generation in flight fails the shard's requests
    within the heartbeat's deadline, never a hang."""
    engine, service, _ = _frozen_service_client(tmp_path, monkeypatch, hang_seconds=None, text=None)
    try:
        assert engine.max_inflight == 4
        service.frozen.set()
        t0 = time.monotonic()
        with pytest.raises(
            EngineError,
            match=r"engine service .*engine_0\.json stopped answering \(DeadlineExceeded: no whole answer .*/health within 1 s\); "
            r"processors\[\]\.hang_seconds is null: nothing restarts it",
        ) as err:
            engine.generate([Request(0, None, "prompt", {})])
        assert err.value.death_class == "engine_service_died"
        assert time.monotonic() - t0 < 0.2 + 1.0 + 2.0
        with pytest.raises(EngineError, match="stopped answering"):  # and every later request, at once
            engine.generate([Request(1, None, "prompt", {})])
    finally:
        engine.close()
        service.kill()


def test_a_shard_waits_for_its_frozen_service_to_be_replaced_and_sends_its_request_again(tmp_path, monkeypatch):
    """The service freezes with a request in flight; the shard's heartbeat finds it alive but
    silent and waits (hang_seconds: 2). The engine job (here this test) kills it after its
    hang_seconds, says restarting, and a successor names itself carrying the frozen death: the
    request held by the frozen one is answered by the successor, and the shard records the death
    with the job's class, frozen."""
    import logging
    import socket

    from mirageflow.engines.server_restarts import new_death
    from mirageflow.errors import EngineDeathClass

    engine, frozen, endpoint = _frozen_service_client(tmp_path, monkeypatch, hang_seconds=2.0, text=None)
    successor = _StandInService("from the successor")
    noticed = threading.Event()

    class Noticed(logging.Handler):
        def emit(self, record):
            if "alive but silent" in record.getMessage():
                noticed.set()

    def engine_job():
        assert noticed.wait(30)  # the shard waits before the job acts: the path under test
        death = new_death(EngineDeathClass.FROZEN, "answered neither a request nor GET /health for 2 s", frozen.process.pid)
        frozen.kill()
        endpoint.write_text(json.dumps({"state": "restarting", "hostname": socket.gethostname(), "pid": os.getpid(), "deaths": [death]}))
        time.sleep(0.5)
        endpoint.write_text(json.dumps(successor.endpoint([death])))

    handler = Noticed()
    logging.getLogger("mirageflow.engines.shared").addHandler(handler)
    job = threading.Thread(target=engine_job)
    try:
        frozen.frozen.set()
        job.start()
        (completion,) = engine.generate([Request(0, None, "prompt", {})])
        job.join()
        assert completion.text == "from the successor" and completion.id == 0
        assert engine.generation == 1 and engine.restarts() == 1
        (death,) = engine.deaths()
        assert death["class"] == "frozen" and death["pid"] == frozen.process.pid and death["requests_resent"] == 1
        assert [r[0] for r in frozen.server.requests if r[0].startswith("POST")] == ["POST /generate HTTP/1.1"]
        assert [r[0] for r in successor.server.requests if r[0].startswith("POST")] == ["POST /generate HTTP/1.1"]
    finally:
        logging.getLogger("mirageflow.engines.shared").removeHandler(handler)
        engine.close()
        frozen.kill()
        successor.kill()


def test_a_frozen_service_that_is_not_replaced_fails_its_shard_after_the_wait(tmp_path, monkeypatch):
    """hang_seconds is set but nothing kills the frozen service (its engine job is stuck or gone):
    the shard waits hang_seconds plus the job's probe interval and deadline plus the restart wait,
    then fails engine_service_died naming the bound, never a hang."""
    from mirageflow.engines.base import EngineDied

    engine, service, _ = _frozen_service_client(tmp_path, monkeypatch, hang_seconds=0.5, text=None)
    engine.restart_wait_seconds = 0.5
    try:
        service.frozen.set()
        with pytest.raises(
            EngineDied, match=r"stopped answering \(.*\) and was not replaced within 1 s \(processors\[\]\.hang_seconds=0\.5, "
        ) as err:
            engine.generate([Request(0, None, "prompt", {})])
        assert err.value.death_class == "engine_service_died"
        with pytest.raises(EngineDied, match="was not replaced"):  # and every later request, at once
            engine.generate([Request(1, None, "prompt", {})])
    finally:
        engine.close()
        service.kill()


def test_a_service_that_closed_its_connection_and_exits_a_moment_later_is_waited_for_though_nobody_watches(tmp_path, monkeypatch):
    """A serving process on its way out (killed, or exiting after an error) closes its sockets
    before its pid is gone: the shard finds it alive though its connection was reset. That is
    not a frozen service: with hang_seconds null (nothing watches for one) the shard gives it
    DYING_GRACE_SECONDS to exit, then waits for its successor as after any death, instead of
    failing at once."""
    import socket

    from mirageflow.engines.server_restarts import new_death
    from mirageflow.errors import EngineDeathClass

    engine, dying, endpoint = _frozen_service_client(tmp_path, monkeypatch, hang_seconds=None, text=None)
    successor = _StandInService("from the successor")

    def engine_job():
        deadline = time.monotonic() + 30
        while not any(r[0].startswith("POST /generate") for r in dying.server.requests):  # the request is in flight
            assert time.monotonic() < deadline
            time.sleep(0.02)
        dying.killed.set()  # its connection is reset, its process still runs a moment
        time.sleep(1.5)
        dying.process.kill()
        dying.process.wait()
        death = new_death(EngineDeathClass.KILLED_BY_SIGNAL, "killed by SIGKILL", dying.process.pid)
        endpoint.write_text(json.dumps({"state": "restarting", "hostname": socket.gethostname(), "pid": os.getpid(), "deaths": [death]}))
        time.sleep(0.3)
        endpoint.write_text(json.dumps(successor.endpoint([death])))

    job = threading.Thread(target=engine_job)
    try:
        job.start()
        (completion,) = engine.generate([Request(0, None, "prompt", {})])
        job.join()
        assert completion.text == "from the successor" and completion.id == 0
        (death,) = engine.deaths()
        assert death["class"] == "killed_by_signal" and death["requests_resent"] == 1
    finally:
        engine.close()
        dying.kill()
        successor.kill()
