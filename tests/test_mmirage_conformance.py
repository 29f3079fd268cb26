"""MMIRAGE's own pipeline files, unchanged, through `mmirage check` (tests/mmirage_configs/,
expectations in tests/mmirage_conformance.py), with their hub model ids served by a stand-in
hub on 127.0.0.1; and the mock ones through `mmirage run`: on the tiny models, against the
batch API stand-in (tests/fakes/fake_batch_api.py, reached as MMIRAGE's SDKs reach a gateway:
$OPENAI_BASE_URL, $ANTHROPIC_BASE_URL) and an images server stand-in (tests/fakes/fake_images.py)
on the port the file names."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from conftest import REPO
from fakes.fake_batch_api import FakeBatchAPI, Trouble
from fakes.fake_hub import FakeHub
from fakes.fake_images import FakeImages
from mmirage_conformance import EQUIVALENTS, EXPECTED, UPSTREAM, UPSTREAM_COUNT, check_env, hub_repos, run_check, workspace


@pytest.fixture(scope="module")
def conformance(tiny_model, tiny_vlm, tmp_path_factory):
    hub = FakeHub(hub_repos(tiny_model, tiny_vlm)).start()
    ws, env = workspace(tmp_path_factory.mktemp("conformance"), tiny_model)
    yield ws, check_env(env, hub.url, REPO / "src")
    hub.stop()


def test_every_upstream_pipeline_file_is_in_the_suite():
    upstream = {str(p.relative_to(UPSTREAM)) for p in UPSTREAM.rglob("*.yaml")}
    listed = {e.config for e in EXPECTED if not (EQUIVALENTS / e.config).exists()}
    assert upstream == listed and len(upstream) == UPSTREAM_COUNT


@pytest.mark.parametrize("expected", EXPECTED, ids=[Path(e.config).stem for e in EXPECTED])
def test_mmirage_check(conformance, expected):
    ws, env = conformance
    proc = run_check(ws, expected.config, env)
    out = proc.stdout + proc.stderr
    assert "Traceback" not in out, out
    if expected.accepted:
        assert proc.returncode == 0, out
        assert f"{expected.config}: valid" in proc.stdout
    else:  # refused for now, naming the key (expected.why says which issue changes it)
        assert proc.returncode == 2, out
        assert f"  - {expected.refused_key}: " in proc.stderr, out


# --------------------------------------------------------------------------- end to end on the tiny models


def _run(ws: Path, env: dict, config: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "mirageflow.cli", "run", "--config", config], cwd=ws, env=env, capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-5000:]


def _merged(ws: Path, out_dir: str) -> list[dict]:
    import pyarrow.parquet as pq

    return sorted(pq.read_table(ws / out_dir / "merged").to_pylist(), key=lambda r: r["source_index"])


def test_config_mock_vision_runs_end_to_end(conformance):
    """The hub id fetched by the driver (a tiny VLM in its place), images, chat_template: qwen2-vl; 10/10 rows."""
    import pyarrow.parquet as pq

    ws, env = conformance
    _run(ws, env, "configs/config_mock_vision.yaml")
    rows = pq.read_table(ws / "tests/output/data_vision/merged").to_pylist()
    assert [r["source_index"] for r in rows] == list(range(10))
    assert all(r["image"].endswith(".jpg") and isinstance(r["caption"], str) for r in rows)
    assert (Path(env["HOME"]) / "hf/hub/models--Qwen--Qwen3-VL-8B-Instruct/snapshots").is_dir()  # execution_params.hf_home: ~/hf


def test_the_filter_example_runs_end_to_end(conformance):
    """A custom step, then an unnamed filter: the 30 rows longer than 33 characters are kept, 20 filtered."""
    import pyarrow.parquet as pq

    ws, env = conformance
    _run(ws, env, "configs/config_mock_filter.yaml")
    rows = pq.read_table(ws / "tests/output/data_mock_filter/merged").to_pylist()
    assert len(rows) == 30 and all(r["length"] > 33 and r["length"] == len(r["text"]) for r in rows)
    state = ws / "tests/output/data_mock_filter/.mirageflow-state"
    stats = json.loads((state / "shard_0/status.json").read_text())["stats"]
    assert (stats["rows_processed"], stats["rows_filtered"], stats["rows_failed"]) == (30, 20, 0)


BATCH_FILES = [
    "config_mock_openai_batch",
    "config_mock_openai_batch_vision",
    "config_mock_anthropic_batch",
    "config_mock_anthropic_batch_vision",
]
IMAGES_PORT = 30010  # config_mock_image_gen_local.yaml's external.base_url


@pytest.fixture(scope="module")
def batch_api(conformance):
    """The batch API stand-in (both providers; every batch ends at its first poll), and the
    environment that reaches it as MMIRAGE's SDKs reach a gateway."""
    ws, env = conformance
    api = FakeBatchAPI(Trouble(polls_to_end=1)).start()
    env = {k: v for k, v in env.items() if not k.lower().endswith("_proxy")}  # 127.0.0.1, never through a proxy
    env.update(OPENAI_BASE_URL=f"{api.url}/v1", ANTHROPIC_BASE_URL=api.url)
    yield ws, env, api
    api.stop()


@pytest.mark.parametrize("name", BATCH_FILES)
def test_the_mock_batch_files_run_end_to_end_against_the_stand_in(batch_api, name):
    ws, env, api = batch_api
    before = api.batches_created
    _run(ws, env, f"configs/{name}.yaml")
    out = f"tests/output/data_{name.removeprefix('config_mock_')}"
    rows = _merged(ws, out)
    if name.endswith("vision"):  # 10 images, each sent as the provider's image part
        assert len(rows) == 10 and all(r["image"].endswith(".jpg") and r["caption"].endswith("[1 image(s)]") for r in rows)
    else:
        assert len(rows) == 50 and all(r["conversations"][0]["content"].startswith("question of u") for r in rows)
    assert api.batches_created > before
    provider = "anthropic" if "anthropic" in name else "openai"
    receipts = ws / "tests" / "output" / f"batch_metadata{'_anthropic' if provider == 'anthropic' else ''}.shard_0.jsonl"
    assert all(json.loads(line)["provider"] == provider for line in receipts.read_text().splitlines())
    state = ws / out / ".mirageflow-state" / "shard_0" / "status.json"
    details = json.loads(state.read_text())["engines"]["batch_api"]["details"]
    assert details["provider"] == provider and details["batches"] and all(b["state"] == "ended" for b in details["batches"])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_mock_image_gen_file_runs_end_to_end_against_the_stand_in(conformance):
    """10 images from the images stand-in, each written under the output_dir by filename_template."""
    import pyarrow.parquet as pq

    ws, env = conformance
    if not _port_free(IMAGES_PORT):
        pytest.skip(f"port {IMAGES_PORT}, which config_mock_image_gen_local.yaml names, is taken on this machine")
    env = {k: v for k, v in env.items() if not k.lower().endswith("_proxy")}
    server = FakeImages(port=IMAGES_PORT).start()
    try:
        _run(ws, env, "configs/config_mock_image_gen_local.yaml")
    finally:
        server.stop()
    # merge: false in this file: the shard's parts
    rows = [r for f in sorted((ws / "tests/output/image_gen/shard_0").glob("part-*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 10 and server.requests == 10
    for r in rows:
        assert r["image"] == r["generated_image_path"] and r["image"].startswith("generated_images/generated_0_")
        assert (ws / "tests/output/image_gen" / r["image"]).is_file()
