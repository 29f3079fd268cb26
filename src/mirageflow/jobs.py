"""Entry points of the workflow's jobs: ``python -m mirageflow.jobs <job> ...``.

Every rule runs its job as a plain shell command, not a Snakemake ``script:``: Snakemake
reads a script file once per job while it builds the DAG, which at 10,000 shards is a
third of a dry run. The config travels in the environment instead: common.smk puts the
config Snakemake was given (after --configfile and --config) in $MIRAGEFLOW_CONFIG when it
parses the Snakefile, locally and in every cluster job, and the job's shell command
inherits it. The job validates it again, so a compute node runs exactly the pipeline the
driver validated, with ``$VAR`` references expanded in the job's own environment.

Each job sends everything it prints (logging, tqdm, warnings from libraries) to the rule's
log file.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from mirageflow.config import PipelineConfig, load_config
from mirageflow.data.writers import atomic_write_json

CONFIG_ENV = "MIRAGEFLOW_CONFIG"
# One environment string may hold at most 128 KiB on Linux (MAX_ARG_STRLEN).
MAX_CONFIG_BYTES = 128 * 1024 - len(CONFIG_ENV) - 2


def export_config(config: dict) -> None:
    """Called by common.smk: hand Snakemake's config to the jobs it starts."""
    text = json.dumps(config, separators=(",", ":"), default=str)
    if len(text.encode()) > MAX_CONFIG_BYTES:
        raise ValueError(
            f"the config is {len(text.encode()):,} bytes as JSON; the jobs receive it in "
            f"${CONFIG_ENV}, which holds at most {MAX_CONFIG_BYTES:,}. Move long prompts or "
            "schemas out of the config (e.g. shorter templates)"
        )
    os.environ[CONFIG_ENV] = text


def _config(check_paths: bool = True) -> PipelineConfig:
    text = os.environ.get(CONFIG_ENV)
    if text is None:
        raise SystemExit(f"${CONFIG_ENV} is not set: run this job through the workflow (snakemake), not by hand")
    return load_config(json.loads(text), check_paths=check_paths)


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


def index_dataset(ds_index: int, output: str) -> None:
    from mirageflow.data.readers import write_index

    cfg = _config()
    ds = cfg.datasets[ds_index]
    index = write_index(ds, cfg.num_shards, output)
    logging.info("indexed %s: %d rows, %d shards", ds.path, index["rows"], cfg.num_shards)


def run_shard(shard: int, attempt: int) -> None:
    from mirageflow.shard import ShardInterrupted
    from mirageflow.shard import run_shard as run

    cfg = _config()
    hf_home = cfg.raw["execution_params"].get("hf_home")
    if hf_home:  # before transformers/sglang read it at import
        os.environ["HF_HOME"] = os.path.expanduser(hf_home)
    try:
        run(cfg, shard, attempt=attempt)
    except ShardInterrupted as e:
        logging.error("%s", e)
        sys.exit(128 + e.signum)  # the shell convention for "killed by signal N"


def merge(ds_index: int, output: str) -> None:
    from mirageflow.data.merge import merge_dataset

    cfg = _config()
    manifest = merge_dataset(cfg, cfg.datasets[ds_index])
    logging.info("merged %s", json.dumps(manifest))
    atomic_write_json(output, manifest)


def aggregate() -> None:
    from mirageflow.report import write_report

    cfg = _config(check_paths=False)
    write_report(cfg.state_dir, cfg.num_shards)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mirageflow.jobs", description="Run one job of the workflow.")
    ap.add_argument("--log", required=True, help="the rule's log file; the job's output goes there")
    sub = ap.add_subparsers(dest="job", required=True)
    p = sub.add_parser("index", help="index one dataset")
    p.add_argument("dataset", type=int)
    p.add_argument("output")
    p = sub.add_parser("shard", help="run one shard")
    p.add_argument("shard", type=int)
    p.add_argument("--attempt", type=int, default=1, help="Snakemake's attempt number (retries)")
    p = sub.add_parser("merge", help="merge one dataset's shard outputs")
    p.add_argument("dataset", type=int)
    p.add_argument("output")
    sub.add_parser("aggregate", help="write the metrics report")
    args = ap.parse_args(argv)
    _log_to(args.log)
    if args.job == "index":
        index_dataset(args.dataset, args.output)
    elif args.job == "shard":
        run_shard(args.shard, args.attempt)
    elif args.job == "merge":
        merge(args.dataset, args.output)
    else:
        aggregate()


if __name__ == "__main__":
    main()
