"""The run's budget: ``execution_params.max_cost_usd`` over every shard, every attempt, the
canary included.

One ledger per run, ``<state_dir>/spend.json`` (transport/shared_state.py: the locked file
the rate limits use), holds the dollars the answers cost (``spent_usd``) and what each
process has in flight (``holds``: ``host:pid`` -> [dollars, when last changed]). Before each
attempt of a request ``with_retries`` (transport/retry.py) awaits ``reserve(estimate)``: when
the spend, the holds and this request's estimate together pass the cap, it waits for the
requests in flight to be answered (they may cost less than they hold); once the spend alone
and the estimate pass it, nothing is sent and ``BudgetExceeded`` ends the shard
(failure.json's failure_class ``budget_exceeded``) with nothing of the run in flight; every
answer already committed is kept, so raising the cap and rerunning asks nothing twice.
``settle`` turns the hold into the answer's cost (its ``usage`` at the processor's price; an
error status costs nothing; no whole answer costs its estimate: the provider may have
counted it). A holder whose process is gone (on this machine), or that has not changed its
holds for ``stale_seconds`` (longer than one request can take; another node's), was killed:
its holds no longer count.

A request's estimate: its prompt's characters / 4 at the input price and its
``max_new_tokens`` (per choice) at the output price (engines/openai_engine.py).

A provider's batch (engines/batch_api.py) outlives the process that submitted it, so a hold
(dropped with its process) cannot carry it: its chunk is held with ``reserve`` (the sum of
its requests' estimates) before it is written or sent, the same BudgetExceeded refusing it;
once the provider has the batch, ``settle(held, None)`` turns the hold into spend (the
estimate, booked) and batches.json records ``booked_usd``, so a later attempt that
re-attaches books nothing again (``book`` books a batch adopted after a kill that never
recorded it). When the batch ends its entry records ``cost_usd`` (its results' usage at the
price) and ``book(cost - estimate)`` corrects the spend.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import Any

from mirageflow.stats.pricing import Price, cached_prompt_tokens
from mirageflow.transport.http_client import TransportError
from mirageflow.transport.shared_state import SharedState

BUDGET_EXCEEDED = "budget_exceeded"  # failure.json's failure_class (errors.EngineDeathClass.BUDGET_EXCEEDED)


class BudgetExceeded(TransportError):
    """The run's spend would pass execution_params.max_cost_usd: no request is sent."""

    failure_class = BUDGET_EXCEEDED


def answer_cost(price: Price, response: Any) -> float:
    """Dollars of an OpenAI-style answer: its ``usage`` at ``price`` (0 without one)."""
    try:
        usage = response.json().get("usage")
    except (ValueError, AttributeError):
        return 0.0
    if not isinstance(usage, dict):
        return 0.0
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    prompt = prompt if isinstance(prompt, int) and prompt > 0 else 0
    completion = completion if isinstance(completion, int) and completion > 0 else 0
    return price.cost(prompt, completion, cached_prompt_tokens(usage))


class SpendLedger:
    """One process's view of the run's spend ledger (see the module's docstring)."""

    def __init__(self, path: str | os.PathLike, cap_usd: float, price: Price, stale_seconds: float):
        self.cap, self.price, self.stale_seconds = cap_usd, price, stale_seconds
        self._file = SharedState(path, "the run's spend ledger")
        self.host = socket.gethostname()
        self.holder = f"{self.host}:{os.getpid()}"

    async def reserve(self, estimate_usd: float, what: str = "this request") -> float:
        """Hold ``estimate_usd`` for a request about to go. While the requests in flight (anyone's)
        leave no room for it, wait for their answers (they may cost less than they hold); raises
        BudgetExceeded once the spend alone leaves no room: then nothing of the run is in flight,
        so no answer being received is lost when the shard stops."""
        wait = 0.02
        while True:
            room = self._try_reserve(estimate_usd, what)
            if room:
                return estimate_usd
            await asyncio.sleep(wait)
            wait = min(1.0, wait * 2)

    def _try_reserve(self, estimate_usd: float, what: str) -> bool:
        """Hold it when it fits; False when it would fit once the holds in flight settle."""
        now = time.time()
        with self._file.use() as state:
            holds = state.setdefault("holds", {})
            for who, (_usd, at) in list(holds.items()):
                if who != self.holder and (now - at > self.stale_seconds or self._gone(who)):
                    del holds[who]  # a process killed with requests in flight
            spent = float(state.get("spent_usd") or 0.0)
            if spent + estimate_usd > self.cap:
                raise BudgetExceeded(
                    f"the run's spend would pass execution_params.max_cost_usd: ${spent:.4f} spent, {what}'s "
                    f"estimate ${estimate_usd:.4f}, cap ${self.cap:.4f}; every answer so far is kept: "
                    "raise execution_params.max_cost_usd and rerun to go on"
                )
            if spent + sum(usd for usd, _ in holds.values()) + estimate_usd > self.cap:
                return False
            mine = holds.get(self.holder, [0.0, now])
            holds[self.holder] = [mine[0] + estimate_usd, now]
        return True

    def _gone(self, holder: str) -> bool:
        """A holder on this machine whose process is no more (others' wait for stale_seconds)."""
        host, _, pid = holder.rpartition(":")
        if host != self.host or not pid.isdigit():
            return False
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return True
        except OSError:  # another user's process: alive
            return False
        return False

    def settle(self, held_usd: float, response: Any | None, sent: bool = True) -> None:
        """Replace a hold by what its answer cost (None: no whole answer, counted at the estimate;
        not ``sent``: nothing)."""
        if not sent:
            cost = 0.0
        elif response is None:
            cost = held_usd
        elif 200 <= response.status_code < 300:
            cost = answer_cost(self.price, response)
        else:
            cost = 0.0
        now = time.time()
        with self._file.use() as state:
            holds = state.setdefault("holds", {})
            left = max(0.0, holds.get(self.holder, [0.0, now])[0] - held_usd)
            if left > 1e-12:
                holds[self.holder] = [left, now]
            else:
                holds.pop(self.holder, None)
            state["spent_usd"] = float(state.get("spent_usd") or 0.0) + cost

    def book(self, usd: float) -> None:
        """Add ``usd`` to the spend (negative: take it back) without a hold: a provider's batch,
        booked at its estimate once submitted and corrected by its results' cost when it ends."""
        with self._file.use() as state:
            state["spent_usd"] = max(0.0, float(state.get("spent_usd") or 0.0) + usd)

    def spent(self) -> float:
        with self._file.use() as state:
            return float(state.get("spent_usd") or 0.0)

    def close(self) -> None:
        self._file.close()
