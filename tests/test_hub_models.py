"""Hugging Face model ids: the driver looks them up, fetches them once (resuming a killed
download), and the shards read them offline. Against a stand-in hub on 127.0.0.1
(tests/fakes/fake_hub.py) that huggingface_hub's real client talks to through HF_ENDPOINT."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import run_workflow
from fakes.configs import pipeline_config
from fakes.fake_hub import FakeHub, HubRepo, repo_from_dir

from mirageflow import hub_models
from mirageflow.config import ConfigError, load_config, records_identity
from mirageflow.config.preflight import hub_model_notes, validate

REPO_ID = "org/tiny-llm"


@pytest.fixture(scope="module")
def hub(tiny_model):
    repo = repo_from_dir(tiny_model)
    repo.tags["v1"] = repo.commit
    server = FakeHub({REPO_ID: repo, "org/gated": repo_from_dir(tiny_model, gated=True)}).start()
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def fresh_lookups():
    hub_models._LOOKUPS.clear()
    yield
    hub_models._LOOKUPS.clear()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp_path: Path, model: str = REPO_ID, **server_args) -> dict:
    data = tmp_path / "in.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(6)))
    return pipeline_config(
        data, inputs=["text"], outputs=[{"name": "answer", "prompt": "Say: {{ text }}"}],
        state_dir=tmp_path / "state", output_dir=tmp_path / "out", num_shards=2, dataset={"output_format": "jsonl"},
        processor={"backend": "transformers", "server_args": {"model_path": model, **server_args},
                   "default_sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        processing={"output_schema": {"text": "{{ text }}", "answer": "{{ answer }}"}},
        execution_params={"hf_home": str(tmp_path / "hf")},
    )  # fmt: skip


def _problems(cfg: dict, environ: dict) -> list[str]:
    try:
        validate(cfg, environ=environ)
    except ConfigError as e:
        return e.problems
    return []


# --------------------------------------------------------------------------- the driver's look-up


def test_an_id_the_hub_has_will_be_downloaded(hub, tmp_path):
    cfg = _config(tmp_path)
    env = {"HF_ENDPOINT": hub.url}
    assert _problems(cfg, env) == []
    (note,) = hub_model_notes(load_config(cfg, environ=env), env)
    assert note.startswith(f"processors[0].server_args.model_path: '{REPO_ID}' will be downloaded from {hub.url}")
    assert f"into {tmp_path / 'hf' / 'hub'}" in note and "before any shard" in note
    assert not (tmp_path / "hf").exists()  # the look-up writes nothing


def test_the_hubs_config_is_checked_before_the_download(hub, tmp_path):
    cfg = _config(tmp_path)
    cfg["processors"][0]["default_sampling_params"]["max_new_tokens"] = 512
    (p,) = _problems(cfg, {"HF_ENDPOINT": hub.url})
    assert p.startswith("processors[0].default_sampling_params.max_new_tokens: 512 is not below the model's context of 512")
    assert f"config.json of {REPO_ID} on the hub" in p


@pytest.mark.parametrize(
    "model, extra, env, expected",
    [
        ("org/nope", {}, {}, "is not a model on {url} (a typo? a private repo needs HF_TOKEN)"),
        ("org/gated", {}, {}, "is a gated model on {url}: accept its conditions at {url}/org/gated"),
        (REPO_ID, {"revision": "v9"}, {}, "has no revision 'v9' on {url} (server_args.revision)"),
        (REPO_ID, {}, {"HF_HUB_OFFLINE": "1"}, "and HF_HUB_OFFLINE is set here, so it cannot be downloaded: download it where"),
    ],
    ids=["unknown", "gated", "no-such-revision", "offline"],
)
def test_an_id_that_cannot_be_had_is_refused_with_the_key_and_the_fix(hub, tmp_path, model, extra, env, expected):
    cfg = _config(tmp_path, model, **extra)
    (p,) = _problems(cfg, {"HF_ENDPOINT": hub.url, **env})
    label = model + (f"@{extra['revision']}" if extra else "")
    assert p.startswith(f"processors[0].server_args.model_path: '{label}' "), p
    assert expected.format(url=hub.url) in p, p


def test_a_hub_that_does_not_answer_is_refused_with_the_fix(tmp_path):
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there
    (p,) = _problems(_config(tmp_path), {"HF_ENDPOINT": url})
    assert f"and the hub {url} does not answer from {socket.gethostname()}" in p
    assert f"hf download {REPO_ID} --cache-dir {tmp_path / 'hf' / 'hub'}" in p


def test_a_gated_model_with_a_token_will_be_downloaded(hub, tmp_path):
    assert _problems(_config(tmp_path, "org/gated"), {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_test"}) == []


def test_revision_of_a_local_directory_is_refused(tiny_model, tmp_path):
    (p,) = _problems(_config(tmp_path, str(tiny_model), revision="main"), {})
    assert p.startswith("processors[0].server_args.revision: 'main' is a revision of a Hugging Face model id")


def test_a_pinned_revision_is_part_of_the_records_identity(tmp_path):
    env = {"HF_HUB_OFFLINE": "1"}
    plain = records_identity(load_config(_config(tmp_path), environ=env, check_paths=False))
    pinned = records_identity(load_config(_config(tmp_path, revision="v1"), environ=env, check_paths=False))
    other = records_identity(load_config(_config(tmp_path, revision="v2"), environ=env, check_paths=False))
    assert plain != pinned != other
    assert pinned["processors"][0]["server_args"]["revision"] == "v1"
    assert "revision" not in plain["processors"][0]["server_args"]  # no default: older configs keep their fingerprint


# --------------------------------------------------------------------------- the driver's download, the jobs offline


def test_download_resumes_a_dropped_connection_with_a_range_request(tmp_path):
    big = _safetensors(os.urandom(12 << 20))  # past huggingface_hub's 10 MB chunk: a dropped body is resumed, not restarted
    hub = FakeHub({"org/big": HubRepo(files={"config.json": b"{}", "model.safetensors": big})}).start()
    try:
        hub.drop_after["model.safetensors"] = 11 << 20
        cfg = load_config(_config(tmp_path, "org/big"), environ={}, check_paths=False)
        env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
        code = (
            "import sys, json; from mirageflow.config import load_config; from mirageflow.hub_models import download;"
            "cfg = load_config(json.loads(sys.argv[1]), check_paths=False); print(download(cfg, 'org--big', sys.argv[2])['snapshot'])"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps(cfg.raw), str(tmp_path / "marker.json")],
            env={**env, "HF_ENDPOINT": hub.url}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        gets = hub.gets(hashlib.sha256(big).hexdigest())
        # the second asks for the rest only: from the last whole 10 MB chunk it had written
        assert [g[2] for g in gets] == [None, f"bytes={10 << 20}-"], gets
        assert gets[1][3] == len(big) - (10 << 20)
        snapshot = Path(proc.stdout.strip())
        assert (snapshot / "model.safetensors").read_bytes() == big
        assert json.loads((tmp_path / "marker.json").read_text())["commit"] == snapshot.name
    finally:
        hub.stop()


def test_workflow_fetches_once_resumes_after_a_kill_and_shards_run_offline(tiny_model, tmp_path):
    repo = repo_from_dir(tiny_model)
    hub = FakeHub({REPO_ID: repo}).start()
    weights = hashlib.sha256(repo.files["model.safetensors"]).hexdigest()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_ENDPOINT": hub.url}
    cfg = _config(tmp_path)
    try:
        # the dry run says what will happen, and downloads nothing
        dry = run_workflow(tmp_path, cfg, "-n", env=env, background=True)
        out, _ = dry.communicate(timeout=300)
        assert dry.returncode == 0, out[-3000:]
        assert f"'{REPO_ID}' will be downloaded from {hub.url}" in out and "hub_model" in out
        assert not (tmp_path / "hf").exists()

        hub.bytes_per_second = 256 * 1024  # the weights take ~6 s: kill the driver half-way through them
        run = run_workflow(tmp_path, cfg, env=env, background=True)
        deadline = time.monotonic() + 240
        half = len(repo.files["model.safetensors"]) // 2
        while hub.sending.get("model.safetensors", 0) < half:
            assert run.poll() is None, run.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the download never got half-way"
            time.sleep(0.1)
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=30)
        time.sleep(0.5)  # the stand-in notices the closed connection
        first = hub.gets(weights)
        assert first and first[-1][3] < len(repo.files["model.safetensors"]), first
        cache = tmp_path / "hf" / "hub" / "models--org--tiny-llm"
        assert not list((cache / "snapshots").glob("*/model.safetensors"))  # the weights were cut
        # (config.json is also read by the driver's look-ups)
        small = {name: len(hub.gets(name)) for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")}
        assert all(n == 1 for n in small.values()), small

        hub.bytes_per_second = None
        unlock = run_workflow(tmp_path, cfg, "--unlock", env=env, background=True)  # the documented recovery after a killed driver
        assert unlock.wait(timeout=300) == 0
        again = run_workflow(tmp_path, cfg, "--rerun-incomplete", env=env, background=True)
        out, _ = again.communicate(timeout=600)
        assert again.returncode == 0, out[-4000:]
        # finished files were kept; the cut file was fetched again, once
        assert {name: len(hub.gets(name)) for name in small} == small
        assert len(hub.gets(weights)) == len(first) + 1
        snapshot = next((cache / "snapshots").iterdir())
        assert (snapshot / "model.safetensors").read_bytes() == repo.files["model.safetensors"]
        marker = json.loads((tmp_path / "state" / "hub_models" / "org--tiny-llm.json").read_text())
        assert marker["commit"] == repo.commit == snapshot.name
        # the shards ran offline on the snapshot: every row has a record
        records = [json.loads(line) for p in sorted((tmp_path / "out").glob("shard_*/*.jsonl")) for line in p.read_text().splitlines()]
        assert len(records) == 6
        status = json.loads((tmp_path / "state" / "shard_0" / "status.json").read_text())
        assert status["engines"]["llm"]["model_path"] == str(snapshot)
        # a second run fetches nothing and runs nothing
        requests = len(hub.requests)
        rerun = run_workflow(tmp_path, cfg, env=env, background=True)
        out, _ = rerun.communicate(timeout=300)
        assert rerun.returncode == 0 and "Nothing to be done" in out, out[-3000:]
        assert len(hub.requests) == requests  # the model is cached: the driver asks the hub nothing
    finally:
        hub.stop()


def test_a_shard_never_downloads_and_says_where_it_looked(tiny_model, tmp_path):
    """A hub id missing from the node's cache fails the shard at once (HF_HUB_OFFLINE=1), with failure.json."""
    cfg = _config(tmp_path)
    cfg["loading_params"]["num_shards"] = 1
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env["HF_ENDPOINT"] = f"http://127.0.0.1:{_free_port()}"  # had it tried to download, it would say connection refused
    proc = subprocess.run(
        [sys.executable, "-m", "mirageflow.jobs", "--config", str(path), "--log", str(tmp_path / "shard.log"), "shard", "0"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    log = (tmp_path / "shard.log").read_text()
    assert f"processors[0].server_args.model_path: '{REPO_ID}' is not in the Hugging Face cache {tmp_path / 'hf' / 'hub'}" in log
    assert "Jobs never download (HF_HUB_OFFLINE=1)" in log
    failure = json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())
    assert "is not in the Hugging Face cache" in failure["error"] and failure["reason"] == "could not start the shard"


def _safetensors(data: bytes = bytes(16)) -> bytes:
    """A valid safetensors file holding ``data`` as one F32 tensor: its header (8-byte length, JSON), then the bytes."""
    header = json.dumps({"w": {"dtype": "F32", "shape": [len(data) // 4], "data_offsets": [0, len(data)]}}).encode()
    return len(header).to_bytes(8, "little") + header + data


def test_weights_damaged_after_the_download_are_named_and_fetched_again(tmp_path):
    """Item 18: a snapshot whose weights file was cut after the download. The driver's look-up
    names the file and will download it again; offline it is refused with the fix; a job names
    it with advice that works (the workflow again), and the driver's download repairs it."""
    weights = _safetensors()
    config = json.dumps({"model_type": "llama", "max_position_embeddings": 512}).encode()
    hub = FakeHub({"org/weights": HubRepo(files={"config.json": config, "model.safetensors": weights})}).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    code = (
        "import sys, json; from mirageflow.config import load_config; from mirageflow.hub_models import download;"
        "cfg = load_config(json.loads(sys.argv[1]), check_paths=False); print(download(cfg, 'org--weights', sys.argv[2])['snapshot'])"
    )
    raw = _config(tmp_path, "org/weights")
    cfg = load_config(raw, environ={}, check_paths=False)

    def fetch():
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps(cfg.raw), str(tmp_path / "marker.json")],
            env={**env, "HF_ENDPOINT": hub.url}, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        return Path(proc.stdout.strip())

    try:
        snapshot = fetch()
        blob = (snapshot / "model.safetensors").resolve()
        blob.write_bytes(weights[:40])  # damaged after the download
        damaged = snapshot / "model.safetensors"
        (p,) = _problems(raw, {"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "1"})
        assert p.startswith(f"processors[0].server_args.model_path: 'org/weights' is in the cache, but its file {damaged} is damaged"), p
        assert "--force-download" in p
        hub_models._LOOKUPS.clear()
        (note,) = hub_model_notes(load_config(raw, environ={"HF_ENDPOINT": hub.url}), {"HF_ENDPOINT": hub.url})
        assert f"{damaged} is damaged" in note and "will be downloaded" in note and "rule hub_model" in note, note
        with pytest.raises(RuntimeError, match=r"model\.safetensors is damaged .*Start the workflow again") as err:
            hub_models.resolve_local(cfg)
        assert "mmirage retry" in str(err.value) and str(damaged) in str(err.value)
        sent = len(hub.gets("model.safetensors"))
        assert fetch() == snapshot and damaged.read_bytes() == weights  # fetched again, whole
        assert len(hub.gets("model.safetensors")) == sent + 1 == 2
        assert hub_models.damaged_weights(snapshot) == []
    finally:
        hub.stop()


def test_an_image_gen_hub_id_is_fetched_by_the_driver_as_a_language_model_id_is(tmp_path):
    """Item 20: an image_gen pipeline named by hub id (MMIRAGE's config_image_gen_sglang.yaml:
    Qwen/Qwen-Image) is looked up, fetched by the hub_model rule and read offline by the jobs."""
    index = json.dumps({"_class_name": "TinyPipeline"}).encode()
    hub = FakeHub({"org/tiny-image": HubRepo(files={"model_index.json": index, "unet/model.safetensors": _safetensors()})}).start()
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(2)))
    raw = {
        "processors": [{"type": "image_gen", "backend": "diffusers", "pipeline_args": {"model_path": "org/tiny-image", "device": "cpu"}}],
        "loading_params": {
            "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(tmp_path / "out")}], "state_dir": str(tmp_path / "state"),
        },
        "processing_params": {
            "inputs": [{"name": "text", "key": "text"}],
            "outputs": [{"name": "pic", "type": "image_gen", "prompt": "A drawing of {{ text }}", "width": 32, "height": 32}],
        },
        "execution_params": {"hf_home": str(tmp_path / "hf")},
    }  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_ENDPOINT": hub.url}
    try:
        assert _problems(raw, {"HF_ENDPOINT": hub.url}) == []
        cfg = load_config(raw, environ={"HF_ENDPOINT": hub.url})
        (note,) = hub_model_notes(cfg, {"HF_ENDPOINT": hub.url})
        assert note.startswith("processors[0].pipeline_args.model_path: 'org/tiny-image' will be downloaded"), note
        dry = run_workflow(tmp_path, raw, "-n", env=env)
        assert "rule hub_model:" in dry.text and "org--tiny-image" in dry.text, dry.text[-3000:]
        code = (
            "import sys, json; from mirageflow.config import load_config; from mirageflow.hub_models import download;"
            "cfg = load_config(json.loads(sys.argv[1]), check_paths=False); print(download(cfg, 'org--tiny-image', sys.argv[2])['snapshot'])"
        )
        proc = subprocess.run(
            [sys.executable, "-c", code, json.dumps(cfg.raw), str(tmp_path / "marker.json")], env=env, capture_output=True, text=True, timeout=120
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        snapshot = Path(proc.stdout.strip())
        assert (snapshot / "model_index.json").read_bytes() == index
        (image,) = hub_models.resolve_local(cfg).image_processors.values()
        assert image.model_path == str(snapshot) and image.revision is None
    finally:
        hub.stop()


@pytest.fixture
def refetch(tmp_path):
    """A stand-in hub serving the model, and a state_dir whose marker says it was fetched once
    and the cache lost it since (as a damaged file's repair does): the driver must fetch it
    again. Yields the environment that points at the hub."""
    config = json.dumps({"model_type": "llama", "max_position_embeddings": 512}).encode()
    hub = FakeHub({REPO_ID: HubRepo(files={"config.json": config, "model.safetensors": _safetensors()})}).start()
    marker = tmp_path / "state" / "hub_models" / "org--tiny-llm.json"
    marker.parent.mkdir(parents=True)
    marker.write_text(json.dumps({"repo_id": REPO_ID, "commit": "0" * 40}))
    try:
        yield {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | {"HF_ENDPOINT": hub.url}
    finally:
        hub.stop()


def test_a_hub_model_fetched_again_runs_the_shards_left_in_that_same_run(tmp_path, refetch):
    """Item 18's advice ("start the workflow again") in one run: the driver must fetch the model
    again (here its snapshot left the cache, as a damaged file's repair does) while the shards
    have not run; Snakemake drops every job below a rerun job whose inputs from it are all
    ancient, so the marker must be a plain input of the shards that run anyway (dry run)."""
    dry = run_workflow(tmp_path, _config(tmp_path), "-n", env=refetch)
    assert "its snapshot is not in the Hugging Face cache any more" in dry.text, dry.text[-3000:]
    assert dry.text.count("rule hub_model:") == 1 and dry.text.count("rule shard:") == 2, dry.text[-3000:]


def test_a_hub_model_fetched_again_runs_the_engine_services_left_in_that_same_run(tmp_path, refetch):
    """The same as above with shards_per_engine > 1, the engine's marker still ancient: the
    services are not dropped, as Snakemake declares a service output always missing (even the
    endpoint files a stopped run left), so every shard that runs pulls its engine in (dry run)."""
    cfg = _config(tmp_path)
    cfg["loading_params"]["num_shards"] = 4
    cfg["execution_params"]["shards_per_engine"] = 2
    for group in (0, 1):  # the endpoints an earlier, stopped run's services left (written first thing)
        endpoint = tmp_path / "state" / "engines" / f"engine_{group}.json"
        endpoint.parent.mkdir(exist_ok=True)
        endpoint.write_text(json.dumps({"url": "http://127.0.0.1:1"}))
    dry = run_workflow(tmp_path, cfg, "-n", env=refetch)
    assert "its snapshot is not in the Hugging Face cache any more" in dry.text, dry.text[-3000:]
    assert dry.text.count("rule hub_model:") == 1, dry.text[-3000:]
    assert dry.text.count("rule engine:") == 2 and dry.text.count("rule shard:") == 4, dry.text[-3000:]
