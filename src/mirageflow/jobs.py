"""Entry points of the workflow's jobs: thin glue between a rule's `snakemake` object and the package.

Each job sends everything it prints (logging, tqdm, warnings from libraries) to the rule's
log file and re-validates the config it was given, so a job on a compute node sees
exactly the pipeline the driver validated.
"""

from __future__ import annotations

import json
import logging
import os
import sys

from mirageflow.config import load_config
from mirageflow.data.writers import atomic_write_json


def _log_to(path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True
    )


def index_dataset(smk) -> None:
    from mirageflow.data.readers import build_index

    _log_to(smk.log[0])
    cfg = load_config(smk.config)
    ds = cfg.datasets[int(smk.wildcards.ds)]
    index = build_index(ds, cfg.num_shards)
    logging.info("indexed %s: %d rows, %d shards", ds.path, index["rows"], cfg.num_shards)
    atomic_write_json(smk.output[0], index)


def run_shard(smk) -> None:
    from mirageflow.shard import ShardInterrupted
    from mirageflow.shard import run_shard as run

    _log_to(smk.log[0])
    cfg = load_config(smk.config)
    hf_home = cfg.raw["execution_params"].get("hf_home")
    if hf_home:  # before transformers/sglang read it at import
        os.environ["HF_HOME"] = os.path.expanduser(hf_home)
    try:
        run(cfg, int(smk.wildcards.shard), attempt=int(smk.resources.get("attempt", 1)))
    except ShardInterrupted as e:
        logging.error("%s", e)
        sys.exit(128 + e.signum)  # the shell convention for "killed by signal N"


def merge(smk) -> None:
    from mirageflow.data.merge import merge_dataset

    _log_to(smk.log[0])
    cfg = load_config(smk.config)
    manifest = merge_dataset(cfg, cfg.datasets[int(smk.wildcards.ds)])
    logging.info("merged %s", json.dumps(manifest))
    atomic_write_json(smk.output[0], manifest)


def aggregate(smk) -> None:
    from mirageflow.report import write_report

    _log_to(smk.log[0])
    cfg = load_config(smk.config, check_paths=False)
    write_report(cfg.state_dir, cfg.num_shards)
