"""Stand-ins (SGLang, HTTP inference servers, an engine) and the tests' shared scaffolding; no GPU or sglang needed.

- ``fake_sglang.py``: a module injected as ``sglang`` (``Engine(**kwargs)``,
  ``generate``/``async_generate``, ``meta_info``, ``tokenizer_manager.tokenizer``,
  ``shutdown``), simulating a continuous-batching engine with a capacity.
- ``fake_http.py``: a real HTTP server on 127.0.0.1 speaking ``/health_generate``,
  ``/generate``, ``/v1/chat/completions``, ``/v1/completions``, ``/metrics``, with scripted
  failures.
- ``fake_sglang_server.py``: a launch script taking SGLang's flags, used via
  ``server_command``.
- ``fake_vllm_server.py``: the same for ``vllm_server`` (vLLM's ``/health``, ``/version`` and
  metric names).
- ``fake_grammar.py``: how both SGLang fakes answer ``json_schema`` and ``ebnf`` requests.
- ``engines.py``: ``ScriptedEngine``, an in-process engine whose answers come from a function.
- ``configs.py``: ``pipeline_config``, the one builder of pipeline config dicts, and the shard
  and merge set-ups built on it.
- ``runs.py``: a run's state files written by hand (for the report, the merge, ``mmirage status``).
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

FAKES = Path(__file__).resolve().parent


def drive(engine, requests, window: int | None = None) -> list:
    """Feed requests like the shard runner: keep ``window`` (default engine.max_inflight) in flight."""

    async def main():
        sem = asyncio.Semaphore(window or engine.max_inflight)

        async def one(r):
            async with sem:
                return await engine.generate_one(r)

        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def stand_in_command() -> list[str]:
    return [sys.executable, str(FAKES / "fake_sglang_server.py")]


def vllm_stand_in_command() -> list[str]:
    return [sys.executable, str(FAKES / "fake_vllm_server.py")]


__all__ = ["FAKES", "alive", "drive", "stand_in_command", "vllm_stand_in_command"]
