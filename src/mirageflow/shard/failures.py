"""How a shard ends when it does not succeed."""

from __future__ import annotations

import signal

from mirageflow.errors import MirageflowError


class ShardFailed(MirageflowError, RuntimeError):
    """The shard cannot succeed: error budget, accounting gap, engine crash, unwritable output."""


class ShardInterrupted(ShardFailed):
    """SIGTERM/SIGINT: finished rows were committed; a rerun resumes."""

    def __init__(self, signum: int, committed: str):
        """``committed``: what the shard has committed, in words ("8 rows", "16 samples (8 rows complete)")."""
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}; {committed} committed, rerun to resume")
