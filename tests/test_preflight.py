"""Mistakes caught before any job starts, by the one validation that `snakemake -n` (the
driver) and `mmirage check` both run (mirageflow.config.preflight.validate)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import yaml
from conftest import run_workflow
from fakes.configs import pipeline_config

from mirageflow import cli
from mirageflow.config import ConfigError, load_config
from mirageflow.config.preflight import validate

REPO = Path(__file__).resolve().parents[1]
ROWS = [{"id": i, "text": f"passage {i}", "meta": {"topic": "t", "difficulty": i % 3}} for i in range(30)]


@pytest.fixture
def model(tmp_path) -> Path:
    """A model directory as far as the checks look: a config.json with a context length."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 512}))
    return d


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "data" / "rows.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.fixture
def parquet(tmp_path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data" / "rows.parquet"
    path.parent.mkdir(exist_ok=True)
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


@pytest.fixture
def cfg(tmp_path, model, jsonl) -> dict:
    return pipeline_config(
        jsonl, model=model, state_dir=tmp_path / "state", output_dir=tmp_path / "out", num_shards=3,
        inputs=["text", {"name": "difficulty", "key": "meta.difficulty"}],
        outputs=[
            {"name": "card", "output_type": "JSON", "output_schema": {"subject": "str", "category": "str"},
             "prompt": "File {{ text }} ({{ difficulty }})"},
            {"name": "summary", "prompt": "Summarise {{ text }} about {{ card.subject }}"},
        ],
        processor={"backend": "transformers", "default_sampling_params": {"max_new_tokens": 16}},
        processing={"output_schema": {"text": "{{ text }}", "subject": "{{ card.subject }}", "summary": "{{ summary }}"}},
    )  # fmt: skip


def problems(cfg: dict, **environ) -> list[str]:
    with pytest.raises(ConfigError) as err:
        validate(cfg, environ=environ)
    return err.value.problems


def one(cfg: dict, **environ) -> str:
    found = problems(cfg, **environ)
    assert len(found) == 1, found
    return found[0]


def test_valid_config_passes(cfg):
    c = validate(cfg, environ={})
    assert c.num_shards == 3


# --------------------------------------------------------------------------- data formats


def test_parquet_file_declared_jsonl(cfg, parquet):
    cfg["loading_params"]["datasets"][0]["path"] = str(parquet)
    p = one(cfg)
    assert p.startswith("loading_params.datasets[0].type: ") and "is a Parquet file" in p and "set type: Parquet" in p


def test_jsonl_file_declared_parquet(cfg, jsonl):
    cfg["loading_params"]["datasets"][0]["type"] = "Parquet"
    p = one(cfg)
    assert p.startswith("loading_params.datasets[0].type: ") and str(jsonl) in p and "set type: JSONL" in p


def test_json_array_declared_jsonl(cfg, tmp_path):
    path = tmp_path / "array.json"
    path.write_text(json.dumps(ROWS, indent=1))
    cfg["loading_params"]["datasets"][0]["path"] = str(path)
    assert "not one object per line" in one(cfg)


def test_parquet_dataset_is_sampled(cfg, parquet):
    ds = cfg["loading_params"]["datasets"][0]
    ds.update(path=str(parquet), type="parquet")
    validate(cfg, environ={})
    cfg["processing_params"]["inputs"][1]["key"] = "meta.dificulty"
    assert one(cfg).startswith("processing_params.inputs[1].key: 'meta.dificulty'")


def test_loadable_dataset_is_sampled_without_datasets_import(cfg, tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "hf"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(path))
    ds = cfg["loading_params"]["datasets"][0]
    ds.update(path=str(path), type="loadable")
    validate(cfg, environ={})
    cfg["processing_params"]["inputs"][0]["key"] = "txet"
    assert "(did you mean 'text'?)" in one(cfg)


# --------------------------------------------------------------------------- JMESPath keys


def test_key_matching_no_row_names_key_and_a_row(cfg):
    cfg["processing_params"]["inputs"][1]["key"] = "meta.dificulty"
    p = one(cfg)
    assert p.startswith("processing_params.inputs[1].key: 'meta.dificulty' (input 'difficulty') matches nothing")
    assert "first 20 rows of loading_params.datasets[0]" in p and "(did you mean 'meta.difficulty'?)" in p
    assert '"id": 0' in p  # the row that lacks it


@pytest.mark.parametrize("switch", [{"default": "easy"}, {"default": None}, {"optional": True}])
def test_missing_key_allowed_with_default_or_optional(cfg, switch):
    cfg["processing_params"]["inputs"][1].update(key="meta.dificulty", **switch)
    c = validate(cfg, environ={})
    assert c.inputs[1].optional is bool(switch.get("optional"))


def test_key_present_in_some_sampled_rows_passes(cfg, jsonl):
    rows = [{"text": "a"}] * 5 + [{"text": "b", "meta": {"difficulty": 1}}]
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg["loading_params"]["num_shards"] = 2
    validate(cfg, environ={})


def test_optional_is_not_in_the_defaults(cfg):
    """A new key with a schema default would change every config's records fingerprint (reruns)."""
    c = load_config(cfg, environ={})
    assert "optional" not in c.raw["processing_params"]["inputs"][0]


# --------------------------------------------------------------------------- models


def test_model_directory_missing(cfg, tmp_path):
    cfg["processors"][0]["server_args"]["model_path"] = str(tmp_path / "nope" / "model")
    assert one(cfg).startswith(f"processors[0].server_args.model_path: model directory '{tmp_path / 'nope' / 'model'}' does not exist")


def test_model_directory_without_model(cfg, model):
    (model / "config.json").unlink()
    p = one(cfg)
    assert p.startswith("processors[0].server_args.model_path: ") and "holds no model (no config.json)" in p


def test_hub_id_not_in_cache_and_offline(cfg, tmp_path):
    """(tests/test_hub_models.py: against a stand-in hub, the other cases)"""
    cfg["processors"][0]["server_args"]["model_path"] = "HuggingFaceTB/SmolLM2-1.7B"
    p = one(cfg, HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    assert p.startswith(f"processors[0].server_args.model_path: 'HuggingFaceTB/SmolLM2-1.7B' is not in the cache {tmp_path / 'hf' / 'hub'}")
    assert "HF_HUB_OFFLINE is set here, so it cannot be downloaded" in p
    assert "hf download HuggingFaceTB/SmolLM2-1.7B --cache-dir" in p


def test_hub_id_in_cache_passes_and_gives_the_context(cfg, tmp_path):
    repo = tmp_path / "hf" / "hub" / "models--org--name"
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc")  # as huggingface_hub writes it
    (snap / "config.json").write_text(json.dumps({"n_positions": 64}))
    cfg["processors"][0]["server_args"]["model_path"] = "org/name"
    validate(cfg, environ={"HF_HOME": str(tmp_path / "hf")})
    cfg["processors"][0]["default_sampling_params"]["max_new_tokens"] = 64
    assert "context of 64 tokens (n_positions in" in one(cfg, HF_HOME=str(tmp_path / "hf"))


def test_workflow_built_model_may_be_absent(cfg, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    cfg["processors"][0]["server_args"]["model_path"] = "resources/models/SmolLM2-135M-Instruct"
    validate(cfg, environ={})


def test_max_new_tokens_over_context(cfg):
    cfg["processors"][0]["default_sampling_params"]["max_new_tokens"] = 600
    cfg["processing_params"]["outputs"][1]["sampling_params"] = {"max_new_tokens": 4096}
    found = problems(cfg)
    assert [p.split(":")[0] for p in found] == [
        "processors[0].default_sampling_params.max_new_tokens",
        "processing_params.outputs[1].sampling_params.max_new_tokens",
    ]
    assert "not below the model's context of 512 tokens (max_position_embeddings in" in found[0]


def test_context_length_from_server_args_wins(cfg):
    cfg["processors"][0]["server_args"]["extra_engine_args"] = {"context_length": 16}
    p = one(cfg)
    assert "context of 16 tokens (processors[0].server_args.extra_engine_args.context_length)" in p
    cfg["processors"][0]["server_args"]["extra_engine_args"] = {"context_length": 4096}
    cfg["processors"][0]["default_sampling_params"]["max_new_tokens"] = 600  # > config.json's 512
    validate(cfg, environ={})


def test_api_key_env_unset(cfg):
    proc = cfg["processors"][0]
    proc.update(backend="openai", base_url="http://node:30000/v1", api_key_env="MY_TEST_KEY")
    proc["server_args"]["model_path"] = "served-name"  # a name, not a directory: not checked
    p = one(cfg)
    assert p.startswith("processors[0].api_key_env: environment variable $MY_TEST_KEY is not set")
    validate(cfg, environ={"MY_TEST_KEY": "sk-1"})


# --------------------------------------------------------------------------- shards, paths, owners


def test_num_shards_over_the_rows(cfg):
    cfg["loading_params"]["num_shards"] = 31
    p = one(cfg)
    assert p.startswith("loading_params.num_shards: 31 shards, but no dataset has more than 30 rows")
    cfg["loading_params"]["num_shards"] = 30
    validate(cfg, environ={})


def test_num_shards_sane_maximum_is_a_message(cfg):
    cfg["loading_params"]["num_shards"] = 1_000_000_000
    assert one(cfg).startswith("loading_params.num_shards: 1000000000 is greater than the maximum of 1000000")


def test_num_shards_over_rows_of_parquet(cfg, parquet):
    cfg["loading_params"]["datasets"][0].update(path=str(parquet), type="parquet")
    cfg["loading_params"]["num_shards"] = 100
    assert "no dataset has more than 30 rows" in one(cfg)


def test_output_dir_of_another_pipeline(cfg, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".mirageflow-owner.json").write_text(json.dumps({"state_dir": str(tmp_path / "other")}))
    p = one(cfg)
    assert p.startswith("loading_params.datasets[0].output_dir: ") and "belongs to another pipeline" in p


# --------------------------------------------------------------------------- one validation, two entry points

HOSTILE = {
    "parquet_as_jsonl": ("loading_params.datasets[0].type", lambda c, t: c["loading_params"]["datasets"][0].update(path=str(_parquet(t)))),
    "key_typo": ("processing_params.inputs[1].key", lambda c, t: c["processing_params"]["inputs"][1].update(key="meta.dificulty")),
    "no_model": ("processors[0].server_args.model_path", lambda c, t: c["processors"][0]["server_args"].update(model_path=str(t / "missing"))),
    "hub_id": ("processors[0].server_args.model_path", lambda c, t: c["processors"][0]["server_args"].update(model_path="org/not-cached")),
    "context": ("processors[0].default_sampling_params.max_new_tokens", lambda c, t: c["processors"][0]["default_sampling_params"].update(max_new_tokens=9999)),
    "api_key": ("processors[0].api_key_env", lambda c, t: c["processors"][0].update(backend="openai", base_url="http://h:1/v1", api_key_env="MIRAGEFLOW_UNSET_KEY")),
    "json_field": ("processing_params.output_schema.subject", lambda c, t: c["processing_params"]["output_schema"].update(subject="{{ card.subjct }}")),
    "later_prompt_field": ("processing_params.outputs[1].prompt", lambda c, t: c["processing_params"]["outputs"][1].update(prompt="{{ card.subjct }}")),
    "unknown_filter": ("processing_params.outputs[0].prompt", lambda c, t: c["processing_params"]["outputs"][0].update(prompt="{{ text | shout }}")),
    "unknown_test": ("processing_params.outputs[0].prompt", lambda c, t: c["processing_params"]["outputs"][0].update(prompt="{% if text is loud %}x{% endif %}")),
    "include": ("processing_params.outputs[0].system", lambda c, t: c["processing_params"]["outputs"][0].update(system="{% include 'x.j2' %}")),
    "extends": ("processing_params.outputs[0].prompt", lambda c, t: c["processing_params"]["outputs"][0].update(prompt="{% extends 'base' %}")),
    "dunder": ("processing_params.outputs[0].prompt", lambda c, t: c["processing_params"]["outputs"][0].update(prompt="{{ text.__class__.__mro__ }}")),
    "empty_state_dir": ("loading_params.state_dir", lambda c, t: c["loading_params"].update(state_dir="")),
    "env_empty_state_dir": ("loading_params.state_dir", lambda c, t: c["loading_params"].update(state_dir="${MIRAGEFLOW_EMPTY_VAR:-}")),
    "empty_output_dir": ("loading_params.datasets[0].output_dir", lambda c, t: c["loading_params"]["datasets"][0].update(output_dir="")),
    "output_dir_in_input_dir": ("loading_params.datasets[0].output_dir", lambda c, t: _parquet_dir_with_output_inside(c, t)),
    "output_dir_is_input_file": ("loading_params.datasets[0].output_dir", lambda c, t: c["loading_params"]["datasets"][0].update(output_dir=c["loading_params"]["datasets"][0]["path"])),
    "state_dir_under_file": ("loading_params.state_dir", lambda c, t: c["loading_params"].update(state_dir=c["loading_params"]["datasets"][0]["path"] + "/state")),
    "num_shards_huge": ("loading_params.num_shards", lambda c, t: c["loading_params"].update(num_shards=1_000_000_000)),
    "num_shards_over_rows": ("loading_params.num_shards", lambda c, t: c["loading_params"].update(num_shards=500)),
    "max_time_limit": ("execution_params.max_time_limit", lambda c, t: c.update(execution_params={"time_limit": "02:00:00", "max_time_limit": "01:00:00"})),
    "slurm_extra": ("execution_params.slurm_extra", lambda c, t: c.update(execution_params={"slurm_extra": "--time=99:00:00"})),
}  # fmt: skip
SNAKEMAKE_SAMPLE = ["parquet_as_jsonl", "key_typo", "hub_id", "unknown_filter", "state_dir_under_file", "num_shards_over_rows"]


def _parquet(tmp_path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data" / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    return path


def _parquet_dir_with_output_inside(c: dict, tmp_path: Path) -> None:
    _parquet(tmp_path)
    c["loading_params"]["datasets"][0].update(path=str(tmp_path / "data"), type="parquet", output_dir=str(tmp_path / "data" / "out"))


def _hostile(cfg: dict, tmp_path: Path, name: str) -> tuple[str, Path]:
    key, edit = HOSTILE[name]
    c = copy.deepcopy(cfg)
    edit(c, tmp_path)
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(c, sort_keys=False))
    return key, path


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.delenv("MIRAGEFLOW_UNSET_KEY", raising=False)
    monkeypatch.delenv("MIRAGEFLOW_EMPTY_VAR", raising=False)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_mmirage_check_exits_2_with_the_key(cfg, tmp_path, capsys, clean_env, name):
    key, path = _hostile(cfg, tmp_path, name)
    assert cli.main(["check", "--config", str(path)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert f"  - {key}: " in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", SNAKEMAKE_SAMPLE)
def test_snakemake_dry_run_refuses_with_the_same_key(cfg, tmp_path, clean_env, name):
    key, path = _hostile(cfg, tmp_path, name)
    proc = run_workflow(tmp_path, path.read_text(), "-n", check=False, env={**os.environ, "HF_HOME": str(tmp_path / "hf-home")})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert f"  - {key}: " in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "state" / "configs").exists()  # refused before the driver wrote anything


def test_valid_config_passes_both(cfg, tmp_path, capsys, clean_env):
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert cli.main(["check", "--config", str(path)]) == cli.EXIT_OK
    assert "valid" in capsys.readouterr().out
    proc = run_workflow(tmp_path, cfg, "-n", check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


@pytest.mark.parametrize(
    "content, expected",
    [
        (b"processors: [\xff]\n", "is not UTF-8 text (byte 0xff at offset 13, line 1)"),
        (None, "does not exist"),
        (b"- a\n", "must hold a YAML mapping"),
    ],
)
def test_mmirage_check_unreadable_config_file(tmp_path, capsys, content, expected):
    path = tmp_path / "c.yaml"
    if content is not None:
        path.write_bytes(content)
    assert cli.main(["check", "--config", str(path)]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert expected in err and str(path) in err and "Traceback" not in err


def test_job_parse_skips_the_file_checks(cfg, monkeypatch):
    """A cluster job (not the main process) validates the config only: no data or model file is read."""
    cfg["processing_params"]["inputs"][1]["key"] = "meta.dificulty"
    cfg["processors"][0]["server_args"]["model_path"] = "org/not-cached"
    validate(cfg, environ={}, preflight=False)
    text = (REPO / "workflow" / "rules" / "common.smk").read_text()
    assert "validate(config, preflight=workflow.is_main_process)" in text


def test_a_json_output_without_xgrammar_installed_is_refused_with_the_install_step(cfg, monkeypatch):
    """The CPU install puts xgrammar in a second step (requirements-no-deps.txt, without triton)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "xgrammar" else real(name, *a))
    message = one(cfg)
    assert message.startswith("processing_params.outputs[0]: JSON output 'card' (processor ") and "backend transformers" in message
    assert "pip install --no-deps -r requirements-no-deps.txt" in message
    cfg["processors"][0]["backend"] = "openai"  # the server constrains the JSON
    cfg["processors"][0]["base_url"] = "http://localhost:1/v1"
    assert validate(cfg, environ={}).num_shards == 3


def test_requirements_no_deps_lists_only_packages_whose_other_requirements_are_pinned():
    """xgrammar goes in without its dependencies: every one it needs on a CPU (all but triton) is in requirements.txt."""
    import importlib.metadata

    from packaging.requirements import Requirement

    def runtime_needs(name: str) -> set[str]:
        needs = [Requirement(r) for r in importlib.metadata.requires(name) or []]
        return {n.name.lower().replace("_", "-") for n in needs if not n.marker or n.marker.evaluate({"extra": ""})}

    def lines(name: str) -> list[Requirement]:
        return [Requirement(line) for line in (REPO / name).read_text().splitlines() if line and not line.startswith("#")]

    installed = set()  # what `pip install -r requirements.txt` brings: the pins and their requirements
    todo = [r.name.lower() for r in lines("requirements.txt")]
    while todo:
        name = todo.pop()
        if name not in installed:
            installed.add(name)
            todo += runtime_needs(name)
    listed = lines("requirements-no-deps.txt")
    assert [r.name for r in listed] == ["xgrammar"]
    assert "triton" not in installed  # the CPU torch does not need it either
    for req in listed:
        assert runtime_needs(req.name) - installed == {"triton"}  # triton: CUDA kernels only (xgrammar.matcher)


# --------------------------------------------------------------------------- the engine the jobs will run


def _missing_here(package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed in this environment")


@pytest.mark.parametrize("backend, package", [("sglang", "sglang"), ("sglang_server", "sglang"), ("vllm_server", "vllm")])
def test_an_engine_package_this_environment_lacks_is_refused_before_any_job(cfg, tmp_path, capsys, clean_env, backend, package):
    """Item 12: a backend whose package the jobs' (= the driver's) Python lacks is refused by
    `mmirage check` and `snakemake -n`, naming the key and the install; the opt-out lets it through."""
    _missing_here(package)
    cfg["processors"][0]["backend"] = backend
    found = one(cfg, PATH=os.environ["PATH"])
    assert found.startswith(f"processors[0].backend: {backend} needs the {package} package") and "pip install" in found, found
    validate(cfg, environ={"MIRAGEFLOW_SKIP_ENGINE_CHECK": "1"})
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    assert cli.main(["check", "--config", str(path)]) == cli.EXIT_USAGE
    assert f"processors[0].backend: {backend} needs the {package} package" in capsys.readouterr().err
    if backend == "vllm_server":  # the driver refuses it the same way, before writing anything
        proc = run_workflow(tmp_path, cfg, "-n", check=False)
        assert proc.returncode != 0 and f"processors[0].backend: {backend} needs the {package} package" in proc.text
        assert not (tmp_path / "state" / "configs").exists()


@pytest.mark.parametrize("backend", ["sglang_server", "vllm_server"])
def test_a_server_command_whose_program_does_not_exist_is_refused_naming_it(cfg, tmp_path, backend):
    """Item 12: no bare FileNotFoundError in the shard: the launcher is looked for before any job."""
    import sys

    cfg["processors"][0].update(backend=backend, server_command=["no-such-launcher-xyz", "--flag"])
    found = one(cfg, PATH=os.environ["PATH"])
    assert found.startswith("processors[0].server_command: program 'no-such-launcher-xyz' is not on PATH"), found
    cfg["processors"][0]["server_command"] = [str(tmp_path / "bin" / "launcher")]
    assert "does not exist" in one(cfg, PATH=os.environ["PATH"])
    cfg["processors"][0]["server_command"] = [sys.executable, "-m", "some.launcher"]  # there: the package is its business
    validate(cfg, environ={"PATH": os.environ["PATH"]})


def test_an_image_gen_sglang_backend_without_its_package_is_refused(cfg, tmp_path):
    """Item 12, image_gen: SGLang's diffusion server is launched by the shard; without sglang here, refused."""
    _missing_here("sglang")
    model = tmp_path / "pipe"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    cfg["processors"].append({"type": "image_gen", "backend": "sglang", "sglang": {"model_path": str(model)}})
    cfg["processing_params"]["outputs"].append({"name": "picture", "type": "image_gen", "prompt": "A photo of {{ text }}"})
    found = one(cfg, PATH=os.environ["PATH"])
    assert found.startswith("processors[1].backend: image_gen backend sglang launches") and "sglang" in found, found
    cfg["processors"][1]["sglang"]["server_command"] = ["no-such-launcher-xyz"]
    assert one(cfg, PATH=os.environ["PATH"]).startswith("processors[1].sglang.server_command: program 'no-such-launcher-xyz'")


def test_a_model_path_with_an_at_revision_points_at_the_revision_key(cfg):
    """Item 19: `org/name@main` is no directory; the message says how a revision is written."""
    cfg["processors"][0]["server_args"]["model_path"] = "org/name@main"
    found = one(cfg)
    assert found.startswith("processors[0].server_args.model_path: model directory 'org/name@main' does not exist"), found
    assert "model_path: org/name with processors[0].server_args.revision: main" in found, found
