"""Any OpenAI-compatible endpoint (``backend: openai``): SGLang, vLLM, a hosted API.

``POST {base_url}/chat/completions`` with the request's chat messages: the server applies
the chat template (``templates_server_side = True``; the runner sends messages, and
``chat_template_kwargs`` travel in the body). With ``apply_chat_template: false`` the
prompt goes to ``POST {base_url}/completions`` as is.

- Model: ``processors[].model``, else ``server_args.model_path``.
- API key: read at load from the environment variable named by ``api_key_env`` and sent
  as ``Authorization: Bearer``; never logged or recorded. Load fails if it is unset.
- Sampling params keep SGLang's names except ``max_new_tokens`` -> ``max_tokens`` and
  ``min_new_tokens`` -> ``min_tokens``; the others (top_k, min_p, repetition_penalty,
  ignore_eos, ...) are passed as the extra fields SGLang and vLLM accept.
- A response prefix (``Request.response_prefix``) is sent as a last assistant message to
  continue: the body then carries ``continue_final_message: true, add_generation_prompt:
  false`` (so does a last assistant message of the prompt itself).
- Image inputs: the user turn's content parts, each image as ``{"type": "image_url",
  "image_url": {"url": "data:image/png;base64,..."}}`` where the prompt placed it.
- JSON outputs: ``response_format: {"type": "json_schema", "json_schema": {"name": "output",
  "schema": ...}}``; not with a response prefix: a server applies that grammar from the
  start of what it generates, so the continuation of ``{"answer": `` would have to be a
  whole object again and every answer would fail. After a prefix the answer is unconstrained
  and checked against the schema like any other (the SGLang backends send the grammar of
  the continuation instead: engines/json_prefix.py; the OpenAI API has no portable field
  for it).
- BOS: the server applies the template and tokenizes it without special tokens (SGLang
  and vLLM do, as ``apply_chat_template(tokenize=True)``), so a template's BOS is not doubled.
- ``message.reasoning`` (vLLM) or ``message.reasoning_content`` (SGLang), a server's
  reasoning parser's output, becomes ``Completion.reasoning``, never part of the answer.
- Several samples of a row (n_samples, ``native_n``): one request with ``n`` and the first
  sample's seed; choice i is sample i. Prompt tokens are booked once (the server read the
  prompt once), the completion tokens of ``usage`` shared out over the choices by the
  length of their text (exact in total, estimated per sample: the API gives no per-choice
  count). A server that answers with other than n choices fails the shard (it has no ``n``).
- Tokens from ``usage``; finish reasons stop/length pass through, content_filter and abort
  become ``abort``, anything else (tool_calls, ...) ``stop``.
- Connection errors, timeouts (``request_timeout`` per attempt: a deadline for the whole
  answer, not per read), 429, 5xx and a 2xx whose body is not JSON are retried with
  exponential backoff and jitter (Retry-After honoured) up to ``max_retries`` times, then the
  request fails with EngineError naming the URL (the shard fails: the endpoint is
  unusable). 401, 403 and 404 fail at once the same way; other 4xx answers fail only their row.
- Transport: transport/http_client.py (keep-alive HTTP/1.1, orjson), with the environment's
  proxies (HTTP(S)_PROXY, NO_PROXY). ``base_url`` may carry a query string (kept on every
  request) and userinfo (Basic auth when no ``api_key_env``); messages and status files
  show it with the password and query values masked.
- ``max_inflight``: 64 requests at once, or ``processors[].max_concurrency`` (MMIRAGE's
  api_llm; ``shard_params.max_inflight`` overrides either); ``retry_base_delay`` sets the
  first retry's delay.
- Pace: ``processors[].max_requests_per_minute`` and ``max_tokens_per_minute`` (input +
  output), shared by the run's shards through ``rate_limit_file`` (the runner sets it), and
  the provider's rate-limit headers and Retry-After: transport/rate_limit.py. A request's
  tokens before it is sent: its text's characters / 4 (images: nothing) plus
  ``max_new_tokens`` per choice, or without it the mean output of the answers so far;
  the answer's ``usage`` corrects it.
"""

from __future__ import annotations

import json
import logging
import os

from mirageflow.config.types import ApiOptions, ProcessorConfig
from mirageflow.engines.wire import BadAnswer, Completion, EngineInfo, Request, prompt_chars, usage_counts
from mirageflow.stats.pricing import cached_prompt_tokens
from mirageflow.errors import RowErrorClass as E
from mirageflow.prompts.images import openai_messages
from mirageflow.engines.http import FATAL_STATUS, EngineError, error_message, post_with_retries, rejected
from mirageflow.transport.http_client import HTTPClient, display_url
from mirageflow.transport.rate_limit import RateLimiter, RateLimits, estimate_tokens
from mirageflow.engines.loop import LoopEngine

log = logging.getLogger(__name__)

DEFAULT_MAX_INFLIGHT = 64
_RENAMED = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_FINISH = {"stop": "stop", "length": "length", "content_filter": "abort", "abort": "abort"}


def openai_params(params: dict) -> dict:
    return {_RENAMED.get(k, k): v for k, v in params.items()}


def split_tokens(total: int, weights: list[int]) -> list[int]:
    """``total`` in parts proportional to ``weights`` (largest remainder): the parts add up to it."""
    if len(weights) == 1:
        return [total]
    weight = sum(weights)
    if weight == 0:
        weights, weight = [1] * len(weights), len(weights)
    parts = [total * w // weight for w in weights]
    by_remainder = sorted(range(len(weights)), key=lambda i: -(total * weights[i] % weight))
    for i in by_remainder[: total - sum(parts)]:
        parts[i] += 1
    return parts


def finish_reason(value) -> str:
    return _FINISH.get(value, "stop") if value is not None else "stop"


class OpenAIEngine(LoopEngine):
    templates_server_side = True  # the runner sends Request.messages; chat_prompt is not used
    native_n = True  # one request with n (native_samples: unless processors[].native_n is false)
    loads_model = False  # the server at base_url has the model; model_path is its name
    provider_api = True  # priced per token unless base_url is self-hosted (stats/pricing.py)
    needs_base_url = True
    retry_base_delay = 0.5
    retry_max_delay = 30.0

    def __init__(self, processor: ProcessorConfig, batch_size: int = 32, log_dir=None):
        super().__init__()
        self.processor = processor
        self.base_url = (processor.base_url or "").rstrip("/")
        self.shown_url = display_url(self.base_url)  # what messages and status files show
        self.model = processor.model or processor.server_args.model_path
        # processors[].max_concurrency (MMIRAGE's api_llm) and retry_base_delay, when set; no api group (the
        # client of an explicit vllm_server): the engine's own
        self.api = processor.api or ApiOptions()
        self.max_inflight = self.api.max_concurrency or DEFAULT_MAX_INFLIGHT
        if self.api.retry_base_delay is not None:
            self.retry_base_delay = self.api.retry_base_delay
        self._client: HTTPClient | None = None
        self._limiter: RateLimiter | None = None
        self._output_seen = [0, 0]  # (completion tokens, choices) answered: the estimate without max_new_tokens
        # awaited after a connection error, before a retry; may raise instead (a launcher's: its server died)
        self.on_transport_error = None
        self._whats: dict[str, str] = {}
        self._warned_usage = False
        self.info = EngineInfo(backend="openai", model_path=self.model)

    def load(self) -> None:
        if not self.base_url:
            raise EngineError("backend openai needs processors[].base_url (e.g. http://host:30000/v1)")
        credentials = {}  # sent to base_url's origin only; they take precedence over its userinfo
        name = self.processor.api_key_env
        if name:
            key = os.environ.get(name)
            if not key:
                raise EngineError(
                    f"backend openai: the environment variable {name} (processors[].api_key_env) is "
                    "not set or empty; export the API key in it before running"
                )
            credentials["Authorization"] = f"Bearer {key}"
        try:  # requests run in the caller's loop (LoopEngine._on_caller_loop), at most max_inflight at once
            self._client = HTTPClient(
                self.base_url, credentials=credentials, max_connections=self.max_inflight, timeout=float(self.processor.request_timeout)
            )
        except ValueError as e:
            raise EngineError(f"backend openai: processors[].base_url: {e}") from None
        limits = RateLimits(self.api.max_requests_per_minute, self.api.max_tokens_per_minute)
        # configured limits are the run's (a file its shards share); headers alone pace this shard
        shared = self.rate_limit_file if any(limits) else None
        self._limiter = RateLimiter(limits, shared, what=f"backend openai at {self.shown_url}")
        self.info = EngineInfo(
            backend="openai",
            model_path=self.model,
            versions=_versions(),
            device="remote",
            details={
                "base_url": self.shown_url,
                "api_key_env": name,
                "max_inflight": self.max_inflight,
                "max_retries": self.processor.max_retries,
                "request_timeout": self.processor.request_timeout,
                "rate_limits": self._limiter.details(),
            },
        )

    def chat_prompt(self, messages, chat_template_kwargs) -> str:
        """Not used for templating (the server applies its template); a readable rendering only."""
        return json.dumps(messages, ensure_ascii=False)

    def request_body(self, request: Request) -> tuple[str, dict]:
        body = {"model": self.model, **openai_params(request.sampling_params)}
        if request.seed is not None:  # OpenAI's per-request seed (vLLM and SGLang honour it)
            body["seed"] = request.seed
        if self.processor.apply_chat_template:
            if request.messages is None:
                raise ValueError("the openai engine needs chat messages (the server applies the chat template)")
            path = "/chat/completions"
            # image parts travel as {"type": "image_url", "image_url": {"url": "data:..."}}
            body["messages"] = openai_messages(request.messages, request.images) if request.images else request.messages
            if request.response_prefix:
                body["messages"] = [*body["messages"], {"role": "assistant", "content": request.response_prefix}]
            if body["messages"] and body["messages"][-1].get("role") == "assistant":
                # a response prefix: the model continues that message (vLLM/SGLang extension)
                body.update(continue_final_message=True, add_generation_prompt=False)
            if self.processor.chat_template_kwargs:
                body["chat_template_kwargs"] = dict(self.processor.chat_template_kwargs)
        else:
            path = "/completions"
            body["prompt"] = request.prompt if request.prompt is not None else request.messages[-1]["content"]
        if request.json_schema is not None and not request.response_prefix:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": json.loads(request.json_schema)},
            }
        return path, body

    @property
    def native_samples(self) -> bool:
        """One request with ``n`` for a row's samples (processors[].native_n; on unless false)."""
        return self.processor.native_n is not False

    async def generate_samples(self, request: Request, n: int) -> list[Completion]:
        if n == 1 or not self.native_samples:
            return await super().generate_samples(request, n)
        return await self._on_caller_loop(self._generate_n, request, n)

    async def generate_one(self, request: Request) -> Completion:
        return (await self._on_caller_loop(self._generate_n, request, 1))[0]

    async def _generate_n(self, request: Request, n: int) -> list[Completion]:
        """The request's n choices as Completions with ids request.id .. request.id + n - 1."""
        path, body = self.request_body(request)
        if n > 1:
            body["n"] = n
        estimate = self._estimate(request, n)
        client = self._client
        if client is None:
            raise RuntimeError("OpenAIEngine: load() was not called, or the engine is closed")
        response = await post_with_retries(
            client,
            path,
            body,
            max_retries=int(self.processor.max_retries),
            timeout=float(self.processor.request_timeout),
            base_delay=self.retry_base_delay,
            max_delay=self.retry_max_delay,
            what=self._what(client, path),
            limiter=self._limiter,
            tokens=sum(estimate),
            on_transport_error=self.on_transport_error,
            spend=self.spend_ledger,
            cost_estimate=self.spend_ledger.price.cost(*estimate) if self.spend_ledger is not None else 0.0,
        )
        if not 200 <= response.status_code < 300:
            message = f"{client.url(path)} answered HTTP {response.status_code}: {error_message(response.content)}"
            if response.status_code in FATAL_STATUS:
                raise EngineError(message)
            return [rejected(request.id + k, message, E.ABORTED if response.status_code >= 500 else E.INVALID_REQUEST) for k in range(n)]
        data = response.json()  # decoded by post_with_retries
        if not isinstance(data, dict):
            raise EngineError(f"{client.url(path)} answered JSON that is not an object: {response.text[:200]!r}")
        choices = data.get("choices") or [{}]
        if n > 1:  # choice i is sample i: exactly the indexes 0..n-1, each once
            indexes = [c.get("index") if isinstance(c, dict) else None for c in choices]
            if sorted(indexes, key=repr) != sorted(range(n), key=repr):
                raise EngineError(
                    f"{client.url(path)} answered a request with n={n} with choice indexes "
                    f"{indexes[:20]}, not 0..{n - 1} once each: the server does not support n; "
                    "set processors[].native_n: false"
                )
            choices = sorted(choices, key=lambda c: c["index"])
        answers = [self._answer(choice, path) for choice in choices[:n]]
        usage = data.get("usage")
        if not usage and not self._warned_usage:
            self._warned_usage = True
            log.warning("%s reports no usage; token counts will be 0", self.shown_url)
        try:
            prompt_tokens, completion_tokens = usage_counts(usage, "prompt_tokens", "completion_tokens")
        except BadAnswer as e:  # this request's rows fail, the shard goes on
            message = f"{client.url(path)} answered {e}"
            return [Completion(request.id + k, "", 0, 0, "abort", E.BAD_ANSWER, message) for k in range(n)]
        self._output_seen[0] += completion_tokens
        self._output_seen[1] += n
        # usage covers the request: the prompt was read once, and the choices' tokens are
        # shared out by the length of their text (exact in total, estimated per sample)
        generated = split_tokens(completion_tokens, [len(text) + len(reasoning or "") for text, reasoning, _ in answers])
        completions = []
        for k, ((text, reasoning, reason), tokens) in enumerate(zip(answers, generated)):
            completion = Completion(
                request.id + k, text, prompt_tokens if k == 0 else 0, tokens, finish_reason(reason), reasoning=reasoning
            )  # fmt: skip
            if k == 0:
                completion.cached_tokens = cached_prompt_tokens(usage)
            if completion.finish_reason == "abort":
                completion.error_kind = E.ABORTED
                completion.error = f"the server ended the request with finish_reason {reason!r}"
            completions.append(completion)
        return completions

    def _estimate(self, request: Request, n: int) -> tuple[int, int]:
        """The request's (input, output) tokens before it is sent (the limiter's and the budget's estimate)."""
        chars = prompt_chars(request, messages=bool(self.processor.apply_chat_template))
        limit = request.sampling_params.get("max_new_tokens")
        if isinstance(limit, int) and limit > 0:
            output = limit
        else:  # no limit given: what answers so far averaged
            output = self._output_seen[0] // self._output_seen[1] if self._output_seen[1] else 0
        return estimate_tokens(chars, 0), output * n

    def _what(self, client: HTTPClient, path: str) -> str:
        """``POST <url>`` for messages (the URL with its secrets masked), made once per path."""
        what = self._whats.get(path)
        if what is None:
            what = self._whats[path] = f"POST {client.url(path)}"
        return what

    @staticmethod
    def _answer(choice: dict, path: str) -> tuple[str, str | None, str | None]:
        """(text, reasoning, finish_reason) of one choice."""
        if path == "/chat/completions":
            message = choice.get("message") or {}
            # a server's reasoning parser puts thinking here: `reasoning` (vLLM >= 0.10; the
            # only field of vLLM 0.32) or `reasoning_content` (SGLang, older vLLM)
            reasoning = message.get("reasoning") or message.get("reasoning_content") or None
            return message.get("content") or "", reasoning, choice.get("finish_reason")
        return choice.get("text") or "", None, choice.get("finish_reason")

    def close(self) -> None:
        self._close_client_and_loop()
        if self._limiter is not None:
            self._limiter.close()
        if self.spend_ledger is not None:
            self.spend_ledger.close()


def _versions() -> dict[str, str]:
    from importlib import metadata

    try:
        return {"orjson": metadata.version("orjson")}
    except metadata.PackageNotFoundError:  # pragma: no cover - pinned; the stdlib json then
        return {}
