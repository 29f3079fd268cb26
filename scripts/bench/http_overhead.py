"""HTTP client overhead: our pipeline through the ``openai`` backend against an instant server.

    python scripts/bench/http_overhead.py                          # 20,000 rows, 3 interleaved repeats
    python scripts/bench/http_overhead.py --baseline-src OLD/src   # also another copy of the package, interleaved
    python scripts/bench/http_overhead.py --profile                # cProfile of one pipeline run, top functions

The server (started here, in its own process pinned to one CPU) is a raw asyncio HTTP/1.1
keep-alive server that answers every ``POST`` at once with the same OpenAI chat completion
(20 words, usage): no per-request logging, sleeping or parsing beyond the framing. Each
measured run is a fresh process pinned to the other CPU:

- ``pipeline``: ``run_shard`` on one shard of a generated JSONL, one plain output, the
  ``openai`` backend (64 requests in flight, the default), default checkpoints (Parquet
  part files every 500 rows but at most once a second, fsynced), after a warm-up shard of
  500 rows in the same process (imports, first-use caches). rows/s = rows / (shard
  runtime - engine load); client CPU = the process's CPU (all its threads) during
  ``run_shard``, per request.
- ``pipeline_baseline`` (with ``--baseline-src``): the same with another copy of the package
  (e.g. a checkout of the code before a change), interleaved with ``pipeline``.
- ``bare_<client>``: the same request bodies posted by 64 coroutines through one client and
  nothing else (the response decoded and its text and usage read): what the HTTP client alone
  costs. ``ours`` is the engines' transport (mirageflow.transport.http_client);
  ``ours_thread_hop`` the same with each request handed to a loop in another thread and
  back (how the engines ran requests before); ``httpx2`` (the client the engines used
  before) and ``aiohttp`` (when importable) are the libraries it was chosen against.

Also measured (in this process): JSON encoding of a request body and decoding of an answer,
stdlib ``json`` against ``orjson``, in microseconds per request.
Variants are interleaved, ``--repeats`` times; medians are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as C

ANSWER_WORDS = 20
IN_FLIGHT = 64
WARM_UP_ROWS = 500
PROMPT = "Summarise in one sentence: {{ text }}"
TARGET_ROWS_PER_SEC = 3500
TARGET_CPU_MS_PER_REQUEST = 0.25


# --------------------------------------------------------------------------- the instant server


def answer_body() -> bytes:
    text = " ".join(f"word{i}" for i in range(ANSWER_WORDS))
    return json.dumps({
        "id": "cmpl-instant", "object": "chat.completion", "created": 0, "model": "instant",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 48, "completion_tokens": ANSWER_WORDS, "total_tokens": 48 + ANSWER_WORDS},
    }).encode()  # fmt: skip


def serve(core: int) -> None:
    """The instant server: print the port, answer until killed."""
    os.sched_setaffinity(0, {core})
    body = answer_body()
    response = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    class Instant(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buffer = transport, b""

        def data_received(self, data):
            buffer, answers = self.buffer + data, 0
            while True:  # every whole request in the buffer gets the answer
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    break
                head = buffer[:end].lower()
                at = head.find(b"content-length:")
                length = int(head[at + 15 :].split(b"\r\n", 1)[0]) if at >= 0 else 0
                if len(buffer) < end + 4 + length:
                    break
                buffer = buffer[end + 4 + length :]
                answers += 1
            self.buffer = buffer
            if answers:
                self.transport.write(response * answers)

    async def main():
        server = await asyncio.get_running_loop().create_server(Instant, "127.0.0.1", 0, backlog=1024)
        print(server.sockets[0].getsockname()[1], flush=True)
        await server.serve_forever()

    asyncio.run(main())


def cpu_seconds_of(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


# --------------------------------------------------------------------------- the measured runs (child processes)


def pipeline_config(data: Path, work: Path, url: str) -> dict:
    return {
        "processors": [{
            "type": "llm", "backend": "openai", "base_url": url + "/v1", "model": "instant",
            "server_args": {"model_path": "instant"},
            "default_sampling_params": {"temperature": 0.0, "max_new_tokens": 64},
        }],
        "loading_params": {
            "state_dir": str(work / "state"), "num_shards": 1, "shard_id": 0,
            "datasets": [{"path": str(data), "type": "JSONL", "output_dir": str(work / "out")}],
        },
        "processing_params": {
            "inputs": [{"name": "id", "key": "id"}, {"name": "text", "key": "text"}],
            "outputs": [{"name": "summary", "type": "llm", "output_type": "plain", "prompt": PROMPT}],
            "remove_columns": True, "output_schema": {"id": "{{ id }}", "summary": "{{ summary }}"},
        },
    }  # fmt: skip


def run_pipeline(data: Path, work: Path, url: str, profile: bool = False) -> dict:
    from mirageflow.config import load_config
    from mirageflow.shard.runner import index_datasets, run_shard

    cfg = load_config(pipeline_config(data, work, url))
    index_datasets(cfg)
    profiler = cProfile.Profile() if profile else None
    cpu0 = time.process_time()
    if profiler:
        profiler.enable()
    status = run_shard(cfg, 0)
    if profiler:
        profiler.disable()
    cpu = time.process_time() - cpu0
    st = status["stats"]
    assert st["rows_failed"] == 0 and st["rows_processed"] > 0, st
    seconds = st["runtime_seconds"] - st["model_load_seconds"]
    if profiler:
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(35)
    return {"requests": st["rows_processed"], "seconds": seconds, "cpu_seconds": cpu}


def request_bodies(data: Path) -> list[dict]:
    """What the pipeline posts for each row (model, the user message, the sampling params)."""
    bodies = []
    for line in data.read_text().splitlines():
        text = json.loads(line)["text"]
        bodies.append({"model": "instant", "temperature": 0.0, "max_tokens": 64,
                       "messages": [{"role": "user", "content": f"Summarise in one sentence: {text}"}]})  # fmt: skip
    return bodies


async def _bare_ours(url: str, bodies: list[dict]) -> None:
    from mirageflow.transport.http_client import HTTPClient

    client = HTTPClient(url + "/v1", max_connections=IN_FLIGHT, timeout=60.0)
    try:
        await _workers(bodies, lambda b: client.post_json("/chat/completions", b), lambda r: r.json())
    finally:
        await client.aclose()


async def _bare_httpx2(url: str, bodies: list[dict]) -> None:
    import httpx2

    limits = httpx2.Limits(max_connections=IN_FLIGHT, max_keepalive_connections=IN_FLIGHT)
    async with httpx2.AsyncClient(base_url=url + "/v1", timeout=60.0, limits=limits) as client:
        await _workers(bodies, lambda b: client.post("/chat/completions", json=b), lambda r: r.json())


async def _bare_aiohttp(url: str, bodies: list[dict]) -> None:
    import aiohttp

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=IN_FLIGHT)) as session:

        async def post(body):
            async with session.post(url + "/v1/chat/completions", json=body) as r:
                await r.read()
                return r

        async def decode(r):
            return await r.json()

        async def worker(k):
            for i in range(k, len(bodies), IN_FLIGHT):
                data = await decode(await post(bodies[i]))
                _read_answer(data)

        await asyncio.gather(*(worker(k) for k in range(IN_FLIGHT)))


def _read_answer(data: dict) -> None:
    assert data["choices"][0]["message"]["content"] and data["usage"]["completion_tokens"] == ANSWER_WORDS


async def _workers(bodies, post, decode) -> None:
    async def worker(k):
        for i in range(k, len(bodies), IN_FLIGHT):
            response = await post(bodies[i])
            assert response.status_code == 200
            _read_answer(decode(response))

    await asyncio.gather(*(worker(k) for k in range(IN_FLIGHT)))


async def _bare_ours_thread_hop(url: str, bodies: list[dict]) -> None:
    """As ``ours``, the client in a private loop in another thread and each request handed
    over and back (run_coroutine_threadsafe + wrap_future): what the engines did before
    their requests ran in the caller's loop (LoopEngine._in_engine_loop)."""
    import threading

    from mirageflow.transport.http_client import HTTPClient

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    client = HTTPClient(url + "/v1", max_connections=IN_FLIGHT, timeout=60.0)

    async def post(body):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(client.post_json("/chat/completions", body), loop))

    async def worker(k):
        for i in range(k, len(bodies), IN_FLIGHT):
            response = await post(bodies[i])
            assert response.status_code == 200
            _read_answer(response.json())

    try:
        await asyncio.gather(*(worker(k) for k in range(IN_FLIGHT)))
    finally:
        asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


BARE = {"ours": _bare_ours, "ours_thread_hop": _bare_ours_thread_hop, "httpx2": _bare_httpx2, "aiohttp": _bare_aiohttp}


def run_bare(client: str, url: str, data: Path) -> dict:
    bodies = request_bodies(data)
    t0, cpu0 = time.perf_counter(), time.process_time()
    asyncio.run(BARE[client](url, bodies))
    return {"requests": len(bodies), "seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - cpu0}


def child(args) -> None:
    os.sched_setaffinity(0, {args.core})
    if args.variant.startswith("pipeline"):
        work = Path(tempfile.mkdtemp(prefix="http-bench-", dir=args.work))
        try:  # a warm-up shard first: imports and first-use caches are not per-request costs
            warm = C.write_jsonl(
                work / "warm.jsonl", [json.loads(line) for line in Path(args.data).read_text().splitlines()[:WARM_UP_ROWS]]
            )
            run_pipeline(warm, work / "warm", args.url)
            result = run_pipeline(Path(args.data), work / "run", args.url, args.profile)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    else:
        result = run_bare(args.variant.removeprefix("bare_"), args.url, Path(args.data))
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- JSON on the request path


def json_costs(data: Path, n: int = 20000) -> dict:
    """Microseconds per request: encode a request body, decode an answer; stdlib json and orjson."""
    bodies = request_bodies(data)[:n]
    answer = answer_body()
    out = {}
    libs = {"json": (lambda o: json.dumps(o, ensure_ascii=False).encode(), json.loads)}
    try:
        import orjson

        libs["orjson"] = (orjson.dumps, orjson.loads)
    except ImportError:
        pass
    for name, (dumps, loads) in libs.items():
        best_enc = best_dec = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for b in bodies:
                dumps(b)
            best_enc = min(best_enc, (time.perf_counter() - t0) / len(bodies))
            t0 = time.perf_counter()
            for _ in bodies:
                loads(answer)
            best_dec = min(best_dec, (time.perf_counter() - t0) / len(bodies))
        out[f"{name}_encode_us_per_request"] = 1e6 * best_enc
        out[f"{name}_decode_us_per_request"] = 1e6 * best_dec
    return out


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--baseline-src", help="also run the pipeline with the package in this directory (e.g. OLD/src)")
    p.add_argument("--baseline-label", default="the package of --baseline-src", help="what the baseline is, for BENCHMARKS.md")
    p.add_argument("--clients", default="ours,ours_thread_hop,httpx2,aiohttp", help="bare loops to run (those importable)")
    p.add_argument("--profile", action="store_true", help="one pipeline run under cProfile (top functions on stderr)")
    p.add_argument("--no-write", action="store_true", help="do not update BENCHMARKS.md")
    p.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    for hidden in ("--url", "--data", "--work"):
        p.add_argument(hidden, help=argparse.SUPPRESS)
    p.add_argument("--core", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve is not None:
        return serve(args.serve)
    if args.variant:
        return child(args)

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        sys.exit("http_overhead needs 2 CPUs: one for the server, one for the client")
    server_core, client_core = cpus[0], cpus[1]
    info = C.machine("httpx2", "orjson", "aiohttp")
    work = Path(tempfile.mkdtemp(prefix="http-overhead-"))
    data = C.write_jsonl(work / "rows.jsonl", C.make_rows(args.rows))
    me = str(Path(__file__).resolve())
    server = subprocess.Popen([sys.executable, me, "--serve", str(server_core)], stdout=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{int(server.stdout.readline())}"
        variants = [("pipeline", None)]
        if args.baseline_src:
            variants.append(("pipeline_baseline", str(Path(args.baseline_src).resolve())))
        for client in args.clients.split(","):
            importable = subprocess.run([sys.executable, "-c", f"import {'mirageflow.transport.http_client' if client.startswith('ours') else client}"],
                                        env={**os.environ, "PYTHONPATH": str(C.ROOT / "src")}, capture_output=True).returncode == 0  # fmt: skip
            if importable:
                variants.append((f"bare_{client}", None))
            else:
                print(f"bare_{client}: not importable here, left out", file=sys.stderr)

        def run(name: str, src: str | None, profile: bool = False) -> dict:
            env = {**os.environ, "PYTHONPATH": src or str(C.ROOT / "src"), "OMP_NUM_THREADS": "1"}
            if src:
                env["BENCH_MIRAGEFLOW_SRC"] = src
            cmd = [
                sys.executable,
                me,
                "--variant",
                name,
                "--core",
                str(client_core),
                "--url",
                url,
                "--data",
                str(data),
                "--work",
                str(work),
            ]
            server_cpu0 = cpu_seconds_of(server.pid)
            proc = subprocess.run(cmd + (["--profile"] if profile else []), env=env, capture_output=True, text=True, timeout=1800)
            if proc.returncode != 0:
                raise SystemExit(f"{name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            if profile:
                print(proc.stderr, file=sys.stderr)
            result = json.loads(proc.stdout.rsplit("RESULT ", 1)[1])
            result["server_cpu_seconds"] = cpu_seconds_of(server.pid) - server_cpu0
            return result

        if args.profile:
            run("pipeline", None, profile=True)
            return
        results: dict[str, list[dict]] = {name: [] for name, _ in variants}
        for rep in range(args.repeats):
            for name, src in variants:
                r = run(name, src)
                results[name].append(r)
                print(f"repeat {rep + 1}/{args.repeats} {name}: {r['requests'] / r['seconds']:,.0f} requests/s, "
                      f"{1000 * r['cpu_seconds'] / r['requests']:.3f} client CPU-ms per request, "
                      f"server {1000 * r['server_cpu_seconds'] / r['requests']:.3f} CPU-ms per request", file=sys.stderr, flush=True)  # fmt: skip
        costs = json_costs(data)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(work, ignore_errors=True)

    rate = {n: C.median([r["requests"] / r["seconds"] for r in rs]) for n, rs in results.items()}
    cpu_ms = {n: C.median([1000 * r["cpu_seconds"] / r["requests"] for r in rs]) for n, rs in results.items()}
    server_ms = {n: C.median([1000 * r["server_cpu_seconds"] / r["requests"] for r in rs]) for n, rs in results.items()}
    figures = {"http_rows_per_sec": rate["pipeline"], "http_client_cpu_ms_per_request": cpu_ms["pipeline"],
               "http_rows_per_client_cpu_sec": 1000 / cpu_ms["pipeline"]}  # fmt: skip
    for name in results:
        if name.startswith("bare_"):
            figures[f"{name}_requests_per_sec"] = rate[name]
            figures[f"{name}_client_cpu_ms_per_request"] = cpu_ms[name]
    if "pipeline_baseline" in results:
        figures["baseline_http_rows_per_sec"] = rate["pipeline_baseline"]
        figures["baseline_http_client_cpu_ms_per_request"] = cpu_ms["pipeline_baseline"]
        figures["rows_per_sec_ratio_vs_baseline"] = rate["pipeline"] / rate["pipeline_baseline"]
        figures["client_cpu_ratio_baseline_over_ours"] = cpu_ms["pipeline_baseline"] / cpu_ms["pipeline"]
    figures["pipeline_server_cpu_ms_per_request"] = server_ms["pipeline"]
    figures.update(costs)

    verdicts = [
        f"- pipeline >= {TARGET_ROWS_PER_SEC:,} rows/s per client core: **{'met' if rate['pipeline'] >= TARGET_ROWS_PER_SEC else 'NOT met'}** ({C.fmt(rate['pipeline'])})",
        f"- client CPU <= {TARGET_CPU_MS_PER_REQUEST} ms per request: **{'met' if cpu_ms['pipeline'] <= TARGET_CPU_MS_PER_REQUEST else 'NOT met'}** ({cpu_ms['pipeline']:.3f})",
    ]
    if not args.no_write:
        rows = [[name, rs[0]["requests"], C.fmt(rate[name]), ", ".join(C.fmt(r["requests"] / r["seconds"]) for r in rs),
                 f"{cpu_ms[name]:.3f}", ", ".join(f"{1000 * r['cpu_seconds'] / r['requests']:.3f}" for r in rs), f"{server_ms[name]:.3f}"]
                for name, rs in results.items()]  # fmt: skip
        shown = [("OLD/src" if prev == "--baseline-src" else a) for prev, a in zip([None, *sys.argv[1:]], sys.argv[1:])]
        cmd = "python scripts/bench/http_overhead.py" + "".join(f" {a!r}" if " " in a else f" {a}" for a in shown)
        body = f"""## HTTP client overhead (`scripts/bench/http_overhead.py`)

Our pipeline through the `openai` backend against an instant OpenAI-compatible server (a raw
asyncio HTTP/1.1 keep-alive server answering every request at once with a fixed
{ANSWER_WORDS}-word completion; no logging, no sleeping), the server pinned to CPU {server_core}, each
measured run a fresh process pinned to CPU {client_core}. `pipeline`: one shard of {args.rows:,}
generated rows, one plain output, {IN_FLIGHT} requests in flight, default checkpoints (part files
fsynced every 500 rows, at most once a second); rows/s = rows / (shard runtime - engine load);
client CPU = the shard process's CPU (all threads) during the shard, per request; each run
after a warm-up shard of {WARM_UP_ROWS} rows in the same process (imports, first-use caches).
`pipeline_baseline`: the same with {args.baseline_label if args.baseline_src else "another copy of the package (`--baseline-src`; not run here)"}.
`bare_<client>`: the same request bodies from {IN_FLIGHT} coroutines through that client alone
(answer decoded, text and usage read). `ours` is `mirageflow.transport.http_client`, the
transport of every HTTP engine; `ours_thread_hop` the same with the client in another thread's
loop and each request handed over and back (how the engines ran requests before: the hop's
cost is the difference); `httpx2` and `aiohttp` are the libraries it was measured against.
{args.repeats} interleaved repeats, medians. Server CPU per request shows the server is not the limit.

- command: `{cmd}`
- date: {C.now()}; mirageflow at {C.git_rev()}
{C.machine_lines(info)}
{C.table(["variant", "requests", "median requests/s", "all repeats", "median client CPU-ms per request", "all repeats", "server CPU-ms per request"], rows)}

Targets:

{chr(10).join(verdicts)}

On a shared machine the wall rates (requests/s) depend on how much CPU the two processes
get (load average above); the CPU per request is the steadier figure: the pipeline costs
{cpu_ms["pipeline"]:.3f} ms of client CPU per row, {1000 / cpu_ms["pipeline"]:,.0f} rows per client CPU-second.

JSON on the request path (this process, best of 3 over {min(args.rows, 20000):,} bodies), microseconds
per request: encoding a request body {costs["json_encode_us_per_request"]:.1f} (json) vs
{costs.get("orjson_encode_us_per_request", float("nan")):.1f} (orjson), decoding an answer {costs["json_decode_us_per_request"]:.1f} vs
{costs.get("orjson_decode_us_per_request", float("nan")):.1f}: the transport uses orjson.

Figures:

```
{chr(10).join(f"{k}: {v:.1f}" if abs(v) >= 10 else f"{k}: {v:.3g}" for k, v in figures.items())}
```
"""
        C.write_section("http_overhead", body)
    C.print_figures(figures)


if __name__ == "__main__":
    main()
