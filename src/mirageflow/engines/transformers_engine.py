"""Hugging Face transformers engine: the CPU default, and one CUDA GPU with continuous batching.

On CUDA (``extra_engine_args.continuous_batching``: ``auto``, the default) the requests it
can serve go to transformers' own continuous-batching manager (paged KV cache; a finished
row frees its slot at once): transformers_cb.py says which ones and why the others (JSON
outputs, stop strings, seeded sampling, images, ...) stay on the static path below, and
``engines.<name>.details.continuous_batching`` in status.json counts each. On the CPU the
static path serves everything unless ``continuous_batching: true`` (BENCHMARKS.md section
``transformers_cb`` measures both there).

Static path: requests arrive one by one from the runner's in-flight window. A worker thread takes
whatever is waiting (up to ``batch_size``, requests that can share one ``generate`` call),
runs a left-padded batch, and resolves each request's future. A batch holds fewer rows
when its rows' limits would keep it running past half the runner's commit interval
(batch_time.py), so a stop loses at most one interval of work. While a batch runs the
window refills the queue, so the next batch is full as soon as the model is free, and a
full batch starts at once (only a short one waits a few ms for more requests).
Requests with different ``max_new_tokens`` share a batch: a per-row stopping criterion
ends each at its own limit. A row that ends (its EOS, or its limit) while others of its
batch go on is handed back at once (``_early_rows``, checked after each decoding step), so
the shard commits it, the live line moves and a stop loses only the rows still generating;
rows with stop strings, which the decoded text decides, come back with their batch. A request with a seed (``Request.seed``: n_samples, or
``sampling_params.seed``) samples from its own generator, so a rerun gives the same text
whatever else shares its batch. A batch that raises an error leaving the model unusable
(a device error: server_process.classify_engine_error) reloads the model in the job, up to
``max_restarts`` times, and its rows not yet handed back run again (``_run_healing``); out of
memory is not reloaded (EngineDied with its class).

JSON outputs (``Request.json_schema``) are constrained as SGLang constrains them: with an
xgrammar grammar compiled from the schema, applied as a per-row token bitmask on the
logits, so rows with different schemas (or none) share a batch. xgrammar is imported only
when the first such request arrives. Whitespace is not free: the JSON is laid out as
``json.dumps`` does (xgrammar's ``any_whitespace=False``), since small models otherwise
loop on whitespace until the length limit.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import os
import queue
import threading
import time
from collections import deque

from mirageflow.config.types import ProcessorConfig, ServerArgs
from mirageflow.engines.base import Engine, EngineStopped
from mirageflow.engines.batch_time import BatchTimeCap
from mirageflow.engines.server_process import classify_engine_error
from mirageflow.engines.reloads import InProcessReloads
from mirageflow.engines.server_restarts import DEFAULT_MAX_RESTARTS
from mirageflow.engines.tokens import PromptTokenizer
from mirageflow.engines.wire import Completion, EngineInfo, Request
from mirageflow.errors import EngineDeathClass as D, RowErrorClass as E

log = logging.getLogger(__name__)

# Sampling params this engine honours; SGLang-only ones are reported once and ignored.
_SUPPORTED = {
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "stop", "ignore_eos", "skip_special_tokens",
}  # fmt: skip
_ENGINE_ARGS = {"dtype", "attn_implementation", "continuous_batching", "max_running_requests"}
_LINGER_SECONDS = 0.005  # a short batch waits this long after each arrival for more requests
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


def default_threads(requested: int | None) -> int:
    if requested:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # Small models on 2-core machines run ~10x slower, and erratically, with 2 threads.
    return 1 if cpus <= 2 else cpus


def _batch_key(params: dict) -> str:
    """Requests may share a generate() call when they differ at most in max_new_tokens."""
    return json.dumps({k: v for k, v in params.items() if k != "max_new_tokens"}, sort_keys=True)


class TransformersEngine(Engine):
    grammar_in_process = True  # JSON outputs through xgrammar token masks (engines/registry.py)
    tokenizer_without_weights = True  # key_tokenizer: the request cache's stand-in (shard/cached_answers.py)

    @staticmethod
    def key_tokenizer(server_args):
        return load_tokenizer(server_args)[1]

    def __init__(self, processor: ProcessorConfig | ServerArgs, batch_size: int = 32, torch_threads: int | None = None, log_dir=None):
        """``processor``: a ProcessorConfig (what create_engine passes), or its server_args."""
        if isinstance(processor, ProcessorConfig):
            server_args, sampling = processor.server_args, processor.sampling_params
            torch_threads = torch_threads or processor.torch_threads
            self.max_restarts = processor.max_restarts
        else:
            server_args, sampling = processor, {}
            self.max_restarts = DEFAULT_MAX_RESTARTS
        # the model's deaths in this job (device errors reload it: _heal); final: dead, not reloaded
        self.reloads = InProcessReloads("the transformers model", self.max_restarts)
        self.server_args = server_args
        self.batch_size = batch_size
        self.max_inflight = 2 * batch_size
        self.threads = default_threads(torch_threads)
        self.model = self.tokenizer = None
        self._warned: set[str] = set()
        self._queue: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._stopped = threading.Event()
        self._running = 0
        self._grammar_compiler = None  # xgrammar, built at the first JSON request
        self._cb = None  # transformers_cb.ContinuousBatcher when continuous batching is on
        self._cap = BatchTimeCap(batch_size, None)  # sized at load(), from the runner's commit_seconds
        self.default_params = dict(sampling or {})
        self.info = EngineInfo(backend="transformers", model_path=server_args.model_path)

    # ------------------------------------------------------------------ setup

    def warmup(self) -> None:
        if self._cb is not None:
            self._cb.warmup()

    def load(self) -> None:
        import torch
        import transformers

        torch.set_num_threads(self.threads)
        extra = dict(self.server_args.extra_engine_args)
        ignored = sorted(set(extra) - _ENGINE_ARGS)
        if ignored:
            log.info("transformers engine ignores extra_engine_args %s (SGLang options)", ignored)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # bf16 on GPU; float32 on CPU, where bf16 matmuls are slow without AMX.
        dtype = extra.get("dtype") or ("bfloat16" if device == "cuda" else "float32")
        path = self.server_args.model_path
        self.processor, self.tokenizer = load_tokenizer(self.server_args)
        self._prompt_ids = PromptTokenizer(self.tokenizer)  # exactly one BOS when the tokenizer adds one
        self._load_model(device, dtype, extra)
        self._reload_args = (device, dtype, extra)
        self.info = EngineInfo(
            backend="transformers",
            model_path=path,
            versions={"transformers": transformers.__version__, "torch": torch.__version__},
            device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            details={"dtype": dtype, "torch_threads": self.threads, "batch_size": self.batch_size, "max_restarts": self.max_restarts},
        )
        self._cap = BatchTimeCap(self.batch_size, self.commit_seconds)
        self.info.details["batch_time"] = self._cap.details()
        self._start_continuous_batching(extra.get("continuous_batching", "auto"), extra.get("max_running_requests"))
        self._worker = threading.Thread(target=self._serve, name="transformers-batcher", daemon=True)
        self._worker.start()

    def _load_model(self, device: str, dtype: str, extra: dict) -> None:
        """The weights, on ``device`` (load, and a reload after a device error: ``_heal``)."""
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        kwargs = {"dtype": getattr(torch, dtype), "trust_remote_code": self.server_args.trust_remote_code}
        if "attn_implementation" in extra:
            kwargs["attn_implementation"] = extra["attn_implementation"]
        model_class = AutoModelForCausalLM if self.processor is None else transformers.AutoModelForImageTextToText
        self.model = model_class.from_pretrained(self.server_args.model_path, **kwargs).to(device).eval()
        self.device = device
        config = self.model.config
        self.max_context = getattr(config, "max_position_embeddings", None) or getattr(
            getattr(config, "text_config", None), "max_position_embeddings", None
        )
        self.eos_ids = self._eos_ids()

    def _start_continuous_batching(self, mode, running) -> None:
        """Build the continuous-batching manager when ``mode`` (auto: on CUDA) asks for it."""
        from mirageflow.engines.transformers_cb import start

        self._cb, self.info.details["continuous_batching"] = start(self, mode, running)
        if self._cb is not None:
            self.max_inflight = 2 * self._cb.running  # as SGLang's: the manager always has the next requests queued
            self.warms_up = True  # this instance does (CUDA graphs): the runner times warmup() as its phase

    def _eos_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------------ requests

    async def generate_one(self, request: Request) -> Completion:
        if self._stopped.is_set():
            raise EngineStopped("engine was stopped")
        if self._cb is not None:
            from mirageflow.engines.transformers_cb import static_reason

            params = request.sampling_params
            reason = static_reason(request, params, self._cb.sampler)
            if reason is None:
                return await self._generate_continuous(request, params)
            self._cb.served_statically(reason)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        key = _batch_key(request.sampling_params) + ("\0images" if request.images else "")  # image rows batch apart
        self._queue.put((request, future, loop, key))
        return await future

    async def _generate_continuous(self, request: Request, params: dict) -> Completion:
        self._warn_unsupported(params)
        prompt_ids = self._prompt_ids(request.prompt)
        limit = params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
        if self.max_context and len(prompt_ids) + limit > self.max_context:
            return _too_long(request.id, len(prompt_ids), limit, self.max_context)
        return await self._cb.generate(request, prompt_ids, params, limit)

    def queue_depth(self) -> int:
        return self._queue.qsize() + self._running + (self._cb.depth() if self._cb is not None else 0)

    def stop(self) -> None:
        self._stopped.set()
        if self._cb is not None:
            self._cb.fail_all(EngineStopped("engine was stopped"))

    def close(self) -> None:
        self._stopped.set()
        if self._cb is not None:
            self._cb.close()
            self._cb = None
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=30)
            self._worker = None

    # ------------------------------------------------------------------ worker thread

    def _next_batch(self, backlog: deque) -> list | None:
        """Up to batch_size waiting requests that can share a generate() call; None to exit.

        A full batch starts at once; a short one waits up to _LINGER_SECONDS after each
        arrival for more (the window refills while the previous batch runs).
        """
        if not backlog:
            item = self._queue.get()
            if item is None:
                return None
            backlog.append(item)
        key = backlog[0][3]
        matching = sum(1 for item in backlog if item[3] == key)
        deadline = time.monotonic() + _LINGER_SECONDS
        while matching < self.batch_size and len(backlog) < 4 * self.batch_size:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # exit after serving what is here
                break
            backlog.append(item)
            matching += item[3] == key
            deadline = time.monotonic() + _LINGER_SECONDS
        batch, rest = [], deque()
        while backlog:
            item = backlog.popleft()
            (batch if len(batch) < self.batch_size and item[3] == key else rest).append(item)
        cap = self._cap.rows(max(_max_new_tokens(item[0]) for item in batch))
        backlog.extend(batch[cap:])  # first in the next batch
        backlog.extend(rest)
        return batch[:cap]

    def _serve(self) -> None:
        backlog: deque = deque()
        while (batch := self._next_batch(backlog)) is not None:
            self._running = len(batch)

            def hand_back(i: int, result, batch=batch) -> None:
                _, future, loop, _ = batch[i]
                try:
                    loop.call_soon_threadsafe(_resolve, future, result)
                except RuntimeError:  # the caller's loop is closed (the shard stopped): nobody waits
                    pass

            try:
                if self._stopped.is_set():
                    raise EngineStopped("engine was stopped")
                if self.reloads.final is not None:  # the model died for good: later batches fail the same way, not run
                    raise self.reloads.final
                results = self._run_healing(batch, hand_back)
            except BaseException as e:  # resolve every waiter; never leave a future hanging
                results = [e] * len(batch)
            finally:
                self._running = 0
            for i, result in enumerate(results):  # a row handed back while the batch ran is not resolved again
                hand_back(i, result)

    def _run_healing(self, batch: list, hand_back) -> list:
        """``_run``; after an error that leaves the model unusable (a device error:
        server_process.classify_engine_error) the model is reloaded (``_heal``) and the rows of
        the batch not yet handed back run again, up to ``max_restarts`` times."""
        results: list = [None] * len(batch)
        pending = list(range(len(batch)))
        while True:
            handed: set[int] = set()

            def early(j: int, completion, pending=pending, handed=handed) -> None:
                handed.add(pending[j])
                results[pending[j]] = completion
                hand_back(pending[j], completion)

            try:
                for j, completion in enumerate(self._run([batch[i] for i in pending], early)):
                    results[pending[j]] = completion
                return results
            except Exception as e:  # noqa: BLE001 - classified: a device error is healed, anything else raised
                pending = [i for i in pending if i not in handed]
                self._heal(e, len(pending))

    def _heal(self, error: Exception, rerun: int) -> None:
        """``error`` ended a batch: reload the model when it is a device error and the restarts
        are not spent (``rerun`` rows run again); else raise (EngineDied for a death, with its class)."""
        found = classify_engine_error(error)
        if found is None or self._stopped.is_set():
            raise error
        death_class, cause = found
        death = self.reloads.died(death_class, cause)
        if death_class is not D.DEVICE_ERROR:
            why = "out of memory: not reloaded, the same batch would run out again"
        elif self._cb is not None:  # its manager holds the model and its paged cache: not rebuilt here
            why = "not reloaded under continuous batching"
        elif self.reloads.spent:
            why = f"processors[].max_restarts={self.max_restarts} spent"
        else:
            why = None
        if why is not None:
            raise self.reloads.give_up(why) from error
        t0 = time.monotonic()
        self.model = None
        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.reloads.count += 1
        self._load_model(*self._reload_args)
        death["requests_resent"] = rerun
        death["restarted_after_seconds"] = death["successor_start_seconds"] = round(time.monotonic() - t0, 3)
        log.warning(
            "the transformers model was reloaded in %.1f s (reload %d of at most %d); %d rows run again",
            time.monotonic() - t0,
            self.reloads.count,
            self.max_restarts,
            rerun,
        )

    def restarts(self) -> int:
        return self.reloads.count

    def deaths(self) -> list[dict]:
        return self.reloads.listing()

    def _run(self, batch: list, hand_back=None) -> list:
        """The completions of a batch; ``hand_back(i, completion)``, when given, gets each row
        that finishes before the batch does, as it finishes."""
        requests = [item[0] for item in batch]
        if requests[0].images:
            return _run_images(self, requests)
        # tokenized once: these ids are checked against the context and padded for generate()
        ids = self._prompt_ids.batch([r.prompt for r in requests])
        results: list = [None] * len(requests)
        runnable = []
        for i, (r, prompt_ids) in enumerate(zip(requests, ids)):
            max_new = _max_new_tokens(r)
            if self.max_context and len(prompt_ids) + max_new > self.max_context:
                results[i] = _too_long(r.id, len(prompt_ids), max_new, self.max_context)
            else:
                runnable.append(i)
        if runnable:
            early = None if hand_back is None else lambda j, c: hand_back(runnable[j], c)
            for i, c in zip(runnable, self._generate_batch([requests[i] for i in runnable], [ids[i] for i in runnable], on_finished=early)):
                results[i] = c
        return results

    def _warn_unsupported(self, params: dict) -> None:
        for name in sorted(set(params) - _SUPPORTED - self._warned):
            log.warning("sampling param %r is not supported by the transformers engine; ignored", name)
            self._warned.add(name)

    def _generation_kwargs(self, params: dict, limits: list[int]) -> dict:
        self._warn_unsupported(params)
        temperature = params.get("temperature", 1.0)  # SGLang's default
        kw = {"max_new_tokens": max(limits), "do_sample": temperature > 0}
        if kw["do_sample"]:
            kw.update(temperature=temperature, top_p=params.get("top_p", 1.0))
            if params.get("top_k", -1) > 0:
                kw["top_k"] = params["top_k"]
            if params.get("min_p"):
                kw["min_p"] = params["min_p"]
        else:
            kw.update(temperature=None, top_p=None, top_k=None)
        if params.get("repetition_penalty"):
            kw["repetition_penalty"] = params["repetition_penalty"]
        if params.get("min_new_tokens"):
            kw["min_new_tokens"] = params["min_new_tokens"]
        stops = params.get("stop")
        if stops:
            kw["stop_strings"] = [stops] if isinstance(stops, str) else list(stops)
            kw["tokenizer"] = self.tokenizer
        if params.get("ignore_eos"):
            kw["eos_token_id"] = None

        return kw

    def _left_padded(self, ids: list[list[int]]) -> dict:
        """input_ids and attention_mask of token id lists, left-padded (as tokenizer(..., padding=True))."""
        import torch

        width = max(map(len, ids))
        input_ids = torch.full((len(ids), width), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, seq in enumerate(ids):
            if seq:
                input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
                mask[row, width - len(seq) :] = 1
        return {"input_ids": input_ids.to(self.device), "attention_mask": mask.to(self.device)}

    def _generate_batch(self, batch: list[Request], ids: list[list[int]], enc: dict | None = None, on_finished=None) -> list[Completion]:
        """One ``generate`` call for the batch. ``on_finished(i, completion)``: called for each
        row as it finishes (its EOS or its limit) while the others go on, so a shard commits
        it without waiting for the batch (not with stop strings, which the text decides)."""
        import torch

        params = batch[0].sampling_params
        limits = [_max_new_tokens(r) for r in batch]
        kw = self._generation_kwargs(params, limits)
        enc = self._left_padded(ids) if enc is None else enc
        prompt_len = enc["input_ids"].shape[1]
        processors = []
        if any(r.json_schema is not None for r in batch):
            processors.append(self._grammar_processor(batch))
        if kw["do_sample"] and any(r.seed is not None for r in batch):
            processors.append(_seeded_sampler(kw, [r.seed for r in batch]))  # after the grammar's mask
        if processors:
            kw["logits_processor"] = processors
        prompt_tokens = [len(seq) for seq in ids]
        stops = kw.get("stop_strings") or []

        def completion(i: int, new_ids: list[int]) -> Completion:
            return self._completion(batch[i], new_ids, prompt_tokens[i], limits[i], params, stops)

        early = None
        if on_finished is not None and not stops and len(batch) > 1:
            eos = set() if params.get("ignore_eos") else self.eos_ids
            early = _early_rows(limits, prompt_len, eos, lambda i, new_ids: on_finished(i, completion(i, new_ids)))
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                **enc,
                **kw,
                stopping_criteria=_row_limits(limits, prompt_len, self._stopped, early),
                pad_token_id=self.tokenizer.pad_token_id,
            )
        if self._stopped.is_set():
            raise EngineStopped("engine was stopped during generation")
        self._cap.observe(len(batch), out.shape[1] - prompt_len, time.perf_counter() - started)
        self.info.details["batch_time"] = self._cap.details()
        return [completion(i, new_ids) for i, new_ids in enumerate(out[:, prompt_len:].tolist())]

    def _completion(self, req: Request, ids: list[int], n_prompt: int, limit: int, params: dict, stops: list[str]) -> Completion:
        """A row's completion from the tokens generated for it (padding after its end included)."""
        pad = self.tokenizer.pad_token_id
        n = min(len(ids), limit)
        for j, t in enumerate(ids[:n]):
            if t in self.eos_ids and not params.get("ignore_eos"):
                n = j + 1
                break
            if t == pad and pad not in self.eos_ids:  # padding after a stop string
                n = j
                break
        # A row ends before its limit only through its own EOS or stop string.
        finish = "length" if n >= limit else "stop"
        text = self.tokenizer.decode(ids[:n], skip_special_tokens=params.get("skip_special_tokens", True))
        cuts = [c for c in (text.find(s) for s in stops) if c >= 0]
        if cuts:
            text, finish = text[: min(cuts)], "stop"
        return Completion(req.id, text, int(n_prompt), n, finish)

    def _grammar_processor(self, batch: list[Request]):
        """A logits processor constraining each row with a schema to JSON valid against it.

        A response prefix (``Request.response_prefix``, which the prompt ends with) is part
        of the JSON: the grammar starts after it."""
        if self._grammar_compiler is None:
            import xgrammar

            vocab = self.model.get_output_embeddings().weight.shape[0]  # may exceed len(tokenizer) (padding)
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=vocab, stop_token_ids=sorted(self.eos_ids) or None)
            self._grammar_compiler = xgrammar.GrammarCompiler(info, max_threads=1)  # caches compiled schemas
            self.info.versions["xgrammar"] = _version("xgrammar")
        compile_schema = self._grammar_compiler.compile_json_schema
        grammars = [None if r.json_schema is None else compile_schema(r.json_schema, any_whitespace=False) for r in batch]
        return _grammar_logits_processor(grammars, [r.response_prefix for r in batch])


def _max_new_tokens(request: Request) -> int:
    return request.sampling_params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)


def _too_long(rid: int, n_prompt: int, max_new: int, context: int) -> Completion:
    return Completion(
        rid, "", n_prompt, 0, "abort", E.CONTEXT_LENGTH,
        f"prompt has {n_prompt} tokens; with max_new_tokens {max_new} it exceeds the model's context of {context}",
    )  # fmt: skip


def load_tokenizer(server_args: ServerArgs) -> tuple:
    """(the vision processor or None, the tokenizer) of the model at ``server_args.model_path``,
    as the engine uses them: what its chat template needs, without the weights (also the
    request cache's stand-in engine's, shard/cached_answers.py). A vision-language model's
    processor (images -> pixels, placeholders expanded) brings its tokenizer."""
    from transformers import AutoTokenizer

    path, trust = server_args.model_path, server_args.trust_remote_code
    processor = _vision_processor(path, trust)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust) if processor is None else processor.tokenizer
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processor, tokenizer


def _vision_processor(path: str, trust: bool):
    """The processor of a local vision-language model (config.json declares a vision tower), else None."""
    from mirageflow import model_config

    if not model_config.is_vision(path):
        return None
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust)
    if getattr(processor, "tokenizer", None) is None or getattr(processor, "image_processor", None) is None:
        raise ValueError(f"{path}: a vision model, but its processor ({type(processor).__name__}) has no tokenizer and image processor")
    return processor


def _run_images(engine: TransformersEngine, requests: list[Request]) -> list:
    """One batch of requests with images, through the model's processor: each prompt holds the
    model's placeholder once per image (else the row fails, ``image_placeholders``), the
    processor expands them into the image tokens and makes the pixel values, and the
    image-text-to-text model generates. ``image_tokens``: the placeholder tokens per row."""
    from mirageflow.prompts.images import placeholder_error

    processor = engine.processor
    if processor is None:
        return [
            Completion(
                r.id,
                "",
                0,
                0,
                "abort",
                E.IMAGE_UNSUPPORTED,
                f"{engine.server_args.model_path} is not a vision-language model (no vision tower in its config.json)",
            )
            for r in requests
        ]
    token = getattr(processor, "image_token", None)
    token_id = getattr(processor, "image_token_id", None)
    bos = engine.tokenizer.bos_token if engine._prompt_ids.bos is not None else None
    results: list = [None] * len(requests)
    texts = {}
    for i, r in enumerate(requests):
        problem = placeholder_error(r.prompt, token, len(r.images))
        if problem:
            results[i] = Completion(r.id, "", 0, 0, "abort", E.IMAGE_PLACEHOLDERS, problem)
            continue
        text = r.prompt
        while bos and text.startswith(bos):  # the processor's tokenizer adds it: one BOS
            text = text[len(bos) :]
        texts[i] = text

    def encode(rows):
        return processor(
            text=[texts[i] for i in rows], images=[[im.pil() for im in requests[i].images] for i in rows],
            return_tensors="pt", padding=True,
        )  # fmt: skip

    rows = list(texts)
    if rows:
        enc = encode(rows)
        lengths = enc["attention_mask"].sum(dim=1).tolist()
        too_long = set()
        for i, n in zip(rows, lengths):
            max_new = _max_new_tokens(requests[i])
            if engine.max_context and n + max_new > engine.max_context:
                too_long.add(i)
                results[i] = Completion(
                    requests[i].id, "", int(n), 0, "abort", E.CONTEXT_LENGTH,
                    f"prompt has {n} tokens with its images; with max_new_tokens {max_new} it exceeds the model's context of {engine.max_context}",
                )  # fmt: skip
        if too_long:
            rows = [i for i in rows if i not in too_long]
            enc = encode(rows) if rows else None
    if rows:
        mask = enc["attention_mask"].bool()
        ids = [seq[m].tolist() for seq, m in zip(enc["input_ids"], mask)]
        enc = {k: v.to(engine.device) for k, v in enc.items()}
        if "pixel_values" in enc:
            enc["pixel_values"] = enc["pixel_values"].to(engine.model.dtype)
        for i, seq, c in zip(rows, ids, engine._generate_batch([requests[i] for i in rows], ids, enc)):
            c.image_tokens = sum(1 for t in seq if t == token_id) if token_id is not None else None
            results[i] = c
    return results


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


_WARNED_PREFIXES: set[str] = set()


def _grammar_logits_processor(grammars: list, prefixes: list[str]):
    """Per-row xgrammar masking for one generate() call (rows without a grammar are free).

    As xgrammar.contrib.hf.LogitsProcessor, but rows may differ in grammar or have none,
    and a row that has ended (its limit, a stop string: generate feeds it padding) or whose
    grammar has terminated is left unmasked instead of failing an assertion.
    """
    import torch
    import xgrammar
    from transformers import LogitsProcessor

    class GrammarMasks(LogitsProcessor):
        def __init__(self):
            self.matchers = [None if g is None else xgrammar.GrammarMatcher(g) for g in grammars]
            for i, prefix in enumerate(prefixes):
                m = self.matchers[i]
                if m is not None and prefix and not m.accept_string(prefix):
                    # a prefix no answer valid against the schema starts with: unconstrained
                    # (the row then fails its schema, as before)
                    if prefix not in _WARNED_PREFIXES:
                        _WARNED_PREFIXES.add(prefix)
                        log.warning(
                            "response prefix %r does not start a JSON value of the schema; rows with it are not constrained", prefix
                        )
                    self.matchers[i] = None
            self.vocab = next(g for g in grammars if g is not None).tokenizer_info.vocab_size
            self.bitmask = xgrammar.allocate_token_bitmask(len(grammars), self.vocab)
            self.started = False

        def __call__(self, input_ids, scores):
            if self.started:  # accept the token each constrained row sampled last step
                last = input_ids[:, -1].tolist()
                for i, m in enumerate(self.matchers):
                    if m is not None and not m.is_terminated() and not m.accept_token(last[i]):
                        self.matchers[i] = None  # the row has ended (padding): no longer constrained
            self.started = True
            rows = []
            for i, m in enumerate(self.matchers):
                if m is not None and not m.is_terminated():
                    m.fill_next_token_bitmask(self.bitmask, i)
                    rows.append(i)
            if not rows:
                return scores
            device = scores.device
            masked = scores if device.type in ("cpu", "cuda") else scores.to("cpu")
            if masked.dtype != torch.float32 and device.type == "cpu":
                masked = masked.float()
            xgrammar.apply_token_bitmask_inplace(masked, self.bitmask.to(masked.device), vocab_size=self.vocab, indices=rows)
            return masked.to(device=device, dtype=scores.dtype)

    return GrammarMasks()


def _seeded_sampler(kw: dict, seeds: list[int | None]):
    """Sampling with one torch.Generator per row, seeded with the request's seed, so that a
    row samples the same tokens whatever else shares its batch (Request.seed).

    generate() samples every row from the global RNG; instead it decodes greedily here and
    this processor, last in the list, applies the warpers generate() would (transformers'
    own classes, in its order), draws each row's token from its own generator and leaves
    only that token possible. ``kw`` is switched to greedy decoding. A row without a seed
    gets a generator seeded from the global RNG (random, as without seeds).
    """
    import torch
    from transformers import LogitsProcessor
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    temperature, top_k, top_p, min_p = (kw.pop(k, None) for k in ("temperature", "top_k", "top_p", "min_p"))
    kw.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    warpers = []
    if temperature is not None and temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p is not None and top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p:
        warpers.append(MinPLogitsWarper(min_p))
    seeds = [int(torch.randint(0, 2**31, ())) if s is None else s for s in seeds]

    class SeededSampling(LogitsProcessor):
        def __init__(self):
            self.generators = None

        def __call__(self, input_ids, scores):
            if self.generators is None:  # on the logits' device
                self.generators = [torch.Generator(device=scores.device).manual_seed(s) for s in seeds]
            for w in warpers:
                scores = w(input_ids, scores)
            probs = torch.softmax(scores.float(), dim=-1)
            chosen = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(self.generators)])
            out = torch.full_like(scores, float("-inf"))
            out[torch.arange(len(seeds), device=scores.device), chosen] = 0.0
            return out

    return SeededSampling()


def _early_rows(limits: list[int], prompt_len: int, eos: set[int], finished):
    """Called after each decoding step with the batch's ids: ``finished(i, new_ids)`` once for
    each row that has just ended (its EOS, or its own limit) while others go on."""
    left = set(range(len(limits)))

    def step(input_ids) -> None:
        generated = input_ids.shape[1] - prompt_len
        last = input_ids[:, -1].tolist()
        done = [i for i in left if last[i] in eos or generated >= limits[i]]
        if len(done) == len(left):  # the batch ends here: its rows are handed back together
            left.clear()
            return
        for i in done:
            left.discard(i)
            finished(i, input_ids[i, prompt_len:].tolist())

    return step


def _row_limits(limits: list[int], prompt_len: int, stopped: threading.Event, each_step=None):
    """Ends each row at its own max_new_tokens, and every row once the engine is stopped;
    ``each_step(input_ids)``: called after every decoding step (``_early_rows``)."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class RowLimits(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            if stopped.is_set():
                return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
            if each_step is not None:
                each_step(input_ids)
            generated = input_ids.shape[1] - prompt_len
            return torch.tensor([generated >= n for n in limits], device=input_ids.device)

    return StoppingCriteriaList([RowLimits()])


def _resolve(future: asyncio.Future, result) -> None:
    if future.done():  # the waiter was cancelled (shutdown)
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
