"""MMIRAGE's own pipeline files, unchanged, through `mmirage check` (tests/mmirage_configs/,
expectations in tests/mmirage_conformance.py), with their hub model ids served by a stand-in
hub on 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO
from fakes.fake_hub import FakeHub
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

    proc = subprocess.run([sys.executable, "-m", "mirageflow.cli", "run", "--config", config], cwd=ws, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]


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
