"""How a shard ends when it does not succeed."""

from __future__ import annotations

import signal


class ShardFailed(RuntimeError):
    """The shard cannot succeed: error budget, accounting gap, engine crash, unwritable output."""


class ShardInterrupted(ShardFailed):
    """SIGTERM/SIGINT: finished rows were committed; a rerun resumes."""

    def __init__(self, signum: int, rows_done: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}; {rows_done} rows committed, rerun to resume")
