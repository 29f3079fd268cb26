"""Entry points of the workflow's jobs: ``python -m mirageflow.jobs --config FILE --log LOG <job> ...``.

Every rule runs its job as a plain shell command, not a Snakemake ``script:``: Snakemake
reads a script file once per job while it builds the DAG (a quiet dry run of 10,000
shards: 13.1 s CPU with ``shell:``, 14.9 s with ``script:``, one run each with
scripts/bench/snakemake_scale.py --snakefile on a copy of the workflow), and a shell
command can be rerun by hand as Snakemake prints it. The config travels as a file named on the command line: when the
driver parses the Snakefile it stores the config it was given (after --configfile and
--config) as JSON in ``<state_dir>/configs/<sha256 prefix>.json`` (mirageflow.state.pipeline),
so the command Snakemake prints runs as is by hand. The job validates that config again,
so a compute node runs exactly the pipeline the driver validated, with ``$VAR`` references
expanded in the job's own environment. ``--config`` also takes a YAML pipeline file.

Each job sends everything it prints (logging, tqdm, warnings from libraries) to a log of
its own attempt, ``<log dir>/attempts/<job>.<UTC time>.<pid>.log``, and the rule's log
path (which Snakemake deletes before a rerun) is a hard link to it: every attempt's log
survives reruns.

A shard job stopped by SIGTERM/SIGINT before its runner takes over the signals (during
the imports, config validation, ...) writes a minimal ``<state_dir>/shard_<id>/failure.json``
and exits 128 + the signal number: the handler is installed before anything heavy is
imported.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from datetime import datetime, timezone

from mirageflow.state import layout

# json, socket, datetime and the state layout come before the handlers: a signal landing in
# the middle of their import would leave the handler a half-initialised module to write
# failure.json with.

# --------------------------------------------------------------------------- early stop
# Installed first (see the end of this block), before the heavy imports below.

_EARLY: dict = {"failure": None, "shard": None, "attempt": None}


def _early_argv(argv: list[str]) -> dict:
    """The little the signal handler needs from the command line, without argparse."""
    found: dict = {"config": None, "log": None, "job": None, "shard": None, "attempt": 1}
    positional = []
    it = iter(argv)
    for arg in it:
        name, eq, value = arg.partition("=")
        if name in ("--config", "--log", "--attempt"):
            value = value if eq else next(it, None)
            found[name[2:]] = value
        elif not arg.startswith("-"):
            positional.append(arg)
    if positional:
        found["job"] = positional[0]
    if found["job"] == "shard" and len(positional) > 1 and positional[1].isdigit():
        found["shard"] = int(positional[1])
    return found


def _write_early_failure(path: str, signum: int | None, error: str | None = None) -> None:
    """failure.json of a shard stopped before its runner started: by a signal, or by ``error``."""
    name = signal.Signals(signum).name if signum is not None else None
    failure = {
        "shard_id": _EARLY["shard"],
        "status": "failed",
        "attempt": _EARLY["attempt"],
        "hostname": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
        "slurm_array_task_id": os.environ.get("SLURM_ARRAY_TASK_ID"),
        "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "error": error or f"stopped by {name} before the shard started (while the job was starting up); nothing was committed",
        "reason": "stopped before the shard runner started" if error is None else "could not start the shard",
        "signal": name,
        "stats": None,
    }
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w") as f:
            f.write(json.dumps(failure, indent=2) + "\n")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _on_early_signal(signum, frame) -> None:
    """SIGTERM/SIGINT before the shard runner installs its own handlers: record it, exit."""
    for other in (signal.SIGINT, signal.SIGTERM):  # a second one (the group's and the driver's) would cut the record
        signal.signal(other, signal.SIG_IGN)
    try:
        sys.stderr.write(f"mirageflow.jobs: stopped by {signal.Signals(signum).name} while starting up\n")
        sys.stderr.flush()
        path = _EARLY["failure"]
        # not after this attempt's success (a signal between status.json and the exit)
        if path and not os.path.exists(os.path.join(os.path.dirname(path), layout.STATUS)):
            _write_early_failure(path, signum)
    except BaseException as e:  # never let the record keep the job from exiting; say why it is missing
        try:
            sys.stderr.write(f"mirageflow.jobs: could not write failure.json: {type(e).__name__}: {e}\n")
        except BaseException:
            pass
    finally:
        os._exit(128 + signum)


def _install_early_handlers(argv: list[str]) -> None:
    found = _early_argv(argv)
    if found["job"] != "shard":  # index, merge, aggregate: the default behaviour is fine
        return
    if found["shard"] is not None:
        _EARLY["shard"] = found["shard"]
        try:
            _EARLY["attempt"] = int(found["attempt"])
        except (TypeError, ValueError):
            pass
        if found["config"]:  # a workflow-written config: <state_dir>/configs/<hash>.json
            state_dir = layout.state_dir_of_config_file(os.path.abspath(found["config"]))
            if state_dir is not None:
                _EARLY["failure"] = str(layout.StateLayout(state_dir).failure(found["shard"]))
    # SIGINT first: Python already catches it (KeyboardInterrupt), so once SIGTERM is seen
    # caught (a test waits for that) both are this handler's
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _on_early_signal)


def _early_endpoint(argv: list[str]) -> None:
    """``engine G ENDPOINT``: write the service's endpoint file now, before any import.

    Snakemake starts an engine's shards with it and gives the file only --latency-wait
    seconds to appear (then fails the group and leaves the service running); the port
    follows once the server listens (mirageflow/cluster/engine_service.py).
    """
    positional, it = [], iter(argv)
    for arg in it:
        if arg in ("--config", "--log"):
            next(it, None)
        elif not arg.startswith("-"):
            positional.append(arg)
    if len(positional) < 3 or positional[0] != "engine":
        return
    path = positional[2]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"state": "starting", "hostname": socket.gethostname(), "pid": os.getpid()}) + "\n")
    os.replace(tmp, path)


if __name__ == "__main__":
    _early_endpoint(sys.argv[1:])
    _install_early_handlers(sys.argv[1:])

# --------------------------------------------------------------------------- the jobs

import argparse  # noqa: E402 - after the early signal handlers, on purpose
import logging  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

from mirageflow.config import PipelineConfig, load_config  # noqa: E402
from mirageflow.files import atomic_write_json  # noqa: E402

_ATTEMPT_LOG: dict = {}  # this job's own log (the rule's log is a link Snakemake removes on rerun)


def _config(path: str, check_paths: bool = True) -> PipelineConfig:
    from mirageflow.redact import register_config_secrets

    cfg = load_config(path, check_paths=check_paths)
    register_config_secrets(cfg)  # api keys, URL passwords and query values: masked wherever they show up
    return cfg


def attempt_log_path(log: str, now: float | None = None, pid: int | None = None) -> str:
    """``<log dir>/attempts/<log name>.<UTC time>.<pid>.log`` for the rule's log path ``log``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if now is None else now))
    name = os.path.basename(log)
    stem = name[: -len(".log")] if name.endswith(".log") else name
    return os.path.join(os.path.dirname(log), layout.ATTEMPT_LOGS, f"{stem}.{stamp}.{pid or os.getpid()}.log")


def _log_to(path: str) -> str:
    """Send stdout/stderr to this attempt's log file, with ``path`` (the rule's log) linked to it.

    Returns the attempt's log path. Files follow the umask. Where hard links fail (a
    filesystem without them), the job writes ``path`` and copies it to the attempt's log
    when it exits.
    """
    attempt = attempt_log_path(path)
    os.makedirs(os.path.dirname(attempt), exist_ok=True)
    fd = os.open(attempt, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
    try:
        try:
            os.unlink(path)  # a previous attempt's link (Snakemake removes it before a rerun)
        except FileNotFoundError:
            pass
        os.link(attempt, path)
    except OSError:
        os.close(fd)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        import atexit

        atexit.register(lambda: shutil.copyfile(path, attempt))
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    _log_to_inherited()
    return attempt


def _log_to_inherited() -> None:
    """The job's logging, to the stdout/stderr it has (``_log_to`` points them at its log first)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    from mirageflow.redact import install_log_redaction

    install_log_redaction()  # no secret in the log, whichever library writes the line (httpx's requests)


def index_dataset(config: str, ds_index: int, output: str) -> None:
    from mirageflow.data.readers import write_index

    cfg = _config(config)
    ds = cfg.datasets[ds_index]
    index = write_index(ds, cfg.num_shards, output)
    logging.info("indexed %s: %d rows, %d shards", ds.path, index["rows"], cfg.num_shards)


def run_shard(config: str, shard: int, attempt: int, engine: str | None = None) -> None:
    """One shard. Until its runner takes over (and writes failure.json itself), a failure
    (a damaged config file, a GPU claim refused, a full disk marking old results) is
    recorded in a short failure.json, so the shard is failed, not pending, for everyone who asks."""
    _EARLY["shard"], _EARLY["attempt"] = shard, attempt
    try:
        cfg, factory = _start_shard(config, shard, engine)
    except Exception as e:
        _record_start_failure(f"failed before the shard started: {type(e).__name__}: {e}")
        raise
    from mirageflow.shard import ShardInterrupted
    from mirageflow.shard.runner import run_shard as run

    try:
        run(cfg, shard, attempt=attempt, **({"engine_factory": factory} if factory else {}))
    except ShardInterrupted as e:
        _EARLY["failure"] = None  # the runner wrote its own failure.json
        logging.error("%s", e)
        sys.exit(128 + e.signum)  # the shell convention for "killed by signal N"
    finally:
        _EARLY["failure"] = None


def canary(config: str, output: str, attempt: int) -> None:
    """The canary (execution_params.canary_rows): shard 0's first rows, judged before any
    shard starts (mirageflow/shard/canary.py); a failed verdict ends the job with its message."""
    cfg = _config(config)
    from mirageflow import hub_models

    hub_models.offline_environment(cfg)
    cfg = hub_models.resolve_local(cfg)
    from mirageflow.cluster.gpu_claim import claim_for_shard
    from mirageflow.cluster.time_limit import arm_time_limit_signal

    claim_for_shard(cfg)
    arm_time_limit_signal()
    from mirageflow.shard.canary import CanaryFailed, run_canary

    try:
        run_canary(cfg, output, attempt)
    except CanaryFailed as e:
        logging.error("mirageflow: %s", e)
        sys.exit(1)


def _start_shard(config: str, shard: int, engine: str | None) -> tuple[PipelineConfig, Callable | None]:
    """The shard job before its runner: the config, the GPUs, the time limit, earlier results marked as the previous run's.
    Returns (config, engine factory or None: the shard loads its own engine)."""
    cfg = _config(config)
    _EARLY["failure"] = str(layout.StateLayout(cfg.state_dir).failure(shard))  # the config's own state_dir
    from mirageflow import hub_models

    hub_models.offline_environment(cfg)  # before transformers/sglang/huggingface_hub read it at import
    if engine is None:  # a shard served by an engine service loads no model
        cfg = hub_models.resolve_local(cfg)  # hub ids -> the snapshots the driver fetched
    from mirageflow.cluster.engine_service import shared_engine_factory
    from mirageflow.cluster.gpu_claim import claim_for_shard
    from mirageflow.cluster.time_limit import arm_time_limit_signal

    factory = shared_engine_factory(cfg, engine) if engine else None
    if factory is None:
        claim_for_shard(cfg)  # before any engine is imported: CUDA_VISIBLE_DEVICES names this shard's GPUs
    arm_time_limit_signal()  # an array's first task runs outside a job step, where --signal does not reach
    from mirageflow.state import pipeline as pipeline_state

    # Whatever the aggregate and merge rules built from earlier shards is the previous run's from
    # now on: kept readable, marked so, until this run's replace them.
    pipeline_state.mark_previous_results(cfg, f"shard {shard} started again")
    return cfg, factory


def _record_start_failure(error: str) -> None:
    """failure.json for a shard job that failed before its runner started (not after a success)."""
    path = _EARLY["failure"]
    if not path or os.path.exists(os.path.join(os.path.dirname(path), layout.STATUS)):
        return
    try:
        from mirageflow.redact import redact_text

        _write_early_failure(path, None, redact_text(error))
    except Exception as write_error:  # a full disk: the log keeps the reason
        logging.error("%s; and failure.json cannot be written: %s", error, write_error)


def run_engine(config: str, group: int, endpoint: str, log: str) -> None:
    """Serve engine group ``group`` to its shards until Snakemake stops it: launch its serving
    process (``engine_process``) and replace it when it dies (cluster/service_restarts.py)."""
    cfg = _config(config)
    from mirageflow.cluster.gpu_claim import claim_for_shard
    from mirageflow.cluster.time_limit import arm_time_limit_signal

    claim = claim_for_shard(cfg)  # noqa: F841 - held while the job runs: the GPUs its shards would have claimed
    arm_time_limit_signal()
    from mirageflow import hub_models

    hub_models.offline_environment(cfg)  # the serving processes inherit the environment
    from mirageflow.cluster.service_restarts import serve_with_replacements

    serve_with_replacements(cfg, config, group, endpoint, log)


def engine_process(config: str, group: int, endpoint: str, log: str, port: int, parent: int | None = None) -> None:
    """The engine job's serving process: load engine group ``group`` and serve it on ``port``
    until SIGTERM or until ``parent`` (the engine job's pid) is gone (cluster/engine_service.py).
    ``log``: the job's, which this process writes to."""
    cfg = _config(config)
    from mirageflow import hub_models

    cfg = hub_models.resolve_local(cfg)  # hub ids -> the snapshots the driver fetched
    from mirageflow.cluster import engine_service

    engine_service.run(cfg, group, endpoint, log_path=log, port=port, parent=parent)


def hub_model(config: str, slug: str, output: str) -> None:
    """Fetch one Hugging Face model into the cache (the driver's localrule hub_model), resuming a killed attempt."""
    cfg = _config(config, check_paths=False)
    hf_home = cfg.execution.hf_home
    if hf_home:  # before huggingface_hub reads it at import
        os.environ["HF_HOME"] = os.path.expanduser(hf_home)
    from mirageflow.hub_models import download

    marker = download(cfg, slug, output)
    logging.info("hub model %s at commit %s in %s", marker["repo_id"], marker["commit"], marker["snapshot"])


def merge(config: str, ds_index: int, output: str) -> None:
    from mirageflow.data.merge import merge_dataset

    cfg = _config(config)
    manifest = merge_dataset(cfg, cfg.datasets[ds_index])
    logging.info("merged %s", json.dumps(manifest))
    atomic_write_json(output, manifest)


def dedup_signatures(config: str, ds_index: int, job: int) -> None:
    """Dedup stage 1, job ``job``: signatures and entries of its merged parts (data/dedup_stages.py)."""
    from mirageflow.data.dedup import dedup_partitions
    from mirageflow.data.dedup_stages import write_signatures
    from mirageflow.state.layout import StateLayout, merged_dir

    cfg = _config(config)
    ds = cfg.datasets[ds_index]
    files = StateLayout(cfg.state_dir).dedup_signatures(ds_index, job)
    meta = write_signatures(merged_dir(ds.output_dir), ds.output_format, cfg.dedup, dedup_partitions(cfg), job, files)
    logging.info("signatures of %d merged parts (%d rows)", len(meta["parts"]), sum(p["rows"] for p in meta["parts"]))


def dedup_pairs(config: str, ds_index: int, partition: int) -> None:
    """Dedup stage 2, partition ``partition``: its duplicate edges (data/dedup_stages.py)."""
    from mirageflow.data.dedup import dedup_partitions
    from mirageflow.data.dedup_stages import write_pairs
    from mirageflow.state.layout import StateLayout

    cfg = _config(config)
    paths, n = StateLayout(cfg.state_dir), dedup_partitions(cfg)
    files = [paths.dedup_signatures(ds_index, k) for k in range(n)]
    edges = write_pairs(cfg.dedup, n, partition, files, paths.dedup_edges(ds_index, partition))
    logging.info("partition %d: %d duplicate edges", partition, edges)


def dedup_decide(config: str, ds_index: int) -> None:
    """Dedup stage 3 (one job): the decisions from every partition's edges (data/dedup_stages.py)."""
    from mirageflow.data.dedup import dedup_partitions
    from mirageflow.data.dedup_stages import write_decisions

    cfg = _config(config)
    removed = write_decisions(cfg, cfg.datasets[ds_index], cfg.dedup, dedup_partitions(cfg))
    logging.info("%d records to remove", removed)


def dedup_write(config: str, ds_index: int, job: int) -> None:
    """Dedup stage 4, job ``job``: its merged parts without their removed records (data/dedup_stages.py)."""
    from mirageflow.data.dedup import dedup_partitions
    from mirageflow.data.dedup_stages import write_kept

    cfg = _config(config)
    report = write_kept(cfg, cfg.datasets[ds_index], cfg.dedup, dedup_partitions(cfg), job)
    logging.info(
        "%d merged parts: %d records read, %d written, %d removed",
        len(report["parts"]), *(sum(p[k] for p in report["parts"]) for k in ("rows_in", "rows_out", "removed")),
    )  # fmt: skip


def dedup(config: str, ds_index: int, counts: str, removed: str) -> None:
    """Dedup's last stage: the written parts in place as deduplicated/, the removed list and the counts."""
    from mirageflow.data.dedup import dedup_partitions
    from mirageflow.data.dedup_stages import write_deduplicated

    cfg = _config(config)
    result = write_deduplicated(cfg, cfg.datasets[ds_index], cfg.dedup, dedup_partitions(cfg), counts, removed)
    logging.info("deduplicated %s", json.dumps(result))


def card(config: str) -> None:
    """The dataset card beside merged/ (mirageflow/publish/card.py)."""
    from mirageflow.publish.card import write_local_cards

    cfg = _config(config, check_paths=False)
    for path in write_local_cards(cfg, config):
        logging.info("wrote the dataset card %s", path)


def publish(config: str) -> None:
    """Upload the records and the card as execution_params.publish says (mirageflow/publish/hub.py)."""
    from mirageflow.errors import MirageflowError
    from mirageflow.publish.hub import publish as upload

    cfg = _config(config, check_paths=False)
    if cfg.execution.publish is None:
        raise SystemExit("execution_params.publish is not set: nothing to publish")
    try:
        record = upload(cfg, config, cfg.execution.publish)  # writes <state_dir>/publish/published.json: the rule's output
    except MirageflowError as e:  # refused, or the Hub failed: the message alone (redacted), no traceback
        logging.error("mirageflow: %s", e)
        sys.exit(1)
    logging.info("published to %s, commit %s", record["repo_id"], record["commit"])


def records_fingerprint(config: str, output: str) -> None:
    """``<state_dir>/records.fingerprint`` where there is none (the driver keeps it current)."""
    from mirageflow.state import pipeline as pipeline_state

    cfg = _config(config, check_paths=False)
    pipeline_state.write_records_fingerprint(cfg)
    logging.info("wrote %s", output)


def aggregate(config: str) -> None:
    from mirageflow.report.aggregate import write_report
    from mirageflow.state.shards import job_fingerprint

    cfg = _config(config, check_paths=False)
    write_report(
        cfg.state_dir, cfg.num_shards, lease_timeout=cfg.shard.lease_timeout_seconds, fingerprint=job_fingerprint(cfg),
        n_samples=cfg.n_samples,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m mirageflow.jobs", description="Run one job of the workflow.")
    ap.add_argument("--config", required=True, help="the pipeline config: <state_dir>/configs/<hash>.json (or a YAML pipeline file)")
    ap.add_argument("--log", required=True, help="the rule's log file; the job's output goes there")
    sub = ap.add_subparsers(dest="job", required=True)
    p = sub.add_parser("index", help="index one dataset")
    p.add_argument("dataset", type=int)
    p.add_argument("output")
    p = sub.add_parser("shard", help="run one shard")
    p.add_argument("shard", type=int)
    p.add_argument("--attempt", type=int, default=1, help="Snakemake's attempt number (retries)")
    p.add_argument(
        "--engine", type=lambda v: None if v == "none" else v, default=None,
        help="the endpoint file of the engine service serving this shard (shards_per_engine > 1); none: load its own",
    )  # fmt: skip
    p = sub.add_parser("canary", help="run the canary rows and judge them (execution_params.canary_rows)")
    p.add_argument("output", help="the verdict, written only when the canary passed")
    p.add_argument("--attempt", type=int, default=1, help="Snakemake's attempt number (retries)")
    p = sub.add_parser("merge", help="merge one dataset's shard outputs")
    p.add_argument("dataset", type=int)
    p.add_argument("output")
    p = sub.add_parser("dedup-signatures", help="dedup stage 1: one job's signatures (deduplication_params)")
    p.add_argument("dataset", type=int)
    p.add_argument("job_index", type=int, metavar="job")
    p = sub.add_parser("dedup-pairs", help="dedup stage 2: one partition's duplicate edges")
    p.add_argument("dataset", type=int)
    p.add_argument("partition", type=int)
    p = sub.add_parser("dedup-decide", help="dedup stage 3: the records to remove, from every partition's edges")
    p.add_argument("dataset", type=int)
    p = sub.add_parser("dedup-write", help="dedup stage 4: one job's merged parts without their removed records")
    p.add_argument("dataset", type=int)
    p.add_argument("job_index", type=int, metavar="job")
    p = sub.add_parser(
        "dedup", help="put one dataset's deduplicated parts in place, with the removed list and counts (deduplication_params)"
    )
    p.add_argument("dataset", type=int)
    p.add_argument("counts")
    p.add_argument("removed")
    p = sub.add_parser("engine", help="serve one engine group to its shards (shards_per_engine > 1)")
    p.add_argument("group", type=int)
    p.add_argument("endpoint", help="the endpoint file (the rule's service output)")
    p = sub.add_parser("engine-process", help="the engine job's serving process (launched by the engine job, not a rule)")
    p.add_argument("group", type=int)
    p.add_argument("endpoint")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--parent", type=int, help="the engine job's pid: stop once it is gone (default: this process's parent)")
    p = sub.add_parser("hub_model", help="download one Hugging Face model id into the cache (the driver, before any shard)")
    p.add_argument("model", help="the model's slug (org--name[@revision])")
    p.add_argument("output", help="the marker written once it is complete")
    sub.add_parser("aggregate", help="write the metrics report")
    sub.add_parser("card", help="write the dataset card beside merged/")
    p = sub.add_parser("publish", help="upload the records and the card to the Hugging Face Hub (execution_params.publish)")
    p.add_argument("output", help="the publish record (<state_dir>/publish/published.json, where it is written)")
    p = sub.add_parser("fingerprint", help="write the records fingerprint the shards depend on")
    p.add_argument("output")
    args = ap.parse_args(argv)
    if args.job == "engine-process":  # its output goes to the engine job's log already (its stdout and stderr)
        _log_to_inherited()
        return engine_process(args.config, args.group, args.endpoint, args.log, args.port, args.parent)
    _ATTEMPT_LOG["path"] = _log_to(args.log)
    if args.job == "index":
        index_dataset(args.config, args.dataset, args.output)
    elif args.job == "shard":
        run_shard(args.config, args.shard, args.attempt, args.engine)
    elif args.job == "canary":
        canary(args.config, args.output, args.attempt)
    elif args.job == "engine":
        run_engine(args.config, args.group, args.endpoint, _ATTEMPT_LOG.get("path") or args.log)
    elif args.job == "merge":
        merge(args.config, args.dataset, args.output)
    elif args.job == "hub_model":
        hub_model(args.config, args.model, args.output)
    elif args.job == "dedup":
        dedup(args.config, args.dataset, args.counts, args.removed)
    elif args.job == "dedup-signatures":
        dedup_signatures(args.config, args.dataset, args.job_index)
    elif args.job == "dedup-pairs":
        dedup_pairs(args.config, args.dataset, args.partition)
    elif args.job == "dedup-decide":
        dedup_decide(args.config, args.dataset)
    elif args.job == "dedup-write":
        dedup_write(args.config, args.dataset, args.job_index)
    elif args.job == "fingerprint":
        records_fingerprint(args.config, args.output)
    elif args.job == "card":
        card(args.config)
    elif args.job == "publish":
        publish(args.config)
    else:
        aggregate(args.config)


if __name__ == "__main__":
    main()
