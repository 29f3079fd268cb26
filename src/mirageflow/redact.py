"""Secrets out of everything written down: logs, status.json, failure.json, progress files.

One function, ``redact``, for every value the workflow records about an engine or a request:

- mappings: the value of a key named like a secret (``api_key``, ``hf_token``,
  ``client_secret``, ``password``, ``authorization``) becomes ``***``; other values are
  redacted recursively;
- argv lists: the value after ``--api-key`` / ``--hf-token`` / ... and the value in
  ``--api-key=VALUE`` become ``***``;
- any string: the password of a URL (``http://user:pass@host`` -> ``http://user:***@host``),
  ``Bearer <token>`` and ``--api-key=VALUE`` / ``--api-key VALUE`` inside a longer text
  (a command line, an error message).

Engines call it on what they log or put in status files (base_url, server commands,
engine arguments) and the shard runner on error messages it records.
"""

from __future__ import annotations

import re
from typing import Any

MASK = "***"
# A key or flag name that holds a secret: api_key, --api-key, hf_token, client_secret, ...
_SECRET_NAME = re.compile(r"(key|token|secret|password|passwd|authorization|auth)$", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)(?P<pw>[^/\s@]+)(?P<at>@)")
_BEARER = re.compile(r"(?P<head>\bBearer\s+)(?P<pw>[^\s\"',]+)", re.IGNORECASE)
_FLAG_VALUE = re.compile(
    r"(?P<head>--?[A-Za-z0-9_-]*(?:key|token|secret|password|passwd)(?:=|\s+))(?P<pw>(?!--)[^\s\"']+|\"[^\"]*\"|'[^']*')",
    re.IGNORECASE,
)


def redact_text(text: str) -> str:
    """``text`` with URL passwords, bearer tokens and ``--secret-flag VALUE`` masked."""
    if not isinstance(text, str) or not text:
        return text
    for pattern in (_URL_PASSWORD, _BEARER, _FLAG_VALUE):
        text = pattern.sub(lambda m: m.group("head") + MASK + (m.groupdict().get("at") or ""), text)
    return text


def _is_secret_flag(item: Any) -> bool:
    return isinstance(item, str) and item.startswith("-") and "=" not in item and bool(_SECRET_NAME.search(item.rstrip()))


def redact(value: Any) -> Any:
    """A copy of ``value`` (mapping, list/tuple of argv, string, or anything else) fit to be written down."""
    if isinstance(value, dict):
        return {
            k: MASK if isinstance(k, str) and _SECRET_NAME.search(k) and v not in (None, False, "") else redact(v)
            for k, v in value.items()
        }
    if isinstance(value, (list, tuple)):
        out, hide = [], False
        for item in value:
            out.append(MASK if hide and item is not None else redact(item))
            hide = _is_secret_flag(item)
        return type(value)(out) if isinstance(value, tuple) else out
    if isinstance(value, str):
        return redact_text(value)
    return value
