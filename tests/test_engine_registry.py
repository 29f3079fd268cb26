"""The engines package: a registry of lazily imported backends, one way of importing, and
how ``backend: auto`` chooses (and says why)."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from mirageflow.engines import base
from mirageflow.engines.base import BACKENDS, EngineInfo, create_engine, engine_class, select_backend

ENGINES = Path(base.__file__).parent
SHARED = {"base", "http", "sglang_common", "json_prefix", "server_process", "server_metrics"}  # modules that are not engines


def engine_imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mirageflow.engines."):
            found.add(node.module.rsplit(".", 1)[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.rsplit(".", 1)[1] for a in node.names if a.name.startswith("mirageflow.engines.")}
    return found


def test_no_engine_module_imports_another():
    modules = {p.stem for p in ENGINES.glob("*.py")} - {"__init__"}
    engines = modules - SHARED
    assert {target.split(":")[0].rsplit(".", 1)[1] for target in BACKENDS.values()} == engines
    for name in modules:
        imported = engine_imports(ENGINES / f"{name}.py")
        assert not imported & engines, f"{name} imports engine module(s) {imported & engines}"
    assert engine_imports(ENGINES / "base.py") == set()  # the interface knows no engine


def test_every_backend_resolves_to_its_class():
    for name, target in BACKENDS.items():
        cls = engine_class(name)
        assert f"{cls.__module__}:{cls.__name__}" == target and issubclass(cls, base.Engine)
    with pytest.raises(ValueError, match="unknown backend 'vllm'"):
        engine_class("vllm")


class _Proc:
    backend = "auto"
    server_args = {"model_path": "m"}
    torch_threads = 1


def test_auto_says_why_it_did_not_take_sglang(monkeypatch, caplog):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(base, "_nvidia_gpus", lambda: (2, "550.54"))
    monkeypatch.setattr(base, "_torch_cuda", lambda: (False, "torch 2.14.1 (CUDA 13.0)"))
    backend, why = select_backend("auto")
    assert backend == "transformers" and "driver 550.54 sees 2 GPU(s)" in why and ">= 580" in why
    with caplog.at_level(logging.INFO, logger="mirageflow.engines.base"):
        engine = create_engine(_Proc(), 4)
    (record,) = [r for r in caplog.records if "backend auto" in r.message]
    assert record.levelno == logging.WARNING and "cannot use them" in record.message
    engine.info = EngineInfo(backend="transformers", model_path="m")  # as load() replaces it
    assert engine.info.details["backend_selection"] == {"requested": "auto", "chosen": "transformers", "reason": why}


def test_auto_without_a_gpu_is_quiet_and_without_sglang_is_not(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(base, "_nvidia_gpus", lambda: (0, None))
    monkeypatch.setattr(base, "_torch_cuda", lambda: (False, "torch 2.13.0+cpu (CPU-only build)"))
    assert select_backend("auto") == ("transformers", "no NVIDIA GPU found (NVML sees none)")
    assert select_backend("auto", {"CUDA_VISIBLE_DEVICES": ""})[1].startswith("no GPU allocated")
    monkeypatch.setattr(base, "_nvidia_gpus", lambda: (1, "580.1"))
    monkeypatch.setattr(base, "_torch_cuda", lambda: (True, "torch 2.13.0 (CUDA 12.8)"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    backend, why = select_backend("auto")
    assert backend == "transformers" and "neither the sglang nor the vllm package is installed" in why and "requirements-gpu.txt" in why
    assert select_backend("sglang_server") == ("sglang_server", "configured")


def test_auto_takes_a_launched_vllm_where_vllm_is_installed_and_sglang_is_not(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(base, "_nvidia_gpus", lambda: (1, "580.1"))
    monkeypatch.setattr(base, "_torch_cuda", lambda: (True, "torch 2.13.0 (CUDA 12.8)"))
    installed = {"vllm"}
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object() if name in installed else None)
    backend, why = select_backend("auto")
    assert backend == "vllm_server" and why.startswith("a CUDA GPU and the vllm package are present, sglang is not")
    installed.add("sglang")
    assert select_backend("auto")[0] == "sglang"  # SGLang first where both are there
    installed.clear()
    monkeypatch.setattr(base, "_torch_cuda", lambda: (False, "torch 2.13.0+cpu (CPU-only build)"))
    installed.add("vllm")
    assert select_backend("auto")[0] == "transformers"  # no usable GPU: the CPU engine
