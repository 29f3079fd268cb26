"""A shard's rows answered from the request cache before any engine is made.

A rerun whose requests were all answered before (an edit of the record template, a lost
output directory) needs no model: ``ShardRunner`` first feeds its rows with a
``CacheOnlyEngine`` per processor, which holds no model, so every request is answered from
the request cache (shard/request_cache.py). The first request whose answer is not kept
raises ``AnswerNotCached`` instead of generating (``RowPath.cache_only``): the runner stops
that pass (what finished is committed; the units in flight are fed again, their answers
booked once: ``ShardMetrics.unbook_cached``), loads the engines as usual and feeds the rest.
A fresh run (an empty cache) skips the pass, so its feeding is as before.

A request is keyed exactly as the loaded engine's (same engine identity, same rendered
prompt), so ``cache_only_engine`` makes a stand-in only where that holds without the model:

- backends that template server-side (openai, vllm_server, batch_api): the key holds the
  messages;
- ``apply_chat_template: false``: the prompt is the user turn;
- transformers: its tokenizer's chat template (the tokenizer is loaded, never the weights);
- not ``auto`` (the backend is chosen when the engine is made) nor an engine service's
  client.

Other processors (sglang and sglang_server with a chat template) load as before, and so
does a pipeline with a custom or image_gen output (their workers and generators start with
the engines).
"""

from __future__ import annotations

from mirageflow.config import PipelineConfig
from mirageflow.config.types import ProcessorConfig
from mirageflow.engines import registry
from mirageflow.engines.base import Engine
from mirageflow.engines.wire import Completion, EngineInfo, Request
from mirageflow.shard.failures import ShardFailed
from mirageflow.shard.request_cache import RequestCache

# Rows in flight while answers come from the cache (no engine to keep busy).
CACHE_ONLY_WINDOW = 64


class AnswerNotCached(ShardFailed):
    """A request's answer is not in the request cache: the engines are loaded for it."""


class CacheOnlyEngine(Engine):
    """Stands in for a processor's engine while every answer comes from the request cache:
    what the request and its key need (templating, native n, the backend's name), no model."""

    max_inflight = CACHE_ONLY_WINDOW

    def __init__(self, processor: ProcessorConfig, tokenizer=None):
        self.processor = processor
        caps = registry.capabilities(processor.backend)
        self.templates_server_side = caps.templates_server_side
        self.native_n = caps.native_n
        self.tokenizer = tokenizer  # chat_prompt's template (Engine.chat_prompt), for a backend that templates here
        self.info = EngineInfo(backend=processor.backend, model_path=processor.server_args.model_path)

    def load(self) -> None:
        pass

    @property
    def native_samples(self) -> bool:  # as the backends with native n say (openai_engine, vllm_server)
        return self.native_n and self.processor.native_n is not False

    async def generate_one(self, request: Request) -> Completion:  # RowPath asks no stand-in; never generate
        raise AnswerNotCached(f"the answer of request {request.id} is not in the request cache")


def stand_ins(cfg: PipelineConfig, cache: RequestCache | None) -> dict[str, CacheOnlyEngine] | None:
    """A stand-in per LLM processor, to answer the shard's requests from ``cache`` alone; None
    when that cannot be (no cache, or no kept answer to look up, or ``fresh_answers``; a custom
    or image_gen output; a processor whose requests' keys need its loaded engine)."""
    if cache is None or not cache.lookups or len(cache) == 0 or any(o.kind not in ("llm", "filter") for o in cfg.outputs):
        return None
    out = {}
    for name in {o.processor for o in cfg.outputs if o.kind == "llm"}:
        engine = cache_only_engine(cfg.processors[name])
        if engine is None:
            return None
        out[name] = engine
    return out


def cache_only_engine(processor: ProcessorConfig) -> CacheOnlyEngine | None:
    """The stand-in for ``processor``'s engine, or None where a request's key needs the
    loaded engine (the module's doc)."""
    backend = processor.backend
    if backend in (registry.AUTO, registry.SHARED):
        return None
    can = registry.capabilities(backend)
    if can.templates_server_side or not processor.apply_chat_template:
        return CacheOnlyEngine(processor)
    if can.tokenizer_without_weights:
        return CacheOnlyEngine(processor, registry.engine_class(backend).key_tokenizer(processor.server_args))
    return None
