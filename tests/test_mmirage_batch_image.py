"""MMIRAGE's seven batch_api and image_gen pipeline files (tests/mmirage_configs/, vendored
unchanged from qchapp/MMIRAGE@2972ff6) through `mmirage check`, and the mock ones end to end
through `mmirage run` against the stand-ins: the batch APIs (tests/fakes/fake_batch_api.py,
reached as MMIRAGE's SDKs reach a gateway: $OPENAI_BASE_URL, $ANTHROPIC_BASE_URL) and an
images server (tests/fakes/fake_images.py) on the port the file names."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO
from fakes.fake_batch_api import FakeBatchAPI, Trouble
from fakes.fake_images import FakeImages

UPSTREAM = Path(__file__).resolve().parent / "mmirage_configs" / "qchapp-2972ff6"
BATCH = ["config_mock_openai_batch", "config_mock_openai_batch_vision", "config_mock_anthropic_batch", "config_mock_anthropic_batch_vision"]
IMAGE = ["config_mock_image_gen_local", "config_image_gen_external", "config_image_gen_sglang"]
IMAGES_PORT = 30010  # config_mock_image_gen_local.yaml's external.base_url


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("mmirage-batch-image")
    ws = root / "mmirage"
    shutil.copytree(UPSTREAM, ws)
    home = root / "home"
    # config_image_gen_sglang.yaml's Qwen/Qwen-Image, in the cache its hf_home (~/hf) names: the
    # jobs download nothing, so a hub id must be there already
    snap = home / "hf" / "hub" / "models--Qwen--Qwen-Image" / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    (snap / "model_index.json").write_text(json.dumps({"_class_name": "QwenImagePipeline"}))
    api = FakeBatchAPI(Trouble(polls_to_end=1)).start()
    env = {k: v for k, v in os.environ.items() if not k.lower().endswith("_proxy")}
    env.update(
        HOME=str(home), PYTHONPATH=str(REPO / "src"), OPENAI_API_KEY="sk-test", ANTHROPIC_API_KEY="sk-test",
        OPENAI_BASE_URL=f"{api.url}/v1", ANTHROPIC_BASE_URL=api.url,
    )  # fmt: skip
    yield ws, env, api
    api.stop()


def _mmirage(ws: Path, env: dict, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mirageflow.cli", *args], cwd=ws, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", BATCH + IMAGE)
def test_mmirage_check_accepts_the_file_unchanged(workspace, name):
    ws, env, _ = workspace
    config = f"configs/{name}.yaml"
    assert (ws / config).read_bytes() == (UPSTREAM / config).read_bytes()
    proc = _mmirage(ws, env, "check", "--config", config)
    assert proc.returncode == 0 and f"{config}: valid" in proc.stdout, proc.stdout + proc.stderr


def _merged(ws: Path, out_dir: str) -> list[dict]:
    import pyarrow.parquet as pq

    return sorted(pq.read_table(ws / out_dir / "merged").to_pylist(), key=lambda r: r["source_index"])


@pytest.mark.parametrize("name", BATCH)
def test_the_mock_batch_files_run_end_to_end_against_the_stand_in(workspace, name):
    ws, env, api = workspace
    before = api.batches_created
    proc = _mmirage(ws, env, "run", "--config", f"configs/{name}.yaml")
    assert proc.returncode == 0, proc.stderr[-5000:]
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
    assert details["provider"] == provider and all(b["state"] == "ended" for b in details["batches"])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_the_mock_image_gen_file_runs_end_to_end_against_the_stand_in(workspace):
    ws, env, _ = workspace
    if not _port_free(IMAGES_PORT):
        pytest.skip(f"port {IMAGES_PORT}, which config_mock_image_gen_local.yaml names, is taken on this machine")
    server = FakeImages(port=IMAGES_PORT).start()
    try:
        proc = _mmirage(ws, env, "run", "--config", "configs/config_mock_image_gen_local.yaml")
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-5000:]
    # merge: false in this file: the shard's parts
    import pyarrow.parquet as pq

    rows = [r for f in sorted((ws / "tests/output/image_gen/shard_0").glob("part-*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 10 and server.requests == 10
    for r in rows:
        assert r["image"] == r["generated_image_path"] and r["image"].startswith("generated_images/generated_0_")
        assert (ws / "tests/output/image_gen" / r["image"]).is_file()
