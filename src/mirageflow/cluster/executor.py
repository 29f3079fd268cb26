"""Where a run's jobs go: a cluster (profiles/slurm) or this machine.

The rules' SLURM resources (mirageflow.cluster.resources) mean something only to a cluster
executor; a local run (`snakemake --cores 1`, profiles/local) ignores them, but Snakemake
still prints them with every job. ``submits_to_cluster`` tells the Snakefile which case this
is while it is parsed, before Snakemake has picked its executor object (and a dry run swaps
in its own ``dryrun`` executor anyway): from the executor the command line names
(``--executor``, or the ``executor:`` of its ``--profile`` / ``$SNAKEMAKE_PROFILE``), read
with Snakemake's own argument parser, so `snakemake --profile profiles/slurm -n` shows what
would be submitted. A job that a cluster executor runs (``slurm-jobstep``, Snakemake's
remote mode) is on the cluster. When the process is not the snakemake command (Snakemake's
Python API), the executor cannot be read: the cluster resources are kept, as before, so a
submission never loses its request.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Sequence

log = logging.getLogger(__name__)

LOCAL_EXECUTORS = {None, "local", "dryrun", "touch"}
_UNKNOWN = object()


def submits_to_cluster(workflow: Any, argv: Sequence[str] | None = None) -> bool:
    """Whether this Snakemake run sends its jobs to a cluster executor (see the module doc)."""
    if getattr(workflow, "remote_exec", False):  # a job step that a cluster executor started
        return True
    executor = named_executor(sys.argv if argv is None else argv)
    return executor is _UNKNOWN or executor not in LOCAL_EXECUTORS


def named_executor(argv: Sequence[str]):
    """The executor a snakemake command line (``argv[0]`` the program) names, profiles
    applied: None for the local one; ``_UNKNOWN`` when argv is not a snakemake command line."""
    program = Path(argv[0]) if argv else Path()
    if "snakemake" not in (program.name, program.parent.name):  # `snakemake ...`, `python -m snakemake ...`
        return _UNKNOWN
    from mirageflow.cluster.snakemake_internals import parse_command_line

    try:
        args = parse_command_line(argv[1:])
    except (Exception, SystemExit) as e:  # argparse exits on what it does not know; Snakemake reports that itself
        log.debug("cannot tell the executor from %s: %s", list(argv), e)
        return _UNKNOWN
    return getattr(args, "executor", None)
