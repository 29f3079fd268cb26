"""The engines package: a registry of lazily imported backends that says what each can do,
one way of importing, how ``backend: auto`` chooses (and says why), and a backend added
at run time going through every stage."""

from __future__ import annotations

import ast
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from fakes.configs import pipeline_config

from mirageflow.config import ConfigError, ProcessorConfig, ServerArgs, load_config
from mirageflow.config import loading
from mirageflow.config.preflight import validate
from mirageflow.engines import base, registry
from mirageflow.engines.base import Engine
from mirageflow.engines.registry import (
    BACKENDS,
    Backend,
    Capabilities,
    Reason,
    capabilities,
    config_backends,
    create_engine,
    engine_class,
    select_backend,
)
from mirageflow.engines.wire import Completion, EngineInfo

ENGINES = Path(base.__file__).parent
SRC = ENGINES.parent
# modules that are not engines: the interface, its wire types, helpers, the registry
SHARED = {
    "base", "wire", "chat_template", "tokens", "registry", "loop", "http", "sglang_common", "json_prefix",
    "server_process", "server_metrics", "server_restarts", "server_ranks", "model_reloads", "reloads",
}  # fmt: skip
# parts of one backend, imported by that backend's modules only (its own module and its other parts)
COMPANIONS = {
    "transformers_cb": "transformers_engine", "transformers_static": "transformers_engine",
    "transformers_generate": "transformers_engine", "batch_time": "transformers_engine",
    "batch_providers": "batch_api", "batch_chunks": "batch_api", "batch_polling": "batch_api", "batch_results": "batch_api",
    "batch_budget": "batch_api",
}  # fmt: skip


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
    engines = modules - SHARED - set(COMPANIONS)
    assert {b.target.split(":")[0].rsplit(".", 1)[1] for b in BACKENDS.values()} == engines
    for name in modules:
        imported = engine_imports(ENGINES / f"{name}.py")
        assert not imported & engines, f"{name} imports engine module(s) {imported & engines}"
        for companion, owner in COMPANIONS.items():
            assert companion not in imported or owner in (name, COMPANIONS.get(name)), f"{name} imports {companion}, a part of {owner}"
    # the interface knows its wire types and its default chat template, no engine, no registry
    assert engine_imports(ENGINES / "base.py") == {"wire", "chat_template"}
    assert engine_imports(ENGINES / "wire.py") == engine_imports(ENGINES / "tokens.py") == set()
    assert engine_imports(ENGINES / "chat_template.py") == set()


def test_every_backend_resolves_to_its_class_which_declares_the_registry_capabilities():
    for name, backend in BACKENDS.items():
        cls = engine_class(name)
        assert f"{cls.__module__}:{cls.__name__}" == backend.target and issubclass(cls, Engine)
        assert Capabilities.of(cls) == backend.can, f"{name}: the class and its registry line disagree"
    assert Capabilities.of(Engine) == Capabilities()  # the base's defaults are the registry's
    with pytest.raises(ValueError, match="unknown backend 'vllm'"):
        engine_class("vllm")


def test_the_schema_enum_is_the_registry():
    """The registry's backends (language models) and image_gen's (config/build.py)."""
    from mirageflow.config.build import IMAGE_BACKENDS

    enum = loading.schema()["properties"]["processors"]["items"]["properties"]["backend"]["enum"]
    assert sorted(set(enum)) == sorted(set(config_backends()) | set(IMAGE_BACKENDS))


def test_auto_can_what_every_backend_it_picks_can():
    # a need any pick has: auto may pick transformers, whose JSON grammar runs here (xgrammar)
    assert capabilities("auto") == Capabilities(loads_model=True, grammar_in_process=True)
    assert capabilities("transformers").grammar_in_process and not capabilities("sglang").grammar_in_process
    assert capabilities("openai") == Capabilities(
        templates_server_side=True, native_n=True, loads_model=False, needs_base_url=True, provider_api=True
    )


def test_capabilities_and_config_types_are_read_without_importing_an_engine():
    """Every job validates its config: that imports no engine module, torch or transformers."""
    code = (
        "import sys, json\n"
        "import mirageflow.config.types\n"
        "types_only = sorted(m for m in sys.modules if m.startswith('mirageflow'))\n"
        "from mirageflow.config import load_config\n"
        "from mirageflow.engines.registry import capabilities\n"
        "capabilities('openai'); capabilities('auto')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'sglang', 'httpx2')\n"
        "               or m.startswith('mirageflow.engines.') and m.rsplit('.', 1)[1] not in ('registry',))\n"
        "print(json.dumps([types_only, heavy]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    types_only, heavy = json.loads(out.stdout)
    assert types_only == ["mirageflow", "mirageflow.config", "mirageflow.config.types"]  # imports nothing of the package
    assert heavy == []


def _comparisons_with_names(path: Path, names: set[str]) -> list[str]:
    """``x == "openai"``, ``x in ("openai", ...)`` and the like in a module."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                values = side.elts if isinstance(side, (ast.Tuple, ast.List, ast.Set)) else [side]
                found += [f"{path}:{node.lineno}" for v in values if isinstance(v, ast.Constant) and v.value in names]
    return found


def test_no_backend_name_is_compared_and_no_capability_guessed_outside_the_engines():
    names = set(BACKENDS)
    outside = [p for p in SRC.rglob("*.py") if ENGINES not in p.parents]
    assert [hit for p in outside for hit in _comparisons_with_names(p, names)] == []
    probes = ("templates_server_side", "native_samples", "native_n", "gpu_share", "warmup", "loads_model", "needs_base_url")
    guessed = [
        f"{p}:{node.lineno}"
        for p in SRC.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("getattr", "hasattr")
        and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in probes
    ]  # fmt: skip
    assert guessed == []


def test_no_consumer_outside_the_config_package_reads_raw():
    outside = [p for p in SRC.rglob("*.py") if SRC / "config" not in p.parents]
    readers = [f"{p}:{i}" for p in outside for i, line in enumerate(p.read_text().splitlines(), 1) if ".raw[" in line]
    assert readers == []


# --------------------------------------------------------------------------- backend: auto


def test_auto_says_why_it_did_not_take_sglang(monkeypatch, caplog):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(registry, "_nvidia_gpus", lambda: (2, "550.54"))
    monkeypatch.setattr(registry, "_torch_cuda", lambda: (False, "torch 2.14.1 (CUDA 13.0)"))
    chosen = select_backend("auto")
    assert (chosen.backend, chosen.reason) == ("transformers", Reason.TORCH_CANNOT_USE_GPU)
    assert "driver 550.54 sees 2 GPU(s)" in chosen.why and ">= 580" in chosen.why
    proc = ProcessorConfig("llm", "auto", ServerArgs("m"), {}, {}, True, torch_threads=1)
    with caplog.at_level(logging.INFO, logger="mirageflow.engines.registry"):
        engine = create_engine(proc, 4)
    (record,) = [r for r in caplog.records if "backend auto" in r.message]
    assert record.levelno == logging.WARNING and "cannot use them" in record.message
    engine.info = EngineInfo(backend="transformers", model_path="m")  # as load() replaces it
    assert engine.info.details["backend_selection"] == {"requested": "auto", "chosen": "transformers", "reason": chosen.why}


def test_auto_without_a_gpu_is_quiet_and_without_sglang_is_not(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(registry, "_nvidia_gpus", lambda: (0, None))
    monkeypatch.setattr(registry, "_torch_cuda", lambda: (False, "torch 2.13.0+cpu (CPU-only build)"))
    chosen = select_backend("auto")
    assert (chosen.backend, chosen.reason, chosen.why) == ("transformers", Reason.NO_NVIDIA_GPU, "no NVIDIA GPU found (NVML sees none)")
    assert not chosen.reason.gpu_unused
    allocated_none = select_backend("auto", {"CUDA_VISIBLE_DEVICES": ""})
    assert allocated_none.reason is Reason.NO_GPU_ALLOCATED and not allocated_none.reason.gpu_unused
    monkeypatch.setattr(registry, "_nvidia_gpus", lambda: (1, "580.1"))
    monkeypatch.setattr(registry, "_torch_cuda", lambda: (True, "torch 2.13.0 (CUDA 12.8)"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    chosen = select_backend("auto")
    assert (chosen.backend, chosen.reason) == ("transformers", Reason.SGLANG_MISSING) and chosen.reason.gpu_unused
    assert "neither the sglang nor the vllm package is installed" in chosen.why and "requirements-gpu.txt" in chosen.why
    configured = select_backend("sglang_server")
    assert (configured.backend, configured.reason, configured.why) == ("sglang_server", Reason.CONFIGURED, "configured")


def test_auto_takes_a_launched_vllm_where_vllm_is_installed_and_sglang_is_not(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(registry, "_nvidia_gpus", lambda: (1, "580.1"))
    monkeypatch.setattr(registry, "_torch_cuda", lambda: (True, "torch 2.13.0 (CUDA 12.8)"))
    installed = {"vllm"}
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object() if name in installed else None)
    chosen = select_backend("auto")
    assert (chosen.backend, chosen.reason) == ("vllm_server", Reason.GPU_AND_VLLM) and not chosen.reason.gpu_unused
    assert chosen.why.startswith("a CUDA GPU and the vllm package are present, sglang is not")
    installed.add("sglang")
    assert select_backend("auto").backend == "sglang"  # SGLang first where both are there
    installed.clear()
    monkeypatch.setattr(registry, "_torch_cuda", lambda: (False, "torch 2.13.0+cpu (CPU-only build)"))
    installed.add("vllm")
    assert select_backend("auto").backend == "transformers"  # no usable GPU: the CPU engine


# --------------------------------------------------------------------------- a backend added at run time


class EchoEngine(Engine):
    """A backend registered by the test below: a remote server that templates the messages
    itself and answers n samples in one request, each with its last user message."""

    templates_server_side = True
    native_n = True
    loads_model = False
    needs_base_url = True
    requests: list[int] = []  # the n of each request (the runner makes the instance)

    def __init__(self, processor: ProcessorConfig, batch_size: int, log_dir=None):
        self.processor = processor
        self.info = EngineInfo(backend="echo", model_path=processor.server_args.model_path, device="remote")

    def load(self) -> None:
        pass

    @property
    def native_samples(self) -> bool:
        return self.processor.native_n is not False

    async def generate_one(self, request):
        return (await self.generate_samples(request, 1))[0]

    async def generate_samples(self, request, n):
        EchoEngine.requests.append(n)
        said = request.messages[-1]["content"]
        return [Completion(request.id + k, f"{said} #{k}", 3, 2, "stop") for k in range(n)]


ECHO = Backend(f"{__name__}:EchoEngine", Capabilities(templates_server_side=True, native_n=True, loads_model=False, needs_base_url=True))


@pytest.fixture
def echo_backend(monkeypatch):
    """One registry line and the schema's enum: all a new backend needs besides its module."""
    monkeypatch.setitem(BACKENDS, "echo", ECHO)
    backend = loading.schema()["properties"]["processors"]["items"]["properties"]["backend"]
    monkeypatch.setitem(backend, "enum", [*backend["enum"], "echo"])
    EchoEngine.requests = []


def _echo_pipeline(tmp_path: Path, **processor) -> dict:
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"question {i}"}) + "\n" for i in range(3)))
    return pipeline_config(
        data, model="echo-model", state_dir=tmp_path / "state", output_dir=tmp_path / "out",
        outputs=[{"name": "a", "prompt": "Say: {{ q }}"}],
        processor={"backend": "echo", "base_url": "http://echo:1/v1", "default_sampling_params": {"temperature": 0.7}, **processor},
        processing={"n_samples": 2, "remove_columns": True, "output_schema": {"q": "{{ q }}", "a": "{{ a }}"}},
        execution_params={"merge": False},
    )  # fmt: skip


def test_a_backend_registered_at_run_time_is_validated_checked_previewed_and_run(echo_backend, tmp_path):
    from mirageflow.data.writers import read_parts
    from mirageflow.shard import preview
    from mirageflow.shard.runner import index_datasets, run_shard

    # config validation reads its capabilities: it needs a base_url, has native n, loads no model
    with pytest.raises(ConfigError) as e:
        load_config(_echo_pipeline(tmp_path, base_url=None), environ={})
    assert e.value.problems == ["processors[0].base_url: required by backend echo (e.g. http://node:30000/v1)"]
    shared = _echo_pipeline(tmp_path)
    shared["execution_params"]["shards_per_engine"] = 2
    with pytest.raises(ConfigError, match=r"execution_params\.shards_per_engine: .*uses backend echo \(a remote server, nothing to load\)"):
        load_config(shared, environ={})
    not_native = _echo_pipeline(tmp_path, backend="transformers", native_n=True)
    with pytest.raises(
        ConfigError, match=r"native_n: only the echo, openai and vllm_server backends send one request with n; backend 'transformers'"
    ):
        load_config(not_native, environ={})

    # preflight: no model directory to look for (echo-model is the server's name), its API key is
    with pytest.raises(ConfigError) as e:
        validate(_echo_pipeline(tmp_path, api_key_env="ECHO_KEY"), environ={})
    assert [p.split(":")[0] for p in e.value.problems] == ["processors[0].api_key_env"]
    cfg = validate(_echo_pipeline(tmp_path, native_n=True), environ={})

    # preview: the server templates, so the messages are what is shown
    shown = preview.preview(cfg, rows=1)
    rows = shown["datasets"][0]["rows"]  # one entry per record: the row's 2 samples
    assert [r["sample_index"] for r in rows] == [0, 1]
    (out,) = rows[0]["outputs"]
    assert out["prompt"] is None and out["messages"] == [{"role": "user", "content": "Say: question 0"}]
    assert shown["engines"] == {"llm": "echo"}

    # a shard: one request with n=2 per row, two records per row
    index_datasets(cfg)
    status = run_shard(cfg, 0)
    assert status["engines"]["llm"]["backend"] == "echo"
    assert EchoEngine.requests == [2, 2, 2]
    records = read_parts(tmp_path / "out" / "shard_0", "parquet").to_pylist()
    assert sorted((r["q"], r["a"]) for r in records) == sorted(
        (f"question {i}", f"Say: question {i} #{k}") for i in range(3) for k in range(2)
    )
