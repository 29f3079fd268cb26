"""A stand-in for the providers' batch APIs on 127.0.0.1: OpenAI Batch and Anthropic Message
Batches, following their documented endpoints and JSON shapes.

OpenAI (https://platform.openai.com/docs/api-reference/batch, .../files):
``POST /v1/files`` (multipart: ``purpose=batch``, ``file``) -> a file object;
``POST /v1/batches`` ``{input_file_id, endpoint, completion_window, metadata}`` -> a batch
(``status: validating``); ``GET /v1/batches/{id}`` (validating -> in_progress ->
finalizing -> completed | expired | cancelled | failed, with ``request_counts``,
``output_file_id``, ``error_file_id``); ``GET /v1/batches?limit=&after=`` (newest first,
``has_more``, ``last_id``); ``POST /v1/batches/{id}/cancel``; ``GET /v1/files/{id}/content``.
Output lines ``{"id", "custom_id", "response": {"status_code": 200, "request_id", "body":
<chat.completion>}, "error": null}``; error-file lines carry a non-200 ``status_code`` with
``body.error {message, type, param, code}``, or ``"response": null, "error": {"code":
"batch_expired" | "batch_cancelled", "message"}`` for requests the batch did not run. An
input file with a bad line (not JSON, no custom_id, a duplicate custom_id, another url)
makes the batch ``failed`` with ``errors.data[{code, message, line}]``.

Anthropic (https://docs.anthropic.com/en/api/creating-message-batches and siblings):
``POST /v1/messages/batches`` ``{"requests": [{"custom_id", "params"}]}`` -> a
``message_batch`` (``processing_status: in_progress``, ``request_counts``);
``GET /v1/messages/batches/{id}`` (in_progress -> canceling -> ended; ``results_url`` once
ended); ``GET /v1/messages/batches/{id}/results`` (JSONL ``{"custom_id", "result": {"type":
"succeeded", "message"} | {"type": "errored", "error": {"type": "error", "error": {"type",
"message"}}} | {"type": "canceled"} | {"type": "expired"}}``); ``POST .../cancel``. Keys:
``x-api-key`` and ``anthropic-version`` (400 without it).

Each request is answered from its own prompt: a JSON schema (OpenAI ``response_format``,
Anthropic ``output_config.format``) gets an object with every property (``"<field> of
<custom_id>"``, 7, 1.5, true); plain text ``answer to: <prompt head>`` (``[N image(s)]``
when the message has image parts, which must be the provider's shape). Markers in the
prompt: ``FAIL_CONTEXT`` (context length), ``FAIL_POLICY`` (content policy / refusal),
``FAIL_RATE`` (429 / rate_limit_error), ``FAIL_SERVER`` (500 / api_error), ``GARBAGE_LINE``
(a result line of another shape: a body or message that is not an object), ``USAGE_HUGE``
(usage's prompt/input tokens written as ``1e999``: valid JSON that Python reads as inf),
``USAGE_NEGATIVE`` (output tokens -12000), ``DUPLICATE_LINE`` (the request's result line
twice), ``DEEP_LINE`` (arrays nested 100,000 deep in its usage: valid JSON Python's parser
cannot read).

Trouble: ``hold`` (an Event: while set, no batch ends), ``polls_to_end`` (status polls of a
batch before it ends), ``expire`` (ordinals of created batches, 1-based, that end expired
after running only their first half; "all" for every one), ``cancel_at_end`` (ordinals
cancelled by the "provider" with half run), ``refuse`` (ordinals of OpenAI batches whose
validation fails: status failed, nothing run), ``stranger_lines`` (result lines added to
every batch for custom_ids never submitted, with tokens). Counters: ``batches_created``, ``polls``,
``requests_seen``.
"""

from __future__ import annotations

import email.parser
import email.policy
import itertools
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, urlparse

from fakes.fake_http import LocalHTTPServer


@dataclass
class Trouble:
    hold: threading.Event = field(default_factory=threading.Event)
    polls_to_end: int = 1
    expire: set | str = field(default_factory=set)
    cancel_at_end: set = field(default_factory=set)
    refuse: set = field(default_factory=set)  # ordinals of OpenAI batches whose input "fails validation" (status failed)
    stranger_lines: int = 0  # result lines per batch for custom_ids never submitted
    api_key: str = "sk-test"
    results_base: str | None = None  # Anthropic results_url on this origin (a ResultsHost), not the API's
    results_redirect: str | None = None  # the API's results endpoint answers 302 to this origin
    poll_status: int | None = None  # every status poll answers this (401: a rotated key, 404: an unknown id)
    file_status: int | None = None  # every GET /v1/files/{id}/content answers this (404: the file is gone)


HUGE = "<1e999>"  # written as the JSON number 1e999 (_jsonl)
DEEP = "<deep>"  # written as arrays nested 100,000 deep (valid JSON past Python's recursion limit)


def _jsonl(lines: list[dict]) -> bytes:
    text = "".join(json.dumps(x) + "\n" for x in lines)
    return text.replace(f'"{HUGE}"', "1e999").replace(f'"{DEEP}"', "[" * 100_000 + "]" * 100_000).encode()


def _hostile_usage(text: str, usage: dict, prompt_key: str, completion_key: str) -> dict:
    if "DEEP_LINE" in text:
        usage["extra"] = DEEP
    if "USAGE_HUGE" in text:
        usage[prompt_key] = HUGE
    if "USAGE_NEGATIVE" in text:
        usage[completion_key] = -12000
    return usage


def _prompt_of(messages) -> tuple[str, int]:
    """(text of the last user message, its image parts)."""
    for m in reversed(messages or []):
        if m.get("role") != "user":
            continue
        content = m.get("content")
        if isinstance(content, str):
            return content, 0
        text = "".join(p.get("text", "") for p in content if p.get("type") == "text")
        images = sum(1 for p in content if p.get("type") in ("image_url", "image"))
        return text, images
    return "", 0


def _answer_for(schema: dict | None, cid: str, text: str, images: int) -> str:
    if schema is None:
        return f"answer to: {text.strip()[:40]}" + (f" [{images} image(s)]" if images else "")
    values = {}
    for name, prop in (schema.get("properties") or {}).items():
        kind = prop.get("type")
        values[name] = {"integer": 7, "number": 1.5, "boolean": True}.get(kind, f"{name} of {cid}")
    return json.dumps(values)


def _check_openai_parts(messages) -> str | None:
    for m in messages:
        if isinstance(m.get("content"), list):
            for p in m["content"]:
                if p.get("type") == "image_url" and not str((p.get("image_url") or {}).get("url", "")).startswith("data:image/"):
                    return "image_url.url must be a data: URI or a URL"
                if p.get("type") not in ("text", "image_url"):
                    return f"unknown content part type {p.get('type')!r}"
    return None


def _check_anthropic_parts(messages) -> str | None:
    for m in messages:
        if m.get("role") not in ("user", "assistant"):
            return f"messages: role {m.get('role')!r} (system goes in the top-level system field)"
        if isinstance(m.get("content"), list):
            for p in m["content"]:
                if p.get("type") == "image":
                    src = p.get("source") or {}
                    if (
                        src.get("type") != "base64"
                        or src.get("media_type") not in ("image/jpeg", "image/png", "image/gif", "image/webp")
                        or not src.get("data")
                    ):
                        return "image source must be {type: base64, media_type, data}"
                elif p.get("type") != "text":
                    return f"unknown content block type {p.get('type')!r}"
    return None


class FakeBatchAPI(LocalHTTPServer):
    def __init__(self, trouble: Trouble | None = None):
        self.trouble = trouble or Trouble()
        self.listen("127.0.0.1", 0, _handler(self))
        self.lock = threading.Lock()
        self.files: dict[str, bytes] = {}
        self.batches: dict[str, dict] = {}  # id -> batch state (both providers)
        self.order: list[str] = []
        self.ids = itertools.count(1)
        self.batches_created = 0
        self.polls = 0
        self.requests_seen = 0
        self.authorization_seen: list[str | None] = []  # each request's Authorization header (None: none)

    # ------------------------------------------------------------------ answers

    def openai_result(self, cid: str, body: dict) -> tuple[int, dict]:
        text, images = _prompt_of(body.get("messages"))
        bad = _check_openai_parts(body.get("messages") or [])
        if bad or not body.get("model") or not isinstance(body.get("messages"), list):
            return 400, {
                "error": {"message": bad or "model and messages are required", "type": "invalid_request_error", "param": None, "code": None}
            }
        if "FAIL_CONTEXT" in text:
            return 400, {
                "error": {
                    "message": "This model's maximum context length is 128000 tokens.",
                    "type": "invalid_request_error",
                    "param": "messages",
                    "code": "context_length_exceeded",
                }
            }
        if "FAIL_POLICY" in text:
            return 400, {
                "error": {
                    "message": "Your request was rejected by the content policy.",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "content_policy_violation",
                }
            }
        if "FAIL_RATE" in text:
            return 429, {"error": {"message": "Rate limit reached.", "type": "requests", "param": None, "code": "rate_limit_exceeded"}}
        if "FAIL_SERVER" in text:
            return 500, {"error": {"message": "The server had an error.", "type": "server_error", "param": None, "code": None}}
        fmt = body.get("response_format") or {}
        schema = (
            (fmt.get("json_schema") or {}).get("schema")
            if fmt.get("type") == "json_schema"
            else ({} if fmt.get("type") == "json_object" else None)
        )
        answer = _answer_for(schema, cid, text, images)
        return 200, {
            "id": f"chatcmpl-{cid}", "object": "chat.completion", "created": int(time.time()), "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": answer, "refusal": None}, "finish_reason": "stop"}],
            "usage": _hostile_usage(text, {"prompt_tokens": len(text) // 4 + 1 + 85 * images, "completion_tokens": len(answer) // 4 + 1,
                                           "total_tokens": 0}, "prompt_tokens", "completion_tokens"),
        }  # fmt: skip

    def anthropic_result(self, cid: str, params: dict) -> dict:
        text, images = _prompt_of(params.get("messages"))
        bad = _check_anthropic_parts(params.get("messages") or [])
        if bad or not params.get("model") or not params.get("max_tokens"):
            return {
                "type": "errored",
                "error": {
                    "type": "error",
                    "error": {"type": "invalid_request_error", "message": bad or "model and max_tokens are required"},
                },
            }
        if "temperature" in params and "top_p" in params:
            return {
                "type": "errored",
                "error": {
                    "type": "error",
                    "error": {"type": "invalid_request_error", "message": "temperature and top_p cannot both be specified"},
                },
            }
        if "FAIL_CONTEXT" in text:
            return {
                "type": "errored",
                "error": {
                    "type": "error",
                    "error": {"type": "invalid_request_error", "message": "prompt is too long: 250000 tokens > 200000 maximum"},
                },
            }
        if "FAIL_RATE" in text:
            return {
                "type": "errored",
                "error": {
                    "type": "error",
                    "error": {"type": "rate_limit_error", "message": "Number of request tokens has exceeded your rate limit."},
                },
            }
        if "FAIL_SERVER" in text:
            return {"type": "errored", "error": {"type": "error", "error": {"type": "api_error", "message": "Internal server error"}}}
        refused = "FAIL_POLICY" in text
        fmt = (params.get("output_config") or {}).get("format") or {}
        answer = "" if refused else _answer_for(fmt.get("schema") if fmt.get("type") == "json_schema" else None, cid, text, images)
        message = {
            "id": f"msg_{cid}", "type": "message", "role": "assistant", "model": params["model"],
            "content": [{"type": "text", "text": answer}] if answer else [], "stop_reason": "refusal" if refused else "end_turn",
            "stop_sequence": None, "usage": _hostile_usage(text, {"input_tokens": len(text) // 4 + 1, "output_tokens": len(answer) // 4 + 1},
                                             "input_tokens", "output_tokens"),
        }  # fmt: skip
        return {"type": "succeeded", "message": message}

    # ------------------------------------------------------------------ batches

    def _new_id(self, prefix: str) -> str:
        return f"{prefix}{next(self.ids):06d}"

    def create(self, provider: str, requests: list[dict], extra: dict) -> dict:
        with self.lock:
            self.batches_created += 1
            self.requests_seen += len(requests)
            bid = self._new_id("batch_" if provider == "openai" else "msgbatch_")
            ordinal = self.batches_created
            ending = "completed"
            if self.trouble.expire == "all" or ordinal in self.trouble.expire:
                ending = "expired"
            elif ordinal in self.trouble.cancel_at_end:
                ending = "cancelled"
            self.batches[bid] = {"id": bid, "provider": provider, "requests": requests, "polls": 0, "status": "validating" if provider == "openai" else "in_progress",
                                 "ending": ending, "created_at": int(time.time()), **extra}  # fmt: skip
            self.order.append(bid)
            return self.batches[bid]

    def advance(self, bid: str) -> dict:
        with self.lock:
            b = self.batches[bid]
            b["polls"] += 1
            self.polls += 1
            ended = b["status"] in ("completed", "expired", "cancelled", "failed", "ended")
            if not ended and b["status"] not in ("cancelling", "canceling"):
                b["status"] = "in_progress"
            if not ended and not self.trouble.hold.is_set() and b["polls"] >= self.trouble.polls_to_end:
                self._end(b, "cancelled" if b["status"] in ("cancelling", "canceling") else b["ending"])
            return b

    def cancel(self, bid: str) -> dict:
        with self.lock:
            b = self.batches[bid]
            if b["status"] not in ("completed", "expired", "cancelled", "failed", "ended"):
                b["status"] = "cancelling" if b["provider"] == "openai" else "canceling"
                b["ending"] = "cancelled"
            return b

    def _end(self, b: dict, how: str) -> None:
        requests = b["requests"]
        run = len(requests) if how == "completed" else len(requests) // 2
        b["ran"], b["how"] = run, how
        if b["provider"] == "openai":
            out, err = [], []
            for i, r in enumerate(requests):
                cid = r["custom_id"]
                if i >= run:
                    code = "batch_expired" if how == "expired" else "batch_cancelled"
                    err.append(
                        {
                            "id": f"batch_req_{cid}",
                            "custom_id": cid,
                            "response": None,
                            "error": {"code": code, "message": f"This request was not executed: {code}."},
                        }
                    )
                    continue
                status, body = self.openai_result(cid, r["body"])
                if "GARBAGE_LINE" in _prompt_of(r["body"].get("messages"))[0]:
                    body = "not an object"
                line = {
                    "id": f"batch_req_{cid}",
                    "custom_id": cid,
                    "response": {"status_code": status, "request_id": f"req_{cid}", "body": body},
                    "error": None,
                }
                (out if status == 200 else err).append(line)
                if "DUPLICATE_LINE" in _prompt_of(r["body"].get("messages"))[0]:
                    (out if status == 200 else err).append(line)
            for n in range(self.trouble.stranger_lines):
                cid = f"u{900 + n}-{'0' * 16}"
                out.append({"id": f"batch_req_{cid}", "custom_id": cid, "error": None,
                            "response": {"status_code": 200, "request_id": f"req_{cid}", "body": self.openai_result(cid, {
                                "model": "m", "messages": [{"role": "user", "content": "stranger"}]})[1]}})  # fmt: skip
            b["output_file_id"] = self._store(out) if out else None
            b["error_file_id"] = self._store(err) if err else None
            b["status"] = how
        else:
            lines = []
            for i, r in enumerate(requests):
                cid = r["custom_id"]
                if i >= run:
                    lines.append({"custom_id": cid, "result": {"type": "expired" if how == "expired" else "canceled"}})
                elif "GARBAGE_LINE" in _prompt_of(r["params"].get("messages"))[0]:
                    lines.append({"custom_id": cid, "result": {"type": "succeeded", "message": "not an object"}})
                else:
                    lines.append({"custom_id": cid, "result": self.anthropic_result(cid, r["params"])})
                    if "DUPLICATE_LINE" in _prompt_of(r["params"].get("messages"))[0]:
                        lines.append(lines[-1])
            for n in range(self.trouble.stranger_lines):
                cid = f"u{900 + n}-{'0' * 16}"
                params = {"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "stranger"}]}
                lines.append({"custom_id": cid, "result": self.anthropic_result(cid, params)})
            b["results"] = _jsonl(lines)
            b["result_types"] = [x["result"]["type"] for x in lines]
            b["status"] = "ended"
            b["ended_how"] = how

    def _store(self, lines: list[dict]) -> str:
        fid = self._new_id("file-")
        self.files[fid] = _jsonl(lines)
        return fid

    def openai_view(self, b: dict) -> dict:
        done = b.get("ran", 0)
        total = len(b["requests"])
        failed = 0
        if b["status"] in ("completed", "expired", "cancelled"):
            failed = total - done + sum(1 for r in b["requests"][:done] if self.openai_result(r["custom_id"], r["body"])[0] != 200)
        return {
            "id": b["id"], "object": "batch", "endpoint": b["endpoint"], "errors": b.get("errors"), "input_file_id": b["input_file_id"],
            "completion_window": b["completion_window"], "status": b["status"], "output_file_id": b.get("output_file_id"),
            "error_file_id": b.get("error_file_id"), "created_at": b["created_at"], "expires_at": b["created_at"] + 86400,
            "request_counts": {"total": total, "completed": total - failed if b["status"] in ("completed", "expired", "cancelled") else 0, "failed": failed},
            "metadata": b.get("metadata"),
        }  # fmt: skip

    def anthropic_view(self, b: dict, base: str) -> dict:
        ended = b["status"] == "ended"
        counts = {"processing": 0 if ended else len(b["requests"]), "succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        if ended:
            for kind in b["result_types"]:
                counts[kind] += 1
        return {
            "id": b["id"], "type": "message_batch", "processing_status": b["status"], "request_counts": counts,
            "ended_at": "2026-01-01T00:00:00Z" if ended else None, "created_at": "2026-01-01T00:00:00Z",
            "expires_at": "2026-01-02T00:00:00Z", "cancel_initiated_at": None,
            "results_url": f"{self.trouble.results_base or base}/v1/messages/batches/{b['id']}/results" if ended else None,
        }  # fmt: skip


def _parse_multipart(content_type: str, body: bytes) -> dict[str, bytes]:
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    parts = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        parts[name] = part.get_payload(decode=True)
    return parts


def _handler(api: FakeBatchAPI):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            pass

        def _send(self, status: int, body, content_type: str = "application/json") -> None:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def _authorized(self) -> bool:
            api.authorization_seen.append(self.headers.get("Authorization"))
            anthropic = self.path.startswith("/v1/messages")
            if anthropic:
                if not self.headers.get("anthropic-version"):
                    self._send(
                        400,
                        {"type": "error", "error": {"type": "invalid_request_error", "message": "anthropic-version header is required"}},
                    )
                    return False
                ok = self.headers.get("x-api-key") == api.trouble.api_key
            else:
                ok = self.headers.get("Authorization") == f"Bearer {api.trouble.api_key}"
            if not ok:
                self._send(
                    401, {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error", "code": "invalid_api_key"}}
                )
            return ok

        def do_GET(self):
            if not self._authorized():
                return
            url = urlparse(self.path)
            parts = url.path.strip("/").split("/")
            if url.path == "/v1/batches":
                query = parse_qs(url.query)
                limit, after = int(query.get("limit", ["20"])[0]), query.get("after", [None])[0]
                newest = [b for b in reversed(api.order) if api.batches[b]["provider"] == "openai"]
                if after in newest:
                    newest = newest[newest.index(after) + 1 :]
                page = [api.openai_view(api.batches[b]) for b in newest[:limit]]
                return self._send(
                    200, {"object": "list", "data": page, "has_more": len(newest) > limit, "last_id": page[-1]["id"] if page else None}
                )
            if api.trouble.poll_status and (
                parts[:2] == ["v1", "batches"] and len(parts) == 3 or parts[:3] == ["v1", "messages", "batches"] and len(parts) == 4
            ):
                api.polls += 1
                return self._send(
                    api.trouble.poll_status,
                    {
                        "type": "error",
                        "error": {
                            "type": "not_found_error" if api.trouble.poll_status == 404 else "authentication_error",
                            "message": f"HTTP {api.trouble.poll_status} for {url.path}",
                        },
                    },
                )
            if parts[:2] == ["v1", "batches"] and len(parts) == 3 and parts[2] in api.batches:
                return self._send(200, api.openai_view(api.advance(parts[2])))
            if parts[:2] == ["v1", "files"] and len(parts) == 4 and parts[3] == "content" and parts[2] in api.files:
                if api.trouble.file_status:
                    return self._send(
                        api.trouble.file_status, {"error": {"message": f"No such File object: {parts[2]}", "type": "invalid_request_error"}}
                    )
                return self._send(200, api.files[parts[2]], "application/octet-stream")
            if parts[:3] == ["v1", "messages", "batches"] and len(parts) == 4 and parts[3] in api.batches:
                return self._send(200, api.anthropic_view(api.advance(parts[3]), api.url))
            if parts[:3] == ["v1", "messages", "batches"] and len(parts) == 5 and parts[4] == "results":
                b = api.batches.get(parts[3])
                if b is None or b["status"] != "ended":
                    return self._send(404, {"type": "error", "error": {"type": "not_found_error", "message": "no results yet"}})
                if api.trouble.results_redirect:
                    self.send_response(302)
                    self.send_header("Location", f"{api.trouble.results_redirect}{url.path}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                return self._send(200, b["results"], "application/binary")
            self._send(404, {"error": {"message": f"no route {url.path}", "type": "invalid_request_error"}})

        def do_POST(self):
            body = self._body()
            if not self._authorized():
                return
            path = urlparse(self.path).path
            parts = path.strip("/").split("/")
            if path == "/v1/files":
                form = _parse_multipart(self.headers["Content-Type"], body)
                if form.get("purpose") != b"batch" or "file" not in form:
                    return self._send(400, {"error": {"message": "purpose=batch and a file are required", "type": "invalid_request_error"}})
                fid = api._new_id("file-")
                api.files[fid] = form["file"]
                return self._send(
                    200,
                    {
                        "id": fid,
                        "object": "file",
                        "bytes": len(form["file"]),
                        "created_at": int(time.time()),
                        "filename": "batch.jsonl",
                        "purpose": "batch",
                    },
                )
            if path == "/v1/batches":
                req = json.loads(body)
                data = api.files.get(req.get("input_file_id"))
                if data is None:
                    return self._send(400, {"error": {"message": "no such input file", "type": "invalid_request_error"}})
                if req.get("completion_window") != "24h" or req.get("endpoint") != "/v1/chat/completions":
                    return self._send(400, {"error": {"message": "completion_window must be 24h", "type": "invalid_request_error"}})
                requests, errors, seen = [], [], set()
                for n, line in enumerate(data.splitlines(), 1):
                    if not line.strip():
                        continue
                    try:
                        r = json.loads(line)
                    except ValueError:
                        errors.append({"code": "invalid_json_line", "message": "This line is not parseable as valid JSON.", "line": n})
                        continue
                    if r.get("custom_id") in seen:
                        errors.append(
                            {"code": "duplicate_custom_id", "message": "The custom_id for this request is a duplicate.", "line": n}
                        )
                    elif r.get("method") != "POST" or r.get("url") != req["endpoint"]:
                        errors.append(
                            {
                                "code": "invalid_url",
                                "message": "The URL provided for this request does not match the batch endpoint.",
                                "line": n,
                            }
                        )
                    seen.add(r.get("custom_id"))
                    requests.append(r)
                if len(requests) > 50_000 or len(data) > 200_000_000:
                    errors.append({"code": "too_many_requests", "message": "The batch input file is larger than the limit.", "line": None})
                b = api.create(
                    "openai",
                    requests,
                    {
                        "input_file_id": req["input_file_id"],
                        "endpoint": req["endpoint"],
                        "completion_window": req["completion_window"],
                        "metadata": req.get("metadata"),
                    },
                )
                if api.batches_created in api.trouble.refuse:
                    errors.append({"code": "invalid_request", "message": "The model gpt-x does not support the Batch API.", "line": None})
                if errors:
                    b["status"], b["errors"] = "failed", {"object": "list", "data": errors}
                return self._send(200, api.openai_view(b))
            if parts[:2] == ["v1", "batches"] and len(parts) == 4 and parts[3] == "cancel" and parts[2] in api.batches:
                return self._send(200, api.openai_view(api.cancel(parts[2])))
            if path == "/v1/messages/batches":
                req = json.loads(body)
                requests = req.get("requests")
                if not isinstance(requests, list) or not requests or len(requests) > 100_000:
                    return self._send(
                        400, {"type": "error", "error": {"type": "invalid_request_error", "message": "requests: 1 to 100,000 items"}}
                    )
                ids = [r.get("custom_id") for r in requests]
                import re

                if len(set(ids)) != len(ids) or not all(isinstance(i, str) and re.fullmatch(r"[a-zA-Z0-9_-]{1,64}", i) for i in ids):
                    return self._send(
                        400,
                        {
                            "type": "error",
                            "error": {
                                "type": "invalid_request_error",
                                "message": "custom_id must be unique and match ^[a-zA-Z0-9_-]{1,64}$",
                            },
                        },
                    )
                b = api.create("anthropic", requests, {})
                return self._send(200, api.anthropic_view(b, api.url))
            if parts[:3] == ["v1", "messages", "batches"] and len(parts) == 5 and parts[4] == "cancel" and parts[3] in api.batches:
                return self._send(200, api.anthropic_view(api.cancel(parts[3]), api.url))
            self._send(404, {"error": {"message": f"no route {path}", "type": "invalid_request_error"}})

    return Handler


class ResultsHost(LocalHTTPServer):
    """Another origin (its own port) serving an API's Anthropic results without asking for a
    key, as a storage host would: ``headers_seen`` records every request's headers."""

    def __init__(self, api: FakeBatchAPI):
        self.api, self.headers_seen = api, []
        host = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, fmt, *args):
                pass

            def do_GET(self):
                host.headers_seen.append({k.lower(): v for k, v in self.headers.items()})
                parts = urlparse(self.path).path.strip("/").split("/")
                b = host.api.batches.get(parts[3]) if len(parts) == 5 else None
                data = (b or {}).get("results")
                status = 200 if data is not None else 404
                data = data if data is not None else b"{}"
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.listen("127.0.0.1", 0, Handler)
