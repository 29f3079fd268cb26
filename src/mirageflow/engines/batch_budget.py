"""The batch_api engine's share of ``execution_params.max_cost_usd`` (a part of
engines/batch_api.py; the run's spend ledger is transport/spend.py).

A chunk is held at its requests' estimates before it is spooled or sent (BudgetExceeded
past the cap), booked as spend once the provider has it (``booked_usd`` in its entry of
batches.json: a re-attach books nothing again) and corrected to its results' usage at the
price when it ends (``cost_usd``). Without a budget every step is a no-op.
"""

from __future__ import annotations

import asyncio

from mirageflow.engines.wire import Request, prompt_chars
from mirageflow.transport.rate_limit import estimate_tokens


class BatchBudget:
    """The batches' bookings in the run's spend ledger (``spend``: None without a budget);
    ``record`` (an ``async (key, **fields)``) writes a chunk's entry of ``ledger``."""

    def __init__(self, spend, ledger, record, max_tokens: int | None):
        self.spend, self.ledger, self.record = spend, ledger, record
        self.max_tokens = max_tokens  # Anthropic's max_tokens: a request's output cap when it names none
        self.estimates: dict[str, float] = {}  # custom_id -> its dollars before it goes

    def estimate(self, cid: str, request: Request) -> None:
        """Keep a request's dollars before it goes, as the openai backend's: its prompt's
        characters / 4 at the input price, its max_new_tokens (else max_tokens) at the output price."""
        if self.spend is None:
            return
        limit = request.sampling_params.get("max_new_tokens") or self.max_tokens
        output = limit if isinstance(limit, int) and limit > 0 else 0
        self.estimates[cid] = self.spend.price.cost(estimate_tokens(prompt_chars(request), 0), output)

    def forget(self, cid: str) -> None:
        """The request is answered: nothing of it is held any more."""
        self.estimates.pop(cid, None)

    async def hold(self, ids: list[str]) -> float | None:
        """Hold a chunk's estimate before anything is written or sent (BudgetExceeded when the
        spend alone and it pass the cap); the dollars held, None without a budget."""
        if self.spend is None:
            return None
        return await self.spend.reserve(sum(self.estimates.get(cid, 0.0) for cid in ids), "this batch")

    def release(self, held: float | None) -> None:
        """The chunk was not sent (refused, or the submission failed): nothing to pay. A batch
        created all the same is booked when it is adopted (``book``)."""
        if held is not None:
            self.spend.settle(held, None, sent=False)

    def spent(self, held: float | None) -> dict:
        """The provider has the chunk: the hold becomes spend, its estimate booked until the
        batch ends; the fields that record it in the chunk's entry."""
        if held is None:
            return {}
        self.spend.settle(held, None)
        return {"booked_usd": held}

    async def book(self, key: str) -> None:
        """Book a submitted batch's estimate as spend unless batches.json says it is (a batch
        adopted at restore, or one whose booking was not recorded before a kill): once per batch."""
        entry = self.ledger.entries[key]
        if self.spend is None or entry.get("estimate_usd") is None or entry.get("booked_usd") is not None:
            return
        await asyncio.to_thread(self.spend.book, entry["estimate_usd"])
        await self.record(key, booked_usd=entry["estimate_usd"])

    def cost(self, tokens_in: int, tokens_out: int) -> float:
        """A batch's dollars from its results' usage at the processor's price (0 without a budget)."""
        return self.spend.price.cost(tokens_in, tokens_out) if self.spend is not None else 0.0

    async def settle(self, key: str, cost_usd: float, **fields) -> None:
        """Record a batch's end (``fields``) and correct its booked estimate to ``cost_usd``:
        recorded first, so a restore never corrects it twice."""
        booked = self.ledger.entries[key].get("booked_usd")
        if booked is None or self.spend is None:
            await self.record(key, **fields)
            return
        await self.record(key, cost_usd=cost_usd, **fields)
        await asyncio.to_thread(self.spend.book, cost_usd - booked)
