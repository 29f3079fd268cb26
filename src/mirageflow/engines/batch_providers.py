"""The providers' batch APIs on the wire (not an engine): OpenAI Batch and Anthropic Message Batches.

``BatchApiEngine`` (engines/batch_api.py) decides when to submit and whom to answer; a
``Provider`` here knows one API: the JSON line of a request, how a batch is created,
polled, cancelled and found again, and what each result line means.

- **OpenAI** (https://platform.openai.com/docs/guides/batch): the requests are a JSONL file
  ``{"custom_id", "method": "POST", "url": "/v1/chat/completions", "body"}`` uploaded with
  ``POST {base}/files`` (multipart, ``purpose=batch``), then ``POST {base}/batches``
  ``{input_file_id, endpoint, completion_window, metadata}``; ``GET {base}/batches/{id}``
  until ``status`` is completed, failed, expired or cancelled; the results are the lines
  of ``output_file_id`` and ``error_file_id`` (``GET {base}/files/{id}/content``). Our
  ``metadata.mirageflow_chunk`` finds a batch again (``GET {base}/batches``) when the shard
  died between creating it and recording its id.
- **Anthropic** (https://docs.anthropic.com/en/docs/build-with-claude/batch-processing):
  ``POST {base}/v1/messages/batches`` ``{"requests": [{"custom_id", "params"}]}``;
  ``GET {base}/v1/messages/batches/{id}`` until ``processing_status`` is ended; the results
  are the JSONL at ``results_url``, one line per request with ``result.type`` succeeded,
  errored, canceled or expired.

Row-error classes of a request's result (``Outcome.completion.error_kind``):
``context_length`` (the prompt does not fit the model), ``content_filter`` (the provider's
content policy refused the prompt or cut the answer), ``invalid_request`` (any other 4xx of
that request), ``request_too_large`` (Anthropic's request_too_large), ``rate_limited``
(429 / rate_limit_error inside a batch), ``provider_error`` (5xx, overloaded_error,
api_error, an unknown code), ``batch_rejected`` (OpenAI refused the whole input file: its
status failed), ``batch_expired`` / ``batch_cancelled`` (a request the batch did not run
before it expired or was cancelled, also after one resubmission). A result that says
expired or cancelled is ``Outcome.retry`` first: the engine resubmits it once.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mirageflow.config.types import BatchSettings, ProcessorConfig
from mirageflow.engines.base import EngineError
from mirageflow.engines.http import is_context_length_error
from mirageflow.engines.wire import Completion, Request, usage_counts
from mirageflow.errors import MirageflowError, RowErrorClass as E
from mirageflow.prompts.images import openai_messages
from mirageflow.redact import redact_text
from mirageflow.transport.fetch import get_url
from mirageflow.transport.http_client import TransportError, dumps, multipart_form
from mirageflow.transport.retry import PermanentStatus, RetryPolicy, error_message, send_with_retries, with_retries

log = logging.getLogger(__name__)

ANTHROPIC_VERSION = "2023-06-01"
CALL_MAX_DELAY_SECONDS = 60.0
RESULTS_MAX_BYTES = 4 * 1024**3  # a batch's results (OpenAI: up to 50,000 answers) are read whole
DEFAULT_BASE_URL = {"openai": "https://api.openai.com/v1", "anthropic": "https://api.anthropic.com"}
BASE_URL_ENV = {"openai": "OPENAI_BASE_URL", "anthropic": "ANTHROPIC_BASE_URL"}
# Anthropic's custom_id: ^[a-zA-Z0-9_-]{1,64}$ (ours are u<unit>-<16 hex>)
_ANTHROPIC_MEDIA = {"image/jpeg", "image/png", "image/gif", "image/webp"}


@dataclass
class BatchState:
    """What a status poll says."""

    status: str  # the provider's word
    ended: bool
    raw: dict


@dataclass
class Outcome:
    """One result line: a Completion (an answer, or a row error in ``error_kind``), or
    ``retry`` (expired / cancelled before it ran: worth one resubmission)."""

    custom_id: str
    completion: Completion | None = None
    retry: str | None = None  # "expired" | "cancelled"


class ProviderRefused(MirageflowError):
    """The provider refused a submission for what it holds (a 4xx other than 401/403/404):
    the rows of that chunk fail as batch_rejected; the shard goes on."""


class PermanentAnswer(EngineError):
    """The provider answered 401, 403 or 404 (transport/retry.py ``PERMANENT_STATUS``): the
    same on every try, so never retried; the engine fails the shard saying what to do."""

    def __init__(self, message: str, status: int = 0):  # rebuilt from its message alone when it reaches each row
        super().__init__(message)
        self.status = status


_CHECK = {401: "check the API key (api_key_env)", 403: "check the API key (api_key_env) and its permissions", 404: "check base_url"}


async def call(
    client, method: str, path: str, *, what: str, policy: RetryPolicy, body: bytes | None = None, content_type=None, hint: bool = True
):
    """One call to the provider's API (``path`` under base_url, with the key) under the
    transport's retry policy: connection errors, deadlines, 429 and 5xx retried. Returns
    the final answer (2xx, or a status the caller reads); PermanentAnswer at once for 401,
    403 and 404 (with ``hint``: saying to check the key or base_url; without, the caller
    says what the status means there); EngineError once the retries are spent (an outage)."""
    try:
        return await send_with_retries(
            client, method, path, body, policy=policy, what=what, content_type=content_type, permanent_raises=True
        )
    except PermanentStatus as e:
        raise PermanentAnswer(f"{e} ({_CHECK[e.status]})" if hint else str(e), e.status) from None
    except TransportError as e:  # the retries are spent, or an answer over the size limit
        raise EngineError(str(e)) from None


_FILE_GONE = {
    401: "the key is refused for this file, though the batch's status was read with it",
    403: "the key may not read this file, though the batch's status was read with it",
    404: "the provider no longer has this file (deleted, or past its retention); the key and base_url work",
}


def _path_id(ident: str) -> str:
    """A provider's id as one path segment (an id holding '/' or '?' cannot reach another path)."""
    return urllib.parse.quote(str(ident), safe="")


def _json(response, what: str) -> dict:
    try:
        data = response.json()
    except ValueError:
        raise EngineError(f"{what}: the answer is not JSON: {response.text[:200]!r}") from None
    if not isinstance(data, dict):
        raise EngineError(f"{what}: the answer is not a JSON object: {str(data)[:200]}")
    return data


def _classify(status: int | None, code: str | None, kind: str | None, message: str) -> E:
    """The row-error class of one failed request (HTTP status, error code or type, message)."""
    low = f"{code or ''} {kind or ''}".lower()
    if "content_policy" in low or "content_filter" in low:
        return E.CONTENT_FILTER
    if is_context_length_error(message) or "context_length" in low or "prompt is too long" in message.lower():
        return E.CONTEXT_LENGTH
    if "request_too_large" in low or status == 413:
        return E.REQUEST_TOO_LARGE
    if status == 429 or "rate_limit" in low:
        return E.RATE_LIMITED
    if (status is not None and status >= 500) or "overloaded" in low or "api_error" in low:
        return E.PROVIDER_ERROR
    if status is not None and 400 <= status < 500 or "invalid_request" in low or "not_found" in low or "permission" in low:
        return E.INVALID_REQUEST
    return E.PROVIDER_ERROR


# SGLang's sampling names -> OpenAI's (as the openai backend sends them; no engine imports another)
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_OPENAI_FINISH = {"stop": "stop", "length": "length", "content_filter": "abort"}


def _failed(rid: int, kind: E, message: str) -> Completion:
    return Completion(rid, "", 0, 0, "abort", kind, message)


class Provider:
    name = ""

    def __init__(self, processor: ProcessorConfig, base_url: str, api_key: str | None):
        self.processor = processor
        self.settings: BatchSettings = processor.batch
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = processor.model or processor.server_args.model_path

    def retry_policy(self) -> RetryPolicy:
        """Each API call: ``max_retries`` retries of an outage, 2 s doubling up to 60 s between them."""
        return RetryPolicy(
            int(self.processor.max_retries), 2.0, CALL_MAX_DELAY_SECONDS, float(self.processor.request_timeout), "request_timeout"
        )

    def headers(self) -> dict:
        """Headers every call carries that are not secrets."""
        return {}

    def credentials(self) -> dict:
        """The key's header: sent to base_url's origin only (transport/http_client.py)."""
        raise NotImplementedError

    def body(self, request: Request) -> dict:
        raise NotImplementedError

    def line(self, custom_id: str, body: dict) -> dict:
        raise NotImplementedError

    async def submit(self, client, key: str, spool: Path, count: int) -> dict:
        """Create the batch of the JSONL in ``spool``: {"batch_id", "status", ...}. ProviderRefused
        when the provider refuses what it holds."""
        raise NotImplementedError

    async def find(self, client, key: str) -> str | None:
        """The id of a batch created for chunk ``key`` whose id was never recorded, or None."""
        return None

    async def poll(self, client, batch_id: str) -> BatchState:
        raise NotImplementedError

    async def cancel(self, client, batch_id: str) -> None:
        raise NotImplementedError

    async def download(self, client, state: BatchState, dest: Path) -> None:
        """Write the ended batch's result lines to ``dest`` (atomically)."""
        raise NotImplementedError

    def outcomes(self, line: dict, rid: int) -> Outcome:
        raise NotImplementedError

    def refused_outcomes(self, state: BatchState) -> str:
        """Why a batch that ended without running (OpenAI failed) ran nothing."""
        return state.status

    def usage(self, line: dict) -> tuple[int, int]:
        """(input, output) tokens of a result line, each a ``wire.token_count``: BadAnswer
        when a figure is not a finite, non-negative integer."""
        return 0, 0


# --------------------------------------------------------------------------- OpenAI


class OpenAIBatches(Provider):
    name = "openai"
    ENDED = {"completed", "failed", "expired", "cancelled"}

    def credentials(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, request: Request) -> dict:
        body: dict[str, Any] = {"model": self.model, **{_OPENAI_NAMES.get(k, k): v for k, v in request.sampling_params.items()}}
        if request.seed is not None:
            body["seed"] = request.seed
        messages = openai_messages(request.messages, request.images) if request.images else request.messages
        body["messages"] = messages
        if request.json_schema is not None:
            schema = json.loads(request.json_schema)
            if schema.get("properties"):  # strict: every field required, nothing else
                strict = {**schema, "additionalProperties": False}
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "strict": True, "schema": strict}}
            else:  # any JSON object
                body["response_format"] = {"type": "json_object"}
        return body

    def line(self, custom_id: str, body: dict) -> dict:
        return {"custom_id": custom_id, "method": "POST", "url": self.settings.endpoint, "body": body}

    async def submit(self, client, key: str, spool: Path, count: int) -> dict:
        what = f"POST {redact_text(self.base_url)}/files"
        data = await asyncio.to_thread(spool.read_bytes)
        form, form_type = multipart_form({"purpose": "batch"}, "file", f"{key}.jsonl", data, "application/jsonl")
        response = await call(client, "POST", "/files", what=what, body=form, content_type=form_type, policy=self.retry_policy())
        if not 200 <= response.status_code < 300:
            raise ProviderRefused(f"{what}: HTTP {response.status_code}: {error_message(response.content)}")
        file_id = _json(response, what).get("id")
        metadata = {**self.settings.metadata, "mirageflow_chunk": key}
        body = {
            "input_file_id": file_id,
            "endpoint": self.settings.endpoint,
            "completion_window": self.settings.completion_window,
            "metadata": metadata,
        }
        what = f"POST {redact_text(self.base_url)}/batches"
        response = await call(client, "POST", "/batches", what=what, body=dumps(body), policy=self.retry_policy())
        if not 200 <= response.status_code < 300:
            raise ProviderRefused(f"{what}: HTTP {response.status_code}: {error_message(response.content)}")
        data = _json(response, what)
        return {"batch_id": data.get("id"), "status": data.get("status"), "input_file_id": file_id, "expires_at": data.get("expires_at")}

    async def find(self, client, key: str) -> str | None:
        after, what = None, f"GET {redact_text(self.base_url)}/batches"
        for _ in range(20):  # the 2,000 newest batches: a chunk recorded minutes before a kill is among them
            params = {"limit": 100, **({"after": after} if after else {})}
            path = "/batches?" + urllib.parse.urlencode(params)
            response = await call(client, "GET", path, what=what, policy=self.retry_policy())
            if not 200 <= response.status_code < 300:
                return None
            data = _json(response, what)
            for batch in data.get("data") or []:
                if isinstance(batch, dict) and (batch.get("metadata") or {}).get("mirageflow_chunk") == key:
                    return batch.get("id")
            if not data.get("has_more") or not data.get("data"):
                return None
            after = data.get("last_id") or data["data"][-1].get("id")
        return None

    async def poll(self, client, batch_id: str) -> BatchState:
        what = f"GET {redact_text(self.base_url)}/batches/{batch_id}"
        response = await call(client, "GET", f"/batches/{_path_id(batch_id)}", what=what, policy=self.retry_policy(), hint=False)
        if not 200 <= response.status_code < 300:
            raise EngineError(f"{what}: HTTP {response.status_code}: {error_message(response.content)}")
        data = _json(response, what)
        status = str(data.get("status"))
        return BatchState(status, status in self.ENDED, data)

    async def cancel(self, client, batch_id: str) -> None:
        what = f"POST {redact_text(self.base_url)}/batches/{batch_id}/cancel"
        await call(client, "POST", f"/batches/{_path_id(batch_id)}/cancel", what=what, policy=self.retry_policy())

    async def download(self, client, state: BatchState, dest: Path) -> None:
        from mirageflow.files import atomic_write_bytes

        chunks = []
        for field in ("output_file_id", "error_file_id"):
            file_id = state.raw.get(field)
            if not file_id:
                continue
            what = f"GET {redact_text(self.base_url)}/files/{file_id}/content"
            try:
                response = await call(
                    client, "GET", f"/files/{_path_id(file_id)}/content", what=what, policy=self.retry_policy(), hint=False
                )
            except PermanentAnswer as e:
                raise PermanentAnswer(
                    f"{e} ({_FILE_GONE[e.status]}: the {field} {file_id} of batch {state.raw.get('id')})", e.status
                ) from None
            if not 200 <= response.status_code < 300:
                raise EngineError(f"{what}: HTTP {response.status_code}: {error_message(response.content)}")
            content = response.content
            chunks.append(content if content.endswith(b"\n") or not content else content + b"\n")
        await asyncio.to_thread(atomic_write_bytes, dest, b"".join(chunks))

    def refused_outcomes(self, state: BatchState) -> str:
        errors = (state.raw.get("errors") or {}).get("data") or []
        said = "; ".join(
            f"{e.get('code')}: {e.get('message')}" + (f" (line {e['line']})" if e.get("line") else "")
            for e in errors[:5]
            if isinstance(e, dict)
        )
        return f"OpenAI refused the batch ({state.status}): {said or 'no reason given'}"

    def outcomes(self, line: dict, rid: int) -> Outcome:
        cid = line.get("custom_id")
        error = line.get("error")
        response = line.get("response") or {}
        if isinstance(error, dict) and error:
            code = str(error.get("code") or "")
            message = str(error.get("message") or code)
            if code == "batch_expired":
                return Outcome(cid, retry="expired")
            if code == "batch_cancelled":
                return Outcome(cid, retry="cancelled")
            return Outcome(cid, _failed(rid, _classify(None, code, None, message), f"OpenAI batch: {code}: {message}"))
        status = response.get("status_code")
        body = response.get("body") or {}
        if status != 200:
            err = body.get("error") if isinstance(body, dict) else None
            err = err if isinstance(err, dict) else {}
            message = str(err.get("message") or body)[:500]
            kind = _classify(status, err.get("code"), err.get("type"), message)
            return Outcome(cid, _failed(rid, kind, f"OpenAI batch: HTTP {status}: {message}"))
        choices = body.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        reason = choice.get("finish_reason")
        completion = Completion(
            rid, message.get("content") or "", *self.usage(line), _OPENAI_FINISH.get(reason, "stop"),
            reasoning=message.get("reasoning_content") or None,
        )  # fmt: skip
        if reason == "content_filter" or message.get("refusal"):
            completion.error_kind = E.CONTENT_FILTER
            completion.error = f"OpenAI: the content filter stopped the answer ({message.get('refusal') or reason})"
        return Outcome(cid, completion)

    def usage(self, line: dict) -> tuple[int, int]:
        usage = ((line.get("response") or {}).get("body") or {}).get("usage")
        return usage_counts(usage, "prompt_tokens", "completion_tokens", "response.body.usage")


# --------------------------------------------------------------------------- Anthropic


def _anthropic_schema(schema: dict) -> dict:
    """Anthropic's structured outputs: objects closed (additionalProperties false), no
    numeric bounds (our validator checks them on the answer)."""
    props = {k: {kk: vv for kk, vv in v.items() if kk not in ("minimum", "maximum")} for k, v in schema.get("properties", {}).items()}
    return {"type": "object", "properties": props, "required": list(schema.get("required", [])), "additionalProperties": False}


class AnthropicBatches(Provider):
    name = "anthropic"
    _STOP = {"end_turn": "stop", "stop_sequence": "stop", "max_tokens": "length", "tool_use": "stop", "pause_turn": "stop"}

    def headers(self) -> dict:
        return {"anthropic-version": ANTHROPIC_VERSION}

    def credentials(self) -> dict:
        return {"x-api-key": self.api_key} if self.api_key else {}

    def body(self, request: Request) -> dict:
        params = dict(request.sampling_params)
        body: dict[str, Any] = {"model": self.model, "max_tokens": params.pop("max_new_tokens", None) or self.settings.max_tokens or 8192}
        for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
            if ours in params:
                body[theirs] = params[ours]
        stop = params.get("stop")
        if stop:
            body["stop_sequences"] = [stop] if isinstance(stop, str) else list(stop)
        images = iter(request.images or ())
        messages, system = [], None
        for m in request.messages:
            if m["role"] == "system":
                system = m["content"] if isinstance(m["content"], str) else "".join(p.get("text", "") for p in m["content"])
                continue
            content = m["content"]
            if isinstance(content, list):
                blocks = []
                for part in content:
                    if part.get("type") == "image":
                        image = next(images)
                        if image.mime not in _ANTHROPIC_MEDIA:
                            raise ValueError(f"Anthropic takes {', '.join(sorted(_ANTHROPIC_MEDIA))} images, not {image.mime}")
                        blocks.append(
                            {
                                "type": "image",
                                "source": {
                                    "type": "base64",
                                    "media_type": image.mime,
                                    "data": base64.b64encode(image.data).decode("ascii"),
                                },
                            }
                        )
                    else:
                        blocks.append({"type": "text", "text": part.get("text", "")})
                content = blocks
            messages.append({"role": m["role"], "content": content})
        if request.response_prefix:  # Anthropic continues a last assistant message (prefill)
            messages.append({"role": "assistant", "content": request.response_prefix})
        if system:
            body["system"] = system
        body["messages"] = messages
        if request.json_schema is not None and not request.response_prefix:
            body["output_config"] = {"format": {"type": "json_schema", "schema": _anthropic_schema(json.loads(request.json_schema))}}
        return body

    def line(self, custom_id: str, body: dict) -> dict:
        return {"custom_id": custom_id, "params": body}

    async def submit(self, client, key: str, spool: Path, count: int) -> dict:
        # the body is {"requests": [<lines>]}: assembled from the spool's lines, as they are
        raw = await asyncio.to_thread(spool.read_bytes)
        content = b'{"requests":[' + b",".join(raw.splitlines()) + b"]}"
        what = f"POST {redact_text(self.base_url)}/v1/messages/batches"
        response = await call(client, "POST", "/v1/messages/batches", what=what, body=content, policy=self.retry_policy())
        if not 200 <= response.status_code < 300:
            raise ProviderRefused(f"{what}: HTTP {response.status_code}: {error_message(response.content)}")
        data = _json(response, what)
        return {"batch_id": data.get("id"), "status": data.get("processing_status"), "expires_at": data.get("expires_at")}

    async def poll(self, client, batch_id: str) -> BatchState:
        what = f"GET {redact_text(self.base_url)}/v1/messages/batches/{batch_id}"
        response = await call(
            client, "GET", f"/v1/messages/batches/{_path_id(batch_id)}", what=what, policy=self.retry_policy(), hint=False
        )
        if not 200 <= response.status_code < 300:
            raise EngineError(f"{what}: HTTP {response.status_code}: {error_message(response.content)}")
        data = _json(response, what)
        status = str(data.get("processing_status"))
        return BatchState(status, status == "ended", data)

    async def cancel(self, client, batch_id: str) -> None:
        what = f"POST {redact_text(self.base_url)}/v1/messages/batches/{batch_id}/cancel"
        await call(client, "POST", f"/v1/messages/batches/{_path_id(batch_id)}/cancel", what=what, policy=self.retry_policy())

    async def download(self, client, state: BatchState, dest: Path) -> None:
        from mirageflow.files import atomic_write_bytes

        url = state.raw.get("results_url")
        if not url:
            raise EngineError(f"Anthropic batch {state.raw.get('id')} ended without a results_url")
        what = f"GET {redact_text(url)}"
        policy = self.retry_policy()
        try:  # results_url is named by the answer: the key goes with it only on base_url's origin (transport/fetch.py)
            response = await with_retries(
                lambda: get_url(client, url, timeout=policy.timeout, max_bytes=RESULTS_MAX_BYTES), policy=policy, what=what,
                permanent_raises=True,
            )  # fmt: skip
        except PermanentStatus as e:
            raise PermanentAnswer(f"{e} ({_FILE_GONE[e.status]}: the results of batch {state.raw.get('id')})", e.status) from None
        except TransportError as e:
            raise EngineError(str(e)) from None
        if not 200 <= response.status_code < 300:
            raise EngineError(f"{what}: HTTP {response.status_code}: {error_message(response.content)}")
        content = response.content
        await asyncio.to_thread(atomic_write_bytes, dest, content if content.endswith(b"\n") or not content else content + b"\n")

    def outcomes(self, line: dict, rid: int) -> Outcome:
        cid = line.get("custom_id")
        result = line.get("result") or {}
        kind = result.get("type")
        if kind == "expired":
            return Outcome(cid, retry="expired")
        if kind == "canceled":
            return Outcome(cid, retry="cancelled")
        if kind == "errored":
            error = result.get("error") or {}
            inner = error.get("error") if isinstance(error.get("error"), dict) else error  # the ErrorResponse wrapper
            message = str(inner.get("message") or inner.get("type") or "errored")
            return Outcome(
                cid, _failed(rid, _classify(None, None, inner.get("type"), message), f"Anthropic batch: {inner.get('type')}: {message}")
            )
        if kind != "succeeded":
            return Outcome(cid, _failed(rid, E.PROVIDER_ERROR, f"Anthropic batch: unknown result type {kind!r}"))
        message = result.get("message") or {}
        text = "".join(b.get("text", "") for b in message.get("content") or [] if isinstance(b, dict) and b.get("type") == "text")
        thinking = "".join(
            b.get("thinking", "") for b in message.get("content") or [] if isinstance(b, dict) and b.get("type") == "thinking"
        )
        stop = message.get("stop_reason")
        completion = Completion(rid, text, *self.usage(line), self._STOP.get(stop, "stop"), reasoning=thinking or None)
        if stop == "refusal":
            completion.error_kind = E.CONTENT_FILTER
            completion.error = "Anthropic: the model refused (stop_reason refusal)"
        return Outcome(cid, completion)

    def usage(self, line: dict) -> tuple[int, int]:
        usage = ((line.get("result") or {}).get("message") or {}).get("usage")
        return usage_counts(usage, "input_tokens", "output_tokens", "result.message.usage")


PROVIDERS = {"openai": OpenAIBatches, "anthropic": AnthropicBatches}
