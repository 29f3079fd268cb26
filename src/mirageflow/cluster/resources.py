"""SLURM resources of the workflow's jobs, from the pipeline's ``execution_params``.

``execution_problems`` is part of config validation (``load_config``), so a bad time limit,
memory, gres, a forbidden ``slurm_extra`` flag or ``max_time_limit < time_limit`` is a
ConfigError naming the key path, in ``mmirage check`` as in ``snakemake -n``.
``cluster_resources`` turns a validated config into the Snakemake resources of a shard or
index job (workflow/rules/*.smk; the mapping is in docs/cluster.md). Shard jobs also get
``--signal=TERM@<seconds>`` (``term_signal_seconds``): SLURM sends SIGTERM that long before
the time limit, so the shard commits its finished rows and writes failure.json instead of
being killed mid-commit, and the retry resumes it. ``job_resources`` gives the rules these
resources only when the run submits to a cluster (mirageflow.cluster.executor): a local run
neither shows nor counts them, except those it limits with ``--resources`` (``gpu=N`` on a
GPU node, so that shards never need more GPUs than there are).

Nothing here imports Snakemake or the SLURM plugin: every job validates its config again,
and importing the plugin costs over half a second.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Collection

from mirageflow.cluster.node_span import engine_gpus, gpus_per_node, gres_gpus
from mirageflow.config.types import ExecutionParams, PipelineConfig, ProcessorConfig

# [D-]HH:MM:SS, as sbatch --time takes it (the schema has the same pattern).
_TIME_RE = re.compile(r"(?:(\d+)-)?(\d{1,3}):(\d{2}):(\d{2})")
_MEM_RE = re.compile(r"(\d+)([KMGT]?)")
_MEM_SCALE_MB = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024**2}
INDEX_MAX_MINUTES = 60  # index jobs only read the dataset once
# SIGTERM before the time limit: a tenth of the limit, at least TERM_MIN_SECONDS, at most
# TERM_MAX_SECONDS (SLURM may send it up to a minute earlier than asked: it checks limits
# periodically). The shard runner needs seconds to commit and write failure.json.
TERM_MIN_SECONDS, TERM_MAX_SECONDS = 5, 300
_SIGNAL_RE = re.compile(r"(?:^|\s)--signal[=\s]")

# The sbatch options snakemake-executor-plugin-slurm sets itself and refuses in slurm_extra
# (snakemake_executor_plugin_slurm.validation.get_forbidden_slurm_options, plugin 2.8.0, as
# pinned in requirements.txt; tests/test_cluster.py checks the copy against the plugin).
FORBIDDEN_SLURM_OPTIONS = {
    r"--job-name[=\s]|-J\s?": "job name",
    r"--output[=\s]|-o\s": "output file",
    r"--error[=\s]|-e\s": "error file",
    r"--parsable": "parsable output",
    r"--export[=\s]": "environment export",
    r"--comment[=\s]": "job comment",
    r"--workdir[=\s]|-D\s": "working directory",
    r"--account[=\s]|-A\s": "account",
    r"--partition[=\s]|-p\s": "partition",
    r"--mem[=\s]": "memory",
    r"--mem-per-cpu[=\s]": "memory per CPU",
    r"--ntasks[=\s]|-n\s": "number of tasks",
    r"--ntasks-per-gpu[=\s]": "tasks per GPU",
    r"--cpus-per-task[=\s]|-c\s": "CPUs per task",
    r"--cpus-per-gpu[=\s]": "CPUs per GPU",
    r"--time[=\s]|-t\s": "runtime/time limit",
    r"--constraint[=\s]|-C\s": "node constraints",
    r"--qos[=\s]": "quality of service",
    r"--nodes[=\s]|-N\s": "number of nodes",
    r"--clusters[=\s]": "cluster specification",
    r"--gres[=\s]": "generic resources (GRES)",
    r"--gpus[=\s]": "GPU allocation",
}


def minutes(limit: str) -> int:
    """``[D-]HH:MM:SS`` in whole minutes, rounded up (at least 1); ValueError when malformed."""
    m = _TIME_RE.fullmatch(limit.strip()) if isinstance(limit, str) else None
    if not m:
        raise ValueError(f"'{limit}' is not a time limit of the form [D-]HH:MM:SS")
    days, h, mins, s = (int(x) if x else 0 for x in m.groups())
    if mins >= 60 or s >= 60:
        raise ValueError(f"'{limit}' has {'minutes' if mins >= 60 else 'seconds'} above 59")
    return max(1, math.ceil((days * 24 + h) * 60 + mins + s / 60))


def mem_mb(mem: str | int) -> int:
    """sbatch --mem value (``200G``, ``64000M``, ``512``: MB) in MB, rounded up; ValueError when malformed."""
    m = _MEM_RE.fullmatch(str(mem).strip().upper())
    if not m or isinstance(mem, bool):
        raise ValueError(f"'{mem}' is not a memory size such as 200G, 64000M or 512 (MB)")
    number, unit = m.groups()
    if int(number) < 1:
        raise ValueError(f"'{mem}' is not a positive memory size")
    return max(1, math.ceil(int(number) * _MEM_SCALE_MB[unit]))


def forbidden_slurm_option(extra: str) -> str | None:
    """What a ``slurm_extra`` string sets that the workflow sets itself (e.g. 'memory'), or None."""
    for pattern, what in FORBIDDEN_SLURM_OPTIONS.items():
        if re.search(pattern, extra):
            return what
    return None


def term_signal_seconds(limit_minutes: int) -> int:
    """Seconds before a ``limit_minutes`` time limit at which the shard job gets SIGTERM.

    A tenth of the limit, between TERM_MIN_SECONDS and TERM_MAX_SECONDS: 6 s for a 1-minute
    limit, 60 s for 10 minutes, 5 minutes from 50 minutes on.
    """
    return max(TERM_MIN_SECONDS, min(TERM_MAX_SECONDS, limit_minutes * 6))


def term_signal_option(limit_minutes: int) -> str:
    """The sbatch option that sends SIGTERM to the job's steps before the time limit.

    No ``B:``: that would signal only the batch shell, which does not pass it on; without
    it SLURM signals every job step, and the shard runs in one (the plugin's ``srun``), except
    in the first task of a job array, which mirageflow.cluster.time_limit covers.
    """
    return f"--signal=TERM@{term_signal_seconds(limit_minutes)}"


def execution_problems(ep: dict, where: str = "execution_params") -> list[str]:
    """The SLURM keys' mistakes a schema pattern cannot catch, each ``key.path: message``."""
    problems = []
    limits = {}
    for key in ("time_limit", "max_time_limit"):
        if ep.get(key) is not None:
            try:
                limits[key] = minutes(ep[key])
            except ValueError as e:
                problems.append(f"{where}.{key}: {e}")
    if "time_limit" in limits and "max_time_limit" in limits and limits["max_time_limit"] < limits["time_limit"]:
        problems.append(f"{where}.max_time_limit: {ep['max_time_limit']} is shorter than time_limit {ep['time_limit']}")
    if ep.get("mem") is not None:
        try:
            mem_mb(ep["mem"])
        except ValueError as e:
            problems.append(f"{where}.mem: {e}")
    if ep.get("gres") is not None and not re.fullmatch(r"[a-zA-Z0-9_]+(:[a-zA-Z0-9_.]+)?(:\d+[TGM]?)?", ep["gres"]):
        problems.append(f"{where}.gres: '{ep['gres']}' is not a gres such as gpu:4 or gpu:a100:4")
    if ep.get("slurm_extra"):
        what = forbidden_slurm_option(ep["slurm_extra"])
        if what:
            problems.append(f"{where}.slurm_extra: sets the {what}, which the workflow sets from execution_params (see docs/cluster.md)")
    return problems


# A shard that only waits on a provider's batch API (engines/batch_api.py) holds its rows while
# the batches run: up to the 24 h completion window, plus the deadline's grace and slack.
BATCH_WAIT_MINUTES = 25 * 60


def _image_gpus(pipeline: PipelineConfig) -> int:
    """GPUs the image_gen processors load a model on: SGLang's diffusion server (num_gpus),
    a diffusers pipeline not pinned to the CPU (1); an external server none."""
    need = {
        "sglang": lambda p: p.num_gpus, "diffusers": lambda p: 0 if p.device == "cpu" else 1, "external": lambda p: 0,
    }  # fmt: skip
    return max((need[p.backend](p) for p in pipeline.image_processors.values()), default=0)


def _image_gpus_or_none(pipeline: PipelineConfig) -> int | None:
    return _image_gpus(pipeline) if pipeline.image_processors else None


def waits_on_batches(pipeline: PipelineConfig) -> bool:
    """Whether the shards only wait on a batch API: some output goes to a batch_api processor,
    and nothing is loaded on the node (no local model, no image model)."""
    from mirageflow.engines.registry import capabilities

    used = [pipeline.processors[name] for name in dict.fromkeys(o.processor for o in pipeline.outputs) if name in pipeline.processors]
    return (
        any(p.batch is not None for p in used) and not any(capabilities(p.backend).loads_model for p in used) and _image_gpus(pipeline) == 0
    )


def _gpus(ep: ExecutionParams, processors: dict[str, ProcessorConfig], image_gpus: int | None = None) -> int:
    """``image_gpus``: the image_gen processors' GPUs (None: the pipeline has none)."""
    gpus = ep.gpus
    if gpus is None:  # tp_size null (= the GPUs the job holds) counts as 1 here; batch APIs load nothing
        models = [(p.server_args.tp_size or 1) * (p.server_args.dp_size or 1) for p in processors.values() if p.batch is None]
        batches = any(p.batch is not None for p in processors.values())
        gpus = max(models + ([image_gpus] if image_gpus is not None else []), default=0 if batches or image_gpus is not None else 1)
    if ep.gres:
        counted = gres_gpus(ep.gres)
        gpus = counted if counted is not None else gpus
    return gpus


def node_gpus(pipeline: PipelineConfig) -> int | None:
    """GPUs of each node of a shard job spanning ``execution_params.nodes`` > 1 nodes (node_span.py); None with one node."""
    ep = pipeline.execution
    if ep.nodes <= 1:
        return None
    engines = [engine_gpus(p.server_args) for p in pipeline.processors.values() if p.batch is None]
    return gpus_per_node({"gres": ep.gres, "gpus": ep.gpus, "nodes": ep.nodes}, engines)


def shard_gpus(pipeline: PipelineConfig) -> int:
    """GPUs a shard job asks for (of each node when it spans nodes): execution_params.gpus (or the
    gres count), else tp_size x dp_size (/ nodes)."""
    if waits_on_batches(pipeline):
        return 0
    if pipeline.execution.nodes > 1:
        return node_gpus(pipeline)
    return _gpus(pipeline.execution, pipeline.processors, _image_gpus_or_none(pipeline))


def runtime(base: int, cap: float) -> Callable:
    """Snakemake's ``runtime`` resource: the time limit times the attempt, at most the cap."""

    def runtime(wildcards, attempt):  # Snakemake passes arguments by these names
        return min(base * attempt, cap)

    return runtime


def cluster_resources(pipeline: PipelineConfig, job: str) -> dict:
    """SLURM resources of a shard job (job="shard"), an index job (job="index") or an
    engine service (job="engine", execution_params.shards_per_engine > 1).

    ``pipeline`` is a validated PipelineConfig (load_config already refused malformed
    values). Index jobs are light: 1 CPU, no GPU, at most INDEX_MAX_MINUTES per attempt.
    """
    if job not in ("shard", "index", "engine", "canary"):  # the canary (canary_rows) loads its own engine
        raise ValueError(f"job must be 'shard', 'index', 'engine' or 'canary', not {job!r}")
    ep = pipeline.execution
    # With shards_per_engine > 1 the engine job (engine_service.py) holds the GPUs, CPUs
    # and memory; its shards, in the same group job, are light clients. Snakemake sums
    # the resources of a service and its consumers.
    shared = ep.shards_per_engine > 1
    base = minutes(ep.time_limit)
    cap = minutes(ep.max_time_limit) if ep.max_time_limit else math.inf
    batch = job == "shard" and waits_on_batches(pipeline)
    if job == "index":
        base = min(base, INDEX_MAX_MINUTES)
    elif batch:  # the completion window, or what max_time_limit allows (a retry re-attaches and waits on)
        base = min(max(base, BATCH_WAIT_MINUTES), cap)
    res: dict[str, Any] = {"runtime": runtime(base, cap)}
    if ep.account:
        res["slurm_account"] = ep.account
    if ep.partition:
        res["slurm_partition"] = ep.partition
    if ep.qos:
        res["qos"] = ep.qos
    extra = [f"--reservation={ep.reservation}"] if ep.reservation else []
    if job == "index" or (job == "shard" and (shared or batch)):  # light: 1 CPU, no GPU, the default memory
        res["cpus_per_task"] = 1
        if batch and ep.mem is not None:  # the rows waiting on the provider are in memory
            res["mem_mb"] = mem_mb(ep.mem)
    elif job != "index" and ep.nodes > 1:  # one engine across the nodes (node_span.py): resources per node
        gpus = node_gpus(pipeline)
        res["nodes"] = ep.nodes
        # --gres is per node (--gpus would be the job's total, and the plugin's job step would
        # ask it of rank 0's one-node step); every step gets the job's gres on its nodes
        res["gres"] = ep.gres or f"gpu:{gpus}"
        res["cpus_per_task"] = ep.cpus_per_task or 8 * gpus
        if ep.mem is not None:  # sbatch --mem is per node
            res["mem_mb"] = mem_mb(ep.mem)
        if ep.constraint:
            res["constraint"] = ep.constraint
        extra.append("--ntasks-per-node=1")  # the shard process on the first node, one engine rank on each other
    else:
        gpus = _gpus(ep, pipeline.processors, _image_gpus_or_none(pipeline))
        if ep.gres:
            res["gres"] = ep.gres
        elif gpus:
            res["gpu"] = gpus
        res["cpus_per_task"] = ep.cpus_per_task or (8 * gpus if gpus else 1)
        if ep.mem is not None:
            res["mem_mb"] = mem_mb(ep.mem)
        if ep.constraint:
            res["constraint"] = ep.constraint
    if job != "index":
        if ep.slurm_extra:
            extra.append(ep.slurm_extra)
        if not _SIGNAL_RE.search(ep.slurm_extra or ""):  # the user's own --signal wins
            extra.append(term_signal_option(base))
    if extra:
        res["slurm_extra"] = " ".join(extra)
    return res


def job_resources(pipeline: Any, job: str, submits: bool, limited: Collection[str]) -> dict:
    """A rule's resources: exactly ``cluster_resources`` when the run ``submits`` to a cluster
    (mirageflow.cluster.executor), else only those of them a local run limits (``limited``:
    its ``--resources``, e.g. ``gpu``)."""
    res = cluster_resources(pipeline, job)
    return res if submits else {name: value for name, value in res.items() if name in limited}
