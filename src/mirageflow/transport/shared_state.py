"""A JSON object that the shards of a run share through a file in the state dir: read and
written under an fcntl lock for each use, so every shard, on this machine or on the
cluster's nodes, sees one set of numbers. The rate limits' pace (transport/rate_limit.py,
``<state_dir>/rate_limits/<processor>.json``) and the run's spend (transport/spend.py,
``<state_dir>/spend.json``) live in one each.

POSIX locks (``lockf``): NFS and Lustre (mounted with ``flock``) honour them across nodes.
The file holds wall-clock times where it holds times (``time.time()``: the nodes' clocks are
assumed in step, as NTP keeps them). A file left unreadable by a writer killed mid-write
starts afresh, with a warning.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import threading
from pathlib import Path
from typing import Iterator

log = logging.getLogger(__name__)


class SharedState:
    """The locked JSON object of one file (``use()``: read it, change it, written back on exit)."""

    def __init__(self, path: str | os.PathLike, what: str):
        self.path, self.what = Path(path), what
        self._fd: int | None = None
        self._thread_lock = threading.Lock()  # fcntl locks exclude processes, not threads of one

    @contextlib.contextmanager
    def use(self) -> Iterator[dict]:
        with self._thread_lock:
            if self._fd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            fd = self._fd
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(fd, 1 << 16, 0)
                try:
                    state = json.loads(raw) if raw else {}
                except ValueError:
                    log.warning("%s: unreadable shared state %s; starting it afresh", self.what, self.path)
                    state = {}
                yield state
                data = json.dumps(state, separators=(",", ":")).encode()
                os.pwrite(fd, data, 0)
                os.ftruncate(fd, len(data))
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
