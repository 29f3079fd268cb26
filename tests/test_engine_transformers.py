"""The transformers engine with real models: token counts, finish reasons, stops, chat templates."""

from __future__ import annotations

import pytest

from mirageflow.config import ServerArgs
from mirageflow.engines.wire import Request
from mirageflow.engines.transformers_engine import TransformersEngine


@pytest.fixture(scope="module")
def engine(tiny_model):
    eng = TransformersEngine(ServerArgs(str(tiny_model)), batch_size=3, torch_threads=1)
    eng.load()
    yield eng
    eng.close()


def _requests(engine, texts, **params):
    params = {"temperature": 0.0, "max_new_tokens": 6, **params}
    return [Request(i, None, engine.chat_prompt([{"role": "user", "content": t}], {}), params) for i, t in enumerate(texts)]


def test_batched_generation_counts_tokens_and_keeps_ids(engine):
    texts = ["hi", "What is the capital of France?", "The cat sat on the mat and looked out of the window.", "ok", "x"]
    out = {c.id: c for c in engine.generate(_requests(engine, texts))}
    assert sorted(out) == list(range(5))
    tok = engine.tokenizer
    for i, t in enumerate(texts):
        expected_prompt = len(tok(engine.chat_prompt([{"role": "user", "content": t}], {}), add_special_tokens=False)["input_ids"])
        assert out[i].prompt_tokens == expected_prompt  # padding is not counted
        assert 1 <= out[i].completion_tokens <= 6
        assert out[i].finish_reason in ("stop", "length")
        if out[i].finish_reason == "length":
            assert out[i].completion_tokens == 6


def test_greedy_is_deterministic_and_independent_of_batching(engine, tiny_model):
    texts = ["hello there", "Water boils at one hundred degrees."]
    batched = {c.id: c.text for c in engine.generate(_requests(engine, texts))}
    single = TransformersEngine(ServerArgs(str(tiny_model)), batch_size=1, torch_threads=1)
    single.load()
    alone = {c.id: c.text for c in single.generate(_requests(single, texts))}
    assert batched == alone


def test_stop_string_cuts_the_text(engine):
    free = next(iter(engine.generate(_requests(engine, ["hello"], max_new_tokens=12))))
    assert len(free.text) > 2
    stop = free.text[1:3]
    cut = next(iter(engine.generate(_requests(engine, ["hello"], max_new_tokens=12, stop=[stop]))))
    assert stop not in cut.text and free.text.startswith(cut.text)
    assert cut.finish_reason == "stop"


def test_prompt_longer_than_context_is_a_per_request_error(engine):
    long = " ".join(["water"] * 600)
    out = {c.id: c for c in engine.generate(_requests(engine, [long, "hi"]))}
    assert out[0].error_kind == "context_length" and "context of 512" in out[0].error
    assert out[1].error_kind is None and out[1].completion_tokens > 0


def test_chat_template_kwargs_reach_the_template(engine):
    template = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = "{% if enable_thinking is defined and not enable_thinking %}NOTHINK {% endif %}" + template
    vars(engine).pop("_chat_template", None)  # compiled once, at first use: recompile this one
    try:
        msgs = [{"role": "user", "content": "hi"}]
        assert engine.chat_prompt(msgs, {"enable_thinking": False}).startswith("NOTHINK ")
        assert not engine.chat_prompt(msgs, {}).startswith("NOTHINK")
    finally:
        engine.tokenizer.chat_template = template
        vars(engine).pop("_chat_template", None)


def test_engine_info_records_versions(engine):
    assert engine.info.backend == "transformers" and engine.info.device == "cpu"
    assert {"transformers", "torch"} <= set(engine.info.versions)


@pytest.fixture(scope="module")
def bos_model(tiny_model, tmp_path_factory):
    """The tiny Llama with a tokenizer that adds a BOS (<|endoftext|>, as Llama's adds <s>)
    and a chat template that starts with it: the builder's output, edited in a copy."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("bos") / "tiny-llama-bos"
    shutil.copytree(tiny_model, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(bos_token="<|endoftext|>", pad_token="<|im_end|>")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    template = out / "chat_template.jinja"
    template.write_text("{{ bos_token }}" + template.read_text())
    return out


def test_exactly_one_bos_for_templates_and_raw_prompts(bos_model):
    eng = TransformersEngine(ServerArgs(str(bos_model)), batch_size=2, torch_threads=1)
    eng.load()
    try:
        tok = eng.tokenizer
        templated = eng.chat_prompt([{"role": "user", "content": "hi"}], {})
        assert templated.startswith("<|endoftext|>") and tok(templated)["input_ids"][:2] == [0, 0]
        assert tok("hello")["input_ids"][0] == 0  # the tokenizer adds a BOS
        assert eng._prompt_ids(templated).count(0) == 1 and eng._prompt_ids("hello")[0] == 0
        params = {"temperature": 0.0, "max_new_tokens": 3}
        a, b = eng.generate([Request(0, None, templated, params), Request(1, None, "hello", params)])
    finally:
        eng.close()
    assert a.prompt_tokens == len(tok(templated, add_special_tokens=False)["input_ids"])  # one BOS, from the template
    assert b.prompt_tokens == len(tok("hello")["input_ids"])  # one BOS, the tokenizer's


_SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["label", "score"],
    "additionalProperties": False,
}


def _valid(text: str) -> bool:
    import json

    import jsonschema

    try:
        jsonschema.validate(json.loads(text), _SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_json_schema_constrains_every_row(engine):
    """The random tiny model never writes valid JSON on its own; with the schema every row does."""
    import json

    texts = [f"Question {i}: is water wet? Answer in JSON." for i in range(8)]
    free = engine.generate(_requests(engine, texts, max_new_tokens=40))
    assert not any(_valid(c.text) for c in free)
    reqs = _requests(engine, texts, max_new_tokens=40)
    for r in reqs:
        r.json_schema = json.dumps(_SCHEMA)
    out = engine.generate(reqs)
    assert all(_valid(c.text) for c in out), [c.text for c in out]
    assert all(c.finish_reason == "stop" and c.error_kind is None for c in out)
    assert "xgrammar" in engine.info.versions


def test_rows_with_and_without_a_schema_share_a_batch(engine):
    import json

    reqs = _requests(engine, ["alpha", "beta", "gamma"], max_new_tokens=40)
    reqs[1].json_schema = json.dumps(_SCHEMA)
    reqs[2].json_schema = json.dumps(
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    )
    alone = engine.generate(_requests(engine, ["alpha"], max_new_tokens=40))[0]
    a, b, c = engine.generate(reqs)
    assert a.text == alone.text  # the unconstrained row is untouched by its neighbours' grammars
    assert _valid(b.text)
    assert isinstance(json.loads(c.text)["ok"], bool) and set(json.loads(c.text)) == {"ok"}


def test_xgrammar_is_imported_only_for_json_requests():
    import subprocess
    import sys

    code = "import sys, mirageflow.engines.transformers_engine; assert 'xgrammar' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_response_prefix_starts_the_json_the_grammar_completes(engine):
    """The prompt ends with the prefix (Request.response_prefix): the grammar continues it,
    so prefix + answer is the valid JSON."""
    import json

    prefix = '{"label": "'
    reqs = []
    for i, t in enumerate(["one", "two", "three"]):
        user = [{"role": "user", "content": t}]
        prompt = engine.chat_prompt(user, {}) + prefix
        reqs.append(Request(i, user, prompt, {"temperature": 0.0, "max_new_tokens": 40}, json.dumps(_SCHEMA),
                            response_prefix=prefix))  # fmt: skip
    out = engine.generate(reqs)
    assert all(_valid(prefix + c.text) for c in out), [c.text for c in out]


def test_rows_that_finish_first_are_handed_back_while_their_batch_runs(tiny_model):
    """A static batch hands back each row as it ends (here at its own max_new_tokens), not
    all at the batch's end: the shard commits them meanwhile, and a stop loses only the rows
    still generating (here the two long ones, stopped once the six short ones are back)."""
    import asyncio

    from mirageflow.engines.base import EngineStopped

    eng = TransformersEngine(ServerArgs(str(tiny_model)), batch_size=8, torch_threads=1)
    eng.load()
    limits = [2, 3, 4, 5, 6, 7, 400, 400]
    prompt = eng.chat_prompt([{"role": "user", "content": "hi"}], {})

    async def main():
        tasks = [
            asyncio.ensure_future(eng.generate_one(Request(i, None, prompt, {"temperature": 0.0, "max_new_tokens": n})))
            for i, n in enumerate(limits)
        ]
        groups = []  # how many completions each wake-up found
        pending = set(tasks)
        while len(tasks) - len(pending) < 6:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            groups.append(len(done))
        eng.stop()
        return groups, await asyncio.gather(*tasks, return_exceptions=True)

    try:
        groups, results = asyncio.run(main())
    finally:
        eng.close()
    assert [r.completion_tokens for r in results[:6]] == limits[:6]
    assert all(isinstance(r, EngineStopped) for r in results[6:])
    assert len(groups) > 1  # the finished rows came back in more than one group


def _batch_sizes(eng) -> list[int]:
    """The rows of every generate() call the engine makes from now on."""
    sizes, generate = [], eng.model.generate

    def counted(**kw):
        sizes.append(kw["input_ids"].shape[0])
        return generate(**kw)

    eng.model.generate = counted
    return sizes


def test_batches_of_rows_that_all_run_to_their_limit_end_within_the_commit_budget(tiny_model):
    """Rows that all run to the same limit come back only at their batch's end, so a batch is
    sized to end within half the runner's commit interval (issue 34, item 5): the first batch
    is small (nothing is measured yet), and with a budget no step fits in, the next is half of it.
    The greedy text is the same as from one uncapped batch."""
    prompts = [f"question number {i}" for i in range(10)]
    params = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}
    texts = {}
    for commit_seconds in (None, 1e-9):
        eng = TransformersEngine(ServerArgs(str(tiny_model)), batch_size=16, torch_threads=1)
        eng.commit_seconds = commit_seconds  # what the shard runner sets before load()
        eng.load()
        sizes = _batch_sizes(eng)
        try:
            out = eng.generate(_requests(eng, prompts, **params))
        finally:
            eng.close()
        assert all(c.completion_tokens == 5 and c.finish_reason == "length" for c in out)
        texts[commit_seconds] = [c.text for c in out]
        if commit_seconds is None:
            assert sizes == [10]  # no runner, no budget: one batch, as before
        else:
            # nothing measured: 4; then a budget no step fits in: half of it (the fit's second size); then what the floor keeps
            assert sizes[:2] == [4, 2] and sum(sizes) == 10, sizes
            details = eng.info.details["batch_time"]
            assert details["budget_seconds"] == commit_seconds / 2 and details["step_seconds_per_row"] > 0
    assert texts[1e-9] == texts[None]


def test_the_shard_runner_gives_the_engine_its_commit_interval(tiny_model, tmp_path):
    from fakes.configs import shard_config

    from mirageflow.shard.runner import run_shard

    cfg = shard_config(tmp_path, [{"q": f"q{i}"} for i in range(3)], [{"name": "a", "prompt": "{{ q }}"}])
    engines = []

    def factory(processor, batch_size, **kw):
        engines.append(TransformersEngine(ServerArgs(str(tiny_model)), batch_size=batch_size, torch_threads=1))
        return engines[-1]

    run_shard(cfg, 0, engine_factory=factory)
    assert engines[0].commit_seconds == cfg.shard.checkpoint_seconds
    assert engines[0].info.details["batch_time"]["budget_seconds"] == cfg.shard.checkpoint_seconds / 2
