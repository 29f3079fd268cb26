"""The request cache: an edit sends only the requests whose key is new; the cache is verified
like the parts, keyed by exactly what determines an answer, and never hides a draw or an error.

The engine is the `openai` backend against the fake OpenAI-compatible server
(tests/fakes/fake_http.py, a thread of this process), which records every request it gets.
Shards run in this process with `run_shard` (no Snakemake: the workflow-level cases are in
scripts/bench/request_cache.py and tests/test_reruns.py).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import time
from pathlib import Path

import pytest
from fakes.configs import pipeline_config
from fakes.fake_http import Behaviour, FakeServer
from fakes.runs import start_shard_job

from mirageflow.config import load_config
from mirageflow.data.writers import read_parts
from mirageflow.shard import ShardFailed
from mirageflow.shard.runner import index_datasets, run_shard
from mirageflow.shard import request_cache as rc
from mirageflow.engines.registry import create_engine
from mirageflow.engines.wire import Completion, Request

pytestmark = pytest.mark.usefixtures("no_proxy")

ROWS = 6


@pytest.fixture
def server():
    s = FakeServer().start()
    yield s
    s.stop()


def write_rows(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def pipeline(root: Path, server: FakeServer, rows: list[dict] | None = None, num_shards: int = 1) -> dict:
    data = root / "in.jsonl"
    if rows is not None or not data.exists():
        write_rows(data, rows or [{"text": f"passage {i}"} for i in range(ROWS)])
    return pipeline_config(
        data, inputs=["text"], model="fake-model", state_dir=root / "state", output_dir=root / "out", num_shards=num_shards,
        outputs=[
            {"name": "summary", "prompt": "Summarise: {{ text }}"},
            {"name": "title", "prompt": "Title for {{ text }}: {{ summary }}"},  # every request distinct
        ],
        dataset={"type": "jsonl", "output_format": "jsonl"},
        processor={"backend": "openai", "base_url": server.url + "/v1", "default_sampling_params": {"max_new_tokens": 5, "temperature": 0.0},
                   "max_retries": 0, "request_timeout": 30},
        processing={"output_schema": {"summary": "{{ summary }}", "title": "{{ title }}"}},
        shard_params={"max_error_rate": 1.0, "checkpoint_rows": 2, "checkpoint_min_seconds": 0},
    )  # fmt: skip


def run(raw: dict, shard: int = 0, reindex: bool = True) -> dict:
    cfg = load_config(copy.deepcopy(raw))
    if reindex:
        index_datasets(cfg)
    return run_shard(cfg, shard)


def prompts_since(server: FakeServer, start: int) -> list[str]:
    return [r["body"]["messages"][-1]["content"] for r in server.records[start:]]


def records(root: Path, shard: int = 0) -> list[dict]:
    return sorted(read_parts(root / "out" / f"shard_{shard}", "jsonl").to_pylist(), key=lambda r: r["source_index"])


# --------------------------------------------------------------------------- what an edit sends


def test_editing_the_record_template_sends_no_request(tmp_path, server):
    raw = pipeline(tmp_path, server)
    first = run(raw)
    assert len(server.records) == 2 * ROWS and first["stats"]["requests_cached"] == 0
    assert first["stats"]["request_cache"]["answers_kept"] == 2 * ROWS

    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"t": "{{ title }}", "both": "{{ summary }} / {{ title }}"}
    sent = len(server.records)
    status = run(edited)
    assert len(server.records) == sent  # not one request
    assert status["stats"]["requests"] == 0 and status["stats"]["requests_cached"] == 2 * ROWS
    out = records(tmp_path)
    assert [r["source_index"] for r in out] == list(range(ROWS)) and all(set(r) >= {"t", "both"} for r in out)
    assert out[0]["both"].startswith(out[0]["both"].split(" / ")[0])


def test_a_request_cache_that_cannot_be_written_fails_the_shard_naming_the_error_and_the_path(tmp_path, server):
    """failure.json says what the log says: the OSError and the cache's path (the tests run
    as root, for whom no mode bit refuses a write: a file where the directory goes stands in
    for an unwritable one), never an error of the failure handling itself."""
    raw = pipeline(tmp_path, server)
    cache_dir = tmp_path / "state" / "shard_0" / rc.CACHE_DIR
    cache_dir.parent.mkdir(parents=True)
    cache_dir.write_text("not a directory")
    with pytest.raises(ShardFailed, match="request cache"):
        run(raw)
    error = json.loads((tmp_path / "state" / "shard_0" / "failure.json").read_text())["error"]
    assert "AttributeError" not in error and "FileExistsError" in error and str(cache_dir) in error, error
    assert "shard_params.request_cache: false" in error
    assert len(server.records) == 0


def test_editing_the_second_prompt_resends_only_its_requests(tmp_path, server):
    raw = pipeline(tmp_path, server)
    run(raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["outputs"][1]["prompt"] = "A short title for {{ text }}: {{ summary }}"
    sent = len(server.records)
    status = run(edited)
    again = prompts_since(server, sent)
    assert len(again) == ROWS and all(p.startswith("A short title for ") for p in again)
    assert status["stats"]["requests"] == ROWS and status["stats"]["requests_cached"] == ROWS


def test_editing_one_row_resends_that_rows_requests(tmp_path, server):
    raw = pipeline(tmp_path, server)
    run(raw)
    before = records(tmp_path)
    rows = [{"text": f"passage {i}"} for i in range(ROWS)]
    rows[3] = {"text": "an edited passage"}
    edited = pipeline(tmp_path, server, rows=rows)  # the same config, the dataset rewritten
    sent = len(server.records)
    run(edited)
    again = prompts_since(server, sent)
    assert again[0] == "Summarise: an edited passage" and again[1].startswith("Title for an edited passage: ") and len(again) == 2
    after = records(tmp_path)
    assert [r for i, r in enumerate(after) if i != 3] == [r for i, r in enumerate(before) if i != 3]


# --------------------------------------------------------------------------- no engine for cached answers


class EngineLog:
    """An engine factory that makes the configured engine (create_engine) and counts the
    engines made; ``refuse``: one made is a test failure (the shard must need none)."""

    def __init__(self, refuse: bool = False):
        self.made, self.refuse = [], refuse

    def __call__(self, processor, batch_size, **kw):
        self.made.append(processor.type)
        if self.refuse:
            raise AssertionError("an engine was made for a shard whose every answer is in the request cache")
        return create_engine(processor, batch_size, **kw)


def run_with(raw: dict, factory: EngineLog) -> dict:
    cfg = load_config(copy.deepcopy(raw))
    index_datasets(cfg)
    return run_shard(cfg, 0, engine_factory=factory)


def test_a_shard_whose_every_answer_is_cached_makes_no_engine(tmp_path, server):
    """Issue 34 item 6: the shard's records are made again (its output and checkpoint lost, then
    an edit of the record template) with every request answered before: no engine is made,
    nothing is loaded, and the records are the first run's."""
    raw = pipeline(tmp_path, server)
    first = run_with(raw, EngineLog())
    before = records(tmp_path)
    shutil.rmtree(tmp_path / "out" / "shard_0")
    (tmp_path / "state" / "shard_0" / "checkpoint.json").unlink()
    sent = len(server.records)

    status = run_with(raw, EngineLog(refuse=True))
    assert len(server.records) == sent and status["status"] == "success" and status["engines"] == {}
    assert records(tmp_path) == before
    st = status["stats"]
    assert st["requests"] == 0 and st["requests_cached"] == 2 * ROWS and st["rows_processed"] == ROWS
    # no load time added by this attempt (the load_dominates finding counts it)
    assert st["attempts"][-1]["model_load_seconds"] == 0 and first["stats"]["attempts"][-1]["model_load_seconds"] > 0

    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"t": "{{ title }}", "s": "{{ summary }}"}
    status = run_with(edited, EngineLog(refuse=True))
    assert len(server.records) == sent and status["engines"] == {}
    assert [(r["s"], r["t"]) for r in records(tmp_path)] == [(r["summary"], r["title"]) for r in before]


def test_one_request_not_cached_makes_the_engine_once_and_counts_each_answer_once(tmp_path, server):
    """One row edited: the rows before it come from the cache without an engine; its request
    makes and loads the engine, once, and the rest is fed through it. Each answer is counted
    once although the row that missed was looked up before the engine was made."""
    raw = pipeline(tmp_path, server)
    run_with(raw, EngineLog())
    before = records(tmp_path)
    rows = [{"text": f"passage {i}"} for i in range(ROWS)]
    rows[3] = {"text": "an edited passage"}
    edited = pipeline(tmp_path, server, rows=rows)
    sent = len(server.records)

    engines = EngineLog()
    status = run_with(edited, engines)
    assert engines.made == ["llm"] and status["engines"]["llm"]["backend"] == "openai"
    again = prompts_since(server, sent)
    assert again == ["Summarise: an edited passage", again[1]] and again[1].startswith("Title for an edited passage: ")
    st = status["stats"]
    assert st["requests"] == 2 and st["requests_cached"] == 2 * ROWS - 2 and st["answers"] == 2 * ROWS
    after = records(tmp_path)
    assert [r for i, r in enumerate(after) if i != 3] == [r for i, r in enumerate(before) if i != 3]


@pytest.mark.parametrize("native_n", [None, False])
def test_samples_answered_from_the_cache_make_no_engine(tmp_path, server, native_n):
    """n_samples 2: each row's samples keyed as the engine keys them (one request with n, or
    one per sample), so a rerun of the same rows makes no engine."""
    raw = pipeline(tmp_path, server)
    raw["processing_params"]["n_samples"] = 2
    raw["processors"][0]["native_n"] = native_n
    raw["processors"][0]["default_sampling_params"] |= {"temperature": 0.7, "seed": 5}  # seeded: kept and reused
    run_with(raw, EngineLog())
    before = records(tmp_path)
    shutil.rmtree(tmp_path / "out" / "shard_0")
    (tmp_path / "state" / "shard_0" / "checkpoint.json").unlink()
    status = run_with(raw, EngineLog(refuse=True))
    assert status["engines"] == {} and status["stats"]["requests_cached"] == 2 * 2 * ROWS
    assert sorted(records(tmp_path), key=lambda r: (r["source_index"], r["sample_index"])) == sorted(
        before, key=lambda r: (r["source_index"], r["sample_index"])
    )


def test_a_transformers_shard_answered_from_the_cache_loads_only_the_tokenizer(tmp_path, tiny_model):
    """The transformers backend templates the prompt with its tokenizer, which the key holds:
    the stand-in loads the tokenizer (not the weights) and keys the requests as the engine."""
    data = tmp_path / "in.jsonl"
    write_rows(data, [{"text": f"passage {i}"} for i in range(3)])
    raw = pipeline_config(
        data, inputs=["text"], state_dir=tmp_path / "state", output_dir=tmp_path / "out",
        outputs=[{"name": "summary", "prompt": "Summarise: {{ text }}"}],
        dataset={"type": "jsonl", "output_format": "jsonl"},
        processor={"backend": "transformers", "server_args": {"model_path": str(tiny_model)},
                   "default_sampling_params": {"max_new_tokens": 3, "temperature": 0.0}},
        processing={"output_schema": {"summary": "{{ summary }}"}},
    )  # fmt: skip
    run_with(raw, EngineLog())
    before = records(tmp_path)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    status = run_with(edited, EngineLog(refuse=True))
    assert status["engines"] == {} and status["stats"]["requests_cached"] == 3
    assert [r["s"] for r in records(tmp_path)] == [r["summary"] for r in before]


def test_cached_answers_give_the_records_a_fresh_run_gives(tmp_path, server):
    raw = pipeline(tmp_path, server)
    run(raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}", "t": "{{ title }}"}
    run(edited)
    cached = records(tmp_path)
    fresh_root = tmp_path / "fresh"
    fresh_root.mkdir()
    fresh = pipeline(fresh_root, server)
    fresh["processing_params"]["output_schema"] = edited["processing_params"]["output_schema"]
    fresh["shard_params"]["request_cache"] = False
    run(fresh)
    assert records(fresh_root) == cached
    assert not (fresh_root / "state" / "shard_0" / "request_cache").exists()


# --------------------------------------------------------------------------- never a draw, never an error


def test_sampling_without_a_seed_is_never_reused(tmp_path, server):
    raw = pipeline(tmp_path, server)
    raw["processors"][0]["default_sampling_params"] = {"max_new_tokens": 5, "temperature": 0.7}
    run(raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    sent = len(server.records)
    status = run(edited)
    assert len(server.records) - sent == 2 * ROWS and status["stats"]["requests_cached"] == 0
    assert status["stats"]["request_cache"]["answers_kept"] == 0

    # with a seed the draw is reproducible: kept and reused
    seeded = copy.deepcopy(raw)
    seeded["processors"][0]["default_sampling_params"]["seed"] = 7
    run(seeded)
    seeded["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    sent = len(server.records)
    assert run(seeded)["stats"]["requests_cached"] == 2 * ROWS and len(server.records) == sent


def test_row_errors_are_not_kept_so_a_rerun_asks_again(tmp_path, server):
    rows = [{"text": "TOO_LONG" if i == 1 else f"passage {i}"} for i in range(ROWS)]
    raw = pipeline(tmp_path, server, rows=rows)
    first = run(raw)
    assert first["stats"]["rows_failed_by_class"] == {"context_length": 1}
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    sent = len(server.records)
    status = run(edited)
    assert prompts_since(server, sent) == ["Summarise: TOO_LONG"]  # only the failed row's request, again
    assert status["stats"]["rows_failed_by_class"] == {"context_length": 1}


def test_an_answer_the_step_rejects_is_not_kept(tmp_path, server):
    raw = pipeline(tmp_path, server)
    raw["processing_params"]["outputs"][1] = {"name": "title", "prompt": "Title for {{ text }}: {{ summary }}", "output_type": "JSON",
                                              "output_schema": {"answer": "int"}}  # fmt: skip
    with pytest.raises(ShardFailed, match=r"json_schema: 6"):  # the fake answers {"answer": "yes"}: every row fails
        run(raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    sent = len(server.records)
    with pytest.raises(ShardFailed, match=r"json_schema: 6"):
        run(edited)
    again = prompts_since(server, sent)
    assert len(again) == ROWS and all(p.startswith("Title for ") for p in again)  # the summaries were kept


def test_fresh_answers_asks_the_engine_again_and_replaces_the_kept_answers(tmp_path, server):
    raw = pipeline(tmp_path, server)
    run(raw)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    edited["fresh_answers"] = True
    sent = len(server.records)
    status = run(edited)
    assert len(server.records) - sent == 2 * ROWS and status["stats"]["requests_cached"] == 0
    edited["fresh_answers"] = False
    edited["processing_params"]["output_schema"] = {"s2": "{{ summary }}"}
    sent = len(server.records)
    assert run(edited)["stats"]["requests_cached"] == 2 * ROWS and len(server.records) == sent


def test_another_model_never_gets_the_cached_answers(tmp_path, server):
    raw = pipeline(tmp_path, server)
    run(raw)
    for edit in (
        lambda p: p["server_args"].update(model_path="other-model"),
        lambda p: p.update(chat_template_kwargs={"enable_thinking": False}),
        lambda p: p["default_sampling_params"].update(max_new_tokens=6),
    ):
        edited = copy.deepcopy(raw)
        edit(edited["processors"][0])
        sent = len(server.records)
        status = run(edited)
        assert len(server.records) - sent == 2 * ROWS and status["stats"]["requests_cached"] == 0, edited["processors"][0]


def test_a_local_models_revision_is_part_of_the_key(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"n_layer": 2}')
    (model / "model.safetensors").write_bytes(b"a" * 5000)
    one = rc.model_revision(str(model))
    (model / "model.safetensors").write_bytes(b"a" * 2500 + b"b" + b"a" * 2499)  # same size, other weights
    two = rc.model_revision(str(model))
    (model / "config.json").write_text('{"n_layer": 3}')
    assert len({one, two, rc.model_revision(str(model))}) == 3
    assert rc.model_revision("a-server-side-name") is None
    ident = {"backend": "transformers", "server_args": {"model_path": str(model)}}
    req = Request(0, None, "hi", {"temperature": 0.0}, None)
    assert rc.request_key(rc.engine_identity(ident, "transformers", one), req) != rc.request_key(
        rc.engine_identity(ident, "transformers", two), req
    )
    # the row's id is not part of the key; the seed, the schema and the prefix are
    key = rc.request_key("e", req)
    assert rc.request_key("e", Request(9, None, "hi", {"temperature": 0.0}, None)) == key
    assert len({key, rc.request_key("e", Request(0, None, "hi", {"temperature": 0.0}, None, seed=1)),
                rc.request_key("e", Request(0, None, "hi", {"temperature": 0.0}, '{"type": "object"}')),
                rc.request_key("e", Request(0, None, "hi", {"temperature": 0.0}, None, response_prefix="{"))}) == 4  # fmt: skip


# --------------------------------------------------------------------------- keys and entries pinned

# Computed by mirageflow at 941180d (before RequestKeys): a key that changes would make every
# answer kept on users' disks unreachable, so these never change without CACHE_VERSION.
PINNED_IDENTITY = "4361c56d6a8cabe9638aafd4a63b2f00d3cefe0343ca077634eb3eacbb06fd31"
PINNED_KEYS = {
    "prompt": "79d89722ed2d6e78e2d796bb7a0a23023cbf45974109f10a695a239155b95958",
    "messages": "6ecdcd359c0a80a2796f359474f8fe6c711366a61f4ca160c21535cbaf3dd550",
    "images": "fa42acad4e79e356537ba61280366ef70bc6bafde4c78e404a5e52cc5ae86345",
    "surrogate": "9dd4618536fd9b919d0371c1e6191bac5015feeb34ada9d86cd3757724f6299a",
    "floats": "d1782d43c1f1852ee650f20bf043beb71c22896b9a545bce63113e4e0cebf2e6",
}
PINNED_CHOICE_1_OF_3 = "adcc7170bd8af55879e09c5bb788fc9391021c4d1399d092e701fdd79154ffbe"  # of "prompt"
PINNED_NATIVE = [  # of "messages", n 3, native
    "fe9ee119b751f06514ea68dfc224b687cb62491be8288a7baeefac367e0b05c9",
    "2a7cd515dd092f03f2d959362e40aad60e05ee76478911de4561c57912d3cf65",
    "2f0487427b41ebaaec69871aa97fe62a3870b642baf8d5ae1b875ca98bec185a",
]
PINNED_SEEDED = [  # of "messages", n 3, a request per sample (seed 7, 8, 9)
    "6ecdcd359c0a80a2796f359474f8fe6c711366a61f4ca160c21535cbaf3dd550",
    "30226ee77c9ac58fc75003655fbf5fabb909fd08b7d100d73298d21be1224dd7",
    "ddf1d15e92bc5d87f6f6d45079576e7c7bf35afd8bcfaa8671d6a53d0d7be44c",
]


class _Image:
    sha256 = "ab" * 32


def _pinned_requests() -> dict[str, Request]:
    """Each request's sampling dict is its own (as a step's is), schema and prefix the step's."""
    return {
        "prompt": Request(0, None, 'Summarise: héllo \u2028 "q"', {"temperature": 0.0, "max_new_tokens": 64}),
        "messages": Request(3, [{"role": "user", "content": "hi ✓"}, {"role": "assistant", "content": "{"}], None,
                            {"temperature": 0, "top_p": 1.0, "stop": ["\n"]}, '{"type":"object"}', response_prefix="{", seed=7),
        "images": Request(1, [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}], None,
                          {"temperature": 0.0}, None, images=[_Image(), _Image()]),
        "surrogate": Request(2, None, "bad \ud800 text", {"temperature": 0.0}),  # orjson refuses it: json's spelling
        "floats": Request(2, None, "p", {"temperature": 0.0, "top_p": 0.95, "big": 10**20, "neg": -1.5e-7,
                                         "nested": {"b": [1, None, True], "a": "z"}}, seed=0),
    }  # fmt: skip


def _step_keys(request: Request) -> rc.RequestKeys:
    return rc.RequestKeys(PINNED_IDENTITY, request.sampling_params, request.json_schema, request.response_prefix)


def test_keys_are_the_ones_kept_on_disk_since_the_cache_began():
    identity = rc.engine_identity(
        {"type": "llm", "server_args": {"model_path": "m"}, "default_sampling_params": {"temperature": 0.0}}, "sglang", "hub:abc"
    )
    assert identity == PINNED_IDENTITY
    requests = _pinned_requests()
    for name, request in requests.items():
        assert rc.request_key(PINNED_IDENTITY, request) == PINNED_KEYS[name], name
        keys = _step_keys(request)
        assert keys.key(request) == PINNED_KEYS[name], name
        assert keys.sample_keys(request, 1, False) == [PINNED_KEYS[name]], name
        # a request whose fixed parts are not the step's (another sampling dict) takes request_key
        other = Request(request.id, request.messages, request.prompt, dict(request.sampling_params), request.json_schema,
                        request.response_prefix, request.seed, request.images)  # fmt: skip
        assert keys.key(other) == PINNED_KEYS[name], name
    prompt, messages = requests["prompt"], requests["messages"]
    assert rc.request_key(PINNED_IDENTITY, prompt, (1, 3)) == _step_keys(prompt).key(prompt, (1, 3)) == PINNED_CHOICE_1_OF_3
    assert rc.sample_keys(PINNED_IDENTITY, messages, 3, True) == _step_keys(messages).sample_keys(messages, 3, True) == PINNED_NATIVE
    assert rc.sample_keys(PINNED_IDENTITY, messages, 3, False) == _step_keys(messages).sample_keys(messages, 3, False) == PINNED_SEEDED


def test_step_keys_are_request_keys_for_hostile_requests():
    """Whatever a row puts in a request (the prompt, the messages, the images, the seed), the
    step's keys are request_key's: compared on requests orjson takes and ones it refuses."""
    # 1e-7: json spells it 1e-07, orjson 1e-7, so a key that took the other path than request_key shows
    sampling = {"temperature": 0.0, "stop": ["</s>", "\u2028"], "x": {"b": 1e-7, "a": [None, False]}}
    deep: list = ["leaf"]
    for _ in range(251):  # orjson nests at most 255 levels: these messages alone fit, inside the key material not
        deep = [deep]
    prompts = ["", "plain", 'q"u\\o\nte', "é ✓ 漢字 \U0001f600", "\x00\x1f\x7f", "lone \udfff", None]
    messages = [[{"role": "user", "content": "m"}], [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
                [{"role": "user", "content": deep}], [{"role": "user", "content": {2: "non-str key"}}], None]  # fmt: skip
    for schema, prefix in ((None, ""), ('{"type": "object"}', "{"), ('{"a": "\\u00e9"}', "é\ud800")):
        keys = rc.RequestKeys("e" * 64, sampling, schema, prefix)
        for prompt in prompts:
            for msgs in messages:
                for seed in (None, 0, -3, 2**63, 10**30):
                    for images in (None, [], [_Image()]):
                        request = Request(4, msgs, prompt, sampling, schema, prefix, seed, images)
                        for choice in (None, (0, 2), (1, 2)):
                            assert keys.key(request, choice) == rc.request_key("e" * 64, request, choice), (prompt, msgs, seed)
                        if seed is None or seed < 2**62:
                            assert keys.sample_keys(request, 3, False) == rc.sample_keys("e" * 64, request, 3, False)


def test_step_keys_say_which_requests_are_deterministic():
    for sampling in ({"temperature": 0.0}, {"temperature": 0}, {"temperature": 0.7}, {}, {"temperature": True}):
        keys = rc.RequestKeys("e", sampling, None, "")
        for seed in (None, 3):
            request = Request(0, None, "p", sampling, seed=seed)
            assert keys.deterministic(request) == rc.deterministic(request), (sampling, seed)
    bad = {"temperature": "warm"}
    keys = rc.RequestKeys("e", bad, None, "")  # the row that sends it fails, not the step
    with pytest.raises(ValueError):
        keys.deterministic(Request(0, None, "p", bad))
    assert keys.deterministic(Request(0, None, "p", bad, seed=1))


# A segment and its manifest as mirageflow at 941180d wrote them for these answers.
OLD_SEGMENT = (
    b'["aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa","plain \xc3\xa9 \xe2\x9c\x93 \xe2\x80\xa8 \\"q\\"",null,12,5,"stop",null]\n'
    b'["bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", "lone \xed\xa0\x80 surrogate", "why\\n", 3, 4, "length", 7]\n'
    b'["cccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccccc","",null,0,0,"stop",null]\n'
)
OLD_MANIFEST = (
    '{"format":1,"segments":[{"name":"seg-00000.jsonl","bytes":328,'
    '"sha256":"787c6e891ed180c6d8a075baa589efaa26e44449bfa4a8f9bcc77d1ba390ff61","entries":3}]}\n'
)
OLD_ANSWERS = {
    "a" * 64: Completion(0, 'plain é ✓ \u2028 "q"', 12, 5, "stop"),
    "b" * 64: Completion(1, "lone \ud800 surrogate", 3, 4, "length", reasoning="why\n", image_tokens=7),
    "c" * 64: Completion(2, "", 0, 0, "stop"),
}


def test_segments_are_written_as_before_and_old_ones_read(tmp_path):
    """New entries are byte for byte what 941180d wrote (so it reads them), and its entries are read."""
    cache = rc.RequestCache(tmp_path / "new")
    cache.restore()
    for key, c in OLD_ANSWERS.items():
        cache.put(key, c)
    cache.commit()
    assert (cache.dir / "seg-00000.jsonl").read_bytes() == OLD_SEGMENT
    assert cache.manifest.read_text() == OLD_MANIFEST
    old = tmp_path / "old" / rc.CACHE_DIR
    old.mkdir(parents=True)
    (old / "seg-00000.jsonl").write_bytes(OLD_SEGMENT)
    (old / rc.MANIFEST).write_text(OLD_MANIFEST)
    again = rc.RequestCache(tmp_path / "old")
    again.restore()
    assert len(again) == 3
    for i, (key, c) in enumerate(OLD_ANSWERS.items()):
        assert again.get(key, c.id) == c
    assert not (old / "damaged").exists() and not (old / "orphaned").exists()


# --------------------------------------------------------------------------- hostile state


def _cache_dir(root: Path, shard: int = 0) -> Path:
    return root / "state" / f"shard_{shard}" / rc.CACHE_DIR


def test_a_damaged_segment_is_moved_aside_and_its_answers_asked_again(tmp_path, server, caplog):
    raw = pipeline(tmp_path, server)
    run(raw)
    manifest = json.loads((_cache_dir(tmp_path) / rc.MANIFEST).read_text())
    assert sum(s["entries"] for s in manifest["segments"]) == 2 * ROWS  # one segment per commit
    victim = _cache_dir(tmp_path) / manifest["segments"][0]["name"]
    data = bytearray(victim.read_bytes())
    data[10] ^= 0x20  # same size, other bytes
    victim.write_bytes(bytes(data))
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}", "t": "{{ title }}"}
    sent = len(server.records)
    status = run(edited)
    assert len(server.records) - sent == manifest["segments"][0]["entries"]
    assert status["stats"]["requests_cached"] == 2 * ROWS - manifest["segments"][0]["entries"]
    assert list((_cache_dir(tmp_path) / "damaged").glob(f"*/{victim.name}"))
    assert "request cache segment" in caplog.text and "moved to" in caplog.text


@pytest.mark.parametrize("damage", [b"not json", b'{"format": 1, "segments": [{"name": "../x"}]}', b'{"format": 99, "segments": []}'])
def test_a_damaged_manifest_is_kept_aside_and_the_cache_starts_empty(tmp_path, server, caplog, damage):
    raw = pipeline(tmp_path, server)
    run(raw)
    (_cache_dir(tmp_path) / rc.MANIFEST).write_bytes(damage)
    edited = copy.deepcopy(raw)
    edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
    sent = len(server.records)
    run(edited)
    assert len(server.records) - sent == 2 * ROWS
    assert list(_cache_dir(tmp_path).glob("manifest.json.damaged-*"))
    assert list((_cache_dir(tmp_path) / "orphaned").glob("*/seg-*.jsonl"))  # the old segments, kept
    # the new cache is whole: the next edit sends nothing
    edited["processing_params"]["output_schema"] = {"s2": "{{ summary }}"}
    sent = len(server.records)
    run(edited)
    assert len(server.records) == sent


def test_a_segment_written_by_a_killed_commit_is_set_aside(tmp_path, server):
    """A kill after a segment's rename but before the manifest's: the segment is unlisted;
    a kill before the rename leaves a temp file. Neither is trusted, neither breaks the cache."""
    raw = pipeline(tmp_path, server)
    run(raw)
    d = _cache_dir(tmp_path)
    (d / "seg-00099.jsonl").write_text(json.dumps(["0" * 64, "forged", None, 1, 1, "stop", None]) + "\n")
    (d / ".seg-00100.jsonl.abc.tmp").write_text("half")
    cache = rc.RequestCache(d.parent)
    cache.restore()
    assert len(cache) == 2 * ROWS and cache.get("0" * 64, 0) is None
    assert not list(d.glob(".*.tmp")) and list((d / "orphaned").glob("*/seg-00099.jsonl"))


def test_a_commit_that_fails_keeps_its_answers_for_the_next(tmp_path, monkeypatch):
    cache = rc.RequestCache(tmp_path)
    cache.restore()
    cache.put("a" * 64, Completion(0, "yes", 3, 1, "stop"))
    real = os.replace
    monkeypatch.setattr(rc.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(OSError):
        cache.commit()
    monkeypatch.setattr(rc.os, "replace", real)
    cache.commit()
    again = rc.RequestCache(tmp_path)
    again.restore()
    assert again.get("a" * 64, 5) == Completion(5, "yes", 3, 1, "stop")


def test_answers_holding_unicode_line_breaks_are_read_back(tmp_path):
    """JSON leaves U+2028, U+2029 and U+0085 unescaped: a segment's lines are split at its newlines only."""
    cache = rc.RequestCache(tmp_path)
    cache.restore()
    answers = {"a" * 64: Completion(0, "one\u2028two\u2029three\x85four", 3, 1, "stop"), "b" * 64: Completion(1, "plain", 2, 1, "stop")}
    for key, c in answers.items():
        cache.put(key, c)
    cache.commit()
    again = rc.RequestCache(tmp_path)
    again.restore()
    assert [again.get(key, c.id) for key, c in answers.items()] == list(answers.values())
    assert not (again.dir / "damaged").exists()


def test_keeping_an_answer_leaves_the_cyclic_gc_one_object_per_answer(tmp_path):
    """Part of the cache's per-row cost is the garbage collector's: every container object
    that outlives its row is walked by the young collections it survives. A kept answer
    leaves one (its tuple, untracked by the first collection that sees it); its key waits
    for the commit as a str, which the GC never walks."""
    import gc

    cache = rc.RequestCache(tmp_path)
    cache.restore()
    answers = [(f"{i:064x}", Completion(i, f"answer {i}", 3, 1, "stop")) for i in range(1000)]
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects(generation=0))
        for key, c in answers:
            cache.put(key, c)
        added = len(gc.get_objects(generation=0)) - before
    finally:
        gc.enable()
    assert added <= 1000 + 20, f"{added} objects for the GC to walk for 1000 answers kept"
    cache.commit()
    again = rc.RequestCache(tmp_path)
    again.restore()
    assert [again.get(key, c.id) for key, c in answers] == [c for _, c in answers]


def test_a_key_kept_twice_before_a_commit_reads_back_its_latest_answer(tmp_path):
    cache = rc.RequestCache(tmp_path)
    cache.restore()
    cache.put("a" * 64, Completion(0, "first", 3, 1, "stop"))
    cache.put("b" * 64, Completion(1, "other", 3, 1, "stop"))
    cache.put("a" * 64, Completion(0, "second", 3, 2, "stop"))
    cache.commit()
    again = rc.RequestCache(tmp_path)
    again.restore()
    assert again.get("a" * 64, 7) == Completion(7, "second", 3, 2, "stop") and len(again) == 2
    assert not (again.dir / "damaged").exists()


def test_concurrent_shards_keep_their_own_caches(tmp_path):
    server = FakeServer(Behaviour(latency=0.05)).start()
    try:
        raw = pipeline(tmp_path, server, rows=[{"text": f"passage {i}"} for i in range(12)], num_shards=2)
        index_datasets(load_config(copy.deepcopy(raw)))
        jobs = [start_shard_job(tmp_path, raw, k) for k in (0, 1)]
        outs = [j.communicate(timeout=120)[0] for j in jobs]
        assert all(j.returncode == 0 for j in jobs), outs
        assert server.peak_in_flight > 1
        for k in (0, 1):
            cache = rc.RequestCache(_cache_dir(tmp_path, k).parent)
            cache.restore()
            assert len(cache) == 12  # its own 6 rows x 2 outputs
        edited = copy.deepcopy(raw)
        edited["processing_params"]["output_schema"] = {"s": "{{ summary }}"}
        sent = len(server.records)
        jobs = [start_shard_job(tmp_path, edited, k) for k in (0, 1)]
        assert all(j.wait(timeout=120) == 0 for j in jobs)
        assert len(server.records) == sent
    finally:
        server.stop()


def test_a_shard_killed_mid_commit_resumes_with_a_whole_cache(tmp_path):
    """SIGKILL while the shard commits rows and answers (checkpoint_rows 1): the rerun finds
    no damaged segment, and every answer kept is one that no request has to repeat."""
    server = FakeServer(Behaviour(latency=0.02)).start()
    try:
        raw = pipeline(tmp_path, server, rows=[{"text": f"passage {i}"} for i in range(40)])
        raw["shard_params"].update(checkpoint_rows=1, max_inflight=4)
        index_datasets(load_config(copy.deepcopy(raw)))
        job = start_shard_job(tmp_path, raw, 0)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(server.records) < 30:
            time.sleep(0.01)
        job.send_signal(signal.SIGKILL)
        job.wait(timeout=30)
        killed_at = len(server.records)
        kept = rc.RequestCache(_cache_dir(tmp_path).parent)
        kept.restore()
        assert not (_cache_dir(tmp_path) / "damaged").exists()
        edited = copy.deepcopy(raw)
        edited["processing_params"]["output_schema"] = {"s": "{{ summary }}", "t": "{{ title }}"}
        status = run(edited, reindex=False)
        assert status["stats"]["rows_processed"] == 40
        # every request after the kill was one the cache did not hold
        assert len(server.records) - killed_at == 80 - len(kept)
        assert status["stats"]["requests_cached"] == len(kept) > 0
    finally:
        server.stop()
