"""Config loading: schema errors with key paths, semantic checks, env expansion, defaults."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from fakes.configs import pipeline_config

from mirageflow.config import ConfigError, ServerArgs, load_config

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def jsonl(tmp_path) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_text('{"question": "2+2?", "meta": {"topic": "math"}}\n')
    return path


@pytest.fixture
def cfg(tmp_path, jsonl) -> dict:
    """A minimal valid config dict reading the tmp JSONL file."""
    return pipeline_config(
        jsonl,
        model="org/model",
        state_dir=None,
        output_dir=tmp_path / "out",
        num_shards=None,
        inputs=["question"],
        outputs=[{"name": "answer", "prompt": "Answer: {{ question }}"}],
    )


def load(cfg: dict, **environ):
    return load_config(cfg, environ=environ)


def problems_of(cfg: dict, **environ) -> list[str]:
    """The ConfigError's problems; fails the test when the config loads."""
    with pytest.raises(ConfigError) as err:
        load_config(cfg, environ=environ)
    # every problem is also in the message, one per line
    for p in err.value.problems:
        assert p in str(err.value)
    return err.value.problems


def only_problem(cfg: dict, **environ) -> str:
    problems = problems_of(cfg, **environ)
    assert len(problems) == 1, problems
    return problems[0]


def add_output(cfg: dict, **output) -> None:
    cfg["processing_params"]["outputs"].append(output)


def json_output(cfg: dict, schema) -> dict:
    out = cfg["processing_params"]["outputs"][0]
    out["output_type"] = "JSON"
    out["output_schema"] = schema
    return cfg


SCHEMA_AT = "processing_params.outputs[0].output_schema"


# --------------------------------------------------------------------------- valid configs


def test_minimal_config_loads_into_typed_view(cfg, jsonl, tmp_path):
    c = load(cfg)
    assert c.num_shards == 1
    [ds] = c.datasets
    assert (ds.index, ds.path, ds.type, ds.output_format, ds.split) == (0, str(jsonl), "jsonl", "parquet", None)
    assert ds.output_dir == str(tmp_path / "out")
    [inp] = c.inputs
    assert (inp.name, inp.key, inp.has_default) == ("question", "question", False)
    [out] = c.outputs
    assert (out.name, out.processor, out.is_json, out.schema, out.system) == ("answer", "llm", False, None, None)
    assert set(c.processors) == {"llm"}


def test_defaults_are_filled_in(cfg):
    c = load(cfg)
    # per pipeline: next to its first output, never one directory shared by every pipeline
    assert c.state_dir == str(Path(cfg["loading_params"]["datasets"][0]["output_dir"]) / ".mirageflow-state")
    assert c.batch_size == 32
    assert c.merge is True
    assert c.stats is False
    assert c.remove_columns is False
    assert c.output_schema == {}
    ep = c.execution
    assert (ep.mode, ep.max_retries, ep.gpus, ep.time_limit) == ("local", 3, None, "11:59:59")  # gpus: from tp_size x dp_size
    proc = c.processors["llm"]
    assert proc.backend == "auto"
    assert proc.server_args == ServerArgs(
        model_path="org/model",
        tp_size=1,
        dp_size=1,
        trust_remote_code=False,  # a model directory is data: its code runs only when asked
        disable_custom_all_reduce=False,
        extra_engine_args={},
    )
    assert proc.apply_chat_template is True
    assert proc.chat_template_kwargs == {}
    assert c.outputs[0].sampling_params == {}
    # defaults never overwrite given values
    cfg["loading_params"].update(batch_size=4, state_dir="/tmp/somewhere")
    cfg["execution_params"] = {"merge": False}
    c = load(cfg)
    assert (c.batch_size, c.state_dir, c.merge) == (4, "/tmp/somewhere", False)


def test_input_default_is_recorded(cfg):
    cfg["processing_params"]["inputs"].append({"name": "topic", "key": "meta.topic", "default": None})
    topic = load(cfg).inputs[1]
    assert (topic.has_default, topic.default) == (True, None)


def test_demo_config_from_repo_loads(monkeypatch):
    monkeypatch.chdir(REPO)  # its dataset path is relative to the repository root
    c = load_config(REPO / "config" / "config.yaml", environ={})
    assert c.num_shards == 3
    assert c.datasets[0].type == "jsonl"
    assert [o.name for o in c.outputs] == ["summary", "card"]
    card = c.outputs[1]
    assert card.is_json and card.response_prefix == '{"subject": "'
    assert [f.name for f in card.schema.fields] == ["subject", "category"]
    assert c.remove_columns is True


def test_config_from_yaml_file(tmp_path, cfg):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert load_config(path, environ={}).outputs[0].name == "answer"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must hold a YAML mapping"):
        load_config(path, environ={})
    with pytest.raises(ConfigError, match="absent.yaml' does not exist"):
        load_config(tmp_path / "absent.yaml", environ={})


# --------------------------------------------------------------------------- schema errors


def test_unknown_top_level_key_has_hint(cfg):
    cfg["stat"] = True
    assert only_problem(cfg) == "stat: unknown key (did you mean 'stats'?)"


def test_unknown_nested_key_has_hint(cfg):
    cfg["loading_params"]["num_shard"] = 4
    assert only_problem(cfg) == "loading_params.num_shard: unknown key (did you mean 'num_shards'?)"


def test_unknown_key_in_list_item(cfg):
    cfg["processors"][0]["server_args"]["modle_path"] = "x"
    assert only_problem(cfg) == "processors[0].server_args.modle_path: unknown key (did you mean 'model_path'?)"


def test_unknown_key_without_close_match_lists_known_keys(cfg):
    cfg["execution_params"] = {"zzzzzz": 1}
    problem = only_problem(cfg)
    assert problem.startswith("execution_params.zzzzzz: unknown key (known: ")
    assert "merge" in problem


def test_wrong_type_names_key_path(cfg):
    cfg["loading_params"]["num_shards"] = "four"
    problem = only_problem(cfg)
    assert problem.startswith("loading_params.num_shards: ")
    assert "'four' is not of type 'integer'" in problem


def test_missing_required_key(cfg):
    del cfg["processing_params"]["outputs"][0]["prompt"]
    # an LLM output needs a prompt unless it sends a row's conversation (test_chat_inputs.py)
    assert (
        only_problem(cfg)
        == "processing_params.outputs[0].prompt: required key is missing (or set conversation to send a row's chat messages)"
    )


def test_missing_required_section(cfg):
    del cfg["processors"]
    assert only_problem(cfg) == "processors: required key is missing"


def test_bad_enum_value(cfg):
    cfg["loading_params"]["datasets"][0]["type"] = "csv"
    assert only_problem(cfg).startswith("loading_params.datasets[0].type: ")


def test_all_schema_problems_reported_at_once(cfg):
    cfg["loading_params"]["num_shards"] = "four"
    cfg["processors"][0]["server_args"]["modle_path"] = "x"
    problems = problems_of(cfg)
    assert len(problems) == 2
    assert any(p.startswith("loading_params.num_shards: ") for p in problems)
    assert any(p.startswith("processors[0].server_args.modle_path: unknown key") for p in problems)


def test_all_semantic_problems_reported_at_once(cfg, tmp_path):
    cfg["loading_params"]["datasets"][0]["path"] = str(tmp_path / "missing.jsonl")
    cfg["processing_params"]["outputs"][0]["prompt"] = "{{ questoin }}"
    problems = problems_of(cfg)
    assert len(problems) == 2
    assert problems[0].startswith("loading_params.datasets[0].path: JSONL file")
    assert problems[1].startswith("processing_params.outputs[0].prompt: unknown variable 'questoin'")


# --------------------------------------------------------------------------- templates


def test_prompt_with_undefined_variable(cfg):
    add_output(cfg, name="check", prompt="Is {{ anser }} right?")
    assert only_problem(cfg) == "processing_params.outputs[1].prompt: unknown variable 'anser' (did you mean 'answer'?)"


def test_later_output_may_use_earlier_output(cfg):
    add_output(cfg, name="check", prompt="Is {{ answer }} right for {{ question }}?")
    assert [o.name for o in load(cfg).outputs] == ["answer", "check"]


def test_earlier_output_may_not_use_later_output(cfg):
    cfg["processing_params"]["outputs"][0]["prompt"] = "{{ check }}"
    add_output(cfg, name="check", prompt="{{ question }}")
    assert only_problem(cfg).startswith("processing_params.outputs[0].prompt: unknown variable 'check'")


def test_system_template_is_checked(cfg):
    cfg["processing_params"]["outputs"][0]["system"] = "You know {{ nothing }}."
    assert only_problem(cfg).startswith("processing_params.outputs[0].system: unknown variable 'nothing'")


def test_template_locals_are_not_unknown_variables(cfg):
    cfg["processing_params"]["outputs"][0]["prompt"] = "{% set q = question %}{% for i in range(2) %}{{ loop.index }} {{ q }}{% endfor %}"
    load(cfg)


def test_undefined_variable_in_nested_record_schema(cfg):
    cfg["processing_params"]["output_schema"] = {
        "conversations": [{"role": "user", "content": "{{ question }}"}, {"role": "assistant", "content": "{{ answr }}"}],
    }
    assert only_problem(cfg) == (
        "processing_params.output_schema.conversations[1].content: unknown variable 'answr' (did you mean 'answer'?)"
    )


def test_record_schema_may_use_inputs_and_outputs(cfg):
    cfg["processing_params"]["output_schema"] = {"q": "{{ question }}", "nested": [{"a": "{{ answer }}"}], "n": 3}
    assert load(cfg).output_schema["nested"] == [{"a": "{{ answer }}"}]


def test_template_syntax_error(cfg):
    cfg["processing_params"]["outputs"][0]["prompt"] = "Answer: {{ question "
    assert only_problem(cfg).startswith("processing_params.outputs[0].prompt: template syntax error on line 1")


def test_bad_jmespath_key(cfg):
    cfg["processing_params"]["inputs"][0]["key"] = "a..b"
    assert only_problem(cfg).startswith("processing_params.inputs[0].key: invalid JMESPath expression 'a..b'")


def test_duplicate_variable_names(cfg):
    cfg["processing_params"]["outputs"][0]["name"] = "question"
    assert only_problem(cfg) == "processing_params.outputs[0].name: duplicate variable 'question'"


# --------------------------------------------------------------------------- output_schema of JSON outputs


@pytest.mark.parametrize(
    "schema, expected",
    [
        ({"score": "decimal"}, f"{SCHEMA_AT}.score.type: unknown type 'decimal'"),
        ({"score": {"min": 1}}, f"{SCHEMA_AT}.score.type: missing type"),
        ({"name": {"type": "str", "min": 1}}, f"{SCHEMA_AT}.name: min/max are only allowed on numeric fields"),
        ({"ok": {"type": "bool", "max": 1}}, f"{SCHEMA_AT}.ok: min/max are only allowed on numeric fields"),
        ({"score": {"type": "int", "min": "low"}}, f"{SCHEMA_AT}.score.min: bound must be a number, got 'low'"),
        ({"score": {"type": "int", "max": True}}, f"{SCHEMA_AT}.score.max: bound must be a number"),
        ({"score": {"type": "int", "max": 2.5}}, f"{SCHEMA_AT}.score.max: fractional bound 2.5 on an integer field"),
        ({"score": {"type": "int", "min": "0.5"}}, f"{SCHEMA_AT}.score.min: fractional bound '0.5' on an integer field"),
        ({"score": {"type": "int", "min": 5, "max": 1}}, f"{SCHEMA_AT}.score: min 5 is greater than max 1"),
        ({"score": {"type": "int", "minimum": 1}}, f"{SCHEMA_AT}.score.minimum: unknown key"),
        ({"score": 3}, f"{SCHEMA_AT}.score: expected a type name or a mapping"),
        (["ok", ""], f"{SCHEMA_AT}[1]: field names must be non-empty strings"),
    ],
)
def test_bad_output_schema(cfg, schema, expected):
    assert only_problem(json_output(cfg, schema)).startswith(expected)


def test_numeric_string_bounds_are_accepted(cfg):
    schema = {"score": {"type": "integer", "min": "1", "max": "${MAX}"}, "p": {"type": "float", "min": "0.5", "max": "1"}}
    c = load(json_output(cfg, schema), MAX="10")
    score, p = c.outputs[0].schema.fields
    assert (score.type, score.minimum, score.maximum) == ("integer", 1, 10)
    assert (p.type, p.minimum, p.maximum) == ("number", 0.5, 1)


def test_mixed_output_schema_forms(cfg):
    c = load(json_output(cfg, {"title": "string", "n": {"type": "int", "max": 3}, "flag": "boolean"}))
    assert [(f.name, f.type, f.maximum) for f in c.outputs[0].schema.fields] == [
        ("title", "string", None),
        ("n", "integer", 3),
        ("flag", "boolean", None),
    ]


def test_json_output_without_schema_accepts_any_object(cfg):
    cfg["processing_params"]["outputs"][0]["output_type"] = "json"
    out = load(cfg).outputs[0]
    assert out.is_json and out.schema.fields == ()


def test_output_schema_on_plain_output_is_an_error(cfg):
    cfg["processing_params"]["outputs"][0]["output_schema"] = ["a"]
    assert only_problem(cfg).startswith(
        "processing_params.outputs[0].output_schema: only JSON outputs have an output_schema (output_type is 'plain')"
    )


# --------------------------------------------------------------------------- dataset paths


@pytest.mark.parametrize(
    "kind, path, expected",
    [
        ("JSONL", "missing.jsonl", "JSONL file"),
        ("loadable", "missing_dir", "loadable dataset directory"),
        ("parquet", "nowhere/*.parquet", "no Parquet file, directory or glob match"),
    ],
)
def test_missing_dataset_path(cfg, tmp_path, kind, path, expected):
    ds = cfg["loading_params"]["datasets"][0]
    ds.update(type=kind, path=str(tmp_path / path))
    assert only_problem(cfg).startswith(f"loading_params.datasets[0].path: {expected}")
    # check_paths=False skips the check (e.g. for a dataset built by an earlier rule)
    assert load_config(cfg, environ={}, check_paths=False).datasets[0].type == kind.lower()


def test_parquet_glob_with_a_match_loads(cfg, tmp_path):
    (tmp_path / "pq").mkdir()
    (tmp_path / "pq" / "a.parquet").write_bytes(b"")
    cfg["loading_params"]["datasets"][0].update(type="Parquet", path=str(tmp_path / "pq" / "*.parquet"))
    assert load(cfg).datasets[0].type == "parquet"


def test_jsonl_path_that_is_a_directory_is_an_error(cfg, tmp_path):
    cfg["loading_params"]["datasets"][0]["path"] = str(tmp_path)
    assert only_problem(cfg).startswith("loading_params.datasets[0].path: JSONL file")


def test_two_datasets_with_one_output_dir(cfg):
    datasets = cfg["loading_params"]["datasets"]
    datasets.append(dict(datasets[0]))
    assert only_problem(cfg).startswith("loading_params.datasets[1].output_dir: ")


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda c: c["processors"].append(dict(c["processors"][0])), "processors[1].type: a second 'llm' processor"),
    ],
)
def test_unsupported_features_are_errors(cfg, edit, expected):
    edit(cfg)
    assert only_problem(cfg).startswith(expected)


# --------------------------------------------------------------------------- environment variables


def test_env_dollar_var(cfg):
    cfg["processors"][0]["server_args"]["model_path"] = "$MODEL"
    assert load(cfg, MODEL="org/other").processors["llm"].server_args.model_path == "org/other"


def test_env_braced_var_inside_text(cfg, tmp_path):
    (tmp_path / "data-v2.jsonl").write_text("{}\n")
    cfg["loading_params"]["datasets"][0]["path"] = str(tmp_path / "data-${VERSION}.jsonl")
    assert load(cfg, VERSION="v2").datasets[0].path == str(tmp_path / "data-v2.jsonl")


def test_env_default(cfg):
    cfg["processors"][0]["server_args"]["model_path"] = "${MODEL:-org/fallback}"
    assert load(cfg).processors["llm"].server_args.model_path == "org/fallback"
    assert load(cfg, MODEL="org/set").processors["llm"].server_args.model_path == "org/set"


def test_env_unset_without_default_is_an_error(cfg):
    cfg["processors"][0]["server_args"]["model_path"] = "models/$MODEL"
    problem = only_problem(cfg)
    assert problem.startswith("processors[0].server_args.model_path: environment variable $MODEL is not set")


def test_env_comes_from_environ_argument_not_process(cfg, monkeypatch):
    monkeypatch.setenv("MIRAGEFLOW_TEST_MODEL", "from/process")
    cfg["processors"][0]["server_args"]["model_path"] = "$MIRAGEFLOW_TEST_MODEL"
    assert "MIRAGEFLOW_TEST_MODEL is not set" in only_problem(cfg)
    # environ=None means os.environ
    assert load_config(cfg).processors["llm"].server_args.model_path == "from/process"


def test_double_dollar_is_a_literal_dollar(cfg):
    cfg["processors"][0]["server_args"]["model_path"] = "models/$$weird"
    assert load(cfg).processors["llm"].server_args.model_path == "models/$weird"


def test_templates_are_not_env_expanded(cfg):
    """A prompt is text for the model: "$5" stays, and "$SECRET" is never replaced by the secret."""
    out = cfg["processing_params"]["outputs"][0]
    out.update(prompt="A $5 price, $$ and ${SECRET} for {{ question }}; $SECRET", system="$SECRET", response_prefix="$SECRET")
    cfg["processing_params"]["output_schema"] = {"a": "{{ answer }} $SECRET", "n": ["$UNSET_VAR"]}
    c = load(cfg, SECRET="hunter2")
    assert c.outputs[0].prompt == "A $5 price, $$ and ${SECRET} for {{ question }}; $SECRET"
    assert (c.outputs[0].system, c.outputs[0].response_prefix) == ("$SECRET", "$SECRET")
    assert c.output_schema == {"a": "{{ answer }} $SECRET", "n": ["$UNSET_VAR"]}  # unset: no error either
    assert "hunter2" not in repr(c.raw)
    # settings are still expanded, and an output's field spec too (numeric bounds)
    cfg["loading_params"]["num_shards"] = "${N}"
    assert load(cfg, N="2", SECRET="x").num_shards == 2


def test_env_whole_value_is_retyped(cfg):
    cfg["loading_params"]["num_shards"] = "${N}"
    cfg["loading_params"]["batch_size"] = "${B:-8}"
    c = load(cfg, N="4")
    assert c.num_shards == 4 and isinstance(c.num_shards, int)
    assert c.batch_size == 8 and isinstance(c.batch_size, int)


def test_env_in_nested_list_values(cfg):
    cfg["processing_params"]["outputs"][0]["sampling_params"] = {"stop": ["$STOP", "end"], "temperature": "${T}"}
    params = load(cfg, STOP="###", T="0.5").outputs[0].sampling_params
    assert params == {"stop": ["###", "end"], "temperature": 0.5}


def test_shard_id_from_slurm_is_accepted_unexpanded(cfg):
    cfg["loading_params"]["shard_id"] = "$SLURM_ARRAY_TASK_ID"
    c = load(cfg)  # SLURM_ARRAY_TASK_ID is not set
    assert c.raw["loading_params"]["shard_id"] == "$SLURM_ARRAY_TASK_ID"


# --------------------------------------------------------------------------- MMIRAGE compatibility


def test_mmirage_chat_template_kwargs_move_out_of_sampling_params(cfg):
    cfg["processors"][0]["default_sampling_params"] = {
        "temperature": 0.0,
        "custom_params": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    proc = load(cfg).processors["llm"]
    assert proc.chat_template_kwargs == {"enable_thinking": False}
    assert proc.sampling_params == {"temperature": 0.0}


def test_explicit_chat_template_kwargs_win_over_mmirage_location(cfg):
    cfg["processors"][0]["default_sampling_params"] = {
        "custom_params": {"chat_template_kwargs": {"enable_thinking": False, "other": 1}},
    }
    cfg["processors"][0]["chat_template_kwargs"] = {"enable_thinking": True}
    assert load(cfg).processors["llm"].chat_template_kwargs == {"enable_thinking": True, "other": 1}


# --------------------------------------------------------------------------- security


def test_trust_remote_code_is_off_unless_set(cfg):
    assert load(cfg).processors["llm"].server_args.trust_remote_code is False
    cfg["processors"][0]["server_args"]["trust_remote_code"] = True  # MMIRAGE configs that set it keep working
    assert load(cfg).processors["llm"].server_args.trust_remote_code is True


def test_redact_covers_url_passwords_and_api_key_flags():
    from mirageflow.redact import redact, redact_text

    argv = ["python", "-m", "sglang.launch_server", "--api-key", "sk-1", "--api-key=sk-2", "--hf-token", "hf_3", "--port", "30000"]
    assert redact(argv) == [
        "python",
        "-m",
        "sglang.launch_server",
        "--api-key",
        "***",
        "--api-key=***",
        "--hf-token",
        "***",
        "--port",
        "30000",
    ]
    info = {"base_url": "http://user:pa:ss@node:30000/v1", "api_key": "sk-1", "engine_args": {"hf_token": "x", "tp_size": 2}}
    assert redact(info) == {"base_url": "http://user:***@node:30000/v1", "api_key": "***", "engine_args": {"hf_token": "***", "tp_size": 2}}
    text = "POST https://u:secret@h/v1/chat/completions failed; server: sglang --api-key abc --api-key=def; Authorization: Bearer sk-9"
    red = redact_text(text)
    assert not any(s in red for s in ("secret", "abc", "def", "sk-9")), red
    assert "https://u:***@h/v1/chat/completions" in red
    # nothing else changes
    plain = "a $5 price at http://host:8/v1 with --max-tokens 5 --tokenizer-path t max_new_tokens"
    assert redact_text(plain) == plain
    assert redact({"max_new_tokens": 5, "api_key_env": None}) == {"max_new_tokens": 5, "api_key_env": None}


# --------------------------------------------------------------------------- sandbox, JSON fields, paths


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("{{ question | shout }}", "unknown filter 'shout'"),
        ("{{ question | uper }}", "unknown filter 'uper' (did you mean 'upper'?)"),
        ("{% if question is loud %}x{% endif %}", "unknown test 'loud'"),
        ("{% include 'other.j2' %}", "{% include %} is not available"),
        ("{% extends 'base.j2' %}", "{% extends %} is not available"),
        ("{% import 'm.j2' as m %}{{ question }}", "{% import %} is not available"),
        ("{% from 'm.j2' import x %}{{ question }}", "{% from ... import %} is not available"),
        ("{{ question.__class__.__mro__ }}", "attribute '__class__' is blocked by the sandbox"),
        ("{{ question['__class__'] }}", "attribute '__class__' is blocked by the sandbox"),
        ("{{ question | attr('__init__') }}", "attribute '__init__' is blocked by the sandbox"),
    ],
)
def test_templates_the_sandbox_cannot_run(cfg, prompt, expected):
    cfg["processing_params"]["outputs"][0]["prompt"] = prompt
    found = problems_of(cfg)
    assert all(p.startswith("processing_params.outputs[0].prompt: ") for p in found), found
    assert any(expected in p for p in found), found


def test_underscore_keys_and_builtin_filters_are_fine(cfg):
    cfg["processing_params"]["outputs"][0]["prompt"] = "{{ question._id | default('x') | upper }}{% if question is string %}!{% endif %}"
    load(cfg)


def test_json_output_fields_must_be_declared(cfg):
    json_output(cfg, {"subject": "str", "category": "str"})
    out = cfg["processing_params"]["outputs"][0]
    out["name"] = "card"
    add_output(cfg, name="more", prompt="{{ card.subject }} {{ card['category'] }} {{ card.items() | list }} {{ card.subjct }}")
    cfg["processing_params"]["output_schema"] = {"s": "{{ card.subject }}", "c": ["{{ card.categroy }}"]}
    assert problems_of(cfg) == [
        "processing_params.outputs[1].prompt: 'card.subjct': output 'card' has no field 'subjct' in its output_schema "
        "(fields: subject, category) (did you mean 'subject'?)",
        "processing_params.output_schema.c[0]: 'card.categroy': output 'card' has no field 'categroy' in its output_schema "
        "(fields: subject, category) (did you mean 'category'?)",
    ]


def test_json_output_without_schema_allows_any_field(cfg):
    cfg["processing_params"]["outputs"][0]["output_type"] = "JSON"
    cfg["processing_params"]["output_schema"] = {"x": "{{ answer.whatever }}"}
    load(cfg)


@pytest.mark.parametrize("value", ["", "  ", "${EMPTY}", "${UNSET:-}"])
def test_empty_state_dir_is_an_error(cfg, value):
    cfg["loading_params"]["state_dir"] = value
    assert only_problem(cfg, EMPTY="").startswith("loading_params.state_dir: empty (a ${VAR} that expands to nothing?)")


def test_empty_output_dir_is_an_error(cfg):
    cfg["loading_params"]["datasets"][0]["output_dir"] = ""
    assert only_problem(cfg).startswith("loading_params.datasets[0].output_dir: empty")


def test_state_dir_under_a_regular_file(cfg, jsonl):
    cfg["loading_params"]["state_dir"] = str(jsonl / "state")
    assert (
        only_problem(cfg)
        == f"loading_params.state_dir: '{jsonl}' is a file, not a directory, so '{jsonl / 'state'}' cannot be created under it"
    )
    assert load_config(cfg, environ={}, check_paths=False).state_dir == str(jsonl / "state")  # status/stats still read it


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_state_dir_not_writable(cfg, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    cfg["loading_params"]["state_dir"] = str(ro / "state")
    assert "is not writable" in only_problem(cfg)


def test_output_dir_equal_to_input_file_or_inside_input_dir(cfg, jsonl, tmp_path):
    ds = cfg["loading_params"]["datasets"][0]
    ds["output_dir"] = str(jsonl)
    assert f"loading_params.datasets[0].output_dir: '{jsonl}' is the input file '{jsonl}' itself (datasets[0].path)" in problems_of(cfg)
    (tmp_path / "pq").mkdir()
    ds.update(path=str(tmp_path / "pq"), type="parquet", output_dir=str(tmp_path / "pq" / "out"))
    assert only_problem(cfg).startswith(
        f"loading_params.datasets[0].output_dir: '{tmp_path / 'pq' / 'out'}' is inside input dataset directory"
    )


def test_default_state_dir_is_per_pipeline(cfg, tmp_path):
    a = load(cfg).state_dir
    cfg["loading_params"]["datasets"][0]["output_dir"] = str(tmp_path / "other")
    assert load(cfg).state_dir == str(tmp_path / "other" / ".mirageflow-state") != a


def test_a_json_response_prefix_must_start_json_of_the_schema(cfg):
    """Engines constrain only the continuation of the prefix: a prefix no valid answer
    starts with is an error at DAG build (the driver's preflight: compiling the grammar
    imports xgrammar, which cluster jobs re-parsing the config must not pay), naming the key."""
    from mirageflow.config.preflight import _json_prefix_problems

    json_output(cfg, {"answer": "str", "score": "int"})
    out = cfg["processing_params"]["outputs"][0]
    out["response_prefix"] = '{"answer": '
    assert _json_prefix_problems(load(cfg)) == []
    out["response_prefix"] = '{"score": '  # the schema's fields come in order: answer first
    [problem] = _json_prefix_problems(load(cfg))
    assert problem.startswith("processing_params.outputs[0].response_prefix: the response prefix '{\"score\": '"), problem


def test_a_missing_dataset_path_says_what_was_meant(cfg, jsonl):
    """A misspelt dataset file or folder: the error names the close name that exists."""
    misspelt = jsonl.with_name(jsonl.stem[:-1] + "x" + jsonl.suffix)  # one letter off
    cfg["loading_params"]["datasets"][0]["path"] = str(misspelt)
    [problem] = [p for p in problems_of(cfg) if ".path:" in p]
    assert problem.endswith(f"does not exist (did you mean '{jsonl}'?)"), problem
    cfg["loading_params"]["datasets"][0]["path"] = str(jsonl.parent.with_name(jsonl.parent.name + "x") / jsonl.name)
    [problem] = [p for p in problems_of(cfg) if ".path:" in p]
    assert problem.endswith(f"(did you mean '{jsonl}'?)"), problem
