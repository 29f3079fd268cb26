"""The batch_api engine's results (a part of engines/batch_api.py): what the files of a
shard's batch chunks hold and what each result line means for its row.

A chunk's requests are spooled to ``batches/<key>.jsonl`` before it is sent and its results
written to ``batches/<key>.results.jsonl`` when it ends (shard/ledger.py names both).
``BatchResults`` reads them: the custom_ids a chunk holds, the lines to submit once more,
and, per custom_id, where its result line is (``found``: chunk key and byte offset, so a
rerun answers a row from disk without keeping the results in memory). A result line's
meaning comes from the provider (engines/batch_providers.py); whatever handling it raises
fails its row with a class, never the shard, and the same on every rerun.
"""

from __future__ import annotations

import json
import logging

from mirageflow.engines.batch_providers import Outcome
from mirageflow.engines.wire import BadAnswer, Completion
from mirageflow.errors import RowErrorClass as E

log = logging.getLogger(__name__)


def failed(rid: int, kind: E, message: str) -> Completion:
    """A row error as the engine's answer to request ``rid``."""
    return Completion(rid, "", 0, 0, "abort", kind, message)


class BatchResults:
    """The chunks' spooled requests and saved results, read back. ``holder`` says which chunk
    answers each custom_id (the newest holding it); ``found`` indexes the result line of every
    custom_id an ended chunk answered."""

    def __init__(self, ledger, provider):
        self.ledger, self.provider = ledger, provider
        self.holder: dict[str, str] = {}  # custom_id -> the newest chunk holding it
        self.found: dict[str, tuple[str, int]] = {}  # custom_id -> (ended chunk, byte offset of its result line)

    def assign(self, key: str, ids) -> None:
        """Chunk ``key`` answers these requests from now on."""
        for cid in ids:
            self.holder[cid] = key

    def held_by(self, key: str, ids) -> list[str]:
        """Those of ``ids`` that chunk ``key`` answers (a later chunk holds the others)."""
        return [cid for cid in ids if self.holder.get(cid) == key]

    # ------------------------------------------------------------------ the spool (requests sent)

    def spool_ids(self, key: str) -> list[str]:
        try:
            with open(self.ledger.spool(key), "rb") as f:
                return [json.loads(line)["custom_id"] for line in f if line.strip()]
        except (OSError, ValueError, KeyError) as e:
            log.warning("cannot read the requests of batch chunk %s (%s): its rows are submitted again", key, e)
            return []

    def spool_lines(self, key: str, wanted: set[str]) -> dict[str, bytes]:
        found = {}
        with open(self.ledger.spool(key), "rb") as f:
            for line in f:
                line = line.rstrip(b"\n")
                if line:
                    cid = json.loads(line).get("custom_id")
                    if cid in wanted:
                        found[cid] = line
        return found

    # ------------------------------------------------------------------ the results (answers received)

    def index(self, key: str, known: set[str], lines: bool = False):
        """custom_id -> (key, byte offset) of each result line of an ended chunk; with
        ``lines`` also (custom_id -> parsed line, input tokens, output tokens, duplicates,
        unknown ids).

        Only lines of requests the chunk holds (``known``, its spool's ids) count, each once:
        of several lines for one custom_id the first is kept (on every read, so a rerun
        answers the same), a line for an id never submitted is ignored; both are counted
        and warned about, and their tokens are not summed. A line's tokens are
        ``provider.usage`` (wire.token_count): a figure that is not a finite, non-negative
        integer counts 0 here and fails its row (``outcome``: bad_answer)."""
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
                        except Exception:  # noqa: BLE001 - its row fails on its shape (outcome)
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

    def _read(self, key: str, offset: int) -> dict:
        with open(self.ledger.results(key), "rb") as f:
            f.seek(offset)
            return json.loads(f.readline())

    # ------------------------------------------------------------------ what a line means for its row

    def stored(self, cid: str, rid: int) -> Outcome:
        """The outcome of a request an ended chunk held, from its saved result line."""
        where = self.found.get(cid)
        if where is None:  # the batch ended without a line for it
            return Outcome(cid, retry="missing")
        try:
            line = self._read(*where)
        except (OSError, ValueError, RecursionError) as e:  # the saved results were damaged since: the request did not get an answer
            log.warning("cannot read the saved result of %s (%s)", cid, e)
            line = None
        return self.outcome(line, cid, rid)

    def outcome(self, line: dict | None, cid: str, rid: int) -> Outcome:
        """A result line's meaning. The row boundary of a provider's answer: whatever handling
        the line raises fails its row with a class (bad_answer for a figure that is no count,
        provider_error for any other shape), never the shard, and the same on every rerun."""
        if line is None:
            return Outcome(cid, retry="missing")
        try:
            return self.provider.outcomes(line, rid)
        except BadAnswer as e:  # the same line on a rerun fails the same row the same way
            return Outcome(cid, failed(rid, E.BAD_ANSWER, f"batch result of {cid}: {e}"))
        except Exception as e:  # noqa: BLE001 - the answer's content decides it: this row's error
            return Outcome(
                cid, failed(rid, E.PROVIDER_ERROR, f"a result line of an unexpected shape ({type(e).__name__}: {e}): {str(line)[:300]}")
            )

    @staticmethod
    def gave_up(rid: int, why: str) -> Completion:
        """The row error of a request that did not run in its second batch either."""
        kind = {"expired": E.BATCH_EXPIRED, "cancelled": E.BATCH_CANCELLED}.get(why, E.PROVIDER_ERROR)
        what = {"missing": "ended without a result for it"}.get(why, f"was {why} before running it")
        return failed(rid, kind, f"the batch {what}, twice (submitted once more after the first time)")
