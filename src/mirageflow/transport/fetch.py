"""GET a URL that an answer named (a batch's results_url, an image answer's ``data[].url``, a
remote image input), following redirects: the one place where a URL from outside our
config is fetched, so the one place that decides whether credentials go with it.

The rule: credentials belong to the configured origin (scheme, host and port of
``base_url``). ``get_url(client, url)`` sends ``url`` through ``client`` (with its
credentials) only when ``url`` is on the client's origin; any other URL, and every
redirect target (also one back on that origin), is fetched by a client of its own that
carries no credentials and no userinfo, whatever the credentials' header is called. At
most ``MAX_REDIRECTS`` redirects; ``timeout`` bounds the whole fetch, redirects included;
``max_bytes`` caps each answer (``ResponseTooLarge``).
"""

from __future__ import annotations

import asyncio
import urllib.parse

from mirageflow.transport.http_client import MAX_BODY_BYTES, DeadlineExceeded, HTTPClient, Response, TransportError, display_url, origin_of

MAX_REDIRECTS = 5
REDIRECT_STATUS = frozenset({301, 302, 303, 307, 308})


async def get_url(
    client: HTTPClient | None,
    url: str,
    *,
    timeout: float,
    max_bytes: int = MAX_BODY_BYTES,
    trust_env: bool = True,
) -> Response:
    """``GET url``: with ``client``'s credentials only on its origin, without any elsewhere and
    after any redirect (see the module). Returns the final answer (any status; a 3xx only
    past MAX_REDIRECTS or without a Location). TransportError when no whole answer came."""
    try:
        async with asyncio.timeout(timeout):
            return await _follow(client, url, max_bytes, trust_env)
    except TimeoutError:
        raise DeadlineExceeded(f"no whole answer from {display_url(url)} within {timeout:g} s") from None


async def _follow(client: HTTPClient | None, url: str, max_bytes: int, trust_env: bool) -> Response:
    for hop in range(MAX_REDIRECTS + 1):
        if hop == 0 and client is not None and _same_origin(client, url):
            response = await client.request("GET", _target(url, client.prefix), timeout=None)
        else:
            response = await _bare_get(url, max_bytes, trust_env)
        location = response.headers.get("location")
        if response.status_code not in REDIRECT_STATUS or not location or hop == MAX_REDIRECTS:
            return response
        url = urllib.parse.urljoin(url, location)
    raise AssertionError("unreachable")  # pragma: no cover


def _same_origin(client: HTTPClient, url: str) -> bool:
    try:
        return origin_of(url) == client.origin and urllib.parse.urlsplit(url).path.startswith(client.prefix)
    except ValueError:
        return False


def _target(url: str, prefix: str = "") -> str:
    """The request path of ``url`` (below ``prefix``, which the client adds back)."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path[len(prefix) :] or "/"
    return path + (f"?{parts.query}" if parts.query else "")


async def _bare_get(url: str, max_bytes: int, trust_env: bool) -> Response:
    """GET on a client of its own, without credentials: userinfo and query are not reused as auth."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
        raise TransportError(f"not an http(s) URL: {display_url(url)}")
    hostport = parts.netloc.rpartition("@")[2]  # userinfo dropped: no Basic auth from an answer's URL
    bare = HTTPClient(f"{parts.scheme}://{hostport}", timeout=None, max_body_bytes=max_bytes, trust_env=trust_env)
    try:
        return await bare.request("GET", _target(url), timeout=None)
    finally:
        await bare.aclose()


def get_url_blocking(url: str, *, timeout: float, max_bytes: int = MAX_BODY_BYTES) -> Response:
    """``get_url(None, url)`` from synchronous code (a thread without a running event loop)."""
    return asyncio.run(get_url(None, url, timeout=timeout, max_bytes=max_bytes))
