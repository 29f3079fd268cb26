"""One engine across several nodes (``execution_params.nodes`` > 1): what the config must
agree on before any job, and the GPUs each node holds.

A shard job of N nodes runs one engine: rank 0 on the job's first node, started by the shard
runner as today, ranks 1..N-1 on the other nodes through ``srun`` (engines/server_ranks.py).
So the engine's GPUs, ``tp_size x pp_size x dp_size``, must be exactly the job's: N x the
GPUs of one node (``gpus``, or the count of a ``gpu:...:K`` gres, which are per node when
nodes > 1; left unset they are the engine's GPUs / N). Only the backends that launch a
server able to span nodes (``Capabilities.spans_nodes``: sglang_server, vllm_server) can;
an engine service (``shards_per_engine`` > 1) serves its shards on one node, and image
models load on one node, so both are refused with nodes > 1.

Nothing here imports an engine (the registry's capability lines are static).
"""

from __future__ import annotations

import re
from typing import Any, Iterable, Mapping

# SGLang's --pp-size, vLLM's --pipeline-parallel-size: given in extra_engine_args
PIPELINE_KEYS = ("pp_size", "pipeline_parallel_size")
_GRES_GPUS_RE = re.compile(r"gpu(?::[^:]+)?:(\d+)")


def pipeline_parallel(extra_engine_args: Mapping[str, Any]) -> int:
    """Pipeline-parallel size from ``extra_engine_args`` (``pp_size`` or ``pipeline_parallel_size``), else 1."""
    for key in PIPELINE_KEYS:
        if extra_engine_args.get(key):
            return int(extra_engine_args[key])
    return 1


def engine_gpus(server_args) -> int | None:
    """``tp_size x pp_size x dp_size`` of one engine; None when tp_size is null (the job's GPUs)."""
    if server_args.tp_size is None:
        return None
    return int(server_args.tp_size) * pipeline_parallel(server_args.extra_engine_args) * int(server_args.dp_size or 1)


def gres_gpus(gres: str | None) -> int | None:
    """The GPU count of a ``gpu:K`` / ``gpu:model:K`` gres, else None."""
    counted = _GRES_GPUS_RE.fullmatch(gres or "")
    return int(counted.group(1)) if counted else None


def gpus_per_node(ep: Mapping[str, Any], engines: Iterable[int | None]) -> int | None:
    """GPUs each node of an N-node shard job holds: the gres count, else ``gpus``, else the
    largest engine's GPUs / N (None when that is not whole or unknown)."""
    counted = gres_gpus(ep.get("gres"))
    if counted is not None:
        return counted
    if ep.get("gpus") is not None:
        return int(ep["gpus"])
    known = [g for g in engines if g is not None]
    if not known:
        return None
    largest = max(known)
    return largest // ep["nodes"] if largest % ep["nodes"] == 0 else None


def node_span_problems(ep: Mapping[str, Any], used: list, image_outputs: list[str]) -> list[str]:
    """The mistakes of ``execution_params.nodes`` > 1, each ``key.path: message``. ``used``:
    the ProcessorConfigs the outputs go to; ``image_outputs``: the image_gen outputs' names."""
    from mirageflow.engines import registry

    nodes = ep["nodes"]
    if nodes <= 1:
        return []
    able = registry.backends_that(lambda c: c.spans_nodes)
    span = f"execution_params.nodes: {nodes} spreads one engine over {nodes} nodes"
    problems = []
    if ep["shards_per_engine"] > 1:
        problems.append(
            f"execution_params.shards_per_engine: {ep['shards_per_engine']} shares an engine service over localhost on one node, "
            f"and {span}; set shards_per_engine to 1 (each shard job then runs its own engine across the nodes)"
        )
    if image_outputs:
        problems.append(
            f"{span}, but image_gen output(s) {', '.join(image_outputs)} load their image model on one node; "
            "run them in a pipeline of their own with nodes: 1"
        )
    if not used:
        problems.append(f"{span}, but no output of this pipeline goes to a processor that loads a model; set nodes to 1")
    for p in used:
        where = f"processors[{p.index}]"
        if not registry.capabilities(p.backend).spans_nodes:
            problems.append(
                f"{where}.backend: '{p.backend}' cannot span nodes ({span}); only {' and '.join(able)} can "
                + ("(a remote server: set nodes to 1)" if not registry.capabilities(p.backend).loads_model else "(or set nodes to 1)")
            )
            continue
        if p.server_args.tp_size is None:
            problems.append(
                f"{where}.server_args.tp_size: null (the GPUs the job holds) is not allowed with {span}: "
                "set tp_size (with dp_size and extra_engine_args.pp_size) to cover every GPU of every node"
            )
    gpus = [engine_gpus(p.server_args) for p in used if registry.capabilities(p.backend).spans_nodes]
    per_node = gpus_per_node(ep, gpus)
    for p, total in zip([p for p in used if registry.capabilities(p.backend).spans_nodes], gpus):
        if total is None:
            continue
        where = f"processors[{p.index}].server_args"
        factors = f"tp_size {p.server_args.tp_size} x pp_size {pipeline_parallel(p.server_args.extra_engine_args)} x dp_size {p.server_args.dp_size or 1} = {total}"
        if per_node is None:
            problems.append(
                f"execution_params.gpus: {factors} GPUs do not divide over nodes: {nodes}; set gpus (GPUs per node) "
                f"so that nodes x gpus = {total}"
            )
        elif per_node * nodes != total:
            key = "gres" if gres_gpus(ep.get("gres")) is not None else "gpus"
            problems.append(
                f"{where}: {factors} GPUs, but execution_params.nodes x {key} = {nodes} x {per_node} = {nodes * per_node} "
                f"(with nodes > 1, {key} counts the GPUs of each node); they must be equal"
            )
    return problems
