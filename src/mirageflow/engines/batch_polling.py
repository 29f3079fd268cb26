"""The batch_api engine's polling (a part of engines/batch_api.py): one submitted batch
watched until it ends, with backoff, an outage limit and a deadline past its window.

Polls back off (``poll_seconds``, x1.5 per poll, at most ``poll_max_seconds``). An outage
(the transport's retries spent: engines/batch_providers.py) is tolerated for
``POLL_OUTAGE_SECONDS`` in a row, then fails the shard (a rerun re-attaches); a permanent
answer (401, 403, 404) fails it at once, naming batches.json, the batch id and the command
that submits the batch again. A batch still running ``deadline_grace_seconds`` past its
completion window is cancelled, and one that has not ended ``CANCEL_WAIT_SECONDS`` later
fails the shard.
"""

from __future__ import annotations

import asyncio
import logging
import time

from mirageflow.engines.base import EngineError
from mirageflow.engines.batch_providers import PermanentAnswer

log = logging.getLogger(__name__)

POLL_OUTAGE_SECONDS = 1800.0  # polls failing this long in a row fail the shard
CANCEL_WAIT_SECONDS = 3600.0  # a batch cancelled at its deadline that has not ended after this fails the shard
WINDOW_SECONDS = {"24h": 86400.0}
POLL_MEANS = {
    401: "the key (api_key_env) is refused: it was rotated or revoked, or belongs to another account",
    403: "the key (api_key_env) may not read this batch: another account or project",
    404: "the provider does not know this batch id: another base_url or account, or a gateway that lost its state",
}


class BatchPoller:
    """Polls the provider about the shard's recorded batches (``ledger``: shard/ledger.py),
    recording each change of status through ``record`` (an ``async (key, **fields)``)."""

    def __init__(self, provider, client, ledger, settings, record):
        self.provider, self.client, self.ledger, self.settings = provider, client, ledger, settings
        self.record = record

    async def until_ended(self, key: str):
        """Poll chunk ``key``'s batch until it ends; its last state (batch_providers.BatchState)."""
        entry = self.ledger.entries[key]
        batch_id = entry["batch_id"]
        delay, failing_since, cancelled_at = self.settings.poll_seconds, None, None
        deadline = (
            float(entry.get("submitted_ts") or time.time())
            + WINDOW_SECONDS.get(self.settings.completion_window, 86400.0)
            + self.settings.deadline_grace_seconds
        )
        while True:
            await asyncio.sleep(delay)
            delay = min(delay * 1.5, self.settings.poll_max_seconds)
            try:
                state = await self.provider.poll(self.client, batch_id)
            except PermanentAnswer as e:  # 401/403/404: the same on every poll, on every rerun
                raise self.unusable(key, e, POLL_MEANS[e.status]) from None
            except EngineError as e:
                failing_since = failing_since or time.monotonic()
                if time.monotonic() - failing_since > POLL_OUTAGE_SECONDS:
                    raise EngineError(
                        f"batch {batch_id}: status polls failed for {POLL_OUTAGE_SECONDS:.0f} s: {e}; rerun the shard to re-attach"
                    ) from e
                log.warning("batch %s: status poll failed (%s); trying again in %.0f s", batch_id, e, delay)
                continue
            failing_since = None
            if state.status != entry.get("status"):
                await self.record(key, status=state.status, counts=state.raw.get("request_counts"))
            if state.ended:
                return state
            if cancelled_at is None and time.time() > deadline:
                log.warning("batch %s is still %s past its completion window: cancelling it", batch_id, state.status)
                await self.provider.cancel(self.client, batch_id)
                cancelled_at = time.time()
            elif cancelled_at is not None and time.time() - cancelled_at > CANCEL_WAIT_SECONDS:
                raise EngineError(f"batch {batch_id} was cancelled at its deadline and has not ended {CANCEL_WAIT_SECONDS:.0f} s later")

    def unusable(self, key: str, error: PermanentAnswer, meaning: str) -> EngineError:
        """The shard's failure for a recorded batch the provider answers 401/403/404 about:
        what happened, where the batch is recorded and the one command that submits it again."""
        batch_id = self.ledger.entries[key].get("batch_id")
        return EngineError(
            f"batch {batch_id} (chunk {key}): {error}: {meaning}. It is recorded in {self.ledger.path}, so every rerun "
            f"asks for it again. To submit its requests again (they are paid again): "
            f"mmirage retry --config <your config> --resubmit-batch {batch_id}"
        )
