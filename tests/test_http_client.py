"""transport/http_client.py against hostile servers (tests/fakes/raw_http.py: real sockets,
answers scripted byte by byte), and post_with_retries on top of it."""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import threading
import time

import pytest

from fakes.raw_http import answer
from mirageflow.engines.http import EngineError, post_with_retries
from mirageflow.transport.http_client import (
    DeadlineExceeded,
    HTTPClient,
    ResponseTooLarge,
    TransportError,
    display_url,
    dumps,
    loads,
)


def each_request(reply):
    """A handler answering every request of a connection with ``reply(conn, request, n)``
    (n counts the requests of the whole server); reply returns False to end the connection."""
    count = [0]
    lock = threading.Lock()

    def handler(conn):
        while (request := conn.read_request()) is not None:
            with lock:
                n = count[0]
                count[0] += 1
            if reply(conn, request, n) is False:
                return

    return handler


def run(coro):
    return asyncio.run(coro)


async def posts(client: HTTPClient, n: int, path: str = "/x", obj=None):
    return [await client.post_json(path, obj if obj is not None else {"i": i}) for i in range(n)]


# --------------------------------------------------------------------------- framing


def test_content_length_answers_reuse_one_connection(raw_servers):
    s = raw_servers(each_request(lambda conn, req, n: conn.send(answer(body=json.dumps({"n": n}).encode()))))
    client = HTTPClient(s.url, timeout=5)
    out = run(posts(client, 5))
    assert [r.json()["n"] for r in out] == list(range(5)) and all(r.status_code == 200 for r in out)
    assert s.connections == 1  # keep-alive
    line, headers, body = s.requests[0]
    assert line == "POST /x HTTP/1.1" and headers["content-type"] == "application/json" and json.loads(body) == {"i": 0}
    assert headers["host"] == f"127.0.0.1:{s.port}"


def test_chunked_body_with_extensions_and_trailers(raw_servers):
    body = b'{"text": "' + b"x" * 5000 + b'"}'
    chunks = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(body[i : i + 777]), body[i : i + 777]) for i in range(0, len(body), 777))
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\nX-Trailer: 1\r\n\r\n"
    s = raw_servers(each_request(lambda conn, req, n: conn.send(wire)))
    client = HTTPClient(s.url, timeout=5)
    out = run(posts(client, 2))
    assert all(r.json() == {"text": "x" * 5000} for r in out)
    assert s.connections == 1  # the trailers were read: the connection stayed usable


def test_connection_close_and_a_body_to_eof(raw_servers):
    def reply(conn, req, n):
        if n % 2 == 0:
            conn.send(answer(body=b'{"n": %d}' % n, headers={"Connection": "close"}))
        else:  # no Content-Length: the body ends with the connection
            conn.send(answer(body=b'{"n": %d}' % n, length=False))
        conn.close()
        return False

    s = raw_servers(each_request(reply))
    client = HTTPClient(s.url, timeout=5)
    out = run(posts(client, 4))
    assert [r.json()["n"] for r in out] == [0, 1, 2, 3]
    assert s.connections == 4  # none reused


def test_an_answer_in_one_byte_pieces_and_an_interim_100(raw_servers):
    wire = b"HTTP/1.1 100 Continue\r\n\r\n" + answer(body=b'{"slow": true}', headers={"X-A": "1", "x-a": "2"})
    s = raw_servers(each_request(lambda conn, req, n: conn.send(wire, pause=0.001, step=1)))
    (r,) = run(posts(HTTPClient(s.url, timeout=10), 1))
    assert r.json() == {"slow": True} and r.headers["x-a"] == "1, 2"


@pytest.mark.parametrize("wire, match", [
    (b"SPDY/3 200 OK\r\n\r\n", "not an HTTP/1.x answer"),
    (b"HTTP/1.1 2xx OK\r\n\r\n", "not an HTTP/1.x answer"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -4\r\n\r\n", "malformed Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello", "malformed Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "malformed chunk size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n0\r\n\r\n", "chunk longer than its size"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\n", "Transfer-Encoding 'gzip'"),
    (b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70_000 + b"\r\n\r\n", "header block or chunk-size line over"),
])  # fmt: skip
def test_malformed_answers_are_transport_errors(raw_servers, wire, match):
    s = raw_servers(each_request(lambda conn, req, n: conn.send(wire)))
    with pytest.raises(TransportError, match=match):
        run(posts(HTTPClient(s.url, timeout=5), 1))


# --------------------------------------------------------------------------- limits and deadlines


def test_a_trickle_fails_at_the_total_deadline(raw_servers):
    wire = answer(body=b'{"a": "' + b"x" * 200 + b'"}')
    s = raw_servers(each_request(lambda conn, req, n: conn.send(wire, pause=0.05, step=1)))  # 1 byte / 50 ms: each read is quick
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded, match=r"no whole answer from http://127\.0\.0\.1:\d+/x within 0\.5 s"):
        run(posts(HTTPClient(s.url, timeout=0.5), 1))
    assert 0.45 < time.monotonic() - t0 < 2.0


def test_a_silent_server_fails_at_the_deadline_and_connecting_has_its_own(raw_servers):
    s = raw_servers(each_request(lambda conn, req, n: time.sleep(3)))
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded):
        run(HTTPClient(s.url, timeout=0.3).get("/health"))
    assert time.monotonic() - t0 < 1.5
    with pytest.raises(TransportError, match="could not connect to http://127.0.0.1:9"):
        run(HTTPClient("http://127.0.0.1:9", timeout=5).get("/"))  # refused: at once


@pytest.mark.parametrize("framing", ["length", "chunked", "eof"])
def test_an_oversized_body_is_refused(raw_servers, framing):
    big = b"x" * 5000
    wire = {
        "length": answer(body=big),
        "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + (b"3e8\r\n" + b"x" * 1000 + b"\r\n") * 5 + b"0\r\n\r\n",
        "eof": answer(body=big, length=False),
    }[framing]

    def reply(conn, req, n):
        conn.send(wire)
        if framing == "eof":
            conn.close()
            return False

    s = raw_servers(each_request(reply))
    with pytest.raises(ResponseTooLarge, match="a body over 4,000 bytes"):
        run(posts(HTTPClient(s.url, timeout=5, max_body_bytes=4000), 1))


# --------------------------------------------------------------------------- keep-alive after errors


def test_a_reset_mid_body_fails_that_request_and_the_next_one_works(raw_servers):
    def reply(conn, req, n):
        if n == 0:
            conn.send(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * 10)
            time.sleep(0.05)
            conn.reset()
            return False
        conn.send(answer())

    s = raw_servers(each_request(reply))
    client = HTTPClient(s.url, timeout=5)

    async def go():
        with pytest.raises(TransportError, match="closed mid-answer|ConnectionResetError"):
            await client.post_json("/x", {})
        return await client.post_json("/x", {})

    assert run(go()).json() == {"ok": True}
    assert s.connections == 2


def test_a_connection_the_server_closed_while_idle_is_not_used(raw_servers):
    def reply(conn, req, n):  # answers keep-alive, then hangs up without saying so
        conn.send(answer())
        time.sleep(0.05)
        conn.close()
        return False

    s = raw_servers(each_request(reply))
    client = HTTPClient(s.url, timeout=5)

    async def go():
        out = []
        for _ in range(3):
            out.append(await client.post_json("/x", {}))
            await asyncio.sleep(0.2)  # the FIN arrives while the connection is idle
        return out

    assert all(r.status_code == 200 for r in run(go()))
    assert s.connections == 3


def test_a_reused_connection_closed_as_we_send_is_retried_once(raw_servers):
    def reply(conn, req, n):
        if n == 0:
            conn.send(answer())
            conn.read_request()  # the second request arrives on the reused connection...
            conn.close()  # ...and the server closes without an answer (its keep-alive timeout)
            return False
        conn.send(answer(body=b'{"second": true}'))

    s = raw_servers(each_request(reply))
    client = HTTPClient(s.url, timeout=5)
    out = run(posts(client, 2))
    assert out[1].json() == {"second": True} and s.connections == 2


def test_a_fresh_connection_that_closes_without_answering_is_an_error(raw_servers):
    s = raw_servers(lambda conn: (conn.read_request(), conn.close()))
    with pytest.raises(TransportError, match="closed mid-answer"):
        run(posts(HTTPClient(s.url, timeout=5), 1))


def test_the_client_works_across_event_loops(raw_servers):
    s = raw_servers(each_request(lambda conn, req, n: conn.send(answer())))
    client = HTTPClient(s.url, timeout=5, max_connections=2)
    for _ in range(3):  # each asyncio.run is a new loop: a new pool
        assert [r.status_code for r in run(posts(client, 2))] == [200, 200]
    client.close()
    with pytest.raises(TransportError, match="is closed"):
        run(posts(client, 1))


def test_max_connections_caps_requests_in_flight(raw_servers):
    peak, now, lock = [0], [0], threading.Lock()

    def reply(conn, req, n):
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.05)
        with lock:
            now[0] -= 1
        conn.send(answer())

    s = raw_servers(each_request(reply))
    client = HTTPClient(s.url, timeout=5, max_connections=3)

    async def go():
        return await asyncio.gather(*(client.post_json("/x", {}) for _ in range(12)))

    assert len(run(go())) == 12 and peak[0] == 3 and s.connections == 3


# --------------------------------------------------------------------------- URL, auth, secrets


def test_base_url_path_query_and_userinfo(raw_servers):
    s = raw_servers(each_request(lambda conn, req, n: conn.send(answer())))
    url = s.url.replace("http://", "http://me:p%40ss@") + "/v1/?key=sek&x"
    client = HTTPClient(url, timeout=5, headers={"X-Extra": "1"})
    run(client.post_json("/chat/completions", {}))
    run(client.get("/models?limit=2"))
    (line1, headers, _), (line2, _, _) = s.requests
    assert line1 == "POST /v1/chat/completions?key=sek&x HTTP/1.1"
    assert line2 == "GET /v1/models?limit=2&key=sek&x HTTP/1.1"
    import base64

    assert headers["authorization"] == "Basic " + base64.b64encode(b"me:p@ss").decode() and headers["x-extra"] == "1"
    assert client.display == f"http://me:***@127.0.0.1:{s.port}/v1?key=***&***"
    assert client.url("/chat/completions") == f"http://me:***@127.0.0.1:{s.port}/v1/chat/completions?key=***&***"
    bearer = HTTPClient(url, headers={"Authorization": "Bearer k"})  # an API key wins over userinfo
    assert b"Basic" not in bearer._head and b"Bearer k" in bearer._head


def test_display_url_masks_every_secret():
    assert display_url("https://u:pw@h:1/p?a=1&b=&c#frag") == "https://u:***@h:1/p?a=***&b=***&***"
    assert display_url("http://tokenonly@h/v1") == "http://***@h/v1"
    assert display_url("http://h:8000/v1") == "http://h:8000/v1"


def test_errors_never_show_the_password_or_query_values(raw_servers):
    s = raw_servers(lambda conn: (conn.read_request(), conn.reset()))
    url = s.url.replace("http://", "http://me:hunter2@") + "/v1?key=sk-query-secret"
    for target in (url, "http://me:hunter2@127.0.0.1:9/v1?key=sk-query-secret"):
        with pytest.raises(TransportError) as err:
            run(HTTPClient(target, timeout=5).post_json("/chat/completions", {}))
        assert "hunter2" not in str(err.value) and "sk-query-secret" not in str(err.value)
    with pytest.raises(ValueError) as err:
        HTTPClient("ftp://me:hunter2@h/")
    assert "hunter2" not in str(err.value)


def test_a_header_with_a_line_break_is_refused_without_showing_it():
    with pytest.raises(ValueError, match="line break") as err:
        HTTPClient("http://h", headers={"Authorization": "Bearer sk-1\r\nX-Injected: 1"})
    assert "sk-1" not in str(err.value)


# --------------------------------------------------------------------------- JSON


def test_json_round_trips_what_orjson_refuses():
    assert loads(dumps({"big": 2**70, "text": "é"})) == {"big": 2**70, "text": "é"}  # the stdlib fallback
    assert dumps({"a": [1, "é"]}) == '{"a":[1,"é"]}'.encode()
    assert json.loads(dumps({"s": "a\ud800b"})) == {"s": "a\ud800b"}  # a lone surrogate goes escaped, never a crash
    assert loads(b'{"x": NaN}')["x"] != loads(b'{"x": NaN}')["x"]  # the stdlib accepts NaN
    with pytest.raises(ValueError):
        loads(b"<html>")


# --------------------------------------------------------------------------- post_with_retries


def retrying(client, path="/x", **kw):
    kw = {"max_retries": 3, "timeout": 5.0, "base_delay": 0.01, "max_delay": 1.0, "what": f"POST {client.url(path)}", **kw}
    return post_with_retries(client, path, {"q": 1}, **kw)


def test_429_with_retry_after_and_5xx_are_retried(raw_servers):
    times = []

    def reply(conn, req, n):
        times.append(time.monotonic())
        if n == 0:
            conn.send(answer(429, b'{"error": {"message": "slow down"}}', headers={"Retry-After": "0.4"}))
        elif n == 1:
            conn.send(answer(502, b"<html>bad gateway</html>"))
        else:
            conn.send(answer(body=b'{"done": 1}'))

    s = raw_servers(each_request(reply))
    response = run(retrying(HTTPClient(s.url, timeout=5)))
    assert response.json() == {"done": 1} and len(times) == 3
    assert times[1] - times[0] >= 0.39  # Retry-After honoured


def test_a_non_json_answer_is_retried_then_fails_naming_the_redacted_url(raw_servers):
    bodies = [b"<html>proxy error</html>", b'{"fine": true}']
    s = raw_servers(each_request(lambda conn, req, n: conn.send(answer(body=bodies[min(n, 1)], headers={"Content-Type": "text/html"}))))
    assert run(retrying(HTTPClient(s.url, timeout=5))).json() == {"fine": True}  # once, then JSON

    s = raw_servers(each_request(lambda conn, req, n: conn.send(answer(body=b"<html>always</html>"))))
    client = HTTPClient(s.url.replace("http://", "http://me:hunter2@") + "/v1?key=sk-q", timeout=5)
    with pytest.raises(EngineError) as err:
        run(retrying(client, "/chat/completions", max_retries=2))
    message = str(err.value)
    assert "gave up after 2 retries" in message and "not JSON" in message and "<html>always</html>" in message
    assert f"me:***@127.0.0.1:{s.port}/v1/chat/completions?key=***" in message
    assert "hunter2" not in message and "sk-q" not in message and len(s.requests) == 3


def test_deadlines_per_attempt_and_an_oversized_answer_is_not_retried(raw_servers):
    s = raw_servers(each_request(lambda conn, req, n: time.sleep(1)))
    t0 = time.monotonic()
    with pytest.raises(EngineError, match=r"no answer within request_timeout=0\.2 s"):
        run(retrying(HTTPClient(s.url), timeout=0.2, max_retries=1))
    assert time.monotonic() - t0 < 1.5  # 2 attempts x 0.2 s + backoff

    s = raw_servers(each_request(lambda conn, req, n: conn.send(answer(body=b"x" * 2000))))
    with pytest.raises(EngineError, match="a body over 1,000 bytes"):
        run(retrying(HTTPClient(s.url, timeout=5, max_body_bytes=1000)))
    assert len(s.requests) == 1


# --------------------------------------------------------------------------- proxies and TLS


@pytest.fixture
def proxy(raw_servers):
    """An HTTP proxy: absolute-form requests forwarded, CONNECT tunnels piped."""
    import socket

    seen = []

    def handler(conn):
        request = conn.read_request()
        if request is None:
            return
        line, headers, body = request
        seen.append((line, headers))
        method, target, _ = line.split(" ")
        if method == "CONNECT":
            host, port = target.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)))
            conn.send(b"HTTP/1.1 200 Connection established\r\n\r\n")
            pipe(conn.sock, upstream)
            return
        from urllib.parse import urlsplit

        u = urlsplit(target)
        upstream = socket.create_connection((u.hostname, u.port))
        head = f"{method} {u.path}{'?' + u.query if u.query else ''} HTTP/1.1\r\n" + "".join(
            f"{k}: {v}\r\n" for k, v in headers.items() if not k.startswith("proxy-")
        )  # fmt: skip
        upstream.sendall(head.encode() + b"\r\n" + body)
        upstream.shutdown(socket.SHUT_WR)
        conn.send(b"".join(iter(lambda: upstream.recv(65536), b"")))
        conn.close()

    server = raw_servers(handler)
    server.seen = seen
    return server


def pipe(a, b):
    def copy(src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    threading.Thread(target=copy, args=(b, a), daemon=True).start()
    copy(a, b)


def test_requests_go_through_the_environments_http_proxy(raw_servers, proxy, monkeypatch):
    s = raw_servers(each_request(lambda conn, req, n: conn.send(answer(headers={"Connection": "close"})) or False))
    monkeypatch.setenv("HTTP_PROXY", proxy.url.replace("http://", "http://pu:pp@"))
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    r = run(HTTPClient(s.url + "/v1?k=1", timeout=5).post_json("/chat/completions", {"a": 1}))
    assert r.json() == {"ok": True}
    line, headers = proxy.seen[0]
    assert line == f"POST {s.url}/v1/chat/completions?k=1 HTTP/1.1" and headers["proxy-authorization"].startswith("Basic ")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    run(HTTPClient(s.url, timeout=5).get("/direct"))
    assert len(proxy.seen) == 1  # bypassed
    assert run(HTTPClient(s.url, timeout=5, trust_env=False).get("/d")).status_code == 200 and len(proxy.seen) == 1


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (the openssl command line)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a test certificate")
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
        check=True, capture_output=True,
    )  # fmt: skip
    return d / "cert.pem", d / "key.pem"


def test_https_direct_and_through_a_connect_tunnel(raw_servers, proxy, certificate, monkeypatch):
    cert, key = certificate
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)

    def handler(conn):
        conn.sock = context.wrap_socket(conn.sock, server_side=True)
        while (request := conn.read_request()) is not None:
            conn.send(answer(body=json.dumps({"path": request[0].split(" ")[1]}).encode()))

    s = raw_servers(handler)
    url = f"https://127.0.0.1:{s.port}/v1"
    monkeypatch.delenv("HTTPS_PROXY", raising=False)
    with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):  # not trusted yet
        run(HTTPClient(url, timeout=5).get("/m"))
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    assert run(HTTPClient(url, timeout=5).get("/m")).json() == {"path": "/v1/m"}
    monkeypatch.setenv("HTTPS_PROXY", proxy.url)
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    out = run(posts(HTTPClient(url, timeout=5), 2, "/chat"))
    assert [r.json() for r in out] == [{"path": "/v1/chat"}] * 2
    assert [line for line, _ in proxy.seen] == [f"CONNECT 127.0.0.1:{s.port} HTTP/1.1"]  # one tunnel, reused
