"""The batch_api engine's chunks (a part of engines/batch_api.py): request lines joining the
open chunk of their round until it is sealed (``OpenChunks``), a sealed chunk recorded and
sent (``BatchSubmitter``), and MMIRAGE's receipt of each submitted one (``Receipts``).

A line joins the open chunk until the next one would pass ``max_chunk_bytes`` or
``max_requests_per_chunk``, or no request came for the engine's ``seal_idle_seconds``
(every row in flight is waiting): then the chunk is sealed and handed to ``on_sealed``. A
line larger than a chunk goes alone (``isolate``) or is refused (``reject``, or beyond the
provider's limit). Round 0 holds first submissions, round 1 the requests an expired or
cancelled batch did not run.

A sealed chunk's lines go to ``batches/<key>.jsonl`` and its entry to ``batches.json``
(shard/ledger.py), fsynced, before it is sent; the batch id is recorded as soon as the
provider answers, before anything waits on it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from mirageflow.config.types import BATCH_LIMITS
from mirageflow.engines.base import EngineError
from mirageflow.engines.batch_providers import ProviderRefused
from mirageflow.files import atomic_write_bytes
from mirageflow.stats.formulas import utc_now

log = logging.getLogger(__name__)


def unit_of(custom_id: str) -> int:
    """The unit (row, or row's sample) of a custom_id ``u<unit>-<16 hex>``."""
    return int(custom_id[1 : custom_id.index("-")])


@dataclass
class Chunk:
    round: int  # 0: first submission; 1: the requests an expired or cancelled batch did not run
    ids: list[str] = field(default_factory=list)
    lines: list[bytes] = field(default_factory=list)
    size: int = 0
    last_add: float = 0.0
    reason: str = "idle"


class OpenChunks:
    """The chunk being filled in each round; ``on_sealed(chunk)`` (in the engine's loop) gets
    each sealed one."""

    def __init__(self, settings, seal_idle_seconds: float, on_sealed: Callable[[Chunk], None]):
        self.settings, self.seal_idle_seconds, self.on_sealed = settings, seal_idle_seconds, on_sealed
        self._open: dict[int, Chunk | None] = {0: None, 1: None}
        self._sealer: asyncio.Task | None = None

    def add(self, cid: str, line: bytes, round_: int) -> str | None:
        """Add a line to the open chunk of its round (sealing it first when full); why it is
        refused when it is too large for any chunk (None: added)."""
        size = len(line) + 1
        limit = self.settings.max_chunk_bytes
        if size > limit:
            provider_max = BATCH_LIMITS[self.settings.provider][1]
            if self.settings.oversized_request_policy == "reject" or size > provider_max:
                cap = limit if self.settings.oversized_request_policy == "reject" else provider_max
                return f"the request is {size} bytes; a batch may hold {cap}"
            self.seal(round_)  # isolate: alone in a chunk of its own
            self._open[round_] = Chunk(round_, [cid], [line], size, time.monotonic(), "oversized")
            self.seal(round_)
            return None
        chunk = self._open[round_]
        if chunk is not None and (chunk.size + size > limit or len(chunk.ids) + 1 > self.settings.max_requests_per_chunk):
            chunk.reason = "full_chunk"
            self.seal(round_)
        chunk = self._open[round_]
        if chunk is None:
            chunk = self._open[round_] = Chunk(round_)
        chunk.ids.append(cid)
        chunk.lines.append(line)
        chunk.size += size
        chunk.last_add = time.monotonic()
        if self._sealer is None or self._sealer.done():
            self._sealer = asyncio.create_task(self._seal_when_idle())
        return None

    def seal(self, round_: int) -> None:
        chunk, self._open[round_] = self._open[round_], None
        if chunk is not None and chunk.ids:
            self.on_sealed(chunk)

    async def _seal_when_idle(self) -> None:
        """Seal an open chunk once no request joined it for seal_idle_seconds."""
        while any(self._open.values()):
            await asyncio.sleep(max(0.01, self.seal_idle_seconds / 4))
            for round_, chunk in list(self._open.items()):
                if chunk is not None and time.monotonic() - chunk.last_add >= self.seal_idle_seconds:
                    self.seal(round_)


class BatchSubmitter:
    """Sends sealed chunks: each spooled and recorded first, held on the budget (``budget``:
    batch_budget.py) before anything is written, its batch id recorded once the provider has
    it; and re-attaches to the chunks an earlier attempt recorded (shard/ledger.py)."""

    def __init__(self, provider, client, ledger, results, budget, receipts, shard_id: int, record):
        self.provider, self.client, self.ledger, self.results = provider, client, ledger, results
        self.budget, self.receipts, self.shard_id, self.record = budget, receipts, shard_id, record

    async def reattach(self) -> list[str]:
        """Pick up the chunks of earlier attempts: ended ones' results indexed, sealed ones
        without a recorded id found in the provider's list (adopted) or given up (their rows
        are submitted again); the keys of those still running, to watch again."""
        running = []
        for key in sorted(self.ledger.entries):
            entry = self.ledger.entries[key]
            state = entry.get("state")
            if state == "sealed":
                found = await self.provider.find(self.client, key)
                if found:
                    log.warning("batch chunk %s: created as %s before the last attempt stopped; waiting for it", key, found)
                    await self.record(
                        key, state="submitted", batch_id=found, submitted_ts=time.time(), submitted_at=utc_now(), adopted=True
                    )
                    state = "submitted"
                else:
                    log.warning("batch chunk %s was sealed but never submitted: its rows are submitted again", key)
                    await self.record(key, state="abandoned")
                    continue
            if state not in ("submitted", "ended", "rejected"):
                continue
            ids = await asyncio.to_thread(self.results.spool_ids, key)
            self.results.assign(key, ids)
            if state == "submitted":
                await self.budget.book(key)
                log.info("re-attaching to batch %s (chunk %s, %s requests)", entry.get("batch_id"), key, entry.get("requests"))
                running.append(key)
            elif state == "ended":
                self.results.found.update(await asyncio.to_thread(self.results.index, key, set(ids)))
        return running

    async def submit(self, chunk: Chunk) -> tuple[str, str | None]:
        """(the chunk's key, None) once its batch is created and recorded, or (key, why) when
        the provider refused it (nothing to pay; its rows fail as batch_rejected)."""
        held = await self.budget.hold(chunk.ids)
        try:
            made, key, data = await self._create(chunk, held)
        except BaseException:
            self.budget.release(held)  # a batch created all the same is booked when adopted at restore
            raise
        if isinstance(made, str):
            self.budget.release(held)
            return key, made
        await self.record(key, state="submitted", batch_id=made["batch_id"], status=made.get("status"), input_file_id=made.get("input_file_id"),
                          submitted_at=utc_now(), submitted_ts=time.time(), **self.budget.spent(held))  # fmt: skip
        log.info("batch %s submitted (chunk %s: %d requests, %d bytes)", made["batch_id"], key, len(chunk.ids), len(data))
        if self.receipts is not None:
            await asyncio.to_thread(self.receipts.append, key, self.ledger.entries[key], chunk, data)
        return key, None

    async def _create(self, chunk: Chunk, estimate_usd: float | None) -> tuple[dict | str, str, bytes]:
        """Spool and record a chunk, then have the provider create its batch: (its answer, the
        chunk's key, its bytes); the answer is why, when the provider refused it."""
        key = self.ledger.new_key(self.shard_id)
        spool = self.ledger.spool(key)
        data = b"\n".join(chunk.lines) + b"\n"
        chunk.lines = []
        await asyncio.to_thread(atomic_write_bytes, spool, data)
        self.results.assign(key, chunk.ids)
        await self.record(
            key, provider=self.provider.name, state="sealed", requests=len(chunk.ids), bytes=len(data), round=chunk.round,
            sealed_at=utc_now(), flush_reason=chunk.reason, **({} if estimate_usd is None else {"estimate_usd": estimate_usd}),
        )  # fmt: skip
        try:
            # shielded: a stop() mid-call must not lose the id of a batch the provider created
            made = await asyncio.shield(self.provider.submit(self.client, key, spool, len(chunk.ids)))
        except ProviderRefused as e:
            await self.record(key, state="rejected", reason=str(e), ended_at=utc_now())
            log.error("batch chunk %s (%d requests) refused: %s", key, len(chunk.ids), e)
            return str(e), key, data
        if not made.get("batch_id"):
            raise EngineError(f"batch_api: the provider created chunk {key} but gave no batch id: {made}")
        return made, key, data


class Receipts:
    """MMIRAGE's receipt of each submitted batch (``metadata_output_path``), appended to
    ``<path without .jsonl>.shard_<id>.jsonl``."""

    def __init__(self, base: str, provider: str, model: str, shard_id: int, samples: int):
        stem = base[: -len(".jsonl")] if base.endswith(".jsonl") else base
        self.path = Path(f"{stem}.shard_{shard_id}.jsonl")
        self.provider, self.model, self.shard_id, self.samples = provider, model, shard_id, samples

    def append(self, key: str, entry: dict, chunk: Chunk, data: bytes) -> None:
        """The receipt of chunk ``key`` (its batches.json ``entry``; ``data``: the bytes sent)."""
        receipt = {
            "provider": self.provider, "chunk_id": key, "provider_batch_id": entry.get("batch_id"),
            "status": entry.get("status"),
            "custom_id_to_source_index": {cid: unit_of(cid) // self.samples for cid in chunk.ids},
            "request_hash": hashlib.sha256(data).hexdigest(), "model_params_snapshot": {"model": self.model, "round": chunk.round},
            "submitted_request_count": len(chunk.ids), "total_bytes": len(data), "has_oversized_request": chunk.reason == "oversized",
            "flush_reason": chunk.reason, "submitted_at_utc": entry.get("submitted_at"), "shard_id": self.shard_id,
        }  # fmt: skip
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(receipt, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
