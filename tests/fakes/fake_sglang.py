"""A stand-in for the ``sglang`` package, injected as ``sys.modules["sglang"]`` by tests.

It honours the real offline-engine API (checked against SGLang's
``python/sglang/srt/entrypoints/engine.py``):

- ``Engine(**server_args)``; ``engine.tokenizer_manager.tokenizer``; ``shutdown()``; a
  context manager.
- ``generate``/``async_generate(prompt=None, sampling_params=None, input_ids=None,
  image_data=None, ..., stream=False, rid=None)``: one prompt -> one dict, a list -> a
  list; ``{"text", "output_ids", "meta_info"}`` with ``meta_info`` = ``id``,
  ``finish_reason`` ({"type": "stop"|"length"|"abort", ...}), ``prompt_tokens``,
  ``completion_tokens``, ``cached_tokens``, ``e2e_latency``.
- Sampling params are checked like ``SamplingParams(**params)`` (unknown names raise
  TypeError); ``json_schema`` must be a string, and at most one of json_schema/regex/ebnf.
- The tokenizer manager binds its receive loop to the first event loop that generates;
  real SGLang then hangs on any other loop, this fake raises.
- Too-long input raises ValueError with SGLang's message.

Simulation: at most ``max_running_requests`` (default 4) requests run at once, the rest
queue; a request takes ``TOKEN_SECONDS`` per output token; output lengths vary with the
prompt. Magic words in a prompt: ``TOO_LONG`` (ValueError), ``ABORT`` (finish_reason
abort), ``CRASH`` (RuntimeError, as when the scheduler dies). ``model_path`` "fail-load"
fails the constructor; "no-tokenizer" leaves ``tokenizer_manager`` None.

Everything is recorded on the module (``ENGINES``) and each engine (``calls``,
``peak_in_flight``, ``peak_running``, ``shutdown_calls``).
"""

from __future__ import annotations

import asyncio
import itertools
import time

__version__ = "0.5.23+fake"

TOKEN_SECONDS = 0.0005
ENGINES: list["Engine"] = []
_SAMPLING_NAMES = {
    "max_new_tokens", "min_new_tokens", "stop", "stop_token_ids", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "ignore_eos", "skip_special_tokens",
    "spaces_between_special_tokens", "no_stop_trim", "n", "json_schema", "regex", "ebnf", "structural_tag",
    "custom_params", "stream_interval", "logit_bias", "sampling_seed",
}  # fmt: skip
_ids = itertools.count()


class FakeTokenizer:
    """Hugging Face's apply_chat_template signature; records every call."""

    def __init__(self):
        self.calls: list[dict] = []

    def apply_chat_template(
        self,
        conversation,
        tools=None,
        documents=None,
        chat_template=None,
        add_generation_prompt=False,
        continue_final_message=False,
        tokenize=True,
        padding=False,
        truncation=False,
        max_length=None,
        return_tensors=None,
        return_dict=False,
        return_assistant_tokens_mask=False,
        tokenizer_kwargs=None,
        **kwargs,
    ):
        self.calls.append(
            {"messages": conversation, "tokenize": tokenize, "add_generation_prompt": add_generation_prompt, "kwargs": kwargs}
        )
        if tokenize:
            return [ord(c) % 256 for c in str(conversation)]
        text = "".join(f"<|{m['role']}|>{m['content']}\n" for m in conversation)
        if kwargs.get("enable_thinking") is False:
            text += "<|no_think|>"
        return text + ("<|assistant|>" if add_generation_prompt else "")


class TokenizerManager:
    def __init__(self):
        self.tokenizer = FakeTokenizer()
        self.event_loop = None
        self.aborts: list[dict] = []

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self.aborts.append({"rid": rid, "abort_all": abort_all})

    def auto_create_handle_loop(self):
        loop = asyncio.get_running_loop()
        if self.event_loop is None:
            self.event_loop = loop
        elif self.event_loop is not loop:
            raise RuntimeError(
                "fake sglang: the tokenizer manager's handle loop is bound to another event loop "
                "(real SGLang would hang here)"
            )


class Engine:
    def __init__(self, **kwargs):
        if "model_path" not in kwargs:
            raise TypeError("ServerArgs.__init__() missing 1 required positional argument: 'model_path'")
        kwargs.setdefault("log_level", "error")  # as SGLang does
        self.server_args = kwargs
        self.capacity = int(kwargs.get("max_running_requests") or 4)
        self.calls: list[dict] = []
        self.in_flight = self.peak_in_flight = 0
        self.running = self.peak_running = 0
        self.shutdown_calls = 0
        self._slots: asyncio.Semaphore | None = None
        ENGINES.append(self)
        if kwargs["model_path"] == "fail-load":
            raise RuntimeError("fake sglang: failed to load the model")
        self.tokenizer_manager = None if kwargs["model_path"] == "no-tokenizer" else TokenizerManager()
        try:
            self.loop = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = asyncio.new_event_loop()

    def generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        image_data=None,
        audio_data=None,
        video_data=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        token_ids_logprob=None,
        lora_path=None,
        custom_logit_processor=None,
        return_hidden_states=False,
        stream=False,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        data_parallel_rank=None,
        rid=None,
    ):
        return self.loop.run_until_complete(
            self.async_generate(prompt=prompt, sampling_params=sampling_params, input_ids=input_ids, stream=stream, rid=rid)
        )

    async def async_generate(
        self,
        prompt=None,
        sampling_params=None,
        input_ids=None,
        image_data=None,
        audio_data=None,
        video_data=None,
        return_logprob=False,
        logprob_start_len=None,
        top_logprobs_num=None,
        token_ids_logprob=None,
        lora_path=None,
        custom_logit_processor=None,
        return_hidden_states=False,
        stream=False,
        bootstrap_host=None,
        bootstrap_port=None,
        bootstrap_room=None,
        data_parallel_rank=None,
        rid=None,
    ):
        if self.tokenizer_manager is None:
            raise RuntimeError("fake sglang: engine without a tokenizer manager")
        self.tokenizer_manager.auto_create_handle_loop()
        if stream:
            raise NotImplementedError("fake sglang: streaming is not simulated")
        if prompt is None:
            raise ValueError("fake sglang: text (prompt) or input_ids is required")
        single = isinstance(prompt, str)
        prompts = [prompt] if single else list(prompt)
        if isinstance(sampling_params, list):
            params = sampling_params
        else:
            params = [dict(sampling_params or {}) for _ in prompts]
        self.calls.append({"prompt": prompt, "sampling_params": sampling_params})
        outs = await asyncio.gather(*(self._one(p, sp) for p, sp in zip(prompts, params)))
        return outs[0] if single else list(outs)

    async def _one(self, prompt: str, params: dict) -> dict:
        unknown = set(params) - _SAMPLING_NAMES
        if unknown:
            raise TypeError(f"SamplingParams.__init__() got an unexpected keyword argument '{sorted(unknown)[0]}'")
        grammars = [k for k in ("json_schema", "regex", "ebnf") if params.get(k) is not None]
        if len(grammars) > 1:
            raise ValueError("Only one of regex, json_schema, or ebnf can be set.")
        if "json_schema" in params and not isinstance(params["json_schema"], str):
            raise TypeError(f"json_schema must be a JSON string, got {type(params['json_schema']).__name__}")
        n_prompt = len(prompt.split())
        if "TOO_LONG" in prompt:
            raise ValueError("The input (5000 tokens) is longer than the model's context length (2048 tokens).")
        if "CRASH" in prompt:
            raise RuntimeError("fake sglang: the scheduler process died")
        start = time.monotonic()
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.capacity)
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            async with self._slots:
                self.running += 1
                self.peak_running = max(self.peak_running, self.running)
                try:
                    limit = int(params.get("max_new_tokens", 128))
                    wanted = 1 + sum(map(ord, prompt)) % 17  # variable output lengths
                    n = min(limit, wanted)
                    await asyncio.sleep(TOKEN_SECONDS * n)
                finally:
                    self.running -= 1
        finally:
            self.in_flight -= 1
        meta = {
            "id": f"fake-{next(_ids)}",
            "prompt_tokens": n_prompt,
            "completion_tokens": n,
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - start,
        }
        if "ABORT" in prompt:
            meta.update(completion_tokens=0, finish_reason={"type": "abort", "message": "fake abort: request was aborted"})
            return {"text": "", "output_ids": [], "meta_info": meta}
        if "json_schema" in params:
            text = '{"answer": "fake"}'
        else:
            text = " ".join(f"w{i}" for i in range(n))
        meta["finish_reason"] = {"type": "length", "length": n} if n >= limit else {"type": "stop", "matched": 2}
        return {"text": text, "output_ids": list(range(n)), "meta_info": meta}

    def shutdown(self):
        self.shutdown_calls += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
        return False
