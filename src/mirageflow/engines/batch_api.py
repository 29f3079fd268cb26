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
  ``POLL_OUTAGE_SECONDS`` in a row fail the shard (a rerun re-attaches); a permanent answer
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
import time
from dataclasses import dataclass, field
from pathlib import Path

from mirageflow.config.types import BATCH_LIMITS, ProcessorConfig
from mirageflow.engines.base import EngineError
from mirageflow.engines.batch_providers import (
    BASE_URL_ENV, DEFAULT_BASE_URL, PROVIDERS, RESULTS_MAX_BYTES, Outcome, PermanentAnswer, ProviderRefused,
)  # fmt: skip
from mirageflow.engines.loop import LoopEngine
from mirageflow.errors import RowErrorClass as E
from mirageflow.engines.wire import BadAnswer, Completion, EngineInfo, Request, prompt_chars
from mirageflow.files import atomic_write_bytes
from mirageflow.redact import redact_text
from mirageflow.stats.formulas import utc_now
from mirageflow.transport.http_client import HTTPClient
from mirageflow.transport.rate_limit import estimate_tokens
from mirageflow.transport.spend import BudgetExceeded

log = logging.getLogger(__name__)

DEFAULT_MAX_PENDING = 100_000
SEAL_IDLE_SECONDS = 2.0
POLL_OUTAGE_SECONDS = 1800.0  # polls failing this long in a row fail the shard
CANCEL_WAIT_SECONDS = 3600.0  # a batch cancelled at its deadline that has not ended after this fails the shard
SUBMIT_SETTLE_SECONDS = 60.0  # close() waits this long for a submission in flight to be recorded
WINDOW_SECONDS = {"24h": 86400.0}
_POLL_MEANS = {
    401: "the key (api_key_env) is refused: it was rotated or revoked, or belongs to another account",
    403: "the key (api_key_env) may not read this batch: another account or project",
    404: "the provider does not know this batch id: another base_url or account, or a gateway that lost its state",
}


@dataclass
class _Chunk:
    round: int  # 0: first submission; 1: the requests an expired or cancelled batch did not run
    ids: list[str] = field(default_factory=list)
    lines: list[bytes] = field(default_factory=list)
    size: int = 0
    last_add: float = 0.0
    reason: str = "idle"


def _unit(custom_id: str) -> int:
    return int(custom_id[1 : custom_id.index("-")])


def _failed(rid: int, kind: E, message: str) -> Completion:
    return Completion(rid, "", 0, 0, "abort", kind, message)


class BatchApiEngine(LoopEngine):
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
        self._waiters: dict[str, asyncio.Future] = {}
        self._where: dict[str, str] = {}  # custom_id -> the newest chunk holding it
        self._results: dict[str, tuple[str, int]] = {}  # custom_id -> (ended chunk, byte offset of its result line)
        self._estimates: dict[str, float] = {}  # custom_id -> its dollars before it goes (with a budget: spend_ledger)
        self._open: dict[int, _Chunk | None] = {0: None, 1: None}
        self._busy: set[asyncio.Task] = set()  # submissions and watchers
        self._submitting: set[asyncio.Task] = set()
        self._sealer: asyncio.Task | None = None
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
        """Pick up the batches of earlier attempts: running ones are watched again, ended
        ones' results indexed, sealed ones without a recorded id found or given up."""
        for key in sorted(self.ledger.entries):
            entry = self.ledger.entries[key]
            state = entry.get("state")
            if state == "sealed":
                found = await self.provider.find(self._control, key)
                if found:
                    log.warning("batch chunk %s: created as %s before the last attempt stopped; waiting for it", key, found)
                    await self._record(
                        key, state="submitted", batch_id=found, submitted_ts=time.time(), submitted_at=utc_now(), adopted=True
                    )
                    state = "submitted"
                else:
                    log.warning("batch chunk %s was sealed but never submitted: its rows are submitted again", key)
                    await self._record(key, state="abandoned")
                    continue
            if state not in ("submitted", "ended", "rejected"):
                continue
            ids = await asyncio.to_thread(self._spool_ids, key)
            for cid in ids:
                self._where[cid] = key
            if state == "submitted":
                await self._book(key)
                self.reattached += 1
                log.info("re-attaching to batch %s (chunk %s, %s requests)", entry.get("batch_id"), key, entry.get("requests"))
                self._spawn(self._watch(key))
            elif state == "ended":
                self._results.update(await asyncio.to_thread(self._index_results, key, set(ids)))

    def _spool_ids(self, key: str) -> list[str]:
        try:
            with open(self.ledger.spool(key), "rb") as f:
                return [json.loads(line)["custom_id"] for line in f if line.strip()]
        except (OSError, ValueError, KeyError) as e:
            log.warning("cannot read the requests of batch chunk %s (%s): its rows are submitted again", key, e)
            return []

    def _index_results(self, key: str, known: set[str], lines: bool = False):
        """custom_id -> (key, byte offset) of each result line of an ended chunk; with
        ``lines`` also (custom_id -> parsed line, input tokens, output tokens, duplicates,
        unknown ids).

        Only lines of requests the chunk holds (``known``, its spool's ids) count, each once:
        of several lines for one custom_id the first is kept (on every read, so a rerun
        answers the same), a line for an id never submitted is ignored; both are counted
        and warned about, and their tokens are not summed. A line's tokens are
        ``provider.usage`` (wire.token_count): a figure that is not a finite, non-negative
        integer counts 0 here and fails its row (``_outcome``: bad_answer)."""
        found, parsed, tokens_in, tokens_out, offset = {}, {}, 0, 0, 0
        duplicates, unknown = [], []
        try:
            with open(self.ledger.results(key), "rb") as f:
                for raw in f:
                    at, offset = offset, offset + len(raw)
                    if not raw.strip():
                        continue
                    try:
                        line = json.loads(raw)
                        cid = line["custom_id"]
                        hash(cid)
                    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: JSON nested past Python's stack
                        log.warning("batch chunk %s: a result line at byte %d does not parse: skipped", key, at)
                        continue
                    if cid in found:
                        duplicates.append(cid)
                        continue
                    if cid not in known:
                        unknown.append(cid)
                        continue
                    found[cid] = (key, at)
                    if lines:
                        parsed[cid] = line
                        try:
                            used = self.provider.usage(line)
                        except Exception:  # noqa: BLE001 - its row fails on its shape (_outcome)
                            used = (0, 0)
                        tokens_in, tokens_out = tokens_in + used[0], tokens_out + used[1]
        except OSError as e:
            log.warning("cannot read the results of batch chunk %s (%s)", key, e)
        if lines and (duplicates or unknown):
            batch_id = self.ledger.entries.get(key, {}).get("batch_id")
            if duplicates:
                log.warning(
                    "batch %s (chunk %s): %d duplicate result line(s) (the first line of each custom_id is kept, its tokens counted once): %s",
                    batch_id, key, len(duplicates), ", ".join(sorted(set(duplicates))[:10]),
                )  # fmt: skip
            if unknown:
                log.warning(
                    "batch %s (chunk %s): %d result line(s) for custom_ids never submitted in it, ignored (not counted): %s",
                    batch_id, key, len(unknown), ", ".join(sorted(set(unknown))[:10]),
                )  # fmt: skip
        return (found, parsed, tokens_in, tokens_out, len(duplicates), len(unknown)) if lines else found

    def _read_result(self, key: str, offset: int) -> dict:
        with open(self.ledger.results(key), "rb") as f:
            f.seek(offset)
            return json.loads(f.readline())

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
            return _failed(request.id, E.INVALID_REQUEST, f"batch_api ({self.settings.provider}): {e}")
        waiting = self._waiters.get(cid)
        if waiting is not None and not waiting.done():  # the same request again (two outputs, one prompt): one line, one answer
            return await waiting
        key = self._where.get(cid)
        entry = self.ledger.entries.get(key) if key else None
        state = entry.get("state") if entry else None
        if state == "submitted" or (state == "sealed" and cid in self._waiters):
            return await self._wait(cid)
        if state == "rejected":
            return _failed(request.id, E.BATCH_REJECTED, entry.get("reason") or "the provider refused the batch")
        round_ = 0
        if state == "ended":
            outcome = self._stored(cid, request.id)
            if outcome.retry is None:
                return outcome.completion
            if entry.get("round", 0) >= 1:
                return self._gave_up(request.id, outcome.retry)
            round_ = 1
        if self.spend_ledger is not None:  # what it adds to its chunk's hold on the budget (_submit)
            self._estimates[cid] = self._estimate_usd(request)
        return await self._enqueue(cid, line, round_)

    def _estimate_usd(self, request: Request) -> float:
        """A request's dollars before it goes, as the openai backend's: its prompt's characters / 4
        at the input price, its max_new_tokens (else Anthropic's max_tokens) at the output price."""
        limit = request.sampling_params.get("max_new_tokens") or self.settings.max_tokens
        output = limit if isinstance(limit, int) and limit > 0 else 0
        return self.spend_ledger.price.cost(estimate_tokens(prompt_chars(request), 0), output)

    def _stored(self, cid: str, rid: int) -> Outcome:
        where = self._results.get(cid)
        if where is None:  # the batch ended without a line for it
            return Outcome(cid, retry="missing")
        try:
            line = self._read_result(*where)
        except (OSError, ValueError, RecursionError) as e:  # the saved results were damaged since: the request did not get an answer
            log.warning("cannot read the saved result of %s (%s)", cid, e)
            line = None
        return self._outcome(line, cid, rid)

    def _outcome(self, line: dict | None, cid: str, rid: int) -> Outcome:
        """A result line's meaning. The row boundary of a provider's answer: whatever handling
        the line raises fails its row with a class (bad_answer for a figure that is no count,
        provider_error for any other shape), never the shard, and the same on every rerun."""
        if line is None:
            return Outcome(cid, retry="missing")
        try:
            return self.provider.outcomes(line, rid)
        except BadAnswer as e:  # the same line on a rerun fails the same row the same way
            return Outcome(cid, _failed(rid, E.BAD_ANSWER, f"batch result of {cid}: {e}"))
        except Exception as e:  # noqa: BLE001 - the answer's content decides it: this row's error
            return Outcome(
                cid, _failed(rid, E.PROVIDER_ERROR, f"a result line of an unexpected shape ({type(e).__name__}: {e}): {str(line)[:300]}")
            )

    @staticmethod
    def _gave_up(rid: int, why: str) -> Completion:
        kind = {"expired": E.BATCH_EXPIRED, "cancelled": E.BATCH_CANCELLED}.get(why, E.PROVIDER_ERROR)
        what = {"missing": "ended without a result for it"}.get(why, f"was {why} before running it")
        return _failed(rid, kind, f"the batch {what}, twice (submitted once more after the first time)")

    async def _wait(self, cid: str) -> Completion:
        fut = self._waiters.get(cid)
        if fut is None or fut.done():
            fut = self._waiters[cid] = asyncio.get_running_loop().create_future()
        return await fut

    def _deliver(self, cid: str, completion: Completion) -> None:
        self._estimates.pop(cid, None)
        fut = self._waiters.pop(cid, None)
        if fut is not None and not fut.done():
            fut.set_result(completion)

    async def _enqueue(self, cid: str, line: bytes, round_: int, wait: bool = True):
        """Add a line to the open chunk of its round (sealing it first when full); with
        ``wait``, the row's answer once its batch ended."""
        size = len(line) + 1
        limit = self.settings.max_chunk_bytes
        if size > limit:
            provider_max = BATCH_LIMITS[self.settings.provider][1]
            if self.settings.oversized_request_policy == "reject" or size > provider_max:
                cap = limit if self.settings.oversized_request_policy == "reject" else provider_max
                refused = _failed(_unit(cid), E.REQUEST_TOO_LARGE, f"the request is {size} bytes; a batch may hold {cap}")
                if wait:
                    return refused
                self._deliver(cid, refused)
                return None
            self._seal(round_)  # isolate: alone in a chunk of its own
            self._open[round_] = _Chunk(round_, [cid], [line], size, time.monotonic(), "oversized")
            self._seal(round_)
        else:
            chunk = self._open[round_]
            if chunk is not None and (chunk.size + size > limit or len(chunk.ids) + 1 > self.settings.max_requests_per_chunk):
                chunk.reason = "full_chunk"
                self._seal(round_)
            chunk = self._open[round_]
            if chunk is None:
                chunk = self._open[round_] = _Chunk(round_)
            chunk.ids.append(cid)
            chunk.lines.append(line)
            chunk.size += size
            chunk.last_add = time.monotonic()
            if self._sealer is None or self._sealer.done():
                self._sealer = asyncio.create_task(self._seal_when_idle())
        return await self._wait(cid) if wait else None

    async def _seal_when_idle(self) -> None:
        """Seal an open chunk once no request joined it for seal_idle_seconds."""
        while any(self._open.values()):
            await asyncio.sleep(max(0.01, self.seal_idle_seconds / 4))
            for round_, chunk in list(self._open.items()):
                if chunk is not None and time.monotonic() - chunk.last_add >= self.seal_idle_seconds:
                    self._seal(round_)

    def _seal(self, round_: int) -> None:
        chunk, self._open[round_] = self._open[round_], None
        if chunk is not None and chunk.ids:
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

    async def _submit(self, chunk: _Chunk) -> None:
        # the budget (transport/spend.py): the batch's estimate is held before anything is written
        # or sent (BudgetExceeded when the spend alone and it pass the cap) and booked as spend once
        # the provider has the batch; its end corrects it to the results' cost (_settle_cost)
        estimate = sum(self._estimates.get(cid, 0.0) for cid in chunk.ids)
        held = await self.spend_ledger.reserve(estimate, "this batch") if self.spend_ledger is not None else None
        try:
            made, key, data = await self._create(chunk, None if held is None else estimate)
        except BaseException:
            if held is not None:
                self.spend_ledger.settle(held, None, sent=False)  # a batch created all the same is booked when adopted (_restore)
            raise
        if made is None:  # refused: nothing to pay
            if held is not None:
                self.spend_ledger.settle(held, None, sent=False)
            return
        if held is not None:
            self.spend_ledger.settle(held, None)  # the hold becomes spend: the estimate, booked until the batch ends
        await self._record(key, state="submitted", batch_id=made["batch_id"], status=made.get("status"), input_file_id=made.get("input_file_id"),
                           submitted_at=utc_now(), submitted_ts=time.time(), **({} if held is None else {"booked_usd": estimate}))  # fmt: skip
        log.info("batch %s submitted (chunk %s: %d requests, %d bytes)", made["batch_id"], key, len(chunk.ids), len(data))
        if self.settings.metadata_output_path:
            await asyncio.to_thread(self._receipt, key, chunk, data)
        self._spawn(self._watch(key))

    async def _create(self, chunk: _Chunk, estimate_usd: float | None) -> tuple[dict | None, str, bytes]:
        """Spool and record a chunk, then have the provider create its batch: (its answer, the
        chunk's key, its bytes); the answer None when the provider refused it (its rows then fail as batch_rejected)."""
        key = self.ledger.new_key(self.shard_id)
        spool = self.ledger.spool(key)
        data = b"\n".join(chunk.lines) + b"\n"
        chunk.lines = []
        await asyncio.to_thread(atomic_write_bytes, spool, data)
        for cid in chunk.ids:
            self._where[cid] = key
        await self._record(
            key, provider=self.settings.provider, state="sealed", requests=len(chunk.ids), bytes=len(data), round=chunk.round,
            sealed_at=utc_now(), flush_reason=chunk.reason, **({} if estimate_usd is None else {"estimate_usd": estimate_usd}),
        )  # fmt: skip
        try:
            # shielded: a stop() mid-call must not lose the id of a batch the provider created
            made = await asyncio.shield(self.provider.submit(self._control, key, spool, len(chunk.ids)))
        except ProviderRefused as e:
            await self._record(key, state="rejected", reason=str(e), ended_at=utc_now())
            log.error("batch chunk %s (%d requests) refused: %s", key, len(chunk.ids), e)
            for cid in chunk.ids:
                self._deliver(cid, _failed(_unit(cid), E.BATCH_REJECTED, str(e)))
            return None, key, data
        if not made.get("batch_id"):
            raise EngineError(f"batch_api: the provider created chunk {key} but gave no batch id: {made}")
        return made, key, data

    def _receipt(self, key: str, chunk: _Chunk, data: bytes) -> None:
        """MMIRAGE's receipt of one submitted batch, appended to this shard's receipt file."""
        entry = self.ledger.entries[key]
        base = self.settings.metadata_output_path
        path = Path(f"{base[: -len('.jsonl')] if base.endswith('.jsonl') else base}.shard_{self.shard_id}.jsonl")
        receipt = {
            "provider": self.settings.provider, "chunk_id": key, "provider_batch_id": entry.get("batch_id"),
            "status": entry.get("status"), "custom_id_to_source_index": {cid: _unit(cid) // self.samples for cid in chunk.ids},
            "request_hash": hashlib.sha256(data).hexdigest(), "model_params_snapshot": {"model": self.model, "round": chunk.round},
            "submitted_request_count": len(chunk.ids), "total_bytes": len(data), "has_oversized_request": chunk.reason == "oversized",
            "flush_reason": chunk.reason, "submitted_at_utc": entry.get("submitted_at"), "shard_id": self.shard_id,
        }  # fmt: skip
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(receipt, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())

    async def _watch(self, key: str) -> None:
        """Poll one batch until it ends (backoff; a deadline past its window), then settle it."""
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
                state = await self.provider.poll(self._control, batch_id)
            except PermanentAnswer as e:  # 401/403/404: the same on every poll, on every rerun
                raise self._unusable(key, e, _POLL_MEANS[e.status]) from None
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
                await self._record(key, status=state.status, counts=state.raw.get("request_counts"))
            if state.ended:
                break
            if cancelled_at is None and time.time() > deadline:
                log.warning("batch %s is still %s past its completion window: cancelling it", batch_id, state.status)
                await self.provider.cancel(self._control, batch_id)
                cancelled_at = time.time()
            elif cancelled_at is not None and time.time() - cancelled_at > CANCEL_WAIT_SECONDS:
                raise EngineError(f"batch {batch_id} was cancelled at its deadline and has not ended {CANCEL_WAIT_SECONDS:.0f} s later")
        await self._ended(key, state)

    async def _book(self, key: str) -> None:
        """Book a submitted batch's estimate as spend unless batches.json says it is (a batch
        adopted by _restore, or one whose booking was not recorded before a kill): once per batch."""
        entry = self.ledger.entries[key]
        if self.spend_ledger is None or entry.get("estimate_usd") is None or entry.get("booked_usd") is not None:
            return
        await asyncio.to_thread(self.spend_ledger.book, entry["estimate_usd"])
        await self._record(key, booked_usd=entry["estimate_usd"])

    async def _settle_cost(self, key: str, cost_usd: float, **fields) -> None:
        """Record a batch's end (``fields``) and correct its booked estimate to ``cost_usd`` (its
        results' usage at the processor's price): recorded first, so a restore never corrects it twice."""
        booked = self.ledger.entries[key].get("booked_usd")
        if booked is None or self.spend_ledger is None:
            await self._record(key, **fields)
            return
        await self._record(key, cost_usd=cost_usd, **fields)
        await asyncio.to_thread(self.spend_ledger.book, cost_usd - booked)

    def _unusable(self, key: str, error: PermanentAnswer, meaning: str) -> EngineError:
        """The shard's failure for a recorded batch the provider answers 401/403/404 about:
        what happened, where the batch is recorded and the one command that submits it again."""
        batch_id = self.ledger.entries[key].get("batch_id")
        return EngineError(
            f"batch {batch_id} (chunk {key}): {error}: {meaning}. It is recorded in {self.ledger.path}, so every rerun "
            f"asks for it again. To submit its requests again (they are paid again): "
            f"mmirage retry --config <your config> --resubmit-batch {batch_id}"
        )

    async def _ended(self, key: str, state) -> None:
        entry = self.ledger.entries[key]
        spooled = await asyncio.to_thread(self._spool_ids, key)
        ids = [cid for cid in spooled if self._where.get(cid) == key]
        if self.settings.provider == "openai" and state.status == "failed":  # the input file was refused: nothing ran
            reason = self.provider.refused_outcomes(state)
            await self._settle_cost(key, 0.0, state="rejected", reason=reason, ended_at=utc_now())
            log.error("batch %s (chunk %s): %s", entry.get("batch_id"), key, reason)
            for cid in ids:
                self._deliver(cid, _failed(_unit(cid), E.BATCH_REJECTED, reason))
            return
        try:
            await self.provider.download(self._control, state, self.ledger.results(key))
        except PermanentAnswer as e:
            raise self._unusable(key, e, "its results cannot be read") from None
        index, parsed, tokens_in, tokens_out, duplicates, unknown = await asyncio.to_thread(self._index_results, key, set(spooled), True)
        cost = self.spend_ledger.price.cost(tokens_in, tokens_out) if self.spend_ledger is not None else 0.0
        await self._settle_cost(key, cost, state="ended", status=state.status, ended_at=utc_now(), input_tokens=tokens_in, output_tokens=tokens_out,
                                counts=state.raw.get("request_counts"), results=len(index), duplicate_results=duplicates,
                                unknown_results=unknown)  # fmt: skip
        log.info("batch %s %s (chunk %s): %d results", entry.get("batch_id"), state.status, key, len(index))
        self._results.update({cid: where for cid, where in index.items() if self._where.get(cid) == key})
        again = []
        for cid in ids:
            if cid not in self._waiters:
                continue  # its row is not waiting in this attempt (committed before, or comes later)
            outcome = self._outcome(parsed.get(cid), cid, _unit(cid))
            if outcome.retry is None:
                self._deliver(cid, outcome.completion)
            elif entry.get("round", 0) >= 1:
                self._deliver(cid, self._gave_up(_unit(cid), outcome.retry))
            else:
                again.append(cid)
        if again:
            log.warning(
                "batch %s %s: %d request(s) did not run; submitting them once more", entry.get("batch_id"), state.status, len(again)
            )
            lines = await asyncio.to_thread(self._spool_lines, key, set(again))
            for cid in again:
                if cid in lines:
                    await self._enqueue(cid, lines[cid], 1, wait=False)
                else:
                    self._deliver(cid, _failed(_unit(cid), E.PROVIDER_ERROR, f"the request is missing from {self.ledger.spool(key)}"))
            self._seal(1)

    def _spool_lines(self, key: str, wanted: set[str]) -> dict[str, bytes]:
        found = {}
        with open(self.ledger.spool(key), "rb") as f:
            for line in f:
                line = line.rstrip(b"\n")
                if line:
                    cid = json.loads(line).get("custom_id")
                    if cid in wanted:
                        found[cid] = line
        return found

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
