"""Stand-ins for SGLang and HTTP inference servers, for tests without a GPU or sglang.

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
