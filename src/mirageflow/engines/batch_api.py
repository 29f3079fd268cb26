"""``processors[].type: batch_api``: a provider's batch API as a shard engine (OpenAI Batch,
Anthropic Message Batches; the wire formats are engines/batch_providers.py).

The runner feeds it like any engine: ``generate_one(request)`` per row, many at once
(``max_inflight``: 100,000 rows wait on the provider; ``shard_params.max_inflight``
changes it). The engine answers them when their batch ends:

- **Chunks.** Each request becomes one JSON line with a ``custom_id`` that is the same on
  every attempt: ``u<unit>-<16 hex of the SHA-256 of its body>`` (the unit is the row, or
  the row's sample). Lines join the open chunk until the next one would pass
  ``max_chunk_bytes`` or ``max_requests_per_chunk`` (the provider's limit by default), or no
  request came for ``SEAL_IDLE_SECONDS`` (every row in flight is waiting): then the chunk
  is sealed and submitted. A line larger than a chunk goes alone (``isolate``) or fails its
  row as ``request_too_large`` (``reject``, or beyond the provider's limit).
- **Recorded before waiting.** A sealed chunk's lines go to
  ``<state_dir>/shard_<id>/batches/<key>.jsonl`` and its entry to ``batches.json``
  (shard/ledger.py), fsynced, before it is sent; the batch id is recorded as soon as the
  provider answers, before anything waits on it. Then the batch is polled with backoff
  (``poll_seconds``, x1.5 per poll, at most ``poll_max_seconds``). Each answer is classified
  by the transport (transport/retry.py): an outage (connection errors, deadlines, 429, 5xx)
  is retried, each call ``max_retries`` times, and polls failing so for
  ``POLL_OUTAGE_SECONDS`` (batch_polling.py) in a row fail the shard (a rerun re-attaches); a permanent answer
  (401, 403, 404 on a status poll or a results file) fails the shard at once, naming
  batches.json, the batch id and ``mmirage retry --resubmit-batch ID``, which marks the
  batch abandoned so that the rerun submits its requests again.
- **Re-attach.** A rerun (after a kill, a preemption, a time limit) reads the ledger at
  load: batches still running are polled again, the results of ended ones are read from
  disk, and a row whose ``custom_id`` a recorded batch holds waits for that batch instead
  of being submitted again, also after an edit of the config (the ledger is kept: the
  custom_id says which request bytes a result answers). A chunk sealed but never recorded as created (killed during
  the upload) is looked up by its key in the provider's list (OpenAI: batch metadata
  ``mirageflow_chunk``) and adopted, else submitted again.
- **Results as they arrive.** When a batch ends its results are written to
  ``batches/<key>.results.jsonl`` (atomically), recorded, and handed to the rows waiting
  for them, which the runner commits as usual (records + row errors = the shard's rows).
  Per-request errors are row errors with classes (batch_providers.py); a result line's
  token figures are counts (wire.token_count) or its row fails as ``bad_answer``. Of
  duplicate result lines the first is kept, lines for ids never submitted are ignored
  (both counted in the batch's entry and warned about). Requests an expired
  or cancelled batch did not run are submitted once more, in a chunk of their own; a
  second miss is the row error ``batch_expired`` / ``batch_cancelled``. A batch still
  running ``deadline_grace_seconds`` past its completion window is cancelled.
- **Budget.** With ``execution_params.max_cost_usd`` a chunk is held at its requests'
  estimates before it is spooled or sent (BudgetExceeded past the cap), booked as spend once
  the provider has it (``booked_usd`` in its entry: a re-attach books nothing again) and
  corrected to its results' usage at the price when it ends (``cost_usd``): transport/spend.py.
- **Recorded for people.** status.json -> engines.<name>.details.batches lists every batch
  (id, state, requests, tokens); with ``metadata_output_path`` each submitted batch also
  appends MMIRAGE's receipt line to ``<path without .jsonl>.shard_<id>.jsonl``.
- **Secrets.** The key is read from the environment variable ``api_key_env`` at load and
  only sent in headers, to base_url's origin only (a results_url elsewhere and any redirect
  are fetched without it: transport/fetch.py); it is never logged or recorded.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os

from mirageflow.config.types import ProcessorConfig
from mirageflow.engines.base import EngineError
from mirageflow.engines.batch_budget import BatchBudget
from mirageflow.engines.batch_chunks import BatchSubmitter, Chunk, OpenChunks, Receipts, unit_of
from mirageflow.engines.batch_polling import BatchPoller
from mirageflow.engines.batch_providers import BASE_URL_ENV, DEFAULT_BASE_URL, PROVIDERS, RESULTS_MAX_BYTES, PermanentAnswer
from mirageflow.engines.batch_results import BatchResults, failed
from mirageflow.engines.loop import LoopEngine
from mirageflow.errors import RowErrorClass as E
from mirageflow.engines.wire import Completion, EngineInfo, Request
from mirageflow.redact import redact_text
from mirageflow.stats.formulas import utc_now
from mirageflow.transport.http_client import HTTPClient
from mirageflow.transport.spend import BudgetExceeded

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 100_000
SEAL_IDLE_SECONDS = 2.0
SUBMIT_SETTLE_SECONDS = 60.0  # close() waits this long for a submission in flight to be recorded


class BatchApiEngine(LoopEngine):
    """The rows' requests as provider batches. Its collaborators each own one concern:
    ``OpenChunks`` (batch_chunks.py: lines into chunks, sealing), ``BatchPoller``
    (batch_polling.py: a batch watched until it ends), ``BatchResults`` (batch_results.py:
    the chunks' files read back, a result line's meaning for its row), ``BatchBudget``
    (batch_budget.py: the bookings under max_cost_usd); the engine keeps the rows waiting,
    the submissions and the ledger's life cycle (restore, end of a batch)."""

    templates_server_side = True  # the provider applies its chat template
    loads_model = False  # the provider has the model
    provider_api = True  # the provider's batch price per token (stats/pricing.py)
    keeps_state = True  # its batches live in the shard's checkpoint (bind_state before load)
    seal_idle_seconds = SEAL_IDLE_SECONDS

    def __init__(self, processor: ProcessorConfig, batch_size: int = 32, log_dir=None):
        super().__init__()
        if processor.batch is None:
            raise ValueError("the batch_api engine needs a processor of type batch_api")
        self.processor, self.settings = processor, processor.batch
        self.model = processor.model or processor.server_args.model_path
        self.max_inflight = DEFAULT_MAX_PENDING
        self.ledger = None
        self.shard_id, self.samples = 0, 1
        self.provider = None
        self._control = None  # the provider's HTTPClient, used on the private loop (closed by _close_client_and_loop)
        # made at load, once the ledger, the provider and the spend ledger are known
        self.results: BatchResults | None = None
        self.poller: BatchPoller | None = None
        self.budget: BatchBudget | None = None
        self.submitter: BatchSubmitter | None = None
        self.chunks = OpenChunks(self.settings, self.seal_idle_seconds, self._sealed)
        self._waiters: dict[str, asyncio.Future] = {}
        self._busy: set[asyncio.Task] = set()  # submissions and watchers
        self._submitting: set[asyncio.Task] = set()
        self.reattached = 0
        self.info = EngineInfo(backend="batch_api", model_path=self.model)

    # ------------------------------------------------------------------ setup

    def bind_state(self, checkpoint, shard_id: int, samples: int = 1) -> None:
        """The shard's ledger of batches (called by the runner after the checkpoint's restore)."""
        self.ledger, self.shard_id, self.samples = checkpoint.batches, shard_id, samples

    def load(self) -> None:
        if self.ledger is None:
            raise EngineError("batch_api: no shard state bound (the shard runner calls bind_state before load)")
        name = self.processor.api_key_env
        key = os.environ.get(name) if name else None
        if name and not key:
            raise EngineError(
                f"batch_api: the environment variable {name} (processors[].api_key_env) is not set or empty; export the API key in it"
            )
        provider = self.settings.provider
        base_url = self.processor.base_url or os.environ.get(BASE_URL_ENV[provider]) or DEFAULT_BASE_URL[provider]
        self.provider = PROVIDERS[provider](self.processor, base_url, key)
        try:  # the key's header goes to base_url's origin only (transport/http_client.py); no redirects followed with it
            self._control = HTTPClient(
                base_url, headers=self.provider.headers(), credentials=self.provider.credentials(),
                timeout=float(self.processor.request_timeout), max_body_bytes=RESULTS_MAX_BYTES,
            )  # fmt: skip
        except ValueError as e:
            raise EngineError(f"batch_api: processors[].base_url: {e}") from None
        self.results = BatchResults(self.ledger, self.provider)
        self.poller = BatchPoller(self.provider, self._control, self.ledger, self.settings, self._record)
        self.budget = BatchBudget(self.spend_ledger, self.ledger, self._record, self.settings.max_tokens)
        receipts = None
        if self.settings.metadata_output_path:
            receipts = Receipts(self.settings.metadata_output_path, provider, self.model, self.shard_id, self.samples)
        self.submitter = BatchSubmitter(
            self.provider, self._control, self.ledger, self.results, self.budget, receipts, self.shard_id, self._record
        )
        self._start_loop(f"batch-{provider}")
        try:
            self._call(self._restore())
        except BaseException:
            self.close()
            raise
        self.info = EngineInfo(
            backend="batch_api", model_path=self.model, device="remote", details=self._details(),
        )  # fmt: skip

    def _details(self) -> dict:
        return {
            "provider": self.settings.provider,
            "base_url": redact_text(self.provider.base_url) if self.provider else None,
            "api_key_env": self.processor.api_key_env,
            "max_chunk_bytes": self.settings.max_chunk_bytes,
            "max_requests_per_chunk": self.settings.max_requests_per_chunk,
            "batches_reattached": self.reattached,
            "batches": self.ledger.summary() if self.ledger is not None else [],
        }

    async def _record(self, key: str, **fields) -> None:
        await asyncio.to_thread(self.ledger.record, key, **fields)

    async def _restore(self) -> None:
        """Pick up the batches of earlier attempts (BatchSubmitter.reattach); watch the running ones again."""
        for key in await self.submitter.reattach():
            self.reattached += 1
            self._spawn(self._watch(key))

    # ------------------------------------------------------------------ requests

    def chat_prompt(self, messages, chat_template_kwargs) -> str:
        """Not used for templating (the provider applies its template); a readable rendering only."""
        return json.dumps(messages, ensure_ascii=False)

    def custom_id(self, request: Request) -> tuple[str, bytes]:
        """(custom_id, the JSON line) of a request: the same on every attempt."""
        body = self.provider.body(request)
        digest = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()).hexdigest()
        cid = f"u{request.id}-{digest[:16]}"
        return cid, json.dumps(self.provider.line(cid, body), separators=(",", ":"), ensure_ascii=False).encode()

    async def _generate(self, request: Request) -> Completion:
        try:
            cid, line = self.custom_id(request)
        except (ValueError, TypeError) as e:  # a request the provider's format cannot carry (an image type)
            return failed(request.id, E.INVALID_REQUEST, f"batch_api ({self.settings.provider}): {e}")
        waiting = self._waiters.get(cid)
        if waiting is not None and not waiting.done():  # the same request again (two outputs, one prompt): one line, one answer
            return await waiting
        key = self.results.holder.get(cid)
        entry = self.ledger.entries.get(key) if key else None
        state = entry.get("state") if entry else None
        if state == "submitted" or (state == "sealed" and cid in self._waiters):
            return await self._wait(cid)
        if state == "rejected":
            return failed(request.id, E.BATCH_REJECTED, entry.get("reason") or "the provider refused the batch")
        round_ = 0
        if state == "ended":
            outcome = self.results.stored(cid, request.id)
            if outcome.retry is None:
                return outcome.completion
            if entry.get("round", 0) >= 1:
                return self.results.gave_up(request.id, outcome.retry)
            round_ = 1
        self.budget.estimate(cid, request)  # what it adds to its chunk's hold on the budget (_submit)
        return await self._enqueue(cid, line, round_)

    async def _wait(self, cid: str) -> Completion:
        fut = self._waiters.get(cid)
        if fut is None or fut.done():
            fut = self._waiters[cid] = asyncio.get_running_loop().create_future()
        return await fut

    def _deliver(self, cid: str, completion: Completion) -> None:
        self.budget.forget(cid)
        fut = self._waiters.pop(cid, None)
        if fut is not None and not fut.done():
            fut.set_result(completion)

    async def _enqueue(self, cid: str, line: bytes, round_: int, wait: bool = True):
        """Add a line to the open chunk of its round; with ``wait``, the row's answer once its
        batch ended (or at once when the line is too large for a chunk)."""
        refused = self.chunks.add(cid, line, round_)
        if refused is not None:
            completion = failed(unit_of(cid), E.REQUEST_TOO_LARGE, refused)
            if wait:
                return completion
            self._deliver(cid, completion)
            return None
        return await self._wait(cid) if wait else None

    def _sealed(self, chunk: Chunk) -> None:
        for cid in chunk.ids:  # answered by this chunk from now on (also a waiter created meanwhile)
            self._waiters.setdefault(cid, asyncio.get_running_loop().create_future())
        self._submitting.add(self._spawn(self._submit(chunk)))

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._busy.add(task)
        task.add_done_callback(self._busy.discard)
        task.add_done_callback(self._submitting.discard)
        task.add_done_callback(self._crashed)
        return task

    def _crashed(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            log.error("batch_api: %s: %s", type(error).__name__, error)
            kept = isinstance(error, (EngineError, BudgetExceeded))  # BudgetExceeded: the shard's failure_class
            self._fail_all(error if kept else EngineError(f"batch_api: {type(error).__name__}: {error}"))

    # ------------------------------------------------------------------ batches

    async def _submit(self, chunk: Chunk) -> None:
        key, refused = await self.submitter.submit(chunk)
        if refused is not None:
            for cid in chunk.ids:
                self._deliver(cid, failed(unit_of(cid), E.BATCH_REJECTED, refused))
            return
        self._spawn(self._watch(key))

    async def _watch(self, key: str) -> None:
        """Poll one batch until it ends (batch_polling.py), then settle it."""
        await self._ended(key, await self.poller.until_ended(key))

    async def _ended(self, key: str, state) -> None:
        entry = self.ledger.entries[key]
        spooled = await asyncio.to_thread(self.results.spool_ids, key)
        ids = self.results.held_by(key, spooled)
        if self.settings.provider == "openai" and state.status == "failed":  # the input file was refused: nothing ran
            reason = self.provider.refused_outcomes(state)
            await self.budget.settle(key, 0.0, state="rejected", reason=reason, ended_at=utc_now())
            log.error("batch %s (chunk %s): %s", entry.get("batch_id"), key, reason)
            for cid in ids:
                self._deliver(cid, failed(unit_of(cid), E.BATCH_REJECTED, reason))
            return
        try:
            await self.provider.download(self._control, state, self.ledger.results(key))
        except PermanentAnswer as e:
            raise self.poller.unusable(key, e, "its results cannot be read") from None
        index, parsed, tokens_in, tokens_out, duplicates, unknown = await asyncio.to_thread(self.results.index, key, set(spooled), True)
        # indexed before the end is recorded: a request asked for while the record is written
        # finds the chunk ended, and must find its answer too (else it would be submitted and paid again)
        self.results.found.update({cid: index[cid] for cid in self.results.held_by(key, index)})
        await self.budget.settle(key, self.budget.cost(tokens_in, tokens_out), state="ended", status=state.status, ended_at=utc_now(),
                                 input_tokens=tokens_in, output_tokens=tokens_out, counts=state.raw.get("request_counts"),
                                 results=len(index), duplicate_results=duplicates, unknown_results=unknown)  # fmt: skip
        log.info("batch %s %s (chunk %s): %d results", entry.get("batch_id"), state.status, key, len(index))
        again = []
        for cid in ids:
            if cid not in self._waiters:
                continue  # its row is not waiting in this attempt (committed before, or comes later)
            outcome = self.results.outcome(parsed.get(cid), cid, unit_of(cid))
            if outcome.retry is None:
                self._deliver(cid, outcome.completion)
            elif entry.get("round", 0) >= 1:
                self._deliver(cid, self.results.gave_up(unit_of(cid), outcome.retry))
            else:
                again.append(cid)
        if again:
            log.warning(
                "batch %s %s: %d request(s) did not run; submitting them once more", entry.get("batch_id"), state.status, len(again)
            )
            lines = await asyncio.to_thread(self.results.spool_lines, key, set(again))
            for cid in again:
                if cid in lines:
                    await self._enqueue(cid, lines[cid], 1, wait=False)
                else:
                    self._deliver(cid, failed(unit_of(cid), E.PROVIDER_ERROR, f"the request is missing from {self.ledger.spool(key)}"))
            self.chunks.seal(1)

    # ------------------------------------------------------------------ life cycle

    def queue_depth(self) -> int:
        return len(self._waiters)

    async def _settle(self) -> None:
        """Wait (bounded) for submissions in flight, so a created batch's id is recorded."""
        if self._submitting:
            await asyncio.wait(list(self._submitting), timeout=SUBMIT_SETTLE_SECONDS)

    def close(self) -> None:
        if self._loop is not None:
            try:
                self._call(self._settle(), timeout=SUBMIT_SETTLE_SECONDS + 5)
            except Exception:  # noqa: BLE001 - closing goes on
                log.debug("waiting for batch submissions failed", exc_info=True)
        if self.ledger is not None:
            self.info.details.update(self._details())
        self._close_client_and_loop()
        if self.spend_ledger is not None:
            self.spend_ledger.close()
