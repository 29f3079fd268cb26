"""``mmirage``: MMIRAGE's command line, as a thin layer over the Snakemake workflow.

run, submit, retry and merge build a ``python -m snakemake`` command (printed before it
runs, so you can run it yourself) and run it in the current directory; stats and status
only read the state directory. There is no second scheduler: Snakemake decides what runs.
MMIRAGE's flags keep their meaning (docs/cli.md and docs/mmirage.md list where ours differ).
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
from mirageflow.data.dedup import DEDUP_RULES
from mirageflow.errors import EXIT_FAILED, EXIT_INCOMPLETE, EXIT_OK, EXIT_USAGE, EngineDeathClass, InputError
from mirageflow.state.layout import StateLayout

EPILOG = """\
exit codes:
  0  success (status, and check of a pipeline that has run: every shard done)
  1  the Snakemake run failed (run/submit/retry/merge), or a shard failed (status, check)
  2  usage or config error (nothing was started)
  3  incomplete: shards pending or running (status, check), or merge refused because of them
  (status, check and merge: 1 wins over 3 when a shard failed)

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


class UsageError(InputError):
    """Bad arguments or config: mmirage exits 2, nothing started."""


class WorkflowNotFound(InputError, FileNotFoundError):
    """No Snakefile where mirageflow looks for it."""


def workflow_dir() -> Path:
    """The checkout holding the Snakefile: $MIRAGEFLOW_WORKFLOW_DIR, else the one this package lives in."""
    env = os.environ.get("MIRAGEFLOW_WORKFLOW_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(Path(__file__).resolve().parents[2])
    for path in candidates:
        if (path / "Snakefile").is_file():
            return path
    raise WorkflowNotFound(
        "cannot find the workflow's Snakefile (mirageflow is not installed from a checkout); "
        "set MIRAGEFLOW_WORKFLOW_DIR to the repository directory"
    )


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


def _slurm_profile(args) -> Path:
    return Path(args.profile) if getattr(args, "profile", None) else default_slurm_profile()


def _on_slurm(cfg, args) -> bool:
    """MMIRAGE's execution_params.mode: slurm sends run and retry through SLURM (--local: here)."""
    return cfg.execution.mode == "slurm" and not getattr(args, "local", False)


def _shard_ids(text: str, cfg, flag: str = "--shard-ids") -> list[int]:
    """MMIRAGE's --shard-ids (or --shard-id, ``flag``): comma-separated shard ids below num_shards."""
    ids = []
    shards = f"the pipeline has shards 0 to {cfg.num_shards - 1}"
    example = "--shard-id 2" if flag == "--shard-id" else "--shard-ids 0,2"
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("-") and part[1:].isdigit():
            raise UsageError(f"{flag} {part}: a shard id is not negative; {shards}")
        if not part.isdigit():
            raise UsageError(f"{flag}: invalid shard id {part!r}; expected a shard number, e.g. {example} ({shards})")
        if int(part) >= cfg.num_shards:
            raise UsageError(f"{flag}: invalid shard id {part}; {shards}")
        ids.append(int(part))
    if not ids:
        raise UsageError("--shard-ids names no shard")
    return sorted(set(ids))


def _retries(cfg, force: bool) -> list[str]:
    """MMIRAGE's retry orchestration (execution_params.retry, or --force-retry): Snakemake retries each failed job
    up to execution_params.max_retries times."""
    ep = cfg.execution
    return ["--retries", str(ep.max_retries)] if force or ep.retry else []


def cmd_run(args) -> int:
    cfg = _load(args.config)  # fail fast, with exit code 2, before Snakemake starts
    if args.export_prompts is not None:
        if args.shard_id is not None or args.force_retry or args.extra:
            raise UsageError(
                "--export-prompts writes the requests and runs nothing: it takes no --shard-id, --force-retry or Snakemake arguments"
            )
        return export_prompts(cfg, args.export_prompts)
    if args.stats and args.shard_id is None and not _dry_run(args.extra) and not retry_plan(cfg, False)["unfinished"]:
        print(
            "mmirage: every shard is done: --stats samples the GPUs of shards that run, and none will run now; "
            "`mmirage stats` prints the run's figures (a shard runs again after a config edit, or with `mmirage retry --failed-rows`)",
            file=sys.stderr,
        )
    flags = _retries(cfg, args.force_retry)
    if args.shard_id is not None:  # MMIRAGE: one shard, on this machine, whatever the mode says
        (shard,) = _shard_ids(str(args.shard_id), cfg, "--shard-id")
        target = str(StateLayout(cfg.state_dir).status(shard))
        return _run(snakemake_command(args.config, stats=args.stats, cores=args.cores, targets=[target], flags=flags, extra=args.extra))
    if _on_slurm(cfg, args):
        print(
            "mmirage: execution_params.mode is slurm: the shards go to SLURM, as with mmirage submit (--local runs them here)",
            file=sys.stderr,
        )
        return _run(snakemake_command(args.config, stats=args.stats, profile=_slurm_profile(args), flags=flags, extra=args.extra))
    return _run(snakemake_command(args.config, stats=args.stats, cores=args.cores, flags=flags, extra=args.extra))


def export_prompts(cfg, where: str) -> int:
    """MMIRAGE's `run --export-prompts P`: the requests to a new JSONL file, nothing generated."""
    import secrets

    from mirageflow.shard.preview import export_prompts as export

    path = Path(where)
    run_id = secrets.token_hex(3)  # as MMIRAGE: a new file each time, never one written before
    path = path.with_name(f"{path.stem}.{run_id}.jsonl") if path.suffix == ".jsonl" else path / f"exported_prompts.{run_id}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            counts = export(cfg, out)
        os.replace(tmp, path)
    except (OSError, ValueError, RuntimeError) as e:  # a tokenizer that cannot load, a dataset that cannot be read
        tmp.unlink(missing_ok=True)
        print(f"mmirage run --export-prompts: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"mmirage: wrote {counts['requests']} request(s) of {counts['rows']} row(s) to {path}"
        + (f' ({counts["row_errors"]} row(s) with an error: lines with "error")' if counts["row_errors"] else ""),
        file=sys.stderr,
    )
    print(path)
    return EXIT_FAILED if counts["row_errors"] else EXIT_OK


def cmd_submit(args) -> int:
    cfg = _load(args.config)
    targets = [str(StateLayout(cfg.state_dir).status(i)) for i in _shard_ids(args.shard_ids, cfg)] if args.shard_ids else []
    rc = _run(snakemake_command(args.config, stats=args.stats, profile=_slurm_profile(args), targets=targets, extra=args.extra))
    if not args.wait or _dry_run(args.extra):
        return rc
    # MMIRAGE's --wait: the exit code is the shards' (the driver always waits for its jobs)
    summary = shard_status(cfg)
    return rc if rc != EXIT_OK else _status_exit(summary)


def retry_plan(cfg: PipelineConfig, failed_rows: bool) -> dict:
    """What `mmirage retry` reruns: unfinished shards always (failed, pending, stale, running);
    with failed_rows, done shards with failed rows too. From the state contract
    (mirageflow.state.shards), as `mmirage status` shows them."""
    from mirageflow.state import layout as L
    from mirageflow.state.shards import states_of

    states = states_of(cfg)
    unfinished = [s.shard_id for s in states if s.state != "done"]
    running = [s.shard_id for s in states if s.state == "running"]
    with_failed_rows = [s.shard_id for s in states if s.state == "done" and (s.stats.get("rows_failed") or 0) > 0]
    # a damaged status.json: not done, but Snakemake sees the file and would not rerun the shard unforced
    damaged = [s.shard_id for s in states if s.state == "failed" and any(x["file"] == L.STATUS for x in s.damaged)]
    return {
        "unfinished": unfinished, "running": running, "with_failed_rows": with_failed_rows if failed_rows else [],
        "damaged_status": damaged, "stale": [s.shard_id for s in states if s.stale], "states": states,
    }  # fmt: skip


def by_failure_class(plan: dict, classes: list[str] | None) -> dict:
    """``plan`` cut to the failed shards whose failure.json names one of ``classes`` (the death
    class of their launched server, engines/server_restarts.py); all of it without classes."""
    if not classes:
        return plan
    chosen = [s.shard_id for s in plan["states"] if s.state == "failed" and s.failure_class in classes]
    return plan | {
        "unfinished": chosen, "with_failed_rows": [], "stale": [i for i in plan["stale"] if i in chosen],
        "damaged_status": [i for i in plan["damaged_status"] if i in chosen],
    }  # fmt: skip


def _ids(ids: list[int]) -> str:
    return str(ids[:20])[:-1] + ", ...]" if len(ids) > 20 else str(ids)


def resubmit_batch(cfg, paths, plan: dict, batch_id: str) -> int:
    """``retry --resubmit-batch ID``: the shards whose batches.json lists batch ``ID`` stop
    waiting for it (its entry marked abandoned); their rerun submits its requests again."""
    from mirageflow.shard.ledger import abandon_batch

    found = []
    for shard in range(cfg.num_shards):
        ledger = paths.batch_ledger(shard)
        if not ledger.exists():
            continue
        if shard in plan["running"]:
            if any(e.get("batch_id") == batch_id for e in (json.loads(ledger.read_text()).get("batches") or {}).values()):
                print(f"mmirage: shard {shard} is running (fresh lease): stop it before resubmitting batch {batch_id}", file=sys.stderr)
                return EXIT_USAGE
            continue
        try:
            keys = abandon_batch(ledger, batch_id)
        except (OSError, ValueError) as e:
            print(f"mmirage: cannot update {ledger}: {e}", file=sys.stderr)
            return EXIT_FAILED
        if keys:
            found.append(shard)
            print(
                f"mmirage: {ledger}: batch {batch_id} (chunk {', '.join(keys)}) abandoned: its requests are submitted again",
                file=sys.stderr,
            )
    if not found:
        print(f"mmirage: no batches.json under {cfg.state_dir} lists batch {batch_id}", file=sys.stderr)
        return EXIT_USAGE
    return EXIT_OK


def cmd_retry(args) -> int:
    """Rerun exactly the shards the plan names (their status.json as Snakemake's targets, each
    resuming from its checkpoint), then, once no shard is failed, build what the shards feed
    (report, merge, dedup) without letting Snakemake start any other shard."""
    from mirageflow.report.terminal import repeats_identically
    from mirageflow.state.layout import StateLayout, default_targets
    from mirageflow.state.shards import states_of

    cfg = _load(args.config)
    plan = by_failure_class(retry_plan(cfg, args.failed_rows), args.failure_class)
    paths = StateLayout(cfg.state_dir)
    for batch_id in args.resubmit_batch or ():
        rc = resubmit_batch(cfg, paths, plan, batch_id)
        if rc != EXIT_OK:
            return rc
    if args.resubmit_batch:
        plan = by_failure_class(retry_plan(cfg, args.failed_rows), args.failure_class)
    if plan["running"]:
        print(
            f"mmirage: shard(s) {_ids(plan['running'])} look alive (fresh progress.json/lease.json); their rerun waits for "
            "their lease to expire or fails clearly",
            file=sys.stderr,
        )
    shards = sorted(set(plan["unfinished"]) | set(plan["with_failed_rows"]))
    forced = sorted(set(plan["with_failed_rows"]) | set(plan["damaged_status"]))
    print(
        f"mmirage: retrying {len(plan['unfinished'])} unfinished shard(s) {_ids(plan['unfinished'])}"
        + (f" ({len(plan['stale'])} of them stale: made with an earlier config)" if plan["stale"] else "")
        + (f" and the failed rows of {len(plan['with_failed_rows'])} done shard(s) {_ids(plan['with_failed_rows'])}" if args.failed_rows else "")
        + ("; Snakemake runs exactly these shards" if shards else "; no shard to rerun"),
        file=sys.stderr,
    )  # fmt: skip
    for s in plan["states"]:
        cls = s.state == "failed" and repeats_identically(s.failure_stats, str(s.error or ""))
        if cls and not args.failed_rows:
            print(
                f"mmirage: WARNING: shard {s.shard_id}: every failed row failed with {cls}, which depends on the config, "
                "prompt or data: this retry will fail the same way unless the config changed",
                file=sys.stderr,
            )
    submit = args.submit or _on_slurm(cfg, args)
    profile = _slurm_profile(args) if submit else None
    cores = None if submit else args.cores
    common = {"stats": args.stats, "cores": cores, "profile": profile, "extra": args.extra}
    dry = _dry_run(args.extra)
    if shards:
        # --rerun-incomplete: the shards a killed driver left marked incomplete; --forcerun: done shards
        # with failed rows, and damaged status.json files Snakemake would take for done
        flags = ["--rerun-incomplete"] + (["--forcerun", *(str(paths.status(i)) for i in forced)] if forced else [])
        values = {"retry_failed_rows": "true"} if args.failed_rows else {}
        targets = [str(paths.status(i)) for i in shards]
        rc = _run(snakemake_command(args.config, config_values=values, flags=flags, targets=targets, **common))
        if rc != EXIT_OK or dry:
            return rc
    if not dry:
        still = [s.shard_id for s in states_of(cfg) if s.state == "failed"]
        if still:
            print(f"mmirage retry: shard(s) {_ids(still)} still failed after the retry", file=sys.stderr)
            return EXIT_FAILED
    if not shards and not dry and _outputs_current(cfg, plan["states"]):
        print(
            "mmirage retry: nothing to retry, and the report and merged outputs are newer than every shard's status.json: nothing to do",
            file=sys.stderr,
        )
        return EXIT_OK
    # the report, merged outputs, card (and upload), from the shards as they are now: no shard may start here
    flags = ["--allowed-rules", "aggregate", "merge", *DEDUP_RULES, "card", "publish", "--rerun-triggers", "mtime"]
    return _run(snakemake_command(args.config, flags=flags, targets=default_targets(cfg), **common))


def _outputs_current(cfg, states: list) -> bool:
    """Whether what the default target builds from the shards (report, merge manifests, dedup
    counts) exists and is newer than every shard's status.json (Snakemake's mtime rule, as
    the retry's last step runs it): then that step has nothing to do."""
    from mirageflow.state.layout import StateLayout, default_targets

    paths = StateLayout(cfg.state_dir)
    try:
        built = min(os.stat(t).st_mtime for t in default_targets(cfg))
        newest = max((os.stat(paths.status(s.shard_id)).st_mtime for s in states), default=0.0)
    except OSError:  # a target (or a status.json) is missing: Snakemake builds it
        return False
    return built >= newest


def _dry_run(extra: list[str]) -> bool:
    return any(
        a in ("-n", "--dry-run", "--dryrun") or (a.startswith("-") and not a.startswith("--") and "n" in a[1:] and a[1:].isalpha())
        for a in extra
    )


def cmd_stats(args) -> int:
    from mirageflow.report.aggregate import full_metrics

    cfg = _load(args.config, check_paths=False)
    missing = _missing_state_dir(cfg, args.config)
    if missing:
        raise UsageError(missing)
    from mirageflow.state.shards import current_fingerprint

    metrics = full_metrics(  # as in metrics.json
        cfg.state_dir, cfg.num_shards, cfg.shard.lease_timeout_seconds, current_fingerprint(cfg), n_samples=cfg.n_samples
    )
    if args.html:
        from mirageflow.files import atomic_write_text
        from mirageflow.report.html import render_html

        atomic_write_text(Path(args.html), render_html(metrics, cfg.state_dir))
        print(f"mmirage: wrote {args.html}", file=sys.stderr)
    if args.diagnose:  # the findings alone, as words (report/findings.py)
        from mirageflow.report.findings import findings_text

        sys.stdout.write(findings_text(metrics["findings"]))
        return EXIT_OK
    json.dump(metrics, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
    return EXIT_OK


def status_summary(cfg: PipelineConfig) -> dict:
    """Every shard's state, counts, the run's progress, rate and ETA (state/remaining.py's
    ``run_progress``, as the live line shows them), GPU-hours and cost (used by `mmirage status`)."""
    from mirageflow.report.terminal import repeats_identically
    from mirageflow.state.remaining import gpu_hours_remaining, indexed_rows, run_cost, status_progress
    from mirageflow.state.shards import count, states_of, units_of
    from mirageflow.stats import formulas as stats

    states = states_of(cfg)
    rows = indexed_rows(cfg.state_dir)
    progress = status_progress(states, cfg.n_samples, rows)
    done = [{**s.status, "shard_id": s.shard_id} for s in states if s.state == "done"]
    cost = run_cost(states, cfg.n_samples, rows * cfg.n_samples if rows else None)
    repeats = {s.shard_id: cls for s in states if s.state == "failed" and (cls := repeats_identically(s.failure_stats, str(s.error or "")))}
    gpus = [s.stats.get("num_gpus") if s.state == "done" else (s.progress or {}).get("num_gpus") for s in states]
    known_gpus = [g for g in gpus if isinstance(g, (int, float))]
    return {
        "state_dir": cfg.state_dir,
        "state_dir_abs": str(Path(cfg.state_dir).resolve()),
        "state_dir_exists": Path(cfg.state_dir).is_dir(),
        "cpu_only": bool(known_gpus) and not any(known_gpus),
        "failures_repeat": repeats,
        "total_shards": cfg.num_shards,
        **count(states),
        "stale": [s.shard_id for s in states if s.stale],
        "n_samples": cfg.n_samples,
        "rows_done": progress.rows_done,
        "samples_done": progress.samples_done,
        "rows_total": progress.rows_total,
        "rate": progress.rate,  # samples (rows when n_samples is 1) per second, now
        "tokens_per_sec": progress.tokens_rate,
        "rate_note": progress.why or None,
        "eta_seconds": progress.eta_seconds,
        "eta_human": stats.human_duration(progress.eta_seconds),
        "eta_note": progress.eta_why or None,
        "progress_text": " | ".join((progress.work_text(), progress.rate_text(), progress.eta_text())),
        "gpu_hours_remaining_estimate": gpu_hours_remaining(done, states, cfg.num_shards),
        "cost_usd": cost.spent_usd,
        "cost_unpriced_tokens": cost.unpriced_tokens,
        "cost_forecast_usd": cost.total_usd,
        "cost_forecast_basis": cost.basis,
        "shards": [
            s.to_json()
            | ({"runtime_seconds": s.stats["runtime_seconds"], "samples_done": units_of(s.stats)} if s.state == "done" else {})
            | ({"repeats_identically": repeats[s.shard_id]} if s.shard_id in repeats else {})
            | _healing(s)
            for s in states
        ],
    }


def _healing(s) -> dict:
    """A shard's engine restarts (engines/server_restarts.py) from its status.json, failure.json
    or progress.json (a ``ShardState``), and the class of the death that failed it; nothing
    when there were none."""
    record = s.status or s.failure
    restarts = (record.get("stats") or {}).get("engine_restarts") if record else (s.progress or {}).get("engine_restarts")
    out = {"engine_restarts": restarts} if restarts else {}
    if s.failure_class:
        out["failure_class"] = s.failure_class
    return out


def _status_line(s: dict, n_samples: int = 1) -> str:
    from mirageflow.numbers import fmt
    from mirageflow.state.remaining import shard_rate
    from mirageflow.state.shards import progress_work

    p = s.get("progress") or {}
    done = ""
    if s["state"] == "done":
        samples = s.get("samples_done")
        done = f"{samples // n_samples}/{samples // n_samples}" if samples is not None else ""
    elif p.get("rows_total") is not None and s["state"] != "pending":
        rows, samples, _ = progress_work(p, n_samples)
        done = f"{rows}/{p['rows_total']}" + (f" ({samples}/{p['rows_total'] * n_samples} samples)" if n_samples > 1 else "")
    detail = ""
    if s["state"] == "running":
        unit = "rows" if n_samples == 1 else "samples"
        rate = shard_rate(p)
        eta = p.get("eta_human") or ("n/a" + (f" ({p['eta_note']})" if p.get("eta_note") else ""))
        detail = (
            f"phase {p.get('phase', '?')}, {fmt(rate)} {unit}/s, {fmt(p.get('tokens_per_sec'))} tok/s, ETA {eta}"
            + (f", {p['inflight']} in flight" if p.get("inflight") else "")
            + (f", queue {p['queue_depth']}" if p.get("queue_depth") is not None else "")
        )
    elif s["state"] == "failed":
        first = next(iter(str(s.get("error") or "no error recorded").splitlines()), "")
        detail = first + (f" [{s['signal']}]" if s.get("signal") else "")  # whole: it ends with the paths to look at
        detail += f" [{s['failure_class']}]" if s.get("failure_class") else ""
    elif s["state"] == "done":
        detail = f"{fmt(s.get('runtime_seconds'))} s"
    if s.get("engine_restarts"):
        detail += f"{', ' if detail else ''}{s['engine_restarts']} engine restart{'s' if s['engine_restarts'] > 1 else ''}"
    elif s.get("stale"):
        detail = s["stale"]
    where = " ".join(
        x for x in (s.get("host") or p.get("hostname") or "", f"job {s['slurm_job_id']}" if s.get("slurm_job_id") else "") if x
    )
    return f"{s['shard_id']:>6}  {s['state']:<8} {done:>13}  {detail}" + (
        f"  ({where})" if where and s["state"] not in ("done", "pending") else ""
    )


def _warn_damaged(shards: list[dict]) -> None:
    """One line on stderr per damaged state file."""
    from mirageflow.state.records import DAMAGED_CONSEQUENCE, damaged_note

    for s in shards:
        for x in s.get("damaged") or []:
            print(
                f"mmirage: WARNING: {damaged_note(x['path'], x['reason'])}; {DAMAGED_CONSEQUENCE.get(x['file'], 'ignored')}",
                file=sys.stderr,
            )


def _missing_state_dir(cfg: PipelineConfig, config: str) -> str | None:
    """Why there is nothing to read: the state_dir does not exist (a relative one is relative to the current directory),
    or it belongs to another pipeline."""
    path = Path(cfg.state_dir)
    if path.is_dir():
        from mirageflow.state.pipeline import state_owner_problem

        return state_owner_problem(cfg)  # another pipeline's shards are not this one's
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
            f"{summary['progress_text']}{gpu_hours}" + (" (CPU run)" if summary["cpu_only"] else "")
        )
        if summary["cost_usd"] or summary["cost_unpriced_tokens"]:
            forecast = summary["cost_forecast_usd"]
            print(
                f"spent ${summary['cost_usd']:,.2f}" + (" + unknown" if summary["cost_unpriced_tokens"] else "")
                + (f"; forecast ~${forecast:,.2f} for the run ({summary['cost_forecast_basis']})" if forecast is not None else "")
            )  # fmt: skip
        if summary["stale"]:
            print(
                f"pending {_ids(summary['stale'])}: their status.json is from an earlier config (the records fingerprint "
                "changed): the next run reruns them"
            )
        shown = [s for s in summary["shards"] if args.all or s["state"] != "done"]
        if shown:
            print(f"{'shard':>6}  {'state':<8} {'rows':>13}  detail")
            for s in shown:
                print(_status_line(s, summary["n_samples"]))
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
    from mirageflow.state.layout import StateLayout
    from mirageflow.state.shards import states_of

    cfg = _load(args.config)
    states = states_of(cfg)
    not_done = {k: [s.shard_id for s in states if s.state == k] for k in ("running", "failed", "pending")}
    if any(not_done.values()):
        what = "; ".join(f"{k}: {v[:20]}{' ...' if len(v) > 20 else ''}" for k, v in not_done.items() if v)
        print(f"mmirage: cannot merge yet, not every shard is done ({what})", file=sys.stderr)
        return EXIT_FAILED if not_done["failed"] else EXIT_INCOMPLETE
    paths = StateLayout(cfg.state_dir)
    targets = [str(paths.merge_manifest(ds.index)) for ds in cfg.datasets]
    rules = ["merge"]
    if cfg.dedup is not None:  # deduplication_params.enabled: deduplicate the merged output too
        targets += [str(paths.dedup_counts(ds.index)) for ds in cfg.datasets]
        rules += DEDUP_RULES
    flags = ["--allowed-rules", *rules, "--rerun-triggers", "mtime"]
    if args.output_path:  # MMIRAGE's merge fills a batch_api run's placeholders from the results there
        print(
            "mmirage merge: --output-path is ignored: here a batch_api shard waits for its batches and writes real records "
            "(no placeholders to fill at merge); the receipts are in the processor's metadata_output_path",
            file=sys.stderr,
        )
    copies = _merge_copies(cfg, args.output_dir) if args.output_dir else []
    rc = _run(snakemake_command(args.config, cores="1", targets=targets, flags=flags, extra=args.extra))
    if rc != EXIT_OK or _dry_run(args.extra):
        return rc
    for src, dest in copies:
        _copy_tree(src, dest)
        print(f"mmirage: merged records of {src.parent} in {dest}", file=sys.stderr)
    return rc


def _merge_copies(cfg, root: str) -> list[tuple[Path, Path]]:
    """MMIRAGE's --output-dir/--output-root: each dataset's merged records under root/<its output_dir's name>
    (<name>_<index> when two have one name). A folder there that is not empty is refused, before anything runs."""
    from mirageflow.publish.card import config_names

    pairs = []
    for ds, name in zip(cfg.datasets, config_names(cfg)):  # the names the datasets have on the Hub too
        dest = Path(root) / name
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise UsageError(f"--output-dir: {dest} exists and is not empty; nothing is replaced: choose another root, or delete it")
        pairs.append((Path(ds.output_dir) / "merged", dest))
    return pairs


def _copy_tree(src: Path, dest: Path) -> None:
    """src's files into dest, hard-linked where the filesystem allows (else copied), appearing at once."""
    import shutil

    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)

    def link_or_copy(a, b):
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    shutil.copytree(src, tmp, copy_function=link_or_copy)
    if dest.is_dir():  # empty (checked before the merge)
        dest.rmdir()
    os.replace(tmp, dest)


def cmd_publish(args) -> int:
    """Upload the merged records (and the deduplicated ones) as Parquet, with the dataset card (mirageflow/publish/hub.py)."""
    from mirageflow.publish.card import CardInputsMissing
    from mirageflow.config.types import PublishParams
    from mirageflow.publish.hub import PublishFailed, PublishRefused, publish

    cfg = _load(args.config)
    configured = cfg.execution.publish  # execution_params.publish: the flags given override it
    repo_id = args.repo_id or (configured.repo_id if configured else None)
    if not repo_id:
        print(f"mmirage publish: no --repo-id, and {args.config} has no execution_params.publish.repo_id", file=sys.stderr)
        return EXIT_USAGE
    base = configured or PublishParams(repo_id)
    target = PublishParams(
        repo_id, private=args.private or base.private, revision=args.revision or base.revision,
        allow_partial=args.allow_partial or base.allow_partial, overwrite_other=args.overwrite_other or base.overwrite_other,
    )  # fmt: skip
    try:
        record = publish(cfg, args.config, target)
    except (PublishRefused, PublishFailed, CardInputsMissing) as e:
        print(f"mmirage publish: {e}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"mmirage: published {len(record['files'])} files to {record['repo_id']} (revision {record['revision']}, "
        f"commit {record['commit']}){' -- a partial dataset, shards left out: ' + str(record['shards_left_out']) if record['partial'] else ''}",
        file=sys.stderr,
    )
    return EXIT_OK


def cmd_preview(args) -> int:
    """The first rows of each dataset through the pipeline: variables, prompts, records (and answers with --generate)."""
    from mirageflow.shard.preview import preview, print_preview

    cfg = _load(args.config)
    if args.rows < 1:
        raise UsageError("--rows must be at least 1")
    from mirageflow.shard.failures import ShardFailed

    try:
        result = preview(cfg, rows=args.rows, generate=args.generate)
    except ShardFailed as e:  # the engine raised while generating (what fails a shard)
        print(f"mmirage preview: {e}", file=sys.stderr)
        return EXIT_FAILED
    except (OSError, ValueError, RuntimeError) as e:  # a tokenizer or engine that cannot load
        print(f"mmirage preview: cannot load the engine: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_FAILED
    forecast = _preview_forecast(cfg, result)
    if args.json:
        json.dump({**result, "cost_forecast": forecast}, sys.stdout, indent=2, ensure_ascii=False, default=str)
        sys.stdout.write("\n")
    else:
        print_preview(result)
        if forecast is not None:
            print(forecast["line"])
    failed = any(r["error"] for ds in result["datasets"] for r in ds["rows"]) or any(ds["error"] for ds in result["datasets"])
    return EXIT_FAILED if failed else EXIT_OK


def _preview_forecast(cfg, result: dict) -> dict | None:
    """The whole dataset's cost forecast from the previewed rows (shard/preview.py cost_of_preview), when anything costs."""
    from mirageflow.config.preflight import dataset_rows
    from mirageflow.shard.preview import cost_of_preview
    from mirageflow.stats.pricing import FREE, processor_price

    if all(processor_price(p) == FREE for p in cfg.processors.values()):
        return None  # nothing costs
    forecast = cost_of_preview(cfg, result, dataset_rows(cfg))
    if forecast is None:
        return None
    return {"usd": forecast.total_usd, "basis": forecast.basis, "line": _forecast_line(cfg, forecast)}


def _forecast_line(cfg, forecast) -> str:
    cap = cfg.execution.max_cost_usd
    cap_text = ""
    if cap is not None:
        cap_text = f"; execution_params.max_cost_usd ${cap:,.2f}" + (": the forecast passes it" if forecast.total_usd > cap else "")
    return f"cost forecast for the whole dataset: ~${forecast.total_usd:,.2f} ({forecast.basis}){cap_text}"


def shard_status(cfg) -> dict | None:
    """Every shard's state (status_summary), or None when the pipeline has no state yet (nothing ran).

    The one place `check` and `submit --wait` ask "is every shard done?".
    """
    if not Path(cfg.state_dir).is_dir():
        return None
    return status_summary(cfg)


def _status_exit(summary: dict | None) -> int:
    if summary is None or summary["failed"]:
        return EXIT_FAILED
    return EXIT_OK if summary["done"] == summary["total_shards"] else EXIT_INCOMPLETE


def cmd_check(args) -> int:
    """MMIRAGE's `check`, safe before `&& publish`: the driver's validation (preflight.validate, as
    `snakemake -n` runs it; exit 2 with every problem's key path), then, once the pipeline has
    state, the shards' status: exit 0 only when every shard succeeded (1: a shard failed, 3:
    shards pending or running). --retry reruns the failed ones (asking first, unless -y)."""
    from mirageflow.config import ConfigError
    from mirageflow.config.preflight import hub_model_notes, validate

    try:
        cfg = validate(args.config)
    except ConfigError as e:
        raise UsageError(str(e)) from None
    print(f"{args.config}: valid ({len(cfg.datasets)} dataset(s), {cfg.num_shards} shard(s), state_dir {cfg.state_dir})")
    for note in hub_model_notes(cfg):
        print(note)
    for warning in cfg.warnings:
        print(f"warning: {warning}")
    for warning in _row_group_warnings(cfg):
        print(f"warning: {warning}")
    from mirageflow.stats.pricing import unpriced_warnings

    for warning in unpriced_warnings(cfg.processors):
        print(f"warning: {warning}")
    from mirageflow.config.preflight import budget_forecast

    try:
        forecast = budget_forecast(cfg)  # before anything is sent; None when nothing costs
    except Exception as e:  # noqa: BLE001 - a preview that cannot run (a tokenizer not here): check goes on
        print(f"warning: no cost forecast: the preview of the first rows failed: {type(e).__name__}: {e}")
        forecast = None
    if forecast is not None and forecast.total_usd is not None:
        print(_forecast_line(cfg, forecast))
    summary = shard_status(cfg)
    if summary is None:
        print(f"no state yet ({Path(cfg.state_dir).resolve()} does not exist): nothing has run, no shard to check")
        return EXIT_OK
    _print_shards(summary)
    if summary["failed"] and args.retry:
        if not _confirm(f"retry {summary['failed']} failed shard(s)?", args.yes):
            return EXIT_FAILED
        args.failed_rows, args.submit, args.profile, args.local, args.cores, args.resubmit_batch = False, False, None, False, "1", []
        args.failure_class = None  # every failed shard, whatever ended it
        cmd_retry(args)
        summary = shard_status(cfg)
        _print_shards(summary)
    return _status_exit(summary)


def _row_group_warnings(cfg) -> list[str]:
    """Parquet files whose row groups are far larger than a shard (their footers only)."""
    from mirageflow.data.readers import row_group_warnings

    out = []
    for ds in cfg.datasets:
        if ds.type == "parquet":
            try:
                out += row_group_warnings(ds, cfg.num_shards)
            except Exception as e:  # the index job fails on it too, naming the file; check goes on
                out.append(f"{ds.key}: cannot read the Parquet footers of '{ds.path}' ({type(e).__name__}: {e})")
    return out


def _print_shards(summary: dict) -> None:
    print(
        f"shards: {summary['done']} of {summary['total_shards']} done, {summary['running']} running, "
        f"{summary['failed']} failed, {summary['pending']} pending"
    )
    for s in summary["shards"]:
        if s["state"] != "done":
            print(_status_line(s))


def _confirm(question: str, yes: bool) -> bool:
    """MMIRAGE's confirmation: -y answers yes; without it a terminal is asked, anything else refused."""
    if yes:
        return True
    if not sys.stdin.isatty():
        print(f"mmirage: {question} needs an answer; stdin is not a terminal: add -y", file=sys.stderr)
        return False
    return input(f"{question} (y/N) ").strip().lower() == "y"


def cmd_merge_dir(args) -> int:
    """MMIRAGE's `merge-dir`: merge shard_* outputs found under a directory, without a config."""
    from mirageflow.data.merge import MergeRefused, merge_directory

    try:
        reports = merge_directory(args.input_dir, args.output_dir)
    except MergeRefused as e:
        print(f"mmirage merge-dir: {e}", file=sys.stderr)
        return EXIT_FAILED
    for r in reports:
        print(f"merged {r['shards']} shard(s) of {r['input_dir']}: {r['rows']} record(s) into {r['output_dir']} ({r['format']})")
    print(
        "mmirage merge-dir: the shards' completeness is not checked without the pipeline's state (mmirage merge --config C checks it)",
        file=sys.stderr,
    )
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

    def command(name, help_, func, config: bool = True):
        p = sub.add_parser(name, help=help_, description=help_, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
        if config:
            p.add_argument("--config", required=True, metavar="C", help="pipeline YAML (MMIRAGE format)")
        p.add_argument("--log-level", choices=LOG_LEVELS, help="log verbosity of this command (MMIRAGE's flag; default WARNING)")
        p.set_defaults(func=func)
        return p

    def yes(p):
        p.add_argument("-y", "--yes", action="store_true", help="do not ask before retrying (MMIRAGE's flag)")

    p = command("run", "run the pipeline on this machine (snakemake --cores N); through SLURM when execution_params.mode is slurm", cmd_run)
    p.add_argument("--stats", action="store_true", help="sample GPU utilisation (config stats=true)")
    p.add_argument(
        "--cores", default="1", metavar="N", help="cores for Snakemake; each shard job takes one (default 1: one shard at a time; 'all')"
    )
    p.add_argument("--shard-id", type=int, metavar="N", help="run only shard N, on this machine, whatever execution_params.mode says")
    p.add_argument(
        "--force-retry", action="store_true",
        help="retry each failed job up to execution_params.max_retries times (Snakemake --retries), as execution_params.retry: true does",
    )  # fmt: skip
    p.add_argument(
        "--export-prompts", metavar="P",
        help="generate nothing: write every row's requests, as the engines would receive them, to P.<run id>.jsonl "
        "(P ending in .jsonl) or P/exported_prompts.<run id>.jsonl",
    )  # fmt: skip
    p.add_argument("--local", action="store_true", help="run on this machine even when execution_params.mode is slurm")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="with execution_params.mode slurm: Snakemake profile (default profiles/slurm, or profiles/slurm-gpu as for submit)",
    )

    p = command("submit", "submit the pipeline's jobs to SLURM (snakemake --profile profiles/slurm); waits for them", cmd_submit)
    p.add_argument("--stats", action="store_true", help="sample GPU utilisation (config stats=true)")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="Snakemake profile (default: the checkout's profiles/slurm; profiles/slurm-gpu under the GPU install's SLURM plugin 2.6)",
    )
    p.add_argument("--shard-ids", metavar="I,J", help="submit only these shards (comma-separated ids)")
    p.add_argument(
        "--wait", action="store_true",
        help="exit with the shards' status (0: every shard done, 1: one failed, 3: some not done); the driver waits for its jobs anyway",
    )  # fmt: skip

    p = command("retry", "rerun failed, missing and incomplete shards (resuming from their checkpoints)", cmd_retry)
    p.add_argument("--stats", action="store_true", help="sample GPU utilisation (config stats=true)")
    p.add_argument("--failed-rows", action="store_true", help="also recompute the failed rows (errors.jsonl) of shards that finished")
    p.add_argument(
        "--resubmit-batch", action="append", metavar="BATCH_ID",
        help="batch_api: stop waiting for this provider batch (one the provider answers 401/403/404 about, as the shard's "
        "failure says) and submit its requests again, paid again; repeatable",
    )  # fmt: skip
    p.add_argument(
        "--failure-class", action="append", metavar="CLASS", choices=[c.value for c in EngineDeathClass],
        help="only the failed shards whose engine's last death was of this class, or that the run's budget "
        "stopped (budget_exceeded) (failure.json's failure_class: "
        + ", ".join(c.value for c in EngineDeathClass) + "); repeatable",
    )  # fmt: skip
    p.add_argument("--cores", default="1", metavar="N", help="cores for a local retry (default 1)")
    p.add_argument(
        "--submit", action="store_true", help="retry through SLURM (the submit profile); the default when execution_params.mode is slurm"
    )
    p.add_argument("--local", action="store_true", help="retry on this machine even when execution_params.mode is slurm")
    p.add_argument(
        "--profile", metavar="DIR", help="through SLURM: Snakemake profile (default profiles/slurm, or profiles/slurm-gpu as for submit)"
    )
    yes(p)

    p = command("stats", "print the metrics JSON {per_shard, aggregate} from the state directory (no Snakemake)", cmd_stats)
    p.add_argument("--html", metavar="FILE", help="also write the HTML report there")
    p.add_argument("--diagnose", action="store_true", help="print the findings (what to change, with evidence) instead of the JSON")

    p = command("status", "shards done / running / failed / pending, with progress and a rough ETA", cmd_status)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="list done shards too")

    p = command("merge", "merge every dataset's shard outputs (Snakemake's merge rule; needs every shard done)", cmd_merge)
    p.add_argument(
        "--output-dir", "--output-root", dest="output_dir", metavar="ROOT",
        help="also put each dataset's merged records in ROOT/<its output_dir's name> (a folder there must be empty or absent)",
    )  # fmt: skip
    p.add_argument(
        "--output-path", metavar="FILE", help="MMIRAGE's, for batch_api configs only; ignored here (batch_api shards write real records)"
    )

    p = command("merge-dir", "merge the shard_* outputs under a directory, without a config", cmd_merge_dir, config=False)
    p.add_argument("--input-dir", required=True, metavar="D", help="a dataset's output_dir (with shard_* folders), or a folder of them")
    p.add_argument(
        "--output-dir", required=True, metavar="O", help="where the merged dataset(s) go (O, or O/<dataset>); must be empty or absent"
    )

    p = command(
        "publish",
        "upload the merged records (and the deduplicated ones) as Parquet, with the dataset card, to a Hugging Face dataset repo",
        cmd_publish,
    )
    p.add_argument(
        "--repo-id", metavar="ORG/NAME", help="the dataset repo (created when absent); default: execution_params.publish.repo_id"
    )
    p.add_argument("--private", action="store_true", help="create the repo private")
    p.add_argument("--revision", metavar="BRANCH", help="commit to this branch (created from main when absent)")
    p.add_argument("--allow-partial", action="store_true", help="publish the done shards' records when some shard is not done")
    p.add_argument("--overwrite-other", action="store_true", help="commit to a repo whose card says another pipeline made it (or none)")

    p = command(
        "preview",
        "try the prompts on the first rows of each dataset: the records a shard would write, one per sample (answers with --generate)",
        cmd_preview,
    )
    p.add_argument("--rows", type=int, default=3, metavar="N", help="rows per dataset (default 3)")
    p.add_argument(
        "--generate",
        action="store_true",
        help="load the configured engine and generate those rows (scratch dir; the pipeline's state and outputs are untouched)",
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = command(
        "check",
        "validate the config and its data and model files; once the pipeline has run, also the shards' status "
        "(exit 0 only when every shard succeeded)",
        cmd_check,
    )  # fmt: skip
    p.add_argument("--retry", action="store_true", help="rerun the failed shards (asks first unless -y)")
    p.add_argument("--stats", action="store_true", help="with --retry: sample GPU utilisation in the retried shards")
    yes(p)
    return parser


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
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
                f"; Snakemake options go after `--`: mmirage {args.command} --config {getattr(args, 'config', None) or 'C'} -- "
                + " ".join(shlex.quote(a) for a in unknown)
            )
        print(f"mmirage {args.command}: unrecognized arguments: {' '.join(unknown)}{hint}", file=sys.stderr)
        return EXIT_USAGE
    args.extra = extra
    if not logging.getLogger().handlers:  # the report's warnings (damaged state files), one line each
        logging.basicConfig(level=logging.WARNING, format="mmirage: %(levelname)s: %(message)s")
    if args.log_level:
        logging.getLogger().setLevel(args.log_level)
    from mirageflow.redact import install_log_redaction

    install_log_redaction()  # no secret reaches a log line, whichever library writes it
    if extra and args.command in ("stats", "status", "check", "preview", "merge-dir", "publish"):
        print(f"mmirage {args.command}: takes no Snakemake arguments (got {' '.join(extra)})", file=sys.stderr)
        return EXIT_USAGE
    try:
        return args.func(args)
    except InputError as e:  # bad arguments or config, no Snakefile, a state_dir of another num_shards
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
