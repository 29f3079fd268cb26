"""Stand-in for ``python -m sglang.launch_server``: same flags, the fake HTTP server behind.

    python tests/fakes/fake_sglang_server.py --model-path M --port P [--host H] [--tp-size N] ...

The flags are sglang 0.5.23's own (tests/fakes/sglang_facts.json, from
``ServerArgs.add_cli_args``; argparse with its defaults, so an unambiguous prefix such as
``--tp`` for ``--tp-size`` is accepted as by the real parser); any other flag is an error
(exit 2). ``/health_generate`` answers 503 until the warm-up ends, as SGLang's does
(http_server.py: 503 until the warm-up request finished), 0.3 s by default. Trouble comes
from the environment (the engine's child inherits it):

- FAKE_SGLANG_UNHEALTHY_FOR=seconds   /health_generate answers 503 this long (the warm-up)
- FAKE_SGLANG_NEVER_HEALTHY=1         ...forever
- FAKE_SGLANG_EXIT_AT_START=code      exit before serving
- FAKE_SGLANG_CRASH_AFTER=n           exit (code 7) on the generation request after n answers
- FAKE_SGLANG_LATENCY=seconds         per generation request
- FAKE_SGLANG_HOLD_UNTIL=n            hold requests until n were in flight at once
- FAKE_SGLANG_PLAN=503,drop,ok        scripted answers, one per generation request
- FAKE_SGLANG_IGNORE_SIGTERM=1        survive SIGTERM (the engine must SIGKILL)
- FAKE_SGLANG_SPAWN_CHILD=1           start a grandchild (like SGLang's scheduler) and log its pid
- FAKE_RANK_EXIT_AT_START, FAKE_RANK_NEVER_JOINS   with --nnodes > 1: fake_ranks.py's rendezvous
- FAKE_SGLANG_DEATHS=kill:4,freeze:3  the k-th start (counted in the file FAKE_SGLANG_STARTS)
                                      SIGKILLs or SIGSTOPs itself after n answers (as FAKE_VLLM_DEATHS)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import fake_ranks
from fake_http import _FACTS, Behaviour, FakeServer, this_starts_death

_TYPED = {"port": int, "tp_size": int, "dp_size": int}


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="sglang.launch_server (fake)")
    for flag in _FACTS["server_flags"]:
        if flag["nargs"] == 0:  # store_true, BooleanOptionalAction, ...
            p.add_argument(*flag["flags"], dest=flag["dest"], action="store_true")
        else:
            p.add_argument(*flag["flags"], dest=flag["dest"], nargs=flag["nargs"], type=_TYPED.get(flag["dest"], str))
    args = p.parse_args(argv)
    if not args.model_path:
        p.error("the following arguments are required: --model-path")
    args.host = args.host or "127.0.0.1"
    args.port = 30000 if args.port is None else args.port
    args.tp_size, args.dp_size = args.tp_size or 1, args.dp_size or 1
    return args


def main() -> None:
    args = parse(sys.argv[1:])
    env = os.environ
    print(f"fake sglang argv: {json.dumps(sys.argv[1:])}", flush=True)
    print(f"fake sglang: server_args={ {k: v for k, v in vars(args).items() if v not in (None, False)} }", flush=True)
    if env.get("FAKE_SGLANG_IGNORE_SIGTERM"):
        signal.signal(signal.SIGTERM, lambda *a: print("fake sglang: ignoring SIGTERM", flush=True))
    if env.get("FAKE_SGLANG_SPAWN_CHILD"):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(f"fake sglang: scheduler child pid {child.pid}", flush=True)
    if int(args.nnodes or 1) > 1:  # one engine across nodes: the ranks meet first (fake_ranks.py)
        fake_ranks.join(int(args.nnodes), int(args.node_rank or 0), args.dist_init_addr)
    print("fake sglang: loading weights...", flush=True)
    death = this_starts_death(env, "FAKE_SGLANG")
    if env.get("FAKE_SGLANG_EXIT_AT_START"):
        print("fake sglang: RuntimeError: not enough memory for the KV cache", flush=True)
        sys.exit(int(env["FAKE_SGLANG_EXIT_AT_START"]))
    plan = [x.strip() for x in env.get("FAKE_SGLANG_PLAN", "").split(",") if x.strip()]
    behaviour = Behaviour(
        latency=float(env.get("FAKE_SGLANG_LATENCY", "0")),
        hold_until=int(env.get("FAKE_SGLANG_HOLD_UNTIL", "0")),
        unhealthy_for=float(env.get("FAKE_SGLANG_UNHEALTHY_FOR", "0.3")),
        never_healthy=bool(env.get("FAKE_SGLANG_NEVER_HEALTHY")),
        plan=plan,
        crash_after=int(env["FAKE_SGLANG_CRASH_AFTER"]) if env.get("FAKE_SGLANG_CRASH_AFTER") else None,
        enable_metrics=args.enable_metrics,
        model=args.model_path,
        allow_exit=True,
        death=death,
    )
    server = FakeServer(behaviour, host=args.host, port=args.port)
    print(f"fake sglang: serving on {server.url}", flush=True)
    server.httpd.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
