"""The transformers engine with continuous batching (transformers' own manager), on the CPU with the tiny model.

On CUDA the engine turns it on by itself (``continuous_batching: auto``); here it is forced
with ``continuous_batching: true``, and every answer is compared with the static path's.
"""

from __future__ import annotations

import asyncio
import json
import pytest

from mirageflow.config import ProcessorConfig, ServerArgs
from mirageflow.engines.base import EngineError, EngineStopped, Request
from mirageflow.engines.transformers_cb import sampler, static_reason
from mirageflow.engines.transformers_engine import TransformersEngine


def _engine(model, continuous, defaults=None, **extra):
    processor = ProcessorConfig(
        type="llm",
        backend="transformers",
        server_args=ServerArgs(str(model), extra_engine_args={"continuous_batching": continuous, **extra}),
        sampling_params={"temperature": 0.0, **(defaults or {})},
        chat_template_kwargs={},
        apply_chat_template=True,
        torch_threads=1,
    )
    engine = TransformersEngine(processor, batch_size=4)
    engine.load()
    return engine


@pytest.fixture(scope="module")
def static(tiny_model):
    eng = _engine(tiny_model, False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def continuous(tiny_model):
    eng = _engine(tiny_model, True, max_running_requests=4)
    yield eng
    eng.close()


TEXTS = ["hi", "What is the capital of France?", "The cat sat on the mat and looked out of the window.", "ok", "x",
         "Rivers flow from the hills down to the ocean.", "Bread is made from flour, water, salt and yeast."]  # fmt: skip


def _requests(engine, params_of):
    return [
        Request(i, None, engine.chat_prompt([{"role": "user", "content": t}], {}), {"temperature": 0.0, **params_of(i)})
        for i, t in enumerate(TEXTS)
    ]


def _answers(engine, requests):
    return {c.id: (c.text, c.prompt_tokens, c.completion_tokens, c.finish_reason, c.error_kind) for c in engine.generate(requests)}


def test_continuous_batching_answers_as_the_static_path(static, continuous):
    params_of = lambda i: {"max_new_tokens": 3 + 2 * i}  # noqa: E731 - rows of different lengths share the manager
    before = continuous.info.details["continuous_batching"]["requests"]
    ours = _answers(continuous, _requests(continuous, params_of))
    assert ours == _answers(static, _requests(static, params_of))
    cb = continuous.info.details["continuous_batching"]
    assert cb["enabled"] and cb["requests"] - before == len(TEXTS) and cb["max_running_requests"] == 4
    assert static.info.details["continuous_batching"] == {"enabled": False, "reason": "off (configured)"}
    assert continuous.max_inflight == 8  # 2 x max_running_requests, as SGLang's window


def test_ignore_eos_gives_exactly_max_new_tokens(continuous):
    out = continuous.generate(_requests(continuous, lambda i: {"max_new_tokens": 9, "ignore_eos": True}))
    assert all(c.completion_tokens == 9 and c.finish_reason == "length" for c in out)


def test_what_the_manager_cannot_do_takes_the_static_path(static, continuous):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]})
    cases = {
        "json_schema": lambda r: Request(r.id, None, r.prompt, r.sampling_params, json_schema=schema),
        "stop": lambda r: Request(r.id, None, r.prompt, {**r.sampling_params, "stop": ["e"]}),
        "min_new_tokens": lambda r: Request(r.id, None, r.prompt, {**r.sampling_params, "min_new_tokens": 5}),
        "repetition_penalty": lambda r: Request(r.id, None, r.prompt, {**r.sampling_params, "repetition_penalty": 1.3}),
        "sampling_params": lambda r: Request(r.id, None, r.prompt, {**r.sampling_params, "temperature": 0.7}, seed=r.id),
    }
    for reason, make in cases.items():
        before = dict(continuous.info.details["continuous_batching"]["static_path_requests"])
        served = continuous.info.details["continuous_batching"]["requests"]
        ours = _answers(continuous, [make(r) for r in _requests(continuous, lambda i: {"max_new_tokens": 8})])
        theirs = _answers(static, [make(r) for r in _requests(static, lambda i: {"max_new_tokens": 8})])
        assert ours == theirs, reason  # the same static path (seeded sampling included)
        cb = continuous.info.details["continuous_batching"]
        assert cb["static_path_requests"].get(reason, 0) - before.get(reason, 0) == len(TEXTS), reason
        assert cb["requests"] == served, reason


def test_a_prompt_too_long_for_the_context_fails_its_row_only(continuous):
    long = continuous.chat_prompt([{"role": "user", "content": " ".join(["water"] * 600)}], {})
    out = {c.id: c for c in continuous.generate([Request(0, None, long, {"temperature": 0.0}), *_requests(continuous, lambda i: {})[1:3]])}
    assert out[0].error_kind == "context_length" and "context of 512" in out[0].error and out[0].completion_tokens == 0
    assert out[1].error_kind is None and out[2].error_kind is None


def test_stop_fails_the_waiting_requests_at_once(tiny_model):
    engine = _engine(tiny_model, True, max_running_requests=2)
    try:

        async def main():
            reqs = [Request(i, None, engine.chat_prompt([{"role": "user", "content": f"q{i}"}], {}),
                            {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}) for i in range(6)]  # fmt: skip
            tasks = [asyncio.ensure_future(engine.generate_one(r)) for r in reqs]
            await asyncio.sleep(0.5)
            engine.stop()
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)

        results = asyncio.run(main())
        assert any(isinstance(r, EngineStopped) for r in results)
        assert all(isinstance(r, EngineStopped) or r.completion_tokens == 400 for r in results)
    finally:
        engine.close()


def test_a_manager_that_dies_fails_its_requests_with_an_engine_error(tiny_model):
    engine = _engine(tiny_model, True, max_running_requests=2)
    try:

        async def main():
            reqs = [Request(i, None, engine.chat_prompt([{"role": "user", "content": f"q{i}"}], {}),
                            {"temperature": 0.0, "max_new_tokens": 400, "ignore_eos": True}) for i in range(4)]  # fmt: skip
            tasks = [asyncio.ensure_future(engine.generate_one(r)) for r in reqs]
            await asyncio.sleep(0.5)
            engine._cb.manager.stop(block=False, hard_stop=True)  # the manager's thread ends with requests left
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), timeout=30)

        results = asyncio.run(main())
        assert any(isinstance(r, EngineError) and not isinstance(r, EngineStopped) for r in results), results
        with pytest.raises(EngineError, match="continuous batching manager (is not running|refused)"):
            engine.generate(_requests(engine, lambda i: {})[:1])
    finally:
        engine.close()


def test_auto_is_off_on_the_cpu_and_bad_values_are_refused(tiny_model):
    engine = _engine(tiny_model, "auto")
    assert engine.info.details["continuous_batching"] == {"enabled": False, "reason": "off (cpu)"}
    assert not engine.warms_up  # no warmup phase for the static path
    engine.close()
    with pytest.raises(ValueError, match="continuous_batching must be auto, true or false"):
        _engine(tiny_model, "yes")
    with pytest.raises(ValueError, match="max_running_requests must be a positive integer"):
        _engine(tiny_model, True, max_running_requests=0)


def test_vision_models_stay_on_the_static_path(tmp_path):
    from mirageflow.model_prep import build_tiny_vlm

    vlm = build_tiny_vlm(tmp_path / "vlm")
    engine = _engine(vlm, "auto")
    assert engine._cb is None
    engine.close()
    with pytest.raises(ValueError, match="needs a text-only model"):
        _engine(vlm, True)


def test_static_reason_names_each_feature():
    greedy = sampler({"temperature": 0.0})
    plain = Request(0, None, "p", {})
    assert static_reason(plain, {"temperature": 0}, greedy) is None
    assert static_reason(Request(0, None, "p", {}, seed=3), {"temperature": 0}, greedy) is None  # greedy: no randomness
    assert static_reason(plain, {"temperature": 0, "stop": "x"}, greedy) == "stop"
    assert static_reason(plain, {"temperature": 0, "repetition_penalty": 1.0}, greedy) is None
    assert static_reason(plain, {"temperature": 0.5}, greedy) == "sampling_params"
    warm = sampler({"temperature": 0.5, "top_p": 0.9})
    assert static_reason(plain, {"temperature": 0.5, "top_p": 0.9}, warm) is None
    assert static_reason(Request(0, None, "p", {}, seed=1), {"temperature": 0.5, "top_p": 0.9}, warm) == "seed"
    assert static_reason(Request(0, None, "p", {}, json_schema="{}"), {"temperature": 0}, greedy) == "json_schema"
    assert static_reason(Request(0, None, "p", {}, images=[object()]), {"temperature": 0}, greedy) == "images"
