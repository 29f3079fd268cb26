"""transport/: credentials reach only the origin they were configured for (issue 33 items 1-3,
issue 35 item 3), against real sockets (tests/fakes/raw_http.py): the client's own origin gets
them; another host, another port, another scheme and every redirect target do not, whatever
the header is called; an API key takes precedence over userinfo in the base URL."""

from __future__ import annotations

import asyncio
import base64

import pytest
from fakes.raw_http import RawServer, answer

from mirageflow.transport.fetch import get_url
from mirageflow.transport.http_client import HTTPClient, TransportError
from mirageflow.transport.retry import PERMANENT, REFUSED, TRANSIENT, PermanentStatus, RetryPolicy, classify, send_with_retries

SECRET = "sk-never-elsewhere"
CREDENTIALS = {"X-Custom-Key": SECRET, "Authorization": f"Bearer {SECRET}"}


def each_request(reply):
    def handler(conn):
        while (req := conn.read_request()) is not None:
            conn.send(reply(req))

    return handler


def _sent_secret(server: RawServer) -> bool:
    return any(SECRET in value for _, headers, _ in server.requests for value in headers.values())


def test_the_configured_origin_gets_the_credentials_and_no_other_origin_does(raw_servers):
    home = raw_servers(each_request(lambda req: answer(body=b"home")))
    other = raw_servers(each_request(lambda req: answer(body=b"other")))
    client = HTTPClient(home.url + "/v1", credentials=CREDENTIALS, timeout=5)

    async def fetch_all():
        own = await get_url(client, home.url + "/v1/results/1?x=1", timeout=5)
        port = await get_url(client, other.url + "/v1/results/1", timeout=5)  # another port
        host = await get_url(client, other.url.replace("127.0.0.1", "localhost") + "/r", timeout=5)  # another host name
        outside = await get_url(client, home.url + "/elsewhere", timeout=5)  # the origin, outside base_url's path
        await client.aclose()
        return own, port, host, outside

    own, port, host, outside = asyncio.run(fetch_all())
    assert (own.content, port.content, host.content, outside.content) == (b"home", b"other", b"other", b"home")
    (line, headers, _), (line2, headers2, _) = home.requests
    assert line == "GET /v1/results/1?x=1 HTTP/1.1" and headers["x-custom-key"] == SECRET
    assert line2 == "GET /elsewhere HTTP/1.1" and "x-custom-key" not in headers2 and "authorization" not in headers2
    assert len(other.requests) == 2 and not _sent_secret(other)


def test_another_scheme_on_the_same_host_and_port_gets_no_credentials(raw_servers):
    seen = []

    def record(conn):
        seen.append(conn.sock.recv(65536))

    plain = raw_servers(record)
    client = HTTPClient(plain.url, credentials=CREDENTIALS, timeout=5)
    with pytest.raises(TransportError):  # a TLS handshake against a socket that hangs up
        asyncio.run(get_url(client, plain.url.replace("http://", "https://") + "/x", timeout=5))
    assert seen and all(SECRET.encode() not in data for data in seen)


def test_a_redirect_target_gets_no_credentials_even_on_the_same_origin(raw_servers):
    other = raw_servers(each_request(lambda req: answer(body=b"there")))

    def home_reply(req):
        line = req[0]
        if line.startswith("GET /v1/first "):
            return answer(302, b"", {"Location": "/v1/second"})  # the same origin, reached by a redirect
        if line.startswith("GET /v1/second "):
            return answer(307, b"", {"Location": other.url + "/third"})
        return answer(404)

    home = raw_servers(each_request(home_reply))
    client = HTTPClient(home.url + "/v1", credentials=CREDENTIALS, timeout=5)
    response = asyncio.run(get_url(client, home.url + "/v1/first", timeout=5))
    assert response.status_code == 200 and response.content == b"there"
    (first, first_headers, _), (second, second_headers, _) = home.requests
    assert first.startswith("GET /v1/first ") and first_headers["x-custom-key"] == SECRET
    assert second.startswith("GET /v1/second ") and SECRET not in str(second_headers)
    assert len(other.requests) == 1 and not _sent_secret(other)


def test_an_api_key_takes_precedence_over_userinfo_and_userinfo_alone_is_basic_auth(raw_servers):
    home = raw_servers(each_request(lambda req: answer()))
    with_userinfo = home.url.replace("http://", "http://user:pw@") + "/v1"

    async def go():
        for client in (
            HTTPClient(with_userinfo, credentials={"x-api-key": "sk-ant"}, timeout=5),
            HTTPClient(with_userinfo, credentials={"Authorization": "Bearer sk-oai"}, timeout=5),
            HTTPClient(with_userinfo, timeout=5),
        ):
            await client.get("/models")
            await client.aclose()

    asyncio.run(go())
    (_, anthropic, _), (_, openai, _), (_, bare, _) = home.requests
    assert anthropic["x-api-key"] == "sk-ant" and "authorization" not in anthropic
    assert openai["authorization"] == "Bearer sk-oai"
    assert bare["authorization"] == "Basic " + base64.b64encode(b"user:pw").decode()


def test_statuses_are_classified_once_and_permanent_ones_are_not_retried(raw_servers):
    home = raw_servers(each_request(lambda req: answer(404, b'{"error": {"message": "no such batch"}}')))
    assert [classify(s) for s in (200, 429, 503, 401, 403, 404, 400, 422)] == ["ok"] + [TRANSIENT] * 2 + [PERMANENT] * 3 + [REFUSED] * 2
    client = HTTPClient(home.url, credentials=CREDENTIALS, timeout=5)
    policy = RetryPolicy(retries=3, base_delay=0.01, max_delay=0.01, timeout=5)
    with pytest.raises(PermanentStatus, match="HTTP 404: no such batch") as raised:
        asyncio.run(send_with_retries(client, "GET", "/b/1", policy=policy, what="GET /b/1", permanent_raises=True))
    assert raised.value.status == 404 and len(home.requests) == 1
