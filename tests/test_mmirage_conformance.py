"""MMIRAGE's own pipeline files, unchanged, through `mmirage check` (tests/mmirage_configs/,
expectations in tests/mmirage_conformance.py), with their hub model ids served by a stand-in
hub on 127.0.0.1."""

from __future__ import annotations

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
