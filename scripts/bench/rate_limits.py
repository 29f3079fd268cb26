"""Throughput under a provider's rate limits, as a fraction of the limit, and the 429s it cost.

    python scripts/bench/rate_limits.py               # ~1 minute; rewrites its BENCHMARKS.md section
    python scripts/bench/rate_limits.py --seconds 20  # each case paced for ~20 s instead of ~10

The provider is the tests' fake OpenAI-compatible server (tests/fakes/fake_http.py, a thread of
this process) with ``ProviderLimits``: a bucket per limit, refilled continuously, a 429 with
OpenAI's headers (x-ratelimit-*, Retry-After) past it; every answer after 20 ms. The limits are
per 5-second window (the client's ``max_*_per_minute`` are the same rates per minute), so a
run of a few hundred requests spans many windows. Cases:

- ``requests, 1 shard``: backend openai (64 requests in flight) with
  ``max_requests_per_minute`` equal to the provider's limit.
- ``tokens, 1 shard``: ``max_tokens_per_minute`` equal to the provider's tokens limit
  (each request ~11 tokens as the provider counts them: prompt + max_tokens 5).
- ``requests, 2 shards``: two shard processes of one run (``run_shard``, as the jobs run
  it), sharing the processor's limit through ``<state_dir>/rate_limits/llm.json``.
- ``headers only``: no limit configured, 64 in flight: only the provider's headers and
  Retry-After pace the shard. Its first bucketful goes at once (the provider allows it), so
  its rate is measured after that, over two more bucketfuls.

Achieved rate = what the provider let through between its first and its last admission
(requests - 1, or their usage tokens less one request's mean), over that span; fraction =
achieved / the provider's limit. Goal: >= 0.95 with no 429 for the configured cases.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

sys.path.insert(0, str(C.ROOT / "tests"))
from fakes import drive
from fakes.configs import pipeline_config
from fakes.fake_http import Behaviour, FakeServer, ProviderLimits
from fakes.runs import start_shard_job

from mirageflow.config import load_config
from mirageflow.engines.openai_engine import OpenAIEngine
from mirageflow.engines.wire import Request
from mirageflow.shard.runner import index_datasets

WINDOW = 5.0  # seconds of the provider's limits
LATENCY = 0.02
GOAL = 0.95


def _config(root: Path, server: FakeServer, rows: int = 1, num_shards: int = 1, **keys) -> dict:
    data = root / "in.jsonl"
    data.write_text("".join(json.dumps({"q": f"passage {i}"}) + "\n" for i in range(rows)))
    return pipeline_config(
        data, state_dir=root / "state", output_dir=root / "out", num_shards=num_shards,
        processor={"backend": "openai", "base_url": server.url + "/v1", "model": "m", "max_retries": 8,
                   "default_sampling_params": {"max_new_tokens": 5}, **keys},
        dataset={"type": "jsonl", "output_format": "jsonl"},
        shard_params={"max_error_rate": 1.0, "checkpoint_rows": 50, "checkpoint_min_seconds": 0},
    )  # fmt: skip


def _engine_case(root: Path, limits: ProviderLimits, n: int, **keys) -> FakeServer:
    server = FakeServer(Behaviour(latency=LATENCY, rate_limits=limits)).start()
    try:
        engine = OpenAIEngine(load_config(_config(root, server, **keys), check_paths=False).processors["llm"])
        engine.load()
        try:
            done = drive(
                engine,
                [Request(i, [{"role": "user", "content": f"Summarise: passage {i}"}], None, {"max_new_tokens": 5}) for i in range(n)],
            )
        finally:
            engine.close()
        failed = [c.error for c in done if c.error]
        if failed:
            raise SystemExit(f"{len(failed)} requests failed: {failed[:3]}")
    finally:
        server.stop()
    return server


def _shards_case(root: Path, limits: ProviderLimits, rows: int, **keys) -> FakeServer:
    server = FakeServer(Behaviour(latency=LATENCY, rate_limits=limits)).start()
    try:
        raw = _config(root, server, rows=rows, num_shards=2, **keys)
        index_datasets(load_config(copy.deepcopy(raw)))
        jobs = [start_shard_job(root, raw, k) for k in (0, 1)]
        outs = [j.communicate(timeout=600)[0] for j in jobs]
        if any(j.returncode for j in jobs):
            raise SystemExit("a shard failed:\n" + "\n".join(o[-2000:] for o in outs))
    finally:
        server.stop()
    return server


def _figures(server: FakeServer, limits: ProviderLimits, skip: int = 0) -> dict:
    times = server.admitted_at[skip:]
    span = times[-1] - times[0]
    if limits.requests:
        achieved, limit, unit = (len(times) - 1) / span, limits.requests / WINDOW, "requests/s"
    else:
        achieved = server.usage_tokens * (len(times) - 1) / len(times) / span
        limit, unit = limits.tokens / WINDOW, "tokens/s"
    return {
        "unit": unit, "limit": limit, "achieved": achieved, "fraction": achieved / limit,
        "admitted": server.admitted, "rate_limited_429": server.rate_limited, "span_s": span,
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=10.0, help="about how long each case is paced")
    ap.add_argument("--no-write", action="store_true", help="print only; leave BENCHMARKS.md alone")
    args = ap.parse_args()
    info = C.machine()
    requests = ProviderLimits(requests=100, seconds=WINDOW)  # 20/s: 1200 a minute
    tokens = ProviderLimits(tokens=1000, seconds=WINDOW)  # 200/s: 12,000 a minute
    per_minute = 60 / WINDOW
    n = int(args.seconds * requests.requests / WINDOW)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases = [
            ("requests, 1 shard", requests, lambda d: _engine_case(d, requests, n, max_requests_per_minute=requests.requests * per_minute)),
            ("tokens, 1 shard", tokens, lambda d: _engine_case(d, tokens, n, max_tokens_per_minute=tokens.tokens * per_minute)),
            (
                "requests, 2 shards",
                requests,
                lambda d: _shards_case(d, requests, n, max_requests_per_minute=requests.requests * per_minute),
            ),
            ("headers only", requests, lambda d: _engine_case(d, requests, 3 * requests.requests)),
        ]
        for name, limits, run in cases:
            case_dir = root / name.replace(" ", "_").replace(",", "")
            case_dir.mkdir()
            skip = requests.requests if name == "headers only" else 0  # the provider's first bucketful
            results[name] = _figures(run(case_dir), limits, skip)
            print(name, {k: round(v, 3) if isinstance(v, float) else v for k, v in results[name].items()}, flush=True)
    rows = [
        [name, f"{r['limit']:g} {r['unit']}", C.fmt(r["achieved"], 2), f"**{r['fraction']:.3f}**", r["admitted"], r["rate_limited_429"], C.fmt(r["span_s"], 1)]
        for name, r in results.items()
    ]  # fmt: skip
    kept = all(results[k]["fraction"] >= GOAL and results[k]["rate_limited_429"] == 0 for k in list(results)[:3])
    body = f"""## Rate limits: throughput as a fraction of a provider's limit (`scripts/bench/rate_limits.py`)

Backend `openai` against the tests' fake provider (tests/fakes/fake_http.py `ProviderLimits`: a
bucket per limit refilled continuously, 429 with OpenAI's x-ratelimit-* headers and Retry-After
past it), limits per {WINDOW:g}-second window, answers after {LATENCY * 1000:g} ms, 64 requests in flight
per shard. The configured cases set `max_requests_per_minute` / `max_tokens_per_minute` to the
provider's limit; `2 shards` are two shard processes of one run sharing it through the state
dir; `headers only` sets no limit (the provider's headers and Retry-After pace it; measured
after the provider's first bucketful, which goes at once). Achieved = what the provider let
through between its first and last admission, over that span.
Goal: >= {GOAL} of the limit with no 429 ({"met" if kept else "NOT met"}). A fraction a little
over 1 is the span's ends (the first request also opens its connection, so its slot is
seen late); `headers only` over 1 is the provider's bucket drawn down to about half, which
its headers allow.

- command: `python scripts/bench/rate_limits.py`
- date: {C.now()}; mirageflow at {C.git_rev()}
{C.machine_lines(info)}
{C.table(["case", "provider's limit", "achieved", "fraction", "admitted", "429s", "span s"], rows)}
"""
    print(body)
    if not args.no_write:
        C.write_section("rate_limits", body)


if __name__ == "__main__":
    main()
