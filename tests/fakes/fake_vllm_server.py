"""Stand-in for ``python -m vllm.entrypoints.openai.api_server``: its flags, the fake HTTP
server behind (OpenAI endpoints, ``/health``, ``/version``, vLLM's metric names).

    python tests/fakes/fake_vllm_server.py --model M --port P [--host H] [--flag value ...]

``--model`` and ``--port`` are required; any other ``--flag`` (with or without a value) is
taken as vLLM takes its many flags, and the argv is logged for tests to read (the real
server checks the flags themselves: tests/test_real_vllm.py). The environment it sees
(``LD_PRELOAD``, ``VLLM_*``) is logged too. Trouble comes from the environment:

- FAKE_VLLM_UNHEALTHY_FOR=seconds   /health answers 503 this long (vLLM's start-up)
- FAKE_VLLM_EXIT_AT_START=code      exit before serving
- FAKE_VLLM_CRASH_AFTER=n           exit (code 7) on the generation request after n answers
- FAKE_VLLM_LATENCY=seconds         per generation request
- FAKE_VLLM_IGNORE_SIGTERM=1        survive SIGTERM, as vLLM does while it compiles
- FAKE_VLLM_DEATHS=kill:4,freeze:3,exit,...  the k-th start of the server (counted in the file
                                    FAKE_VLLM_STARTS) SIGKILLs itself (kill:n) or SIGSTOPs itself
                                    (freeze:n) on the generation request after n answers, or
                                    exits (code 4) before serving (exit); later starts serve
- FAKE_RANK_EXIT_AT_START, FAKE_RANK_NEVER_JOINS   with --nnodes > 1: fake_ranks.py's rendezvous
                                    (at --master-addr:--master-port; ranks > 0 must be --headless)
- FAKE_VLLM_REQUEST_LOG=path        a JSON line per generation request asked and answered
"""

from __future__ import annotations

import json
import os
import signal
import sys

import fake_ranks
from fake_http import Behaviour, FakeServer, this_starts_death


def parse(argv: list[str]) -> dict:
    args: dict = {}
    i = 0
    while i < len(argv):
        flag = argv[i]
        if not flag.startswith("--"):
            sys.exit(f"fake vllm: unexpected argument {flag!r}")
        values = []
        while i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            values.append(argv[i + 1])
            i += 1
        args[flag[2:].replace("-", "_")] = values[0] if len(values) == 1 else (values or True)
        i += 1
    for required in ("model", "port"):
        if required not in args:
            sys.exit(f"fake vllm: the following arguments are required: --{required}")
    return args


def main() -> None:
    args = parse(sys.argv[1:])
    env = os.environ
    print(f"fake vllm argv: {json.dumps(sys.argv[1:])}", flush=True)
    seen = {k: v for k, v in env.items() if k == "LD_PRELOAD" or k.startswith("VLLM_")}
    print(f"fake vllm env: {json.dumps(seen, sort_keys=True)}", flush=True)
    if env.get("FAKE_VLLM_IGNORE_SIGTERM"):
        signal.signal(signal.SIGTERM, lambda *a: print("fake vllm: ignoring SIGTERM (compiling)", flush=True))
    nnodes, node_rank = int(args.get("nnodes", 1)), int(args.get("node_rank", 0))
    if nnodes > 1:  # vLLM's multiprocessing multi-node route: ranks > 0 run headless (no API server)
        if (node_rank > 0) != bool(args.get("headless")):
            sys.exit(f"fake vllm: node rank {node_rank} of {nnodes} {'needs' if node_rank else 'must not have'} --headless")
        fake_ranks.join(nnodes, node_rank, f"{args['master_addr']}:{args['master_port']}")
    print("fake vllm: Loading weights took 0.94 seconds", flush=True)
    death = this_starts_death(env, "FAKE_VLLM")
    if death == ("exit", 0):
        print("fake vllm: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", flush=True)
        sys.exit(4)
    if env.get("FAKE_VLLM_EXIT_AT_START"):
        print("fake vllm: ValueError: No available memory for the cache blocks", flush=True)
        sys.exit(int(env["FAKE_VLLM_EXIT_AT_START"]))
    behaviour = Behaviour(
        latency=float(env.get("FAKE_VLLM_LATENCY", "0")),
        unhealthy_for=float(env.get("FAKE_VLLM_UNHEALTHY_FOR", "0.3")),
        crash_after=int(env["FAKE_VLLM_CRASH_AFTER"]) if env.get("FAKE_VLLM_CRASH_AFTER") else None,
        model=args.get("served_model_name") or args["model"],
        allow_exit=True,
        flavour="vllm",
        seed_in_text=True,
        death=death,
        request_log=env.get("FAKE_VLLM_REQUEST_LOG"),
    )
    server = FakeServer(behaviour, host=args.get("host", "127.0.0.1"), port=int(args["port"]))
    print(f"fake vllm: Starting vLLM server on {server.url}", flush=True)
    server.httpd.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
