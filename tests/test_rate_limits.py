"""processors[].max_requests_per_minute and max_tokens_per_minute (issue 38, "limits kept, not
discovered"): backend openai against a stand-in provider that enforces its limits
(tests/fakes/fake_http.py ``ProviderLimits``: short windows, high limits, answering 429 with
OpenAI's headers past them). A shard under its limits gets no 429; the shards of a run share
them (two shard processes, one budget in the state dir); the provider's headers slow a shard
that has no limit of its own."""

from __future__ import annotations

import asyncio
import copy
import json
import time

import pytest
from fakes import drive
from fakes.configs import pipeline_config
from fakes.fake_http import Behaviour, FakeServer, ProviderLimits
from fakes.runs import start_shard_job

from mirageflow.config import load_config
from mirageflow.engines.openai_engine import OpenAIEngine
from mirageflow.engines.wire import Request
from mirageflow.shard.runner import index_datasets
from mirageflow.transport.http_client import Response
from mirageflow.transport.rate_limit import RateLimiter, RateLimits, parse_duration

pytestmark = pytest.mark.usefixtures("no_proxy")


@pytest.fixture
def provider():
    servers = []

    def start(limits: ProviderLimits) -> FakeServer:
        servers.append(FakeServer(Behaviour(rate_limits=limits)).start())
        return servers[-1]

    yield start
    for s in servers:
        s.stop()


def engine_for(server: FakeServer, tmp_path, **keys) -> OpenAIEngine:
    raw = pipeline_config(
        tmp_path / "in.jsonl", state_dir=tmp_path / "state",
        processor={"backend": "openai", "base_url": server.url + "/v1", "model": "m", "max_retries": 5, **keys},
    )  # fmt: skip
    engine = OpenAIEngine(load_config(raw, check_paths=False).processors["llm"])
    engine.load()
    return engine


def requests(n: int, max_new_tokens: int = 5) -> list[Request]:
    return [
        Request(i, [{"role": "user", "content": f"Summarise: passage {i}"}], None, {"max_new_tokens": max_new_tokens}) for i in range(n)
    ]


def test_openai_durations_of_the_reset_headers():
    assert [parse_duration(t) for t in ("6m0s", "20ms", "1s", "59.178s", "1h2m3.5s", "2", "0.5")] == [
        360.0, 0.02, 1.0, 59.178, 3723.5, 2.0, 0.5,
    ]  # fmt: skip
    assert [parse_duration(t) for t in ("", None, "soon", "5x", "m5s")] == [None] * 5


@pytest.mark.parametrize(
    "limits, keys",
    [
        # 20 requests per half second is 2400 a minute; 40 requests at once would be 20 too many
        (ProviderLimits(requests=20, seconds=0.5), {"max_requests_per_minute": 2400}),
        # ~11 tokens a request (6 of prompt as the provider counts, 5 of max_tokens): 200 per half
        # second lets ~18 of 40 through at once
        (ProviderLimits(tokens=200, seconds=0.5), {"max_tokens_per_minute": 24000}),
    ],
    ids=["requests", "tokens"],
)
def test_a_shard_under_its_limits_gets_no_429(provider, tmp_path, limits, keys):
    server = provider(limits)
    engine = engine_for(server, tmp_path, **keys)
    try:
        done = drive(engine, requests(40))
    finally:
        engine.close()
    assert [c.error for c in done] == [None] * 40
    assert (server.admitted, server.rate_limited) == (40, 0)


def test_the_shards_of_a_run_share_its_limits(provider, tmp_path):
    """Two shard processes at once, each alone allowed the whole limit: together they keep it."""
    server = provider(ProviderLimits(requests=10, seconds=0.5))  # 1200 a minute
    data = tmp_path / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"passage {i}"}) + "\n" for i in range(80)))
    raw = pipeline_config(
        data, state_dir=tmp_path / "state", output_dir=tmp_path / "out", num_shards=2,
        processor={"backend": "openai", "base_url": server.url + "/v1", "model": "m", "max_retries": 0,
                   "max_requests_per_minute": 1200, "default_sampling_params": {"max_new_tokens": 5}},
        dataset={"type": "jsonl", "output_format": "jsonl"},
        # 4 in flight each: a shard reserves at most 4 slots ahead, so the shards take turns closely
        shard_params={"max_error_rate": 1.0, "checkpoint_rows": 10, "checkpoint_min_seconds": 0, "max_inflight": 4},
    )  # fmt: skip
    index_datasets(load_config(copy.deepcopy(raw)))
    jobs = [start_shard_job(tmp_path, raw, k) for k in (0, 1)]
    outs = [j.communicate(timeout=120)[0] for j in jobs]
    assert all(j.returncode == 0 for j in jobs), outs
    # both shards sent at once: each one's requests came between the other's first and last
    # (shard 0 has passages 0-39), taking turns
    shards = [int(r["body"]["messages"][-1]["content"].split()[-1]) >= 40 for r in server.records]
    spans = [(shards.index(k), len(shards) - 1 - shards[::-1].index(k)) for k in (False, True)]
    assert max(a for a, _ in spans) < min(b for _, b in spans), shards
    assert sum(a != b for a, b in zip(shards, shards[1:])) >= 4, shards
    assert (server.admitted, server.rate_limited) == (80, 0)
    assert (tmp_path / "state" / "rate_limits" / "llm.json").exists()


def test_the_providers_headers_slow_a_shard_without_limits_of_its_own(provider, tmp_path):
    """No limit configured, one request at a time: the answers' x-ratelimit-remaining/reset
    headers space the requests out before the provider's bucket runs dry."""
    server = provider(ProviderLimits(requests=10, seconds=1))
    engine = engine_for(server, tmp_path, max_concurrency=1)
    try:
        done = drive(engine, requests(20))
    finally:
        engine.close()
    assert [c.error for c in done] == [None] * 20
    assert (server.admitted, server.rate_limited) == (20, 0)


@pytest.mark.parametrize(
    "processor",
    [
        {"backend": "sglang_server", "max_requests_per_minute": 100},
        {"type": "batch_api", "provider": "openai", "max_tokens_per_minute": 1000, "server_args": None},
    ],
    ids=["sglang_server", "batch_api"],
)
def test_rate_limit_keys_where_nothing_paces_by_them_are_refused(tmp_path, processor):
    from mirageflow.config import ConfigError

    raw = pipeline_config(tmp_path / "in.jsonl", processor=processor)
    if raw["processors"][0]["server_args"] is None:
        del raw["processors"][0]["server_args"]
    with pytest.raises(ConfigError, match=r"processors\[0\]\.max_\w+_per_minute: only backend openai"):
        load_config(raw, check_paths=False)


def test_a_cancelled_wait_gives_its_slot_back_and_other_limits_start_afresh(tmp_path):
    """A shard stopping while its requests wait returns their slots to the run's budget; a
    budget file kept for other limits (an edited config) is not held against the new ones."""
    shared = tmp_path / "rate_limits" / "llm.json"
    limiter = RateLimiter(RateLimits(requests_per_minute=60), shared)  # a slot a second

    async def stop_a_waiter():
        await limiter.acquire()  # at once; the next slot is a second on
        waiting = asyncio.create_task(limiter.acquire())
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(stop_a_waiter())
    limiter.close()
    next_slot = json.loads(shared.read_text())["requests"]
    assert next_slot - time.time() < 1.0  # the first request's second only; 2 s had the waiter kept its slot
    faster = RateLimiter(RateLimits(requests_per_minute=6000), shared)
    asyncio.run(faster.acquire())
    faster.close()
    assert json.loads(shared.read_text())["requests"] - time.time() < 0.5


def test_the_answer_corrects_the_estimate_and_the_providers_word_holds_the_pace_back(tmp_path):
    """usage replaces the estimate (a 429 gives it all back); Retry-After pauses every request;
    x-ratelimit-remaining 0 with a reset holds requests until then."""
    shared = tmp_path / "llm.json"
    limiter = RateLimiter(RateLimits(tokens_per_minute=60_000), shared)  # a token a millisecond
    state = lambda: json.loads(shared.read_text())  # noqa: E731
    ticket = asyncio.run(limiter.acquire(500))  # the next request 0.5 s on
    before = state()["tokens"]
    limiter.settle(ticket, Response(200, {}, b'{"usage": {"prompt_tokens": 30, "completion_tokens": 70}}'))
    assert state()["tokens"] == pytest.approx(before - 0.4)  # 100 tokens, not 500
    limiter.settle(ticket, Response(429, {"retry-after": "2"}, b"{}"))
    assert state()["tokens"] == pytest.approx(before - 0.9)  # the provider counted none of a refused one
    assert 1.5 < state()["pause_until"] - time.time() <= 2
    limiter.settle(ticket, Response(200, {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "1m0s"}, b"{}"))
    until, _, next_slot = state()["requests_headers"]
    assert 59 < until - time.time() <= 60 and next_slot == until
    limiter.close()
