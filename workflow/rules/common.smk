# Config validation (at DAG-build time, before any job starts) and path helpers.
import os
import sys

from snakemake.exceptions import WorkflowError

try:
    import mirageflow
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(workflow.basedir, "src"))

from mirageflow.config import ConfigError, load_config
from mirageflow.jobs import export_config

try:
    PIPELINE = load_config(config)
    # The jobs read the config from the environment (see mirageflow/jobs.py).
    export_config(config)
except (ConfigError, ValueError) as e:
    raise WorkflowError(str(e)) from None


STATE_DIR = PIPELINE.state_dir
# The demo model, built by the smollm2_model rule (workflow/rules/models.smk).
SMOLLM2_DIR = "resources/models/SmolLM2-135M-Instruct"
SHARD_IDS = list(range(PIPELINE.num_shards))
DATASET_IDS = [ds.index for ds in PIPELINE.datasets]


wildcard_constraints:
    shard=r"\d+",
    ds=r"\d+",


def dataset_files(wildcards):
    """The dataset's files, so a changed dataset re-indexes (and reruns its shards)."""
    from mirageflow.data.readers import _files

    return _files(PIPELINE.datasets[int(wildcards.ds)])


def index_files():
    return [f"{STATE_DIR}/datasets/dataset_{k}.index.json" for k in DATASET_IDS]


def model_inputs():
    """Local model directories the shards need; the demo model is built by a rule."""
    paths = []
    for proc in PIPELINE.processors.values():
        path = proc.server_args["model_path"]
        if os.path.normpath(path) == SMOLLM2_DIR or os.path.isdir(path):
            paths.append(path)
    return paths


def status_files():
    """Input of the rules that need every shard's status.json (aggregate, merge).

    An input function, not a list: Snakemake calls it only when the DAG holds such a job.
    A list of num_shards paths would be built and registered each time the Snakefile is
    parsed, and every cluster job parses it again to run one shard (O(num_shards) per job).
    """
    return _status_files


def _status_files(wildcards):
    return [f"{STATE_DIR}/shard_{i}/status.json" for i in SHARD_IDS]


def default_targets():
    targets = [f"{STATE_DIR}/metrics.json", f"{STATE_DIR}/summary.md"]
    if PIPELINE.merge:
        targets += expand(f"{STATE_DIR}/merged/dataset_{{ds}}.json", ds=DATASET_IDS)
    return targets


def cluster_resources(job):
    """SLURM resources of a shard job (job="shard") or of an index job (job="index").

    They come from execution_params, so a user edits one file (docs/cluster.md has the
    mapping). Local runs ignore them: Snakemake only limits the resources given with
    --cores/--resources, so a `gpu` request never blocks a run on a machine without one.
    Evaluated at DAG build, on the login node: a bad value fails before any job starts.
    """
    import math
    import re

    ep = PIPELINE.raw["execution_params"]

    def minutes(limit):  # [D-]HH:MM:SS, rounded up
        days, _, hms = limit.rpartition("-")
        h, m, s = (int(x) for x in hms.split(":"))
        return max(1, math.ceil((int(days or 0) * 24 + h) * 60 + m + s / 60))

    base = minutes(ep["time_limit"])
    cap = minutes(ep["max_time_limit"]) if ep["max_time_limit"] else math.inf
    if cap < base:
        raise WorkflowError(
            f"execution_params.max_time_limit: {ep['max_time_limit']} is shorter than "
            f"time_limit {ep['time_limit']}"
        )
    if job == "index":  # light: reads the dataset once to count rows
        base = min(base, 60)
    res = {"runtime": lambda wildcards, attempt: min(base * attempt, cap)}
    if ep["account"]:
        res["slurm_account"] = ep["account"]
    if ep["partition"]:
        res["slurm_partition"] = ep["partition"]
    if ep["qos"]:
        res["qos"] = ep["qos"]
    extra = [f"--reservation={ep['reservation']}"] if ep["reservation"] else []
    if job == "index":
        res["cpus_per_task"] = 1
    else:
        gpus = ep["gpus"]
        if gpus is None:  # tp_size null (= the GPUs the job holds) counts as 1 here
            gpus = max(
                (p.server_args.get("tp_size") or 1)
                * (p.server_args.get("dp_size") or 1)
                for p in PIPELINE.processors.values()
            )
        if ep["gres"]:
            res["gres"] = ep["gres"]
            counted = re.fullmatch(r"gpu(?::[^:]+)?:(\d+)", ep["gres"])
            gpus = int(counted.group(1)) if counted else gpus
        elif gpus:
            res["gpu"] = gpus
        res["cpus_per_task"] = ep["cpus_per_task"] or (8 * gpus if gpus else 1)
        if ep["mem"] is not None:
            number, unit = re.fullmatch(
                r"(\d+)([KMGT]?)", str(ep["mem"]).upper()
            ).groups()
            scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024**2}[unit]
            res["mem_mb"] = max(1, math.ceil(int(number) * scale))
        if ep["constraint"]:
            res["constraint"] = ep["constraint"]
        if ep["slurm_extra"]:
            try:
                from snakemake_executor_plugin_slurm.validation import (
                    get_forbidden_slurm_options,
                )
            except ImportError:  # no SLURM plugin: nothing is submitted
                get_forbidden_slurm_options = dict
            for pattern, what in get_forbidden_slurm_options().items():
                if re.search(pattern, ep["slurm_extra"]):
                    raise WorkflowError(
                        f"execution_params.slurm_extra: sets the {what}, which the "
                        "workflow sets from execution_params (see docs/cluster.md)"
                    )
            extra.append(ep["slurm_extra"])
    if extra:
        res["slurm_extra"] = " ".join(extra)
    return res
