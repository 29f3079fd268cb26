"""Shared fixtures: real small models built offline, and a helper to run the workflow."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
FAKES = Path(__file__).resolve().parent / "fakes"

# One torch thread: small models on 2-core machines run ~10x slower with two.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# No test reaches the real Hugging Face Hub: hub model ids go to a closed local port unless a
# test points HF_ENDPOINT at its stand-in hub (tests/fakes/fake_hub.py).
os.environ["HF_ENDPOINT"] = "http://127.0.0.1:9"


def pytest_collection_modifyitems(config, items):
    """The real-vLLM tests run last: .ci/run builds their environment (~5-9 minutes) in the
    background while the other tests run."""
    items.sort(key=lambda item: item.get_closest_marker("real_vllm") is not None)  # stable: the others keep their order


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama with a ChatML template, built offline by the project's script."""
    out = tmp_path_factory.mktemp("models") / "tiny-llama"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_tiny_model.py"), str(out)], check=True)
    return out


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    """A tiny random LLaVA (vision-language), built offline."""
    from mirageflow.model_prep import build_tiny_vlm

    return build_tiny_vlm(tmp_path_factory.mktemp("models") / "tiny-vlm")


@pytest.fixture(scope="session")
def smollm2_model(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct: the demo's model dir when built, else converted from the PyPI wheel."""
    built = REPO / "resources" / "models" / "SmolLM2-135M-Instruct"
    if (built / "config.json").exists():
        return built
    out = tmp_path_factory.mktemp("models") / "SmolLM2-135M-Instruct"
    wheels = REPO / "resources" / "wheels"
    subprocess.run([sys.executable, "-m", "mirageflow.model_prep", "smollm2", str(out), "--wheel-dir", str(wheels)], check=True)
    return out


def run_workflow(
    workdir: Path,
    config: dict | str,
    *extra: str,
    check: bool = True,
    env: dict | None = None,
    background: bool = False,
    stdout=subprocess.PIPE,
):
    """Run the workflow as a user would: `python -m snakemake --cores 1` with workdir/pipeline.yaml.

    ``config`` is written there first (a dict as YAML, or YAML text as it is); ``extra`` goes on the
    command line (``"-n"``, ``"--unlock"``, ...); ``env`` replaces the environment. By default it
    waits and returns the CompletedProcess with ``.text`` (stdout + stderr), raising with the
    output's tail when ``check`` and it failed. ``background=True`` returns the Popen at once, in a
    session of its own (``os.killpg`` ends the driver and its jobs together), stderr merged into
    ``stdout`` (a text pipe unless given, e.g. ``subprocess.DEVNULL``)."""
    cfg_path = workdir / "pipeline.yaml"
    cfg_path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    cmd = [
        sys.executable, "-m", "snakemake",
        "--snakefile", str(REPO / "Snakefile"),
        "--directory", str(workdir),
        "--configfile", str(cfg_path),
        "--cores", "1",
        *extra,
    ]  # fmt: skip
    if background:
        return subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    proc.text = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        raise AssertionError(f"snakemake failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


def shard_jobs(proc: subprocess.CompletedProcess) -> int:
    """Shard jobs Snakemake ran or (dry run) would run."""
    return proc.text.count("rule shard:")


@pytest.fixture
def no_proxy(monkeypatch):
    """No proxy variables: requests to the fake servers on 127.0.0.1 go straight there. A module
    that talks to them applies it to every test: ``pytestmark = pytest.mark.usefixtures("no_proxy")``."""
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def raw_servers(no_proxy):
    """Start scripted servers on real sockets (tests/fakes/raw_http.py): ``raw_servers(handler)``
    returns a started RawServer; every one is stopped after the test."""
    from fakes.raw_http import RawServer

    started = []

    def start(handler):
        started.append(RawServer(handler))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def fake_sglang(monkeypatch):
    """A fresh fake sglang module as sys.modules['sglang'] (recorded state starts empty)."""
    spec = importlib.util.spec_from_file_location("sglang", FAKES / "fake_sglang.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "sglang", module)
    return module
