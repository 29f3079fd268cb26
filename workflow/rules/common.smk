# Config validation (at DAG-build time, before any job starts) and path helpers.
import os
import sys

from snakemake.exceptions import WorkflowError

try:
    import mirageflow
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(workflow.basedir, "src"))

from mirageflow.config import ConfigError, load_config

try:
    PIPELINE = load_config(config)
except ConfigError as e:
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
    return expand(f"{STATE_DIR}/shard_{{shard}}/status.json", shard=SHARD_IDS)


def default_targets():
    targets = [f"{STATE_DIR}/metrics.json", f"{STATE_DIR}/summary.md"]
    if PIPELINE.merge:
        targets += expand(f"{STATE_DIR}/merged/dataset_{{ds}}.json", ds=DATASET_IDS)
    return targets
