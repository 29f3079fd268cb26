"""Secrets out of everything written down: logs, status.json, failure.json, progress files.

One function, ``redact``, for every value the workflow records about an engine or a request:

- mappings: the value of a key named like a secret (``api_key``, ``hf_token``,
  ``client_secret``, ``password``, ``authorization``, ``auth_header``, ``credentials``,
  ``cookie``) becomes ``***``; other values are redacted recursively;
- argv lists: the value after ``--api-key`` / ``--hf-token`` / ... and the value in
  ``--api-key=VALUE`` become ``***``;
- any string (``redact_text``): the password of a URL (``http://user:pass@host`` ->
  ``http://user:***@host``), the values of a URL's query (``?key=v`` -> ``?key=***``: a
  token travels there as often as in a password), ``Bearer <token>``, ``--api-key=VALUE``
  / ``--api-key VALUE`` inside a longer text (a command line, an error message), and every
  value registered as a secret (``register_secret``; ``register_environment_secrets``
  registers the environment's variables named like secrets: ``*_KEY``, ``*_TOKEN``,
  ``*SECRET*``, ``*PASSWORD*``, ...).

Logs: ``install_log_redaction()`` puts a ``RedactingFilter`` on every handler of the root
logger and of Snakemake's logger, so a line from any library (httpx's ``HTTP Request: POST
http://user:pw@host/...?k=...``) is redacted before it is written, wherever it comes from.
The jobs (mirageflow.jobs), ``mmirage`` (mirageflow.cli) and the Snakemake driver
(workflow/rules/common.smk) install it where they set up logging.

Stored configs: ``secrets_out_of_config`` moves the secrets written literally in a
processor of the config (a URL's password or query values, a key named like a secret, the
value after a secret flag of ``server_command``) into environment variables
``MIRAGEFLOW_SECRET_<n>`` and leaves ``${MIRAGEFLOW_SECRET_<n>}`` in their place: the
driver exports them to its jobs (local jobs and ``sbatch --export=ALL`` inherit them), and
``<state_dir>/configs/<hash>.json`` holds no secret.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any, Iterable, Mapping
from urllib.parse import urlsplit

MASK = "***"
# A key or flag name that holds a secret: api_key, --api-key, hf_token, client_secret, auth_header, ...
_SECRET_NAME = re.compile(r"(key|token|secret|password|passwd|authorization|auth|auth_header|credentials?|cookie)$", re.IGNORECASE)
_URL_PASSWORD = re.compile(r"(?P<head>\b[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)(?P<pw>[^/\s@]+)(?P<at>@)")
_BEARER = re.compile(r"(?P<head>\bBearer\s+)(?P<pw>[^\s\"',]+)", re.IGNORECASE)
_FLAG_VALUE = re.compile(
    r"(?P<head>--?[A-Za-z0-9_-]*(?:key|token|secret|password|passwd)(?:=|\s+))(?P<pw>(?!--)[^\s\"']+|\"[^\"]*\"|'[^']*')",
    re.IGNORECASE,
)
# A URL with a query: its values are masked (names are kept: they say what was sent)
_URL_QUERY = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.-]*://[^\s\"'<>?#]*\?(?P<query>[^\s\"'<>#]*)")
_QUERY_VALUE = re.compile(r"(?P<head>(?:^|[&;])[^=&;]*=)(?P<pw>[^&;]*)")
# Environment variables whose value is a secret, by name
_SECRET_ENV_NAME = re.compile(
    r"(^|_)(KEY|TOKEN|SECRET|PASSWORD|PASSWD|PWD|CREDENTIALS?|AUTH|COOKIE)(_|$)|SECRET|PASSWORD|API_?KEY|TOKEN", re.IGNORECASE
)
_NOT_SECRET_ENV = frozenset({"PWD", "OLDPWD"})  # the working directory
MIN_SECRET_CHARS = 6  # shorter registered values would mask ordinary words

_SECRETS: set[str] = set()
_SECRETS_SORTED: list[str] = []


def register_secret(value: Any) -> None:
    """Mask ``value`` wherever ``redact_text`` sees it from now on (in this process)."""
    global _SECRETS_SORTED
    if not isinstance(value, str) or len(value) < MIN_SECRET_CHARS or value in _SECRETS:
        return
    _SECRETS.add(value)
    _SECRETS_SORTED = sorted(_SECRETS, key=len, reverse=True)


def register_environment_secrets(environ: Mapping[str, str] | None = None, names: Iterable[str] = ()) -> None:
    """Register the values of the environment's variables named like secrets, and of ``names``."""
    environ = os.environ if environ is None else environ
    for name, value in list(environ.items()):
        if name in _NOT_SECRET_ENV:
            continue
        if _SECRET_ENV_NAME.search(name):
            register_secret(value)
    for name in names:
        if name and name in environ:
            register_secret(environ[name])


def _mask_query(m: re.Match) -> str:
    whole, query = m.group(0), m.group("query")
    if not query:
        return whole
    masked = _QUERY_VALUE.sub(lambda q: q.group("head") + (MASK if q.group("pw") else ""), query)
    return whole[: m.start("query") - m.start()] + masked


def redact_text(text: str) -> str:
    """``text`` with URL passwords and query values, bearer tokens, ``--secret-flag VALUE``
    and registered secrets masked."""
    if not isinstance(text, str) or not text:
        return text
    for secret in _SECRETS_SORTED:
        if secret in text:
            text = text.replace(secret, MASK)
    for pattern in (_URL_PASSWORD, _BEARER, _FLAG_VALUE):
        text = pattern.sub(lambda m: m.group("head") + MASK + (m.groupdict().get("at") or ""), text)
    if "?" in text and "://" in text:
        text = _URL_QUERY.sub(_mask_query, text)
    return text


def is_secret_name(name: Any) -> bool:
    return isinstance(name, str) and bool(_SECRET_NAME.search(name.rstrip()))


def _is_secret_flag(item: Any) -> bool:
    return isinstance(item, str) and item.startswith("-") and "=" not in item and is_secret_name(item)


def redact(value: Any) -> Any:
    """A copy of ``value`` (mapping, list/tuple of argv, string, or anything else) fit to be written down."""
    if isinstance(value, dict):
        return {k: MASK if is_secret_name(k) and v not in (None, False, "") else redact(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        out, hide = [], False
        for item in value:
            out.append(MASK if hide and item is not None else redact(item))
            hide = _is_secret_flag(item)
        return type(value)(out) if isinstance(value, tuple) else out
    if isinstance(value, str):
        return redact_text(value)
    return value


# --------------------------------------------------------------------------- logs


class RedactingFilter(logging.Filter):
    """Redacts each record's message, arguments and exception text (``redact_text``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):  # Snakemake's structured events (dicts) are its own
            try:
                message = record.getMessage()
            except Exception:  # a broken format: logging reports it itself
                return True
            clean = redact_text(message)
            if clean != message:
                record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


_FILTER = RedactingFilter("mirageflow.redact")


def install_log_redaction(*loggers: logging.Logger, environ: Mapping[str, str] | None = None) -> None:
    """Put the redacting filter on the handlers of the root logger, of Snakemake's logger and
    of ``loggers`` (and on those loggers themselves), and register the environment's secrets.
    Idempotent: call it again after handlers are added."""
    register_environment_secrets(environ)
    targets = [logging.getLogger(), logging.getLogger("snakemake"), logging.getLogger("snakemake.logging"), *loggers]
    for logger in targets:
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
        for handler in logger.handlers:
            if _FILTER not in handler.filters:
                handler.addFilter(_FILTER)


# --------------------------------------------------------------------------- stored configs

SECRET_ENV_PREFIX = "MIRAGEFLOW_SECRET_"
# what config loading expands ($$ first: a literal $), as mirageflow.config.loading._ENV_RE
_TOKENS = re.compile(r"\$\$|\$\{[A-Za-z_][A-Za-z0-9_]*(?::-.*?)?\}|\$[A-Za-z_][A-Za-z0-9_]*")


def _literal(value: str) -> bool:
    """Whether ``value`` holds text of its own, not only ``$VAR`` references (expanded in each job)."""
    return bool(_TOKENS.sub(lambda m: "$" if m.group(0) == "$$" else "", value).strip())


class _Mover:
    def __init__(self):
        self.env: dict[str, str] = {}

    def ref(self, secret: str) -> str:
        """``secret`` with its literal text moved to variables; ``$VAR`` references stay (each job expands them)."""
        if not _literal(secret):
            return secret  # only references to the environment
        pieces, literal, pos = [], "", 0
        for m in _TOKENS.finditer(secret):
            literal += secret[pos : m.start()]
            pos = m.end()
            if m.group(0) == "$$":  # a literal $
                literal += "$$"
                continue
            if literal:
                pieces.append(self._move(literal))
                literal = ""
            pieces.append(m.group(0))
        literal += secret[pos:]
        if literal:
            pieces.append(self._move(literal))
        return "".join(pieces)

    def _move(self, secret: str) -> str:
        for name, value in self.env.items():
            if value == secret:
                return "${" + name + "}"
        name = f"{SECRET_ENV_PREFIX}{len(self.env) + 1}"
        # `$$` is a literal `$` in the config: what the job reads back from the environment is expanded once
        self.env[name] = secret.replace("$$", "$")
        return "${" + name + "}"

    def url(self, text: str) -> str:
        if "://" not in text:
            return text
        try:
            parts = urlsplit(text)
        except ValueError:
            return text
        out = text
        if parts.password:
            head = f"{parts.scheme}://{parts.username or ''}:"
            out = out.replace(head + parts.password + "@", head + self.ref(parts.password) + "@", 1)
        if parts.query:
            query = _QUERY_VALUE.sub(lambda q: q.group("head") + (self.ref(q.group("pw")) if q.group("pw") else ""), parts.query)
            out = out.replace("?" + parts.query, "?" + query, 1)
        return out

    def value(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self.secret(v) if is_secret_name(k) and not str(k).endswith("_env") else self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            out, hide = [], False
            for item in value:
                out.append(self.secret(item) if hide else self.value(item))
                hide = _is_secret_flag(item)
            return out
        if isinstance(value, str):
            if "=" in value and value.startswith("-"):  # --api-key=VALUE
                flag, _, v = value.partition("=")
                if _is_secret_flag(flag):
                    return f"{flag}={self.secret(v)}"
            return self.url(value)
        return value

    def secret(self, value: Any) -> Any:
        if isinstance(value, str) and value:
            return self.ref(value)
        if isinstance(value, (dict, list)):  # credentials: {user, password}: every string in it
            return self._all(value)
        return value

    def _all(self, value: Any) -> Any:
        if isinstance(value, dict):
            return {k: self._all(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self._all(v) for v in value]
        return self.secret(value) if isinstance(value, str) else value


def secrets_out_of_config(config: Mapping) -> tuple[dict, dict[str, str]]:
    """(the config with each literal secret of its processors replaced by ``${MIRAGEFLOW_SECRET_<n>}``,
    {variable: secret}). The numbering follows the config's order, so the same config gives the
    same stored file."""
    mover = _Mover()
    out = dict(config)
    if isinstance(config.get("processors"), list):
        out["processors"] = [mover.value(p) if isinstance(p, dict) else p for p in config["processors"]]
    return out, mover.env


def register_config_secrets(cfg) -> None:
    """Register what a validated pipeline config (``PipelineConfig``) holds that is secret: the
    values of its ``api_key_env`` variables (LLM and image_gen processors) and the passwords and query values of its
    ``base_url``s, so they are masked wherever they show up (not only inside a URL)."""
    names = []
    for proc in (*cfg.processors.values(), *cfg.image_processors.values()):  # image_gen's external servers take keys too
        if proc.api_key_env:
            names.append(proc.api_key_env)
        url = proc.base_url
        if isinstance(url, str) and "://" in url:
            try:
                parts = urlsplit(url)
            except ValueError:
                continue
            register_secret(parts.password)
            for q in _QUERY_VALUE.finditer(parts.query or ""):
                register_secret(q.group("pw"))
    register_environment_secrets(names=names)
