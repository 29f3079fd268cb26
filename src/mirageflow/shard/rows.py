"""One row through the pipeline's steps: rows -> variables -> prompts -> engine -> records.

``RowPath`` holds what the shard's row path needs (extractor, image loader, record renderer,
metrics) and runs one unit of work: a row (``one``), or with n_samples > 1 every pending
sample of a row (``row_samples``, when ``grouped_step`` allows it), through the steps
(shard/steps/: each a ``Step``, dispatched on what its class declares). Each returns (sample,
record or ``FILTERED`` or None, RowError or None); an exception on the row path
that is not the engine's becomes the row error ``internal_error``; the engine raising is
``EngineFailed`` (the shard cannot go on). Booking the outcome is the runner's.

With a request cache (shard/request_cache.py), a step's request whose answer is kept is
not sent, and an answer the step accepts is kept (``_answers``, ``_steps``). With
``cache_only`` (shard/cached_answers.py: no engine is loaded yet) a request whose answer is
not kept raises ``AnswerNotCached`` and the unit's bookings are taken back.
"""

from __future__ import annotations

import asyncio
import logging
import traceback

from mirageflow.shard import samples
from mirageflow.data.readers import SourceRow
from mirageflow.errors import RowError, RowErrorClass as E
from mirageflow.shard.cached_answers import AnswerNotCached
from mirageflow.shard.failures import ShardFailed
from mirageflow.shard.request_cache import RequestCache
from mirageflow.shard.steps.base import FILTERED, Step, Unit, first_engine_step
from mirageflow.shard.steps.llm import LLMStep
from mirageflow.shard.tally import UnitTally

log = logging.getLogger(__name__)


def grouped_step(steps: list[Step], n: int) -> int | None:
    """With n_samples > 1: ``first_engine_step`` (every sample of a row then sends it the same
    request, but for the seed), else None."""
    return None if n == 1 else first_engine_step(steps)


class EngineFailed(ShardFailed):
    """The engine raised instead of answering: the shard cannot go on."""


class RowPath:
    def __init__(self, extract, images, render, metrics, n: int):
        self.extract, self.images, self.render, self.metrics, self.n = extract, images, render, metrics, n
        self.seeded = False  # whether requests carry per-sample seeds (set with the steps)
        self.grouped: int | None = None  # the step asked once per row for all its samples (grouped_step)
        self.internal_logged: set = set()
        # mmirage preview (shard/preview.py) watches each step of a unit: observe(row,
        # sample, step, variables, outcome), outcome (request, completion) of an LLM step
        # (before its value is set) or whether a Python step kept the row; sample is a list
        # of sample indexes for a filter run once for a row's samples (row_samples)
        self.observe = None
        # the shard's request cache (None: off); a step with cache_keys uses it
        self.cache: RequestCache | None = None
        # answers come from the request cache alone (shard/cached_answers.py): a request it
        # does not hold raises AnswerNotCached, and the unit's bookings are taken back
        self.cache_only = False

    def set_steps(self, steps: list[Step], cache_only: bool = False) -> None:
        self.cache_only = cache_only
        self.seeded = self.n > 1 or any(step.base_seed is not None for step in steps)
        self.grouped = grouped_step(steps, self.n)

    async def row(self, row: SourceRow, steps: list[Step], ds_index: int = 0, sample: int | None = None) -> dict:
        """The row's record (of sample ``sample`` with n_samples > 1); raises RowError for a
        row that cannot be completed, EngineFailed when the engine raised."""
        variables, images = await self._start(row, ds_index)
        return await self._steps(row, steps, variables, images, ds_index, sample)

    async def _start(self, row: SourceRow, ds_index: int) -> tuple[dict, dict | None]:
        """The row's variables and its loaded images (None without image inputs)."""
        if row.value.__class__ is RowError:
            raise row.value
        variables = self.extract(row.value)
        # decoded off the event loop (Pillow releases the GIL), once for all outputs
        images = await asyncio.to_thread(self.images, variables, ds_index) if self.images else None
        return variables, images

    async def _steps(self, row, steps, variables: dict, images, ds_index: int, sample: int | None, answered=None) -> dict:
        """Run ``steps`` on the row's variables and render the record. ``answered``: (request,
        completion, whether the request was sent for this sample, its cache key, whether it came
        from the cache, the prompt tokens of the request it is a choice of under native n) of
        the first step, already generated (``_row_samples``)."""
        m = self.metrics
        tally = UnitTally()  # what the record holds, committed with it (shard/tally.py)
        unit = None  # where the unit stands, for the steps that run: made on first use (none for LLM steps alone)
        try:
            for step in steps:
                if not step.calls_engine:  # a filter, a Python step, an image (shard/steps/)
                    if unit is None:
                        unit = Unit(ds_index, row.index, sample or 0)
                    kept = await step.run(variables, unit)
                    if self.observe is not None:
                        self.observe(row, sample, step, variables, kept)
                    if not kept:
                        return FILTERED
                    continue
                sent, key, cached, choice_prompt = True, None, False, None
                if answered is not None:
                    (request, completion, sent, key, cached, choice_prompt), answered = answered, None
                else:
                    if self.seeded:
                        seed = samples.sample_seed(step.base_seed, ds_index, row.index, sample or 0)
                        request = step.request(row.index if sample is None else row.index * self.n + sample, variables, seed, images=images)
                    else:
                        request = step.request(row.index, variables, images=images)
                    (completion,), (key,), cached = await self._answers(step, request, 1, row)
                m.book(request, completion, sent, cached, step.output.processor, choice_prompt)
                tally.book(request, completion, cached)
                if self.observe is not None:
                    self.observe(row, sample, step, variables, (request, completion))
                step.assign(variables, completion)
                if key is not None:  # accepted: kept for a rerun
                    self.cache.put(key, completion)
        except (AnswerNotCached, asyncio.CancelledError):
            if self.cache_only:  # the unit is fed again once the engines are loaded: its answers are booked then
                m.unbook_cached(tally)
            raise
        record = self.render(row.index, row.value, variables) if sample is None else self.render(row.index, row.value, variables, sample)
        m.rendered(ds_index, row.index, sample, tally)
        return record

    async def one(self, row: SourceRow, steps, ds_index: int, sample: int | None) -> tuple:
        """(sample, record or FILTERED or None, RowError or None) of one unit; EngineFailed raises."""
        return await self._outcome(row, sample, self.row(row, steps, ds_index, sample))

    async def _outcome(self, row: SourceRow, sample: int | None, work) -> tuple:
        """``one``'s tuple from ``work``, a coroutine giving the record."""
        try:
            return sample, await work, None
        except RowError as e:
            return sample, None, e
        except ShardFailed:
            raise
        except Exception as e:
            return sample, None, self.internal_error(row, e)

    async def row_samples(self, row: SourceRow, steps, ds_index: int, todo: list[int]) -> list[tuple]:
        """The pending samples ``todo`` of one row, as ``_one`` gives each: the filters before
        the first LLM step (``self.grouped``) once, that step as one ``generate_samples`` per
        run of consecutive samples (one request with n on engines that have it), the rest
        of the steps per sample."""
        at = self.grouped
        try:
            variables, images = await self._start(row, ds_index)
            unit = Unit(ds_index, row.index, todo[0])  # steps once_per_row: the same for every sample
            for step in steps[:at]:
                kept = await step.run(variables, unit)
                if self.observe is not None:
                    self.observe(row, todo, step, variables, kept)
                if not kept:
                    return [(k, FILTERED, None) for k in todo]
            step = steps[at]
            asked = []
            for run in samples.runs(todo):
                seed = samples.sample_seed(step.base_seed, ds_index, row.index, run[0])
                asked.append((run, step.request(row.index * self.n + run[0], variables, seed, images=images)))
            answers = await asyncio.gather(*(self._answers(step, request, len(run), row) for run, request in asked))
        except RowError as e:
            return [(k, None, e) for k in todo]
        except ShardFailed:
            raise
        except Exception as e:
            error = self.internal_error(row, e)
            return [(k, None, error) for k in todo]
        tails, native = steps[at:], step.engine.native_samples
        return await asyncio.gather(
            *(
                self._outcome(row, k, self._steps(row, tails, dict(variables), images, ds_index, k, (
                    request, completion, k == run[0] or not native, key, cached, completions[0].prompt_tokens if native else None)))
                for (run, request), (completions, keys, cached) in zip(asked, answers)
                for k, completion, key in zip(run, completions, keys)
            )
        )  # fmt: skip

    async def _answers(self, step: LLMStep, request, n: int, row: SourceRow) -> tuple[list, list, bool]:
        """(the n completions of ``request``, the cache key to keep each under once accepted
        or None, whether they came from the cache). Cached only when every sample's answer
        is kept; a request that samples without a seed is never looked up nor kept."""
        cache, cache_keys = self.cache, step.cache_keys
        if cache is None or cache_keys is None or not cache_keys.deterministic(request):
            return await self._generate_samples(step, request, n, row), [None] * n, False
        if n == 1:  # the plain path, without the lists
            key = cache_keys.key(request)
            found = cache.get(key, request.id)
            if found is not None:
                return [found], [None], True
            return await self._generate_samples(step, request, 1, row), [key], False
        keys = cache_keys.sample_keys(request, n, step.engine.native_samples)
        found = [cache.get(key, request.id + k) for k, key in enumerate(keys)]
        if all(c is not None for c in found):
            return found, [None] * n, True
        return await self._generate_samples(step, request, n, row), keys, False

    async def _generate_samples(self, step: LLMStep, request, n: int, row: SourceRow) -> list:
        """The engine's n completions of ``request`` (n = 1: ``generate_one``), its in-flight
        count observed; EngineFailed when the engine raised."""
        if self.cache_only:  # no engine yet: the runner loads it and feeds this unit again
            raise AnswerNotCached(f"the answer of output '{step.output.name}' of row {row.index} is not in the request cache")
        m = self.metrics
        for _ in range(n):
            m.tracker.submitted()
        try:
            completions = [await step.engine.generate_one(request)] if n == 1 else await step.engine.generate_samples(request, n)
        except Exception as e:
            raise EngineFailed(f"engine '{step.output.processor}' failed on row {row.index}: {type(e).__name__}: {e}") from e
        finally:
            for _ in range(n):
                m.tracker.completed()
        if len(completions) != n:  # an engine's bug, not a row's
            raise EngineFailed(
                f"engine '{step.output.processor}' returned {len(completions)} completions for {n} samples of row {row.index}"
            )
        return completions

    def internal_error(self, row: SourceRow, e: Exception) -> RowError:
        """An unexpected exception on this row's Python path: the row's error, with the trace in the log once per type."""
        if type(e) not in self.internal_logged:
            self.internal_logged.add(type(e))
            log.warning("row %d: unexpected %s (recorded as internal_error):\n%s", row.index, type(e).__name__, traceback.format_exc())
        return RowError("row", E.INTERNAL_ERROR, f"{type(e).__name__}: {e}")
