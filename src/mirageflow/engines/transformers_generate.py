"""The transformers engine's generation: one ``generate`` call for a batch of requests that
share their sampling parameters (the static path; transformers_static.py forms the batches).

Requests with different ``max_new_tokens`` share a batch: a per-row stopping criterion ends
each at its own limit. A row that ends (its EOS, or its limit) while others of its batch go
on is handed back at once (``_early_rows``, checked after each decoding step), so the shard
commits it, the live line moves and a stop loses only the rows still generating; rows with
stop strings, which the decoded text decides, come back with their batch. A request with a
seed (``Request.seed``: n_samples, or ``sampling_params.seed``) samples from its own
generator, so a rerun gives the same text whatever else shares its batch.

JSON outputs (``Request.json_schema``) are constrained as SGLang constrains them: with an
xgrammar grammar compiled from the schema, applied as a per-row token bitmask on the
logits, so rows with different schemas (or none) share a batch. xgrammar is imported only
when the first such request arrives. Whitespace is not free: the JSON is laid out as
``json.dumps`` does (xgrammar's ``any_whitespace=False``), since small models otherwise
loop on whitespace until the length limit.
"""

from __future__ import annotations

import logging
import threading
import time

from mirageflow.engines.base import EngineStopped
from mirageflow.engines.wire import Completion, Request
from mirageflow.errors import RowErrorClass as E

log = logging.getLogger(__name__)

# Sampling params this engine honours; SGLang-only ones are reported once and ignored.
_SUPPORTED = {
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "stop", "ignore_eos", "skip_special_tokens",
}  # fmt: skip
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default


class BatchGenerator:
    """Runs batches on ``engine``'s model (read at each call: a reload replaces it)."""

    def __init__(self, engine):
        self.engine = engine
        self._warned: set[str] = set()
        self._grammar_compiler = None  # xgrammar, built at the first JSON request

    def run(self, requests: list[Request], hand_back=None) -> list:
        """The completions of a batch (a row too long for the context fails alone);
        ``hand_back(i, completion)``, when given, gets each row that finishes before the batch
        does, as it finishes."""
        if requests[0].images:
            return run_images(self, requests)
        # tokenized once: these ids are checked against the context and padded for generate()
        ids = self.engine._prompt_ids.batch([r.prompt for r in requests])
        results: list = [None] * len(requests)
        runnable = []
        for i, (r, prompt_ids) in enumerate(zip(requests, ids)):
            max_new = max_new_tokens(r)
            if self.engine.max_context and len(prompt_ids) + max_new > self.engine.max_context:
                results[i] = too_long(r.id, len(prompt_ids), max_new, self.engine.max_context)
            else:
                runnable.append(i)
        if runnable:
            early = None if hand_back is None else lambda j, c: hand_back(runnable[j], c)
            for i, c in zip(runnable, self.generate_batch([requests[i] for i in runnable], [ids[i] for i in runnable], on_finished=early)):
                results[i] = c
        return results

    def warn_unsupported(self, params: dict) -> None:
        for name in sorted(set(params) - _SUPPORTED - self._warned):
            log.warning("sampling param %r is not supported by the transformers engine; ignored", name)
            self._warned.add(name)

    def _generation_kwargs(self, params: dict, limits: list[int]) -> dict:
        self.warn_unsupported(params)
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
            kw["tokenizer"] = self.engine.tokenizer
        if params.get("ignore_eos"):
            kw["eos_token_id"] = None

        return kw

    def _left_padded(self, ids: list[list[int]]) -> dict:
        """input_ids and attention_mask of token id lists, left-padded (as tokenizer(..., padding=True))."""
        import torch

        width = max(map(len, ids))
        input_ids = torch.full((len(ids), width), self.engine.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, seq in enumerate(ids):
            if seq:
                input_ids[row, width - len(seq) :] = torch.tensor(seq, dtype=torch.long)
                mask[row, width - len(seq) :] = 1
        return {"input_ids": input_ids.to(self.engine.device), "attention_mask": mask.to(self.engine.device)}

    def generate_batch(self, batch: list[Request], ids: list[list[int]], enc: dict | None = None, on_finished=None) -> list[Completion]:
        """One ``generate`` call for the batch. ``on_finished(i, completion)``: called for each
        row as it finishes (its EOS or its limit) while the others go on, so a shard commits
        it without waiting for the batch (not with stop strings, which the text decides)."""
        import torch

        params = batch[0].sampling_params
        limits = [max_new_tokens(r) for r in batch]
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
            eos = set() if params.get("ignore_eos") else self.engine.eos_ids
            early = _early_rows(limits, prompt_len, eos, lambda i, new_ids: on_finished(i, completion(i, new_ids)))
        started = time.perf_counter()
        with torch.inference_mode():
            out = self.engine.model.generate(
                **enc,
                **kw,
                stopping_criteria=_row_limits(limits, prompt_len, self.engine.stopped, early),
                pad_token_id=self.engine.tokenizer.pad_token_id,
            )
        if self.engine.stopped.is_set():
            raise EngineStopped("engine was stopped during generation")
        self.engine.cap.observe(len(batch), out.shape[1] - prompt_len, time.perf_counter() - started)
        self.engine.info.details["batch_time"] = self.engine.cap.details()
        return [completion(i, new_ids) for i, new_ids in enumerate(out[:, prompt_len:].tolist())]

    def _completion(self, req: Request, ids: list[int], n_prompt: int, limit: int, params: dict, stops: list[str]) -> Completion:
        """A row's completion from the tokens generated for it (padding after its end included)."""
        pad = self.engine.tokenizer.pad_token_id
        n = min(len(ids), limit)
        for j, t in enumerate(ids[:n]):
            if t in self.engine.eos_ids and not params.get("ignore_eos"):
                n = j + 1
                break
            if t == pad and pad not in self.engine.eos_ids:  # padding after a stop string
                n = j
                break
        # A row ends before its limit only through its own EOS or stop string.
        finish = "length" if n >= limit else "stop"
        text = self.engine.tokenizer.decode(ids[:n], skip_special_tokens=params.get("skip_special_tokens", True))
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

            vocab = self.engine.model.get_output_embeddings().weight.shape[0]  # may exceed len(tokenizer) (padding)
            info = xgrammar.TokenizerInfo.from_huggingface(
                self.engine.tokenizer, vocab_size=vocab, stop_token_ids=sorted(self.engine.eos_ids) or None
            )
            self._grammar_compiler = xgrammar.GrammarCompiler(info, max_threads=1)  # caches compiled schemas
            self.engine.info.versions["xgrammar"] = _version("xgrammar")
        compile_schema = self._grammar_compiler.compile_json_schema
        grammars = [None if r.json_schema is None else compile_schema(r.json_schema, any_whitespace=False) for r in batch]
        return _grammar_logits_processor(grammars, [r.response_prefix for r in batch])


def max_new_tokens(request: Request) -> int:
    return request.sampling_params.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)


def too_long(rid: int, n_prompt: int, max_new: int, context: int) -> Completion:
    return Completion(
        rid, "", n_prompt, 0, "abort", E.CONTEXT_LENGTH,
        f"prompt has {n_prompt} tokens; with max_new_tokens {max_new} it exceeds the model's context of {context}",
    )  # fmt: skip


def run_images(generator: BatchGenerator, requests: list[Request]) -> list:
    """One batch of requests with images, through the model's processor: each prompt holds the
    model's placeholder once per image (else the row fails, ``image_placeholders``), the
    processor expands them into the image tokens and makes the pixel values, and the
    image-text-to-text model generates. ``image_tokens``: the placeholder tokens per row."""
    from mirageflow.prompts.images import placeholder_error

    engine = generator.engine
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
            max_new = max_new_tokens(requests[i])
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
        for i, seq, c in zip(rows, ids, generator.generate_batch([requests[i] for i in rows], ids, enc)):
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
