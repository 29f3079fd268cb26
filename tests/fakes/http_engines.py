"""Builders for the HTTP engine tests (tests/test_engine_http.py, tests/test_server_ranks.py):
a ProcessorConfig whose launched server is the SGLang stand-in, and numbered Requests."""

from __future__ import annotations

import json

from fakes import stand_in_command
from mirageflow.config import LaunchedServer, ProcessorConfig, ServerArgs
from mirageflow.config.build import LAUNCH_KEYS
from mirageflow.engines.wire import Request


def processor(backend="sglang_server", model="org/model", extra=None, apply_chat_template=False, **fields) -> ProcessorConfig:
    server_args = {"model_path": model, "tp_size": 1, "dp_size": 1, "trust_remote_code": True,
                   "disable_custom_all_reduce": False, "extra_engine_args": extra or {}}  # fmt: skip
    server_args.update(fields.pop("server_args", {}))
    defaults = dict(
        type="llm", backend=backend, server_args=ServerArgs(**server_args), sampling_params={}, chat_template_kwargs={},
        apply_chat_template=apply_chat_template, torch_threads=None, request_timeout=10.0, max_retries=3,
    )  # fmt: skip
    # the launched server's keys, as processors[] spells them (ProcessorConfig.launch holds them)
    launch = {"command": stand_in_command(), "start_timeout": 10.0}
    launch.update({LAUNCH_KEYS[key]: fields.pop(key) for key in list(fields) if key in LAUNCH_KEYS})
    defaults.update(fields)
    return ProcessorConfig(**defaults, launch=LaunchedServer(**launch))


def req(i, prompt=None, schema=None, messages=None, **params) -> Request:
    messages = messages or [{"role": "user", "content": f"question {i}"}]
    return Request(i, messages, prompt or f"prompt number {i} " + "x" * i, params, json.dumps(schema) if schema else None)
