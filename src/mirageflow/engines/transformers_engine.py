"""Hugging Face transformers engine: the CPU default (and a simple CUDA fallback).

Requests are grouped by sampling parameters, sorted by prompt length (less padding) and
generated in left-padded batches of ``batch_size``.
"""

from __future__ import annotations

import json
import logging
import os
from itertools import groupby
from typing import Iterable, Iterator

from mirageflow.engines.base import Completion, Engine, EngineInfo, Request

log = logging.getLogger(__name__)

# Sampling params this engine honours; SGLang-only ones are reported once and ignored.
_SUPPORTED = {
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "min_p",
    "repetition_penalty", "stop", "ignore_eos", "skip_special_tokens",
}  # fmt: skip
_ENGINE_ARGS = {"dtype", "attn_implementation"}


def default_threads(requested: int | None) -> int:
    if requested:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    # Small models on 2-core machines run ~10x slower, and erratically, with 2 threads.
    return 1 if cpus <= 2 else cpus


class TransformersEngine(Engine):
    def __init__(self, server_args: dict, batch_size: int = 32, torch_threads: int | None = None):
        self.server_args = server_args
        self.batch_size = batch_size
        self.threads = default_threads(torch_threads)
        self.model = self.tokenizer = None
        self._warned: set[str] = set()
        self.info = EngineInfo(backend="transformers", model_path=server_args["model_path"])

    def load(self) -> None:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(self.threads)
        extra = dict(self.server_args.get("extra_engine_args") or {})
        ignored = sorted(set(extra) - _ENGINE_ARGS)
        if ignored:
            log.info("transformers engine ignores extra_engine_args %s (SGLang options)", ignored)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        # bf16 on GPU; float32 on CPU, where bf16 matmuls are slow without AMX.
        dtype = extra.get("dtype") or ("bfloat16" if device == "cuda" else "float32")
        path = self.server_args["model_path"]
        trust = self.server_args.get("trust_remote_code", True)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
        self.tokenizer.padding_side = "left"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        kwargs = {"dtype": getattr(torch, dtype), "trust_remote_code": trust}
        if "attn_implementation" in extra:
            kwargs["attn_implementation"] = extra["attn_implementation"]
        self.model = AutoModelForCausalLM.from_pretrained(path, **kwargs).to(device).eval()
        self.device = device
        self.max_context = getattr(self.model.config, "max_position_embeddings", None)
        self.eos_ids = self._eos_ids()
        self.info = EngineInfo(
            backend="transformers",
            model_path=path,
            versions={"transformers": transformers.__version__, "torch": torch.__version__},
            device=torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
            details={"dtype": dtype, "torch_threads": self.threads, "batch_size": self.batch_size},
        )

    def _eos_ids(self) -> set[int]:
        ids = self.model.generation_config.eos_token_id
        ids = set(ids if isinstance(ids, list) else [ids] if ids is not None else [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def chat_prompt(self, messages, chat_template_kwargs) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **chat_template_kwargs
        )

    def _generation_kwargs(self, params: dict) -> dict:
        for name in sorted(set(params) - _SUPPORTED - self._warned):
            log.warning("sampling param %r is not supported by the transformers engine; ignored", name)
            self._warned.add(name)
        temperature = params.get("temperature", 1.0)  # SGLang's default
        kw = {"max_new_tokens": params.get("max_new_tokens", 128), "do_sample": temperature > 0}
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

    def generate(self, requests: Iterable[Request]) -> Iterator[Completion]:
        key = lambda r: json.dumps(r.sampling_params, sort_keys=True)  # noqa: E731
        for _, group in groupby(sorted(requests, key=key), key=key):
            group = list(group)
            prompts = [r.prompt for r in group]
            lengths = [len(ids) for ids in self.tokenizer(prompts, add_special_tokens=False)["input_ids"]]
            order = sorted(range(len(group)), key=lambda i: lengths[i])
            params = group[0].sampling_params
            max_new = params.get("max_new_tokens", 128)
            runnable = []
            for i in order:
                if self.max_context and lengths[i] + max_new > self.max_context:
                    yield Completion(
                        group[i].id, "", lengths[i], 0, "abort", "context_length",
                        f"prompt has {lengths[i]} tokens; with max_new_tokens {max_new} it exceeds the model's context of {self.max_context}",
                    )  # fmt: skip
                else:
                    runnable.append(i)
            for b in range(0, len(runnable), self.batch_size):
                batch = [group[i] for i in runnable[b : b + self.batch_size]]
                yield from self._generate_batch(batch, params)

    def _generate_batch(self, batch: list[Request], params: dict) -> list[Completion]:
        import torch

        kw = self._generation_kwargs(params)
        enc = self.tokenizer([r.prompt for r in batch], return_tensors="pt", padding=True, add_special_tokens=False)
        enc = {k: v.to(self.device) for k, v in enc.items()}
        with torch.inference_mode():
            out = self.model.generate(**enc, **kw, pad_token_id=self.tokenizer.pad_token_id)
        new = out[:, enc["input_ids"].shape[1] :].tolist()
        prompt_tokens = enc["attention_mask"].sum(dim=1).tolist()
        stops = kw.get("stop_strings") or []
        skip = params.get("skip_special_tokens", True)
        pad = self.tokenizer.pad_token_id
        results = []
        for req, ids, n_prompt in zip(batch, new, prompt_tokens):
            n = len(ids)
            for j, t in enumerate(ids):
                if t in self.eos_ids and not params.get("ignore_eos"):
                    n = j + 1
                    break
                if t == pad and pad not in self.eos_ids:  # padding after a stop string
                    n = j
                    break
            # A sequence ends early only through its own EOS or stop string.
            finish = "length" if n >= kw["max_new_tokens"] else "stop"
            text = self.tokenizer.decode(ids[:n], skip_special_tokens=skip)
            cuts = [c for c in (text.find(s) for s in stops) if c >= 0]
            if cuts:
                text, finish = text[: min(cuts)], "stop"
            results.append(Completion(req.id, text, int(n_prompt), n, finish))
        return results
