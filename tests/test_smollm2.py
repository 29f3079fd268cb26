"""A real model through the real prompt path: proves the chat template and prompts are right."""

from __future__ import annotations

import pytest

from mirageflow.config import ServerArgs
from mirageflow.engines.wire import Request
from mirageflow.engines.transformers_engine import TransformersEngine


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2_model):
    engine = TransformersEngine(ServerArgs(str(smollm2_model)), batch_size=2, torch_threads=1)
    engine.load()
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    prompt = engine.chat_prompt(messages, {})
    assert prompt.rstrip().endswith("<|im_start|>assistant")
    (answer,) = engine.generate([Request(0, messages, prompt, {"temperature": 0.0, "max_new_tokens": 20})])
    assert "Paris" in answer.text
    assert answer.finish_reason == "stop" and answer.completion_tokens < 20
