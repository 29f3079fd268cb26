"""A TCP server on 127.0.0.1 whose HTTP answers are scripted byte by byte: hostile servers
for transport/http_client.py (chunked bodies, Connection: close, trickles, resets, garbage).

``RawServer(handler)`` runs ``handler(conn)`` in a thread for each accepted connection;
``conn.read_request()`` reads one request (None when the client closed), ``conn.send``,
``conn.close`` and ``conn.reset`` (an RST) answer. ``server.connections`` counts the
connections accepted, ``server.requests`` records (request line, headers, body) in order.
"""

from __future__ import annotations

import socket
import struct
import threading
import time


class RawConnection:
    def __init__(self, server: "RawServer", sock: socket.socket):
        self.server, self.sock, self.buffer = server, sock, b""

    def read_request(self) -> tuple[str, dict[str, str], bytes] | None:
        while b"\r\n\r\n" not in self.buffer:
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buffer += data
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
        length = int(headers.get("content-length") or 0)
        while len(self.buffer) < length:
            data = self.sock.recv(65536)
            if not data:
                return None
            self.buffer += data
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        with self.server.lock:
            self.server.requests.append((line, headers, body))
        return line, headers, body

    def send(self, data: bytes, pause: float = 0.0, step: int | None = None) -> None:
        """``data``, in pieces of ``step`` bytes ``pause`` seconds apart when given."""
        if step is None:
            self.sock.sendall(data)
            return
        for i in range(0, len(data), step):
            self.sock.sendall(data[i : i + step])
            time.sleep(pause)

    def close(self) -> None:
        self.sock.close()

    def reset(self) -> None:
        """Close with an RST (SO_LINGER 0), as a crashed peer or a middlebox does."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()


class RawServer:
    def __init__(self, handler):
        self.handler = handler
        self.lock = threading.Lock()
        self.connections = 0
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.open: list[socket.socket] = []
        self._stopped = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._stopped:
            try:
                sock, _ = self.sock.accept()
            except OSError:
                return
            with self.lock:
                self.connections += 1
                self.open.append(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            self.handler(RawConnection(self, sock))
        except OSError:  # the client went away: its business
            pass
        finally:
            try:
                sock.close()
            except OSError:
                pass

    def stop(self) -> None:
        self._stopped = True
        self.sock.close()
        for sock in self.open:
            try:
                sock.close()
            except OSError:
                pass


def answer(status: int = 200, body: bytes = b'{"ok": true}', headers: dict[str, str] | None = None, length: bool = True) -> bytes:
    """An HTTP/1.1 answer; ``length=False`` leaves out Content-Length (a body to EOF)."""
    lines = [f"HTTP/1.1 {status} X"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    if length:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
