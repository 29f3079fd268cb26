"""Chat inputs: a row's list of chat messages sent as the conversation itself (outputs[].conversation).

Units of the message mapping (OpenAI and ShareGPT style) and of hostile rows (each a
bad_conversation row error naming the variable), the config checks at load, the chat
template of the transformers engine over a multi-turn conversation (the tiny model), and
one run through `snakemake` with the openai backend against the fake server, whose
recorded requests show the messages each row sent.
"""

from __future__ import annotations

import json

import pytest
from conftest import run_workflow
from fakes.configs import pipeline_config
from fakes.fake_http import FakeServer

from mirageflow.config import ConfigError, ServerArgs, load_config
from mirageflow.errors import RowError
from mirageflow.prompts.templates import PromptBuilder, conversation_messages

pytestmark = pytest.mark.usefixtures("no_proxy")

OPENAI = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Name a colour."},
]
SHAREGPT = [
    {"from": "system", "value": "Be brief."},
    {"from": "human", "value": "Hi", "weight": 0},
    {"from": "gpt", "value": "Hello!"},
    {"from": "human", "value": "Name a colour."},
]


def pipeline_dict(outputs: list[dict], processor: dict | None = None) -> dict:
    return pipeline_config(
        model="m", state_dir=None, num_shards=None, dataset={"type": "jsonl"}, outputs=outputs,
        inputs=[{"name": "conv", "key": "conversations"}, "topic"],
        processor={"backend": "openai", "base_url": "http://h:1/v1", **(processor or {})},
    )  # fmt: skip


def builder(**output) -> PromptBuilder:
    cfg = load_config(pipeline_dict([{"name": "answer", **output}]), check_paths=False)
    return PromptBuilder(cfg.outputs[0])


# --------------------------------------------------------------------------- mapping


def test_openai_and_sharegpt_styles_give_the_same_messages():
    assert conversation_messages(OPENAI, "conv", False) == OPENAI
    assert conversation_messages(SHAREGPT, "conv", False) == OPENAI  # from/value mapped; 'weight' ignored
    assert conversation_messages([{"from": "user", "value": "a"}], "conv", False) == [{"role": "user", "content": "a"}]


HOSTILE = {
    "not a list": ("a string", "is a str, not a list of chat messages"),
    "an object": ({"role": "user", "content": "x"}, "is a dict, not a list"),
    "empty": ([], "is an empty list"),
    "a message not an object": (["hi"], "message 0 is a str"),
    "unknown role": ([{"role": "tool", "content": "x"}], "message 0 has unknown role 'tool'"),
    "unknown speaker": ([{"from": "bot", "value": "x"}], "message 0 has unknown speaker 'from': 'bot'"),
    "both styles": ([{"role": "user", "from": "human", "content": "x"}], "needs either 'role' and 'content'"),
    "neither style": ([{"text": "x"}], "needs either 'role' and 'content'"),
    "content a number": ([{"role": "user", "content": 3}], "message 0 (user): 'content' is a int, not text"),
    "content a list": ([{"role": "user", "content": [{"type": "text", "text": "x"}]}], "'content' is a list, not text"),
    "content missing": ([{"from": "human"}], "message 0 (user): 'value' is missing"),
    "system later": ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "message 1: a system message may only be the first"),
    "ends with assistant": (OPENAI[:3], "ends with an assistant turn: nothing for the model to answer"),
    "only a system message": (OPENAI[:1], "ends with a system turn"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_conversations_are_row_errors_naming_the_variable(case):
    value, message = HOSTILE[case]
    with pytest.raises(RowError) as e:
        conversation_messages(value, "conv", False)
    assert e.value.kind == "bad_conversation" and e.value.stage == "render"
    assert str(e.value).startswith("input 'conv': ") and message in str(e.value)


def test_a_prompt_after_the_conversation_is_its_last_user_turn():
    b = builder(conversation="conv", prompt="Now answer about {{ topic }}.")
    msgs = b.messages({"conv": OPENAI[:3], "topic": "cats"})  # ends with the assistant: fine before a prompt
    assert msgs == [*OPENAI[:3], {"role": "user", "content": "Now answer about cats."}]
    with pytest.raises(RowError, match="ends with a system turn"):
        builder(conversation="conv").messages({"conv": OPENAI[:1], "topic": "x"})
    assert builder(conversation="conv", prompt="Q").messages({"conv": OPENAI[:1], "topic": "x"}) == [
        OPENAI[0],
        {"role": "user", "content": "Q"},
    ]


def test_the_outputs_system_prompt_replaces_the_conversations_own():
    b = builder(conversation="conv", system="You judge {{ topic }}.")
    msgs = b.messages({"conv": SHAREGPT, "topic": "colours"})
    assert msgs == [{"role": "system", "content": "You judge colours."}, *OPENAI[1:]]
    no_system = [m for m in OPENAI if m["role"] != "system"]
    assert b.messages({"conv": no_system, "topic": "t"}) == [{"role": "system", "content": "You judge t."}, *no_system]
    assert builder(conversation="conv").messages({"conv": OPENAI, "topic": "t"}) == OPENAI  # kept without one


def test_plain_outputs_are_unchanged():
    assert builder(prompt="Tell me about {{ topic }}", system="S").messages({"topic": "x", "conv": None}) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "Tell me about x"},
    ]  # fmt: skip


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "outputs, processor, expected",
    [
        ([{"name": "a"}], None, "processing_params.outputs[0].prompt: required key is missing (or set conversation"),
        ([{"name": "a", "conversation": "cnv"}], None, "outputs[0].conversation: 'cnv' must name an input variable holding the chat messages (no such input) (did you mean 'conv'?)"),
        ([{"name": "a", "prompt": "x"}, {"name": "b", "conversation": "a"}], None, "outputs[1].conversation: 'a' must name an input variable"),
        ([{"name": "a", "conversation": "conv"}], {"apply_chat_template": False}, "outputs[0].conversation: needs processors[].apply_chat_template: true"),
        ([{"name": "a", "conversation": 3}], None, "processing_params.outputs[0].conversation: 3 is not of type"),
    ],
)  # fmt: skip
def test_config_mistakes_are_caught_at_load_with_the_key(outputs, processor, expected):
    with pytest.raises(ConfigError) as e:
        load_config(pipeline_dict(outputs, processor), check_paths=False)
    assert any(expected in p for p in e.value.problems), e.value.problems


def test_conversation_is_part_of_the_records_identity():
    from mirageflow.config import records_identity

    a = records_identity(load_config(pipeline_dict([{"name": "a", "prompt": "x"}]), check_paths=False))
    b = records_identity(load_config(pipeline_dict([{"name": "a", "prompt": "x", "conversation": "conv"}]), check_paths=False))
    assert a != b  # switching it on reruns the shards


# --------------------------------------------------------------------------- transformers: the chat template


def test_transformers_renders_the_whole_conversation_through_the_chat_template(tiny_model):
    from mirageflow.engines.transformers_engine import TransformersEngine
    from mirageflow.shard.steps.llm import LLMStep

    cfg = load_config(
        pipeline_dict([{"name": "a", "conversation": "conv"}], {"backend": "transformers", "server_args": {"model_path": str(tiny_model)}}),
        check_paths=False,
    )
    engine = TransformersEngine(ServerArgs(str(tiny_model)), batch_size=1, torch_threads=1)
    engine.load()
    try:
        step = LLMStep(cfg.outputs[0], cfg.processors["llm"], engine)
        request = step.request(0, {"conv": SHAREGPT, "topic": "t"})
        assert request.messages == OPENAI
        expected = engine.tokenizer.apply_chat_template(OPENAI, tokenize=False, add_generation_prompt=True)
        assert request.prompt == expected
        assert expected.count("Hello!") == 1 and expected.index("Hi") < expected.index("Hello!") < expected.index("Name a colour.")
        [done] = engine.generate([request.__class__(**{**request.__dict__, "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}})])
        assert done.completion_tokens >= 1 and done.prompt_tokens == len(engine.tokenizer(expected, add_special_tokens=False)["input_ids"])
    finally:
        engine.close()


# --------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def server():
    s = FakeServer().start()
    yield s
    s.stop()


def test_workflow_sends_each_rows_conversation_and_records_bad_ones(tmp_path, server):
    rows = [
        {"id": 0, "conversations": OPENAI},
        {"id": 1, "conversations": SHAREGPT},
        {"id": 2, "conversations": "not a list"},
        {"id": 3, "conversations": OPENAI[:3]},  # ends with the assistant: nothing to answer
        {"id": 4, "conversations": [{"role": "robot", "content": "beep"}]},
        {"id": 5, "conversations": [{"role": "user", "content": "Only one turn."}]},
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = {
        "processors": [{"type": "llm", "backend": "openai", "base_url": server.url + "/v1", "server_args": {"model_path": "fake-model"},
                        "default_sampling_params": {"max_new_tokens": 3}, "max_retries": 0}],
        "loading_params": {"state_dir": "state", "num_shards": 2,
                           "datasets": [{"path": "in.jsonl", "type": "jsonl", "output_dir": "out", "output_format": "jsonl"}]},
        "shard_params": {"max_error_rate": 0.9},
        "processing_params": {
            "inputs": [{"name": "conv", "key": "conversations"}, {"name": "id", "key": "id"}],
            "outputs": [{"name": "reply", "conversation": "conv", "system": "Row {{ id }}."}],
            "remove_columns": True,
            "output_schema": {"id": "{{ id }}", "reply": "{{ reply }}"},
        },
    }  # fmt: skip
    before = len(server.records)
    run_workflow(tmp_path, cfg)

    sent = {}
    for r in server.records[before:]:
        system = r["body"]["messages"][0]["content"]
        sent[int(system.split()[1].rstrip("."))] = r["body"]["messages"]
    assert sorted(sent) == [0, 1, 5]  # bad rows never reach the engine
    assert sent[0] == [{"role": "system", "content": "Row 0."}, *OPENAI[1:]]  # the row's system message replaced
    assert sent[1] == [{"role": "system", "content": "Row 1."}, *OPENAI[1:]]
    assert sent[5] == [{"role": "system", "content": "Row 5."}, {"role": "user", "content": "Only one turn."}]

    merged = [json.loads(line) for p in sorted((tmp_path / "out" / "merged").glob("*.jsonl")) for line in p.read_text().splitlines()]
    assert [r["id"] for r in merged] == [0, 1, 5] and all(r["reply"] for r in merged)
    errors = [json.loads(line) for p in sorted((tmp_path / "state").glob("shard_*/errors.jsonl")) for line in p.read_text().splitlines()]
    by_index = {e["source_index"]: e for e in errors}
    assert sorted(by_index) == [2, 3, 4]
    assert {e["error"] for e in errors} == {"bad_conversation"}
    assert all(e["message"].startswith("input 'conv': ") for e in errors)
    assert "not a list" in by_index[2]["message"] and "assistant turn" in by_index[3]["message"] and "'robot'" in by_index[4]["message"]
