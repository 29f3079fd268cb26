"""An in-process engine for shard-runner tests: answers come from a function of the prompt."""

from __future__ import annotations

from mirageflow.engines.base import Engine
from mirageflow.engines.wire import Completion, EngineInfo


class ScriptedEngine(Engine):
    """Answers each prompt with ``answer(prompt)``; records what it was asked."""

    def __init__(self, answer):
        self.answer = answer
        self.prompts: list[str] = []
        self.closed = False
        self.info = EngineInfo(backend="scripted", model_path="none")

    def load(self):
        pass

    def chat_prompt(self, messages, kwargs):
        return "|".join(f"{m['role']}:{m['content']}" for m in messages)

    async def generate_one(self, r):
        self.prompts.append(r.prompt)
        result = self.answer(r.prompt)
        if isinstance(result, Completion):
            result.id = r.id
            return result
        return Completion(r.id, result, len(r.prompt), len(result.split()), "stop")

    def close(self):
        self.closed = True


class EngineCrash(RuntimeError):
    """What an ``answer`` function raises to play an engine that died (not a row's error)."""
