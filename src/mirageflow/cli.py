"""``mmirage``: MMIRAGE's command line, as a thin layer over the Snakemake workflow.

run, submit, retry and merge build a ``python -m snakemake`` command (printed before it
runs, so you can run it yourself) and run it in the current directory; stats and status
only read the state directory. There is no second scheduler: Snakemake decides what runs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

from mirageflow.config.types import PipelineConfig

EXIT_OK = 0
EXIT_FAILED = 1  # Snakemake failed, or shards failed
EXIT_USAGE = 2  # bad arguments or config
EXIT_INCOMPLETE = 3  # shards still pending or running (status, merge)

EPILOG = """\
exit codes:
  0  success (status: every shard done)
  1  the Snakemake run failed (run/submit/retry/merge), or a shard failed (status)
  2  usage or config error (nothing was started)
  3  incomplete: shards pending or running (status), or merge refused because of them
  (status and merge: 1 wins over 3 when a shard failed)

Anything after `--` goes to Snakemake unchanged, e.g.
  mmirage run --config my.yaml -- --dry-run
  mmirage submit --config my.yaml -- --retries 0
"""


def default_slurm_profile(plugin_version: str | None = None) -> Path:
    """profiles/slurm, or profiles/slurm-gpu under snakemake-executor-plugin-slurm < 2.7 (the GPU
    install's 2.6.1, which does not know the profile's slurm-disable-memory-fudge)."""
    if plugin_version is None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            plugin_version = version("snakemake-executor-plugin-slurm")
        except PackageNotFoundError:
            plugin_version = ""
    try:
        major_minor = tuple(int(x) for x in plugin_version.split(".")[:2])
    except ValueError:
        major_minor = ()
    old = len(major_minor) == 2 and major_minor < (2, 7)
    return workflow_dir() / "profiles" / ("slurm-gpu" if old else "slurm")


def workflow_dir() -> Path:
    """The checkout holding the Snakefile: $MIRAGEFLOW_WORKFLOW_DIR, else the one this package lives in."""
    env = os.environ.get("MIRAGEFLOW_WORKFLOW_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2])
    for path in candidates:
        if (path / "Snakefile").is_file():
            return path
    raise FileNotFoundError(
        "cannot find the workflow's Snakefile (mirageflow is not installed from a checkout); "
        "set MIRAGEFLOW_WORKFLOW_DIR to the repository directory"
    )


class UsageError(Exception):
    pass


def _load(path: str, check_paths: bool = True):
    from mirageflow.config import ConfigError, load_config

    from mirageflow.redact import register_config_secrets

    try:
        cfg = load_config(path, check_paths=check_paths)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    register_config_secrets(cfg)
    return cfg


def snakemake_command(
    config: str, *, stats: bool = False, cores: str | None = None, profile: Path | None = None,
    config_values: dict | None = None, flags: list[str] = (), extra: list[str] = (), targets: list[str] = (),
) -> list[str]:  # fmt: skip
    """``python -m snakemake --snakefile <repo>/Snakefile --configfile C ...``.

    Targets go right after a one-value option (``--cores``/``--profile``): Snakemake's
    multi-value options (--configfile, --config, --forcerun, ...) would swallow them.
    """
    cmd = [sys.executable, "-m", "snakemake", "--snakefile", str(workflow_dir() / "Snakefile"), "--configfile", config]
    values = {**({"stats": "true"} if stats else {}), **(config_values or {})}
    if values:
        cmd += ["--config", *(f"{k}={v}" for k, v in values.items())]
    if profile is not None:
        cmd += ["--profile", str(profile)]
    if cores is not None:
        cmd += ["--cores", str(cores)]
    if targets and profile is None and cores is None:
        raise ValueError("targets need --cores or --profile before them")
    return cmd + list(targets) + list(flags) + list(extra)


def _run(cmd: list[str]) -> int:
    print("mmirage: " + shlex.join(cmd), file=sys.stderr, flush=True)
    rc = subprocess.call(cmd)
    if rc != 0:
        print(f"mmirage: snakemake exited with status {rc}", file=sys.stderr)
    return EXIT_OK if rc == 0 else EXIT_FAILED


# --------------------------------------------------------------------------- commands


def cmd_run(args) -> int:
    _load(args.config)  # fail fast, with exit code 2, before Snakemake starts
    return _run(snakemake_command(args.config, stats=args.stats, cores=args.cores, extra=args.extra))


def cmd_submit(args) -> int:
    _load(args.config)
    profile = Path(args.profile) if args.profile else default_slurm_profile()
    return _run(snakemake_command(args.config, stats=args.stats, profile=profile, extra=args.extra))


def retry_plan(cfg: PipelineConfig, failed_rows: bool) -> dict:
    """What `mmirage retry` reruns: unfinished shards always; with failed_rows, done shards with failed rows too."""
    from mirageflow.report.aggregate import shard_states

    states = shard_states(cfg.state_dir, cfg.num_shards, cfg.shard.lease_timeout_seconds)
    unfinished = [s["shard_id"] for s in states if s["state"] != "done"]
    running = [s["shard_id"] for s in states if s["state"] == "running"]
    with_failed_rows = [
        s["shard_id"] for s in states if s["state"] == "done" and (s["status"]["stats"].get("rows_failed") or 0) > 0
    ]
    # a damaged status.json: not done, but Snakemake sees the file and would not rerun the shard unforced
    damaged = [s["shard_id"] for s in states if s["state"] == "failed" and any(x["file"] == "status.json" for x in s.get("damaged") or [])]
    return {
        "unfinished": unfinished, "running": running, "with_failed_rows": with_failed_rows if failed_rows else [],
        "damaged_status": damaged,
    }  # fmt: skip


def cmd_retry(args) -> int:
    from mirageflow.report.aggregate import shard_states

    cfg = _load(args.config)
    plan = retry_plan(cfg, args.failed_rows)
    if plan["running"]:
        print(
            f"mmirage: shard(s) {plan['running']} look alive (fresh progress.json/lease.json); their rerun waits for "
            "their lease to expire or fails clearly",
            file=sys.stderr,
        )
    # Failed and missing shards have no status.json, so Snakemake reruns them anyway;
    # --rerun-incomplete also redoes the ones a killed driver left marked incomplete.
    # Every rerun resumes from the shard's checkpoint. Shards that finished with failed
    # rows are forced (one by one, not all shards) and recompute only those rows.
    flags = ["--rerun-incomplete"]
    values = {}
    forced = sorted(set(plan["with_failed_rows"]) | set(plan["damaged_status"]))
    if forced:
        flags += ["--forcerun", *(str(cfg.shard_dir(i) / "status.json") for i in forced)]
    if args.failed_rows:
        values["retry_failed_rows"] = "true"
    print(
        f"mmirage: retrying {len(plan['unfinished'])} unfinished shard(s) {plan['unfinished'][:20]}"
        + (f" and the failed rows of {len(plan['with_failed_rows'])} done shard(s) {plan['with_failed_rows'][:20]}" if args.failed_rows else ""),
        file=sys.stderr,
    )  # fmt: skip
    from mirageflow.report.terminal import repeats_identically

    for s in shard_states(cfg.state_dir, cfg.num_shards, cfg.shard.lease_timeout_seconds):
        cls = s["state"] == "failed" and repeats_identically((s.get("failure") or {}).get("stats"), str(s.get("error") or ""))
        if cls and not args.failed_rows:
            print(
                f"mmirage: WARNING: shard {s['shard_id']}: every failed row failed with {cls}, which depends on the config, "
                "prompt or data: this retry will fail the same way unless the config changed",
                file=sys.stderr,
            )
    profile = (Path(args.profile) if args.profile else default_slurm_profile()) if args.submit else None
    cores = None if args.submit else args.cores
    rc = _run(
        snakemake_command(args.config, stats=args.stats, cores=cores, profile=profile, config_values=values, flags=flags, extra=args.extra)
    )
    if rc == EXIT_OK and not _dry_run(args.extra):
        still = [s["shard_id"] for s in shard_states(cfg.state_dir, cfg.num_shards, cfg.shard.lease_timeout_seconds) if s["state"] == "failed"]
        if still:
            print(f"mmirage retry: shard(s) {still[:20]}{' ...' if len(still) > 20 else ''} still failed after the retry", file=sys.stderr)
            return EXIT_FAILED
    return rc


def _dry_run(extra: list[str]) -> bool:
    return any(a in ("-n", "--dry-run", "--dryrun") or (a.startswith("-") and not a.startswith("--") and "n" in a[1:] and a[1:].isalpha()) for a in extra)


def cmd_stats(args) -> int:
    from mirageflow.report.aggregate import full_metrics

    cfg = _load(args.config, check_paths=False)
    missing = _missing_state_dir(cfg, args.config)
    if missing:
        raise UsageError(missing)
    metrics = full_metrics(cfg.state_dir, cfg.num_shards, cfg.shard.lease_timeout_seconds)  # as in metrics.json
    if args.html:
        from mirageflow.files import atomic_write_text
        from mirageflow.report.html import render_html

        atomic_write_text(Path(args.html), render_html(metrics, cfg.state_dir))
        print(f"mmirage: wrote {args.html}", file=sys.stderr)
    json.dump(metrics, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return EXIT_OK


def status_summary(cfg: PipelineConfig) -> dict:
    """Every shard's state, counts, and rough remaining time (used by `mmirage status`)."""
    from mirageflow.stats import formulas as stats
    from mirageflow.report.aggregate import gpu_hours_remaining, shard_states

    states = shard_states(cfg.state_dir, cfg.num_shards, cfg.shard.lease_timeout_seconds)
    counts = {k: sum(1 for s in states if s["state"] == k) for k in ("done", "running", "failed", "pending")}
    done_runtimes = [s["status"]["stats"]["runtime_seconds"] for s in states if s["state"] == "done"]
    if not done_runtimes:  # nothing done yet: running shards extrapolate their own runtime
        done_runtimes = [
            p["elapsed_seconds"] / p["fraction_done"]
            for s in states
            if s["state"] == "running" and (p := s.get("progress") or {}).get("fraction_done") and p.get("elapsed_seconds")
        ]
    mean_runtime = sum(done_runtimes) / len(done_runtimes) if done_runtimes else None
    running_left = []
    for s in states:
        if s["state"] != "running":
            continue
        p = s.get("progress") or {}
        if p.get("eta_seconds") is not None:
            running_left.append(p["eta_seconds"])
        elif mean_runtime is not None:
            running_left.append(max(0.0, mean_runtime - (p.get("elapsed_seconds") or 0)))
        else:
            running_left.append(None)
    todo = counts["pending"] + counts["failed"]
    eta = None
    if counts["done"] == cfg.num_shards:
        eta = 0.0
    elif None not in running_left and (todo == 0 or mean_runtime is not None):
        # as many shards at a time as run now (at least one): a rough figure
        parallel = max(1, counts["running"])
        eta = (sum(running_left) + todo * (mean_runtime or 0)) / parallel
    statuses = [s["status"] for s in states if s["state"] == "done"]
    from mirageflow.report.terminal import repeats_identically

    repeats = {
        s["shard_id"]: cls
        for s in states
        if s["state"] == "failed" and (cls := repeats_identically((s.get("failure") or {}).get("stats"), str(s.get("error") or "")))
    }
    gpus = [s["status"]["stats"].get("num_gpus") for s in states if s["state"] == "done"]
    gpus += [(s.get("progress") or {}).get("num_gpus") for s in states if s["state"] != "done"]
    known_gpus = [g for g in gpus if isinstance(g, (int, float))]
    return {
        "state_dir": cfg.state_dir,
        "state_dir_abs": str(Path(cfg.state_dir).resolve()),
        "state_dir_exists": Path(cfg.state_dir).is_dir(),
        "cpu_only": bool(known_gpus) and not any(known_gpus),
        "failures_repeat": repeats,
        "total_shards": cfg.num_shards,
        **counts,
        "eta_seconds": eta,
        "eta_human": stats.human_duration(eta),
        "gpu_hours_remaining_estimate": gpu_hours_remaining(statuses, states, cfg.num_shards),
        "shards": [
            {k: v for k, v in s.items() if k not in ("status", "failure")}
            | ({"runtime_seconds": s["status"]["stats"]["runtime_seconds"]} if s["state"] == "done" else {})
            | ({"repeats_identically": repeats[s["shard_id"]]} if s["shard_id"] in repeats else {})
            for s in states
        ],
    }


def _status_line(s: dict) -> str:
    from mirageflow.report.aggregate import _fmt

    p = s.get("progress") or {}
    rows = f"{p.get('rows_done')}/{p.get('rows_total')}" if p.get("rows_total") is not None else ""
    detail = ""
    if s["state"] == "running":
        detail = (
            f"phase {p.get('phase', '?')}, {_fmt(p.get('rows_per_sec'))} rows/s, {_fmt(p.get('tokens_per_sec'))} tok/s, "
            f"ETA {p.get('eta_human') or 'n/a'}"
            + (f", queue {p['queue_depth']}" if p.get("queue_depth") is not None else "")
        )
    elif s["state"] == "failed":
        first = next(iter(str(s.get("error") or "no error recorded").splitlines()), "")
        detail = first + (f" [{s['signal']}]" if s.get("signal") else "")  # whole: it ends with the paths to look at
    elif s["state"] == "done":
        detail = f"{_fmt(s.get('runtime_seconds'))} s"
    where = " ".join(x for x in (s.get("host") or p.get("hostname") or "", f"job {s['slurm_job_id']}" if s.get("slurm_job_id") else "") if x)
    return f"{s['shard_id']:>6}  {s['state']:<8} {rows:>13}  {detail}" + (f"  ({where})" if where and s["state"] != "done" else "")


def _warn_damaged(shards: list[dict]) -> None:
    """One line on stderr per damaged state file."""
    from mirageflow.report.aggregate import DAMAGED_CONSEQUENCE, damaged_note

    for s in shards:
        for x in s.get("damaged") or []:
            print(f"mmirage: WARNING: {damaged_note(x['path'], x['reason'])}; {DAMAGED_CONSEQUENCE.get(x['file'], 'ignored')}", file=sys.stderr)


def _missing_state_dir(cfg: PipelineConfig, config: str) -> str | None:
    """Why there is nothing to read: the state_dir does not exist (a relative one is relative to the current directory)."""
    path = Path(cfg.state_dir)
    if path.is_dir():
        return None
    where = f"state_dir {path.resolve()} does not exist"
    if not path.is_absolute():
        where += (
            f" (the config's state_dir '{cfg.state_dir}' is relative to the directory mmirage runs in, {Path.cwd()}; "
            "run mmirage from the directory the pipeline was started in)"
        )
    return where + f"; nothing has run yet for {config}, or it ran elsewhere"


def cmd_status(args) -> int:
    cfg = _load(args.config, check_paths=False)
    missing = _missing_state_dir(cfg, args.config)
    if missing:
        raise UsageError(missing)
    summary = status_summary(cfg)
    _warn_damaged(summary["shards"])
    if args.json:
        json.dump(summary, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(f"state_dir {summary['state_dir_abs']}: {summary['total_shards']} shards")
        hours = summary["gpu_hours_remaining_estimate"]
        gpu_hours = "" if summary["cpu_only"] else f"; GPU-hours remaining {'n/a' if hours is None else f'{hours:.2f}'}"
        print(
            f"done {summary['done']}, running {summary['running']}, failed {summary['failed']}, pending {summary['pending']}; "
            f"ETA {summary['eta_human'] or 'n/a'} (rough){gpu_hours}" + (" (CPU run)" if summary["cpu_only"] else "")
        )
        shown = [s for s in summary["shards"] if args.all or s["state"] != "done"]
        if shown:
            print(f"{'shard':>6}  {'state':<8} {'rows':>13}  detail")
            for s in shown:
                print(_status_line(s))
        repeats = summary["failures_repeat"]
        for shard_id, cls in repeats.items():
            print(
                f"shard {shard_id}: every failed row failed with {cls}, which depends on the config, prompt or data: a retry "
                "would fail the same way; fix the config or prompt (try it with mmirage preview) and run again"
            )
        if summary["failed"] > len(repeats):
            others = "" if not repeats else " (the others)"
            print(f"retry the failed shards{others} with: mmirage retry --config " + shlex.quote(args.config))
    if summary["failed"]:
        return EXIT_FAILED
    if summary["done"] < summary["total_shards"]:
        return EXIT_INCOMPLETE
    return EXIT_OK


def cmd_merge(args) -> int:
    """Merge through Snakemake's merge rule only (never starts shards), once every shard is done."""
    from mirageflow.report.aggregate import shard_states

    cfg = _load(args.config)
    states = shard_states(cfg.state_dir, cfg.num_shards, cfg.shard.lease_timeout_seconds)
    not_done = {k: [s["shard_id"] for s in states if s["state"] == k] for k in ("running", "failed", "pending")}
    if any(not_done.values()):
        what = "; ".join(f"{k}: {v[:20]}{' ...' if len(v) > 20 else ''}" for k, v in not_done.items() if v)
        print(f"mmirage: cannot merge yet, not every shard is done ({what})", file=sys.stderr)
        return EXIT_FAILED if not_done["failed"] else EXIT_INCOMPLETE
    targets = [f"{cfg.state_dir}/merged/dataset_{ds.index}.json" for ds in cfg.datasets]
    rules = ["merge"]
    if cfg.dedup is not None:  # deduplication_params.enabled: deduplicate the merged output too
        targets += [f"{cfg.state_dir}/dedup/dataset_{ds.index}.json" for ds in cfg.datasets]
        rules.append("dedup")
    flags = ["--allowed-rules", *rules, "--rerun-triggers", "mtime"]
    return _run(snakemake_command(args.config, cores="1", targets=targets, flags=flags, extra=args.extra))


def cmd_preview(args) -> int:
    """The first rows of each dataset through the pipeline: variables, prompts, records (and answers with --generate)."""
    from mirageflow.shard.preview import preview, print_preview

    cfg = _load(args.config)
    if args.rows < 1:
        raise UsageError("--rows must be at least 1")
    try:
        result = preview(cfg, rows=args.rows, generate=args.generate)
    except (OSError, ValueError, RuntimeError) as e:  # a tokenizer or engine that cannot load
        print(f"mmirage preview: cannot load the engine: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    if args.json:
        json.dump(result, sys.stdout, indent=2, ensure_ascii=False, default=str)
        sys.stdout.write("\n")
    else:
        print_preview(result)
    failed = any(r["error"] for ds in result["datasets"] for r in ds["rows"]) or any(ds["error"] for ds in result["datasets"])
    return EXIT_FAILED if failed else EXIT_OK


def cmd_check(args) -> int:
    """The driver's validation (mirageflow.config.preflight.validate, as `snakemake -n` runs it): the
    config, then the data and model files; exit 2 with every problem's key path."""
    from mirageflow.config import ConfigError
    from mirageflow.config.preflight import validate

    try:
        cfg = validate(args.config)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    print(f"{args.config}: valid ({len(cfg.datasets)} dataset(s), {cfg.num_shards} shard(s), state_dir {cfg.state_dir})")
    return EXIT_OK


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmirage",
        description="Run MMIRAGE pipelines with the mirageflow Snakemake workflow, and read their stats.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name, help_, func):
        p = sub.add_parser(name, help=help_, description=help_, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", required=True, metavar="C", help="pipeline YAML (MMIRAGE format)")
        p.set_defaults(func=func)
        return p

    p = command("run", "run the pipeline on this machine (snakemake --cores N)", cmd_run)
    p.add_argument("--stats", action="store_true", help="sample GPU utilisation (config stats=true)")
    p.add_argument("--cores", default="1", metavar="N", help="cores for Snakemake; each shard job takes one (default 1: one shard at a time; 'all')")

    p = command("submit", "submit the pipeline's jobs to SLURM (snakemake --profile profiles/slurm)", cmd_submit)
    p.add_argument("--stats", action="store_true", help="sample GPU utilisation (config stats=true)")
    p.add_argument("--profile", metavar="DIR", help="Snakemake profile (default: the checkout's profiles/slurm; profiles/slurm-gpu under the GPU install's SLURM plugin 2.6)")

    p = command("retry", "rerun failed, missing and incomplete shards (resuming from their checkpoints)", cmd_retry)
    p.add_argument("--stats", action="store_true", help="sample GPU utilisation (config stats=true)")
    p.add_argument("--failed-rows", action="store_true", help="also recompute the failed rows (errors.jsonl) of shards that finished")
    p.add_argument("--cores", default="1", metavar="N", help="cores for a local retry (default 1)")
    p.add_argument("--submit", action="store_true", help="retry through SLURM (the submit profile) instead of locally")
    p.add_argument("--profile", metavar="DIR", help="with --submit: Snakemake profile (default profiles/slurm, or profiles/slurm-gpu as for submit)")

    p = command("stats", "print the metrics JSON {per_shard, aggregate} from the state directory (no Snakemake)", cmd_stats)
    p.add_argument("--html", metavar="FILE", help="also write the HTML report there")

    p = command("status", "shards done / running / failed / pending, with progress and a rough ETA", cmd_status)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="list done shards too")

    command("merge", "merge every dataset's shard outputs (Snakemake's merge rule; needs every shard done)", cmd_merge)

    p = command("preview", "try the prompts on the first rows of each dataset (variables, prompts, records; answers with --generate)", cmd_preview)
    p.add_argument("--rows", type=int, default=3, metavar="N", help="rows per dataset (default 3)")
    p.add_argument("--generate", action="store_true", help="load the configured engine and generate those rows (scratch dir; the pipeline's state and outputs are untouched)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    command("check", "validate the config and exit", cmd_check)
    return parser


SNAKEMAKE_COMMANDS = ("run", "submit", "retry", "merge")  # the commands that run Snakemake


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        flags = [a for a in unknown if a.startswith("-")]
        hint = ""
        if flags and args.command in SNAKEMAKE_COMMANDS:
            hint = (
                f"; Snakemake options go after `--`: mmirage {args.command} --config {args.config or 'C'} -- "
                + " ".join(shlex.quote(a) for a in unknown)
            )
        print(f"mmirage {args.command}: unrecognized arguments: {' '.join(unknown)}{hint}", file=sys.stderr)
        return EXIT_USAGE
    args.extra = extra
    if not logging.getLogger().handlers:  # the report's warnings (damaged state files), one line each
        logging.basicConfig(level=logging.WARNING, format="mmirage: %(levelname)s: %(message)s")
    from mirageflow.redact import install_log_redaction

    install_log_redaction()  # no secret reaches a log line, whichever library writes it
    if extra and args.command in ("stats", "status", "check", "preview"):
        print(f"mmirage {args.command}: takes no Snakemake arguments (got {' '.join(extra)})", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except UsageError as e:
        print(f"mmirage {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except FileNotFoundError as e:  # no Snakefile
        print(f"mmirage {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as e:  # state from another num_shards
        print(f"mmirage {args.command}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `mmirage status | head`: the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
