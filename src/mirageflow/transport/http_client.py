"""The HTTP client of every module that speaks HTTP (the engines ``openai``, ``sglang_server``
and ``batch_api``, the shard client of the engine service, image generation, remote image
inputs): a small keep-alive HTTP/1.1 client over asyncio streams, bound to one origin.

Why not a library: on a short-answer pipeline the client sets the pace, and each row may
cost at most 0.25 ms of client CPU in all (issue 29). Measured by
``scripts/bench/http_overhead.py`` (BENCHMARKS.md, "HTTP client overhead"), a bare loop of
64 requests in flight against an instant server: httpx2 (what the engines used before)
costs ~20x the client CPU per request of this client, aiohttp (its C parser) ~3x, which
alone is about the whole budget of a row before the pipeline does anything. It speaks only
what the engines need:

- Framing: ``Content-Length``, ``Transfer-Encoding: chunked`` (trailers skipped), or a body
  read to EOF (then the connection is not reused); interim 1xx answers skipped; no body for
  HEAD, 204 and 304. A header block over 64 KiB, a malformed status line, header or chunk
  size, a body over ``max_body_bytes`` (``ResponseTooLarge``) or a connection that ends
  mid-answer is a ``TransportError``.
- Keep-alive: idle connections are reused, newest first; a connection goes back to the
  pool only after a whole answer on HTTP/1.1 without ``Connection: close``, and any error
  or cancellation mid-request closes it. One the server closed while idle is dropped
  before use; a reused one that ends before the first byte of the answer (the server
  closed it as we sent) is retried once on a new connection.
- Deadline: ``timeout`` bounds the whole request (connect, send, the whole answer), not
  each read: a server that trickles a byte a second fails at the deadline
  (``DeadlineExceeded``). ``connect_timeout`` bounds connecting on its own.
- URL: the path of ``base_url`` prefixes every request path, its query string is kept on
  every request (``?key=...`` endpoints). Requests go only to the origin of ``base_url``
  (scheme, host, port): the client takes paths, never URLs, so the ``credentials`` it is
  given (an API key's header, whatever it is called) reach that origin only. A URL named by
  an answer, and every redirect, is fetched by transport/fetch.py, without credentials.
  Userinfo in ``base_url`` becomes Basic auth only when no ``credentials`` are given: an API
  key (``api_key_env``) takes precedence over it. ``display_url`` masks the password and
  every query value; errors name URLs only that way. Nothing is logged per request.
- No redirects: a 3xx is returned as it is (transport/fetch.py follows them, without
  credentials).
- TLS for ``https`` with httpx2's trust store (``SSL_CERT_FILE``/``SSL_CERT_DIR``, else the
  system's); with ``trust_env`` the proxies of ``HTTP(S)_PROXY``/``ALL_PROXY``/``NO_PROXY``
  (an ``http://`` proxy: absolute-form requests, ``CONNECT`` tunnels for ``https``).
- JSON: ``dumps``/``loads`` use orjson (BENCHMARKS.md: ~20x faster than json encoding a
  request body, ~4x decoding an answer) and fall back to the stdlib for what orjson
  refuses (integers beyond 64 bits, NaN in an answer), so nothing that parsed before fails.
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import urllib.parse
import urllib.request
from typing import Any

try:
    import orjson
except ImportError:  # pragma: no cover - a pinned dependency; the stdlib still works
    orjson = None

from mirageflow.errors import MirageflowError

HEADER_LIMIT = 64 * 1024  # status line + headers, and one chunk-size line
MAX_BODY_BYTES = 64 * 1024 * 1024
_READ_SIZE = 64 * 1024


class TransportError(MirageflowError):
    """No whole answer: refused, reset, closed early, malformed, too large or too late."""


class DeadlineExceeded(TransportError):
    pass


class ResponseTooLarge(TransportError):
    pass


class _Stale(MirageflowError):
    """A reused connection ended before any answer byte."""


def dumps(obj: Any) -> bytes:
    """JSON bytes of ``obj`` (compact UTF-8, as httpx's ``json=``)."""
    if orjson is not None:
        try:
            return orjson.dumps(obj)
        except TypeError:  # orjson.JSONEncodeError: ints over 64 bits, non-str keys, lone surrogates
            pass
    # ASCII with escapes: a lone surrogate (not UTF-8) goes as \udxxx for the server to judge
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def loads(data: bytes | str) -> Any:
    if orjson is not None:
        try:
            return orjson.loads(data)
        except ValueError:  # orjson.JSONDecodeError: NaN/Infinity, which the stdlib accepts
            pass
    return json.loads(data)


def display_url(url: str) -> str:
    """``url`` fit to be shown: the userinfo's password (or a bare userinfo, which may be a
    token) and every query value masked, the fragment dropped."""
    parts = urllib.parse.urlsplit(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, hostport = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        netloc = f"{user}:***@{hostport}" if colon else f"***@{hostport}"
    query = "&".join(f"{p.partition('=')[0]}=***" if "=" in p else "***" for p in parts.query.split("&")) if parts.query else ""
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, query, ""))


class Response:
    __slots__ = ("status_code", "headers", "content", "_json")

    def __init__(self, status_code: int, headers: dict[str, str], content: bytes):
        self.status_code, self.headers, self.content = status_code, headers, content
        self._json = _UNSET

    def json(self) -> Any:
        """The body as JSON (decoded once); ValueError when it is not JSON."""
        if self._json is _UNSET:
            self._json = loads(self.content)
        return self._json

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")


_UNSET = object()


class _Connection:
    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def abort(self) -> None:
        try:
            self.writer.transport.abort()
        except RuntimeError:  # its loop is closed: end the connection now, the object goes with the garbage
            try:
                self.writer.get_extra_info("socket").shutdown(socket.SHUT_RDWR)
            except (OSError, AttributeError):
                pass


class HTTPClient:
    """Requests to one origin (``base_url``) over a pool of keep-alive connections.

    ``max_connections`` (None: no limit) caps the requests in flight (so the connections
    open) at once; ``timeout`` (seconds, None: none) is each request's total deadline unless
    the request gives its own. Connections belong to the loop that opened them: requests
    from another loop (a later ``asyncio.run``) start a new pool. ``credentials``: the headers
    that carry a secret (``Authorization``, ``x-api-key``, ...), sent with every request of
    this client, which only ever reaches ``base_url``'s origin; they replace base_url's
    userinfo. ``headers``: other fixed headers.
    """

    def __init__(
        self,
        base_url: str,
        *,
        headers: dict[str, str] | None = None,
        credentials: dict[str, str] | None = None,
        max_connections: int | None = None,
        timeout: float | None = None,
        connect_timeout: float = 30.0,
        max_body_bytes: int = MAX_BODY_BYTES,
        trust_env: bool = True,
    ):
        url = urllib.parse.urlsplit(base_url)
        shown = urllib.parse.urlsplit(display_url(base_url))
        self._shown_base = urllib.parse.urlunsplit((shown.scheme, shown.netloc, shown.path.rstrip("/"), "", ""))
        self._shown_query = "?" + shown.query if shown.query else ""
        self.display = self._shown_base + self._shown_query  # base_url fit to be shown
        if url.scheme not in ("http", "https") or not url.hostname:
            raise ValueError(f"not an http(s) URL: {self.display}")
        try:
            self.port = url.port or (443 if url.scheme == "https" else 80)
        except ValueError:
            raise ValueError(f"bad port in {self.display}") from None
        self.scheme, self.host = url.scheme, url.hostname
        self.hostport = url.netloc.rpartition("@")[2]
        self.origin = origin_of(base_url)
        self.prefix, self.query = url.path.rstrip("/"), url.query
        self.timeout, self.connect_timeout, self.max_body_bytes = timeout, connect_timeout, max_body_bytes
        self._ssl = _ssl_context(trust_env) if url.scheme == "https" else None
        sent = {"Host": self.hostport, "User-Agent": "mirageflow", "Accept": "*/*"}
        if (url.username or url.password) and not credentials and not any(k.lower() == "authorization" for k in headers or {}):
            sent["Authorization"] = _basic(url.username or "", url.password or "")
        sent.update(headers or {})
        sent.update(credentials or {})
        self._proxy = _proxy_for(url, trust_env)
        self._proxy_prefix = ""  # absolute-form targets through an http proxy
        if self._proxy is not None and self.scheme == "http":
            self._proxy_prefix = f"http://{self.hostport}"
            if self._proxy.username or self._proxy.password:
                sent["Proxy-Authorization"] = _basic(self._proxy.username or "", self._proxy.password or "")
        for name, value in sent.items():
            if any(c in str(name) + str(value) for c in "\r\n\0"):
                raise ValueError(f"header {name!r} for {self.display} holds a line break or NUL (its value is not shown)")
        self._head = "".join(f"{k}: {v}\r\n" for k, v in sent.items()).encode("latin-1")
        self._heads: dict[tuple[str, str], bytes] = {}  # (method, path) -> request line and fixed headers
        self._idle: list[_Connection] = []
        self.max_connections = max_connections
        self._slots: asyncio.Semaphore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # ------------------------------------------------------------------ requests

    def url(self, path: str) -> str:
        """Where ``path`` goes, fit to be shown (for messages)."""
        if self._shown_query and "?" in path:
            return self._shown_base + path + "&" + self._shown_query[1:]
        return self._shown_base + path + self._shown_query

    async def get(self, path: str, *, timeout: float | None = ...) -> Response:
        return await self.request("GET", path, timeout=timeout)

    async def post(self, path: str, content: bytes, *, timeout: float | None = ..., content_type: str | None = None) -> Response:
        return await self.request("POST", path, content, timeout=timeout, content_type=content_type)

    async def post_json(self, path: str, obj: Any, *, timeout: float | None = ...) -> Response:
        return await self.request("POST", path, dumps(obj), timeout=timeout)

    async def request(
        self, method: str, path: str, body: bytes | None = None, *, timeout: float | None = ..., content_type: str | None = None
    ) -> Response:
        """One request to this client's origin; ``timeout`` (default: the client's) bounds all
        of it; a body is JSON unless ``content_type`` says otherwise."""
        if self._closed:
            raise TransportError(f"the HTTP client of {self.display} is closed")
        head = self._heads.get((method, path))
        if head is None:
            head = self._heads[(method, path)] = self._request_head(method, path)
        if body is not None:
            if content_type is not None:
                if any(c in content_type for c in "\r\n\0"):
                    raise ValueError(f"a Content-Type with a line break or NUL: {content_type[:60]!r}")
                head += b"Content-Type: %s\r\n" % content_type.encode("latin-1")
                data = head + b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            else:
                data = head + b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        else:
            data = head + b"\r\n"
        limit = self.timeout if timeout is ... else timeout
        if asyncio.get_running_loop() is not self._loop:
            self._bind()
        try:
            if limit is None:
                return await self._send(method, data)
            async with asyncio.timeout(limit):
                return await self._send(method, data)
        except TimeoutError:
            raise DeadlineExceeded(f"no whole answer from {self.url(path)} within {limit:g} s") from None

    def _request_head(self, method: str, path: str) -> bytes:
        if len(self._heads) > 64:  # paths are few (an engine's endpoints); a caller varying them does not grow this
            self._heads.clear()
        target = self._proxy_prefix + self.prefix + path
        if self.query:
            target += ("&" if "?" in path else "?") + self.query
        if any(c in target for c in " \r\n\0"):
            raise ValueError(f"a request path with a space, line break or NUL: {path[:60]!r}")
        return b"%s %s HTTP/1.1\r\n%s" % (method.encode(), target.encode("latin-1"), self._head)

    def _bind(self) -> None:
        """A pool for the running loop; the old loop's idle connections are closed."""
        self._drop_idle()
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(self.max_connections) if self.max_connections else None

    def _drop_idle(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.abort()

    async def _send(self, method: str, data: bytes) -> Response:
        if self._slots is None:
            return await self._exchange(method, data)
        async with self._slots:
            return await self._exchange(method, data)

    async def _exchange(self, method: str, data: bytes) -> Response:
        conn = None
        while self._idle and conn is None:
            conn = self._idle.pop()
            if not conn.usable():
                conn.abort()
                conn = None
        if conn is not None:
            try:
                return await self._over(conn, method, data, reused=True)
            except _Stale:
                pass  # the server closed it as we sent: once more on a new connection
        return await self._over(await self._connect(), method, data, reused=False)

    async def _over(self, conn: _Connection, method: str, data: bytes, reused: bool) -> Response:
        try:
            conn.writer.write(data)
            try:
                head = await conn.reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                if reused and not getattr(e, "partial", b""):
                    raise _Stale from None
                raise
            response, keep = await self._read(conn.reader, method, head)
        except BaseException as e:
            conn.abort()
            if isinstance(e, (_Stale, TransportError)) or not isinstance(e, Exception):
                raise
            raise _transport_error(e, self.display) from None
        if keep and not self._closed:
            self._idle.append(conn)
        else:
            conn.writer.close()
        return response

    async def _read(self, reader: asyncio.StreamReader, method: str, head: bytes) -> tuple[Response, bool]:
        status, headers, http11 = _parse_head(head)
        while 100 <= status < 200:  # interim answers (100 Continue, 103 Early Hints)
            status, headers, http11 = _parse_head(await reader.readuntil(b"\r\n\r\n"))
        keep = http11 and "close" not in headers.get("connection", "").lower()
        if method == "HEAD" or status in (204, 304):
            return Response(status, headers, b""), keep
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if coding.lower().replace(" ", "") != "chunked":
                raise TransportError(f"{self.display} answered with Transfer-Encoding {coding[:40]!r}, which this client does not decode")
            content = await self._chunked(reader)
        elif "content-length" in headers:
            try:
                length = int(headers["content-length"])
                if length < 0:
                    raise ValueError
            except ValueError:
                raise TransportError(f"{self.display} answered a malformed Content-Length {headers['content-length'][:40]!r}") from None
            if length > self.max_body_bytes:
                raise ResponseTooLarge(f"{self.display} answered a body over {self.max_body_bytes:,} bytes (Content-Length: {length:,})")
            content = await reader.readexactly(length)
        else:  # the body ends with the connection
            content, keep = await self._until_eof(reader), False
        return Response(status, headers, content), keep

    async def _chunked(self, reader: asyncio.StreamReader) -> bytes:
        parts, total = [], 0
        while True:
            line = await reader.readuntil(b"\r\n")
            try:
                size = int(line.split(b";", 1)[0], 16)
                if size < 0:
                    raise ValueError
            except ValueError:
                raise TransportError(f"{self.display} answered a malformed chunk size {line[:40]!r}") from None
            if size == 0:
                break
            total += size
            self._check_size(total)
            chunk = await reader.readexactly(size + 2)
            if chunk[-2:] != b"\r\n":
                raise TransportError(f"{self.display} answered a chunk longer than its size")
            parts.append(chunk[:-2])
        while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers
            pass
        return b"".join(parts)

    async def _until_eof(self, reader: asyncio.StreamReader) -> bytes:
        parts, total = [], 0
        while chunk := await reader.read(_READ_SIZE):
            total += len(chunk)
            self._check_size(total)
            parts.append(chunk)
        return b"".join(parts)

    def _check_size(self, size: int) -> None:
        if size > self.max_body_bytes:
            raise ResponseTooLarge(f"{self.display} answered a body over {self.max_body_bytes:,} bytes")

    # ------------------------------------------------------------------ connections

    async def _connect(self) -> _Connection:
        proxy = self._proxy
        host, port = (proxy.hostname, proxy.port or 80) if proxy is not None else (self.host, self.port)
        tls = self._ssl if proxy is None else None
        try:
            async with asyncio.timeout(self.connect_timeout):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=tls, server_hostname=self.host if tls else None, limit=HEADER_LIMIT
                )
                conn = _Connection(reader, writer)
                if proxy is not None and self.scheme == "https":
                    await self._tunnel(conn)
        except TimeoutError:
            raise TransportError(f"could not connect to {self.display} within connect_timeout={self.connect_timeout:g} s") from None
        except TransportError:
            raise
        except Exception as e:  # refused, unreachable, TLS refused, a proxy that hung up
            raise _transport_error(e, self.display, "could not connect to ") from None
        return conn

    async def _tunnel(self, conn: _Connection) -> None:
        """CONNECT through the proxy, then TLS to the origin inside the tunnel."""
        auth = b""
        if self._proxy.username or self._proxy.password:
            auth = b"Proxy-Authorization: %s\r\n" % _basic(self._proxy.username or "", self._proxy.password or "").encode()
        conn.writer.write(b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n%s\r\n" % ((self.hostport.encode(),) * 2 + (auth,)))
        status, _, _ = _parse_head(await conn.reader.readuntil(b"\r\n\r\n"))
        if status != 200:
            conn.abort()
            raise TransportError(f"the proxy refused to CONNECT to {self.display}: HTTP {status}")
        await conn.writer.start_tls(self._ssl, server_hostname=self.host)

    def close(self) -> None:
        """No more requests: the idle connections are closed (from the thread of their loop,
        or after it ended), those in use close when their request ends."""
        self._closed = True
        self._drop_idle()

    async def aclose(self) -> None:
        self.close()


# --------------------------------------------------------------------------- helpers


def _parse_head(head: bytes) -> tuple[int, dict[str, str], bool]:
    """(status, headers with lower-case names, HTTP/1.1?) of a status line + header block."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
        raise TransportError(f"not an HTTP/1.x answer: {lines[0][:60]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise TransportError(f"malformed header line in an answer: {line[:60]!r}")
        name, value = name.lower(), value.strip()
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    return int(code), headers, version == "HTTP/1.1"


def _transport_error(e: BaseException, where: str, what: str = "") -> TransportError:
    if isinstance(e, asyncio.IncompleteReadError):
        return TransportError(f"{what}{where}: the connection closed mid-answer ({len(e.partial)} bytes of {e.expected or 'more'} read)")
    if isinstance(e, asyncio.LimitOverrunError):
        return TransportError(f"{what}{where}: a header block or chunk-size line over {HEADER_LIMIT:,} bytes")
    return TransportError(f"{what}{where}: {type(e).__name__}: {e}" if str(e) else f"{what}{where}: {type(e).__name__}")


def multipart_form(fields: dict[str, str], file_field: str, filename: str, data: bytes, mime: str) -> tuple[bytes, str]:
    """(body, Content-Type) of a multipart/form-data upload: text ``fields`` and one file."""
    import secrets

    boundary = "mirageflow-" + secrets.token_hex(16)
    for value in (*fields, *fields.values(), file_field, filename, mime):
        if any(c in value for c in '"\r\n\0'):
            raise ValueError(f"a multipart field name or value with a quote, line break or NUL: {value[:60]!r}")
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode() for name, value in fields.items()]
    parts.append(
        f'--{boundary}\r\nContent-Disposition: form-data; name="{file_field}"; filename="{filename}"\r\n'
        f"Content-Type: {mime}\r\n\r\n".encode()
    )
    return b"".join(parts) + data + f"\r\n--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def origin_of(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of ``url``, the port made explicit: what credentials are bound to."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"bad port in {display_url(url)}") from None
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), port or (443 if scheme == "https" else 80)


def _basic(user: str, password: str) -> str:
    pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
    return "Basic " + base64.b64encode(pair.encode()).decode()


def _ssl_context(trust_env: bool):
    import httpx2  # its trust store (certifi-free: the system's, or SSL_CERT_FILE / SSL_CERT_DIR)

    return httpx2.create_ssl_context(trust_env=trust_env)


def _proxy_for(url: urllib.parse.SplitResult, trust_env: bool) -> urllib.parse.SplitResult | None:
    """The proxy the environment names for ``url`` (HTTP_PROXY, HTTPS_PROXY, ALL_PROXY, NO_PROXY), if any."""
    if not trust_env:
        return None
    proxies = urllib.request.getproxies_environment()
    chosen = proxies.get(url.scheme) or proxies.get("all")
    if not chosen or urllib.request.proxy_bypass_environment(url.hostname, proxies):
        return None
    proxy = urllib.parse.urlsplit(chosen if "://" in chosen else f"http://{chosen}")
    if proxy.scheme != "http" or not proxy.hostname:
        raise ValueError(f"proxy {display_url(chosen)} for {display_url(url.geturl())}: only http:// proxies are supported")
    return proxy


def get_blocking(url: str, timeout: float) -> Response:
    """``GET url`` from synchronous code (a thread without a running event loop: a health
    poll, a metrics sampler), on a connection of its own; ``timeout`` bounds all of it."""
    parts = urllib.parse.urlsplit(url)
    base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "", parts.query, ""))
    client = HTTPClient(base, timeout=timeout, trust_env=False)

    async def get() -> Response:
        try:
            return await client.get(parts.path or "/")
        finally:
            await client.aclose()

    return asyncio.run(get())
