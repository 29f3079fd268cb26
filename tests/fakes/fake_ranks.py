"""A real TCP rendezvous between the ranks of a stand-in server spanning nodes
(fake_sglang_server.py with ``--nnodes N --node-rank R --dist-init-addr HOST:PORT``).

As SGLang's (torch.distributed's) does: rank 0 listens on PORT and waits until every other
rank connected and said its rank; only then does it serve HTTP. Ranks 1..N-1 connect (retrying
until rank 0 listens), say their rank, and hold the connection: they serve nothing. A lost
connection is a lost rank (as NCCL's collective fails): rank 0 exits with code 9 when any other
rank goes, the others exit with code 9 when rank 0 goes. Trouble from the environment:

- FAKE_RANK_EXIT_AT_START=r   rank r exits with code 3 before joining
- FAKE_RANK_NEVER_JOINS=r     rank r runs but never connects
"""

from __future__ import annotations

import os
import socket
import threading
import time

LOST = 9


def _say(text: str) -> None:
    print(f"fake rendezvous: {text}", flush=True)


def join(nnodes: int, node_rank: int, addr: str) -> None:
    """Returns once every rank joined (rank 0); never returns for the other ranks."""
    host, _, port = addr.rpartition(":")
    _say(f"rank {node_rank} of {nnodes}, meeting at {addr}, pid {os.getpid()}")
    if os.environ.get("FAKE_RANK_EXIT_AT_START") == str(node_rank):
        _say(f"rank {node_rank}: RuntimeError: NCCL error: unhandled system error")
        raise SystemExit(3)
    if os.environ.get("FAKE_RANK_NEVER_JOINS") == str(node_rank):
        _say(f"rank {node_rank} stuck before joining")
        while True:
            time.sleep(60)
    if node_rank == 0:
        _lead(nnodes, int(port))
    else:
        _follow(node_rank, host, int(port))


def _lead(nnodes: int, port: int) -> None:
    listener = socket.create_server(("", port), reuse_port=False)
    peers = {}
    while len(peers) < nnodes - 1:
        conn, _ = listener.accept()
        rank = int(conn.makefile().readline())
        peers[rank] = conn
        _say(f"rank {rank} joined")
    _say(f"all {nnodes} ranks joined")
    for rank, conn in peers.items():
        threading.Thread(target=_watch, args=(conn, f"lost rank {rank}"), daemon=True).start()


def _follow(node_rank: int, host: str, port: int) -> None:
    deadline = time.monotonic() + 120
    while True:
        try:
            conn = socket.create_connection((host, port), timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline:
                _say(f"rank {node_rank}: rank 0 at {host}:{port} never answered")
                raise SystemExit(LOST) from None
            time.sleep(0.1)
    conn.settimeout(None)
    conn.sendall(f"{node_rank}\n".encode())
    _say(f"rank {node_rank} joined rank 0")
    _watch(conn, "lost rank 0")


def _watch(conn: socket.socket, lost: str) -> None:
    try:
        while conn.recv(1):
            pass
    except OSError:
        pass
    _say(lost)
    os._exit(LOST)
