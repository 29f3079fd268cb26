# Config validation (when Snakemake parses the workflow, before any job starts; it writes
# nothing), the pipeline's state files (mirageflow/state/pipeline.py) and path helpers.
# Every path in the state_dir comes from STATE (mirageflow/state/layout.py), as for the
# jobs, the CLI and the report; "{shard}"-style arguments make a rule's pattern.
import os
import sys

from snakemake.logging import logger

try:
    import mirageflow
except ImportError:  # running from a checkout without `pip install -e .`
    # this file is <checkout>/workflow/rules/common.smk, whichever Snakefile was given
    sys.path.insert(
        0, os.path.join(str(workflow.current_basedir), os.pardir, os.pardir, "src")
    )

from mirageflow import hub_models
from mirageflow.cluster import executor as cluster_executor
from mirageflow.cluster import resources as cluster
from mirageflow.state import layout as state_layout
from mirageflow.state import pipeline as pipeline_state
from mirageflow.state.inputs import ContentChanges
from mirageflow.config import ConfigError
from mirageflow.config.preflight import validate
from mirageflow.data.dedup import dedup_partitions
from mirageflow.redact import install_log_redaction, register_config_secrets


def config_error_exit(error) -> None:
    """A config the workflow cannot run: the message alone on stderr, then exit status 1,
    before any job; not a WorkflowError, which Snakemake prints as a crash at this file's
    line, with a traceback line."""
    print(str(error), file=sys.stderr, flush=True)
    raise SystemExit(1)


# No secret (from the environment, a URL's password or query) in Snakemake's log or ours.
install_log_redaction(logger)

# The driver (and `mmirage check`) also runs the checks that read the data and model
# files (mirageflow/config/preflight.py); a cluster job re-parsing this file validates the config only.
try:
    PIPELINE = validate(config, preflight=workflow.is_main_process)
except ConfigError as e:
    config_error_exit(e)
register_config_secrets(PIPELINE)

# Parsing the workflow writes nothing (`snakemake -n` and `--lint` change nothing on disk):
# the driver stores the config, claims the output_dirs and cleans up in the onstart hook
# (the Snakefile: pipeline_state.prepare). Here it only refuses a foreign output_dir.
if workflow.is_main_process:
    try:
        pipeline_state.check_output_owners(PIPELINE)
    except pipeline_state.OwnershipError as e:
        config_error_exit(f"mirageflow: {e}")

STATE_DIR = PIPELINE.state_dir
STATE = state_layout.StateLayout(STATE_DIR)
# Whether the jobs go to a cluster (profiles/slurm): only then do they carry SLURM resources.
SUBMITS_TO_CLUSTER = cluster_executor.submits_to_cluster(workflow)
# An engine across nodes (execution_params.nodes > 1; docs/cluster.md) needs a SLURM job of that
# many nodes: a run whose jobs execute on this machine would fail each shard at its engine's start.
if workflow.is_main_process and not SUBMITS_TO_CLUSTER and PIPELINE.execution.nodes > 1:
    config_error_exit(
        f"mirageflow: execution_params.nodes: {PIPELINE.execution.nodes} runs each shard's engine across that many "
        "nodes of a SLURM job, and this run executes its jobs on this machine; submit it to SLURM "
        "(snakemake --profile profiles/slurm, or mmirage run with execution_params.mode: slurm)"
    )
# The demo model, built by the smollm2_model rule (workflow/rules/models.smk).
SMOLLM2_DIR = "resources/models/SmolLM2-135M-Instruct"
# Secrets written literally in the config are not stored with it: the jobs get them from
# the environment (local jobs and sbatch --export=ALL inherit the driver's).
os.environ.update(pipeline_state.stored_config(config)[1])
# The config as the jobs read it: <state_dir>/configs/<sha256 prefix>.json, on every job's
# command line (`python -m mirageflow.jobs --config <file> ...`) through the job's
# resources, not its params: a new config file alone reruns nothing.
JOB_CONFIG = str(pipeline_state.config_path(config, STATE_DIR))
# Input of every shard; rewritten (onstart) only when what can change the records changes.
RECORDS_FINGERPRINT = str(STATE.fingerprint)
# What the jobs read, by content (mirageflow/state/inputs.py): a job whose records identity,
# dataset or image files changed, whatever the mtimes say, is forced while the DAG is built.
CONTENT_CHANGES = ContentChanges(PIPELINE, main=workflow.is_main_process)

# Hugging Face model ids: the driver says which are cached and which its hub_model rule
# downloads before any shard (mirageflow/hub_models.py); preflight refused the others.
HUB_MODELS = hub_models.hub_models(PIPELINE)
# the markers of the models the hub_model rule must (again) download
HUB_DOWNLOADS = set()
if workflow.is_main_process:
    from mirageflow.config.preflight import hub_model_states

    for warning in PIPELINE.warnings:  # MMIRAGE keys accepted that change nothing here
        logger.warning(f"mirageflow: {warning}")

    for state in hub_model_states(PIPELINE):
        logger.info(f"mirageflow: {hub_models.describe([state])[0]}")
        if state.state == "download":
            HUB_DOWNLOADS.add(str(hub_models.marker_path(STATE_DIR, state.model)))

DATASET_IDS = [ds.index for ds in PIPELINE.datasets]
# Parallel jobs per dedup stage (mirageflow/data/dedup.py; the jobs compute the same number).
DEDUP_PARTITIONS = dedup_partitions(PIPELINE)


wildcard_constraints:
    model=r"[^/]+",
    shard=r"\d+",
    job=r"\d+",
    partition=r"\d+",
    group=r"\d+",
    ds=r"\d+",


def dataset_files(wildcards):
    """The dataset's files, so a changed dataset re-indexes (and reruns its shards)."""
    from mirageflow.data.readers import dataset_files as files_of

    return files_of(PIPELINE.datasets[int(wildcards.ds)])


# Input functions that add no file: each forces its job when what it read changed by
# content (mirageflow/state/inputs.py), in memory, as `--forcerun` would, and settles an
# output Snakemake left marked incomplete (a stopped driver): a verified shard is kept,
# anything else made again, so the same command goes on without --rerun-incomplete.


def dataset_changed(wildcards):
    """The index job, when a dataset file's content changed since it was indexed."""
    why = CONTENT_CHANGES.dataset(int(wildcards.ds))
    for path in (
        STATE.dataset_index(wildcards.ds),
        STATE.dataset_offsets(wildcards.ds),
    ):
        CONTENT_CHANGES.force(workflow, str(path), why, logger)
    return []


def shard_changed(wildcards):
    """A finished shard, when its records identity or an image file it read changed."""
    shard = int(wildcards.shard)
    why = CONTENT_CHANGES.shard(shard)
    # only the driver settles a mark (a cluster job trusts it: docs/cluster.md)
    complete = (
        not why and workflow.is_main_process and CONTENT_CHANGES.shard_complete(shard)
    )
    CONTENT_CHANGES.force(workflow, str(STATE.status(shard)), why, logger, complete)
    return []


def derived_changed(wildcards):
    """The metrics report and merges, when a shard they were built from has no status file."""
    why = CONTENT_CHANGES.derived()
    for path in [str(STATE.metrics), str(STATE.summary), str(STATE.report_html)] + [
        str(STATE.merge_manifest(k)) for k in DATASET_IDS
    ]:
        CONTENT_CHANGES.force(workflow, path, why, logger)
    return []


def dedup_changed(wildcards):
    """Every dedup stage's job, when deduplication_params changed since the dataset was deduplicated."""
    why = CONTENT_CHANGES.dedup(int(wildcards.ds))
    for path in (STATE.dedup_counts(wildcards.ds), STATE.dedup_removed(wildcards.ds)):
        CONTENT_CHANGES.force(workflow, str(path), why, logger)
    if why:
        for k in range(DEDUP_PARTITIONS):
            CONTENT_CHANGES.force(
                workflow,
                str(STATE.dedup_signatures(wildcards.ds, k)["meta"]),
                why,
                logger,
            )
            CONTENT_CHANGES.force(
                workflow, str(STATE.dedup_edges(wildcards.ds, k)), why, logger
            )
            CONTENT_CHANGES.force(
                workflow, str(STATE.dedup_written(wildcards.ds, k)), why, logger
            )
        CONTENT_CHANGES.force(
            workflow, str(STATE.dedup_decisions(wildcards.ds)), why, logger
        )
    return []


def dedup_signature_files(wildcards):
    """Every dedup_signatures job's files of the dataset (a dedup_pairs job reads a slice of each)."""
    return [
        str(path)
        for k in range(DEDUP_PARTITIONS)
        for path in STATE.dedup_signatures(wildcards.ds, k).values()
    ]


def dedup_signature_metas(wildcards):
    return [
        str(STATE.dedup_signatures(wildcards.ds, k)["meta"])
        for k in range(DEDUP_PARTITIONS)
    ]


def dedup_edge_files(wildcards):
    return [str(STATE.dedup_edges(wildcards.ds, k)) for k in range(DEDUP_PARTITIONS)]


def dedup_written_files(wildcards):
    """Every dedup_write job's report of the dataset (the dedup rule checks and assembles them)."""
    return [str(STATE.dedup_written(wildcards.ds, k)) for k in range(DEDUP_PARTITIONS)]


def hub_model_changed(wildcards):
    """The hub_model job, when its marker outlived the snapshot (it left the cache): fetched
    again (forced in memory: the marker is not deleted, a dry run changes nothing)."""
    path = str(STATE.hub_model_marker(wildcards.model))
    why = (
        "its snapshot is not in the Hugging Face cache any more"
        if path in HUB_DOWNLOADS
        else None
    )
    CONTENT_CHANGES.force(workflow, path, why, logger)
    return []


def index_files():
    return [str(STATE.dataset_index(k)) for k in DATASET_IDS]


def model_inputs(runs_anyway=False):
    """Local model directories the shards need (the demo model is built by a rule), and the
    marker of each hub model id the driver fetches (rule hub_model). The marker's time is no
    rerun trigger (ancient): its repo and revision are in the records fingerprint. But for a
    job that ``runs_anyway`` it is a plain input: Snakemake drops every job below a rerun job
    (a hub_model fetching again) whose inputs from it are all ancient, even a job that had
    to run, and with it everything it needed (shard_model_inputs, canary_model_inputs). The
    engine service needs neither: Snakemake declares a service output always missing
    (jobs.py, 9.27), so each shard that runs pulls its engine in.
    """
    paths = []
    for proc in PIPELINE.processors.values():
        path = proc.server_args.model_path
        if os.path.normpath(path) == SMOLLM2_DIR or (path and os.path.isdir(path)):
            paths.append(path)
    markers = [str(hub_models.marker_path(STATE_DIR, m)) for m in HUB_MODELS]
    return paths + (markers if runs_anyway else [ancient(m) for m in markers])


def shard_model_inputs(wildcards):
    """model_inputs of a shard: it runs anyway when it has not finished, or forced by content."""
    shard = int(wildcards.shard)
    runs = not STATE.status(shard).exists() or bool(CONTENT_CHANGES.shard(shard))
    return model_inputs(runs_anyway=runs)


def canary_model_inputs(wildcards):
    """model_inputs of the canary: it runs anyway without a verdict, or forced by content."""
    runs = not STATE.canary_verdict.exists() or bool(CONTENT_CHANGES.canary())
    return model_inputs(runs_anyway=runs)


def status_files():
    """Input of the rules that need every shard's status.json (aggregate, merge).

    An input function, not a list: Snakemake calls it only when the DAG holds such a job.
    A list of num_shards paths would be built and registered each time the Snakefile is
    parsed, and every cluster job parses it again to run one shard (O(num_shards) per job).
    """
    return _status_files


def _status_files(wildcards):
    return STATE.status_files(PIPELINE.num_shards)


def engine_endpoint(wildcards):
    """The endpoint file of the shard's engine service (a Snakemake service output), or none.

    Always the same for a shard, finished or not: a shard's set of inputs is a rerun
    trigger. So when a group has shards left, its finished shards run with them again;
    they resume from their complete checkpoints and compute nothing.
    """
    from mirageflow.cluster.engine_groups import group_of

    group = group_of(PIPELINE, int(wildcards.shard))
    if group is None:
        return []
    path = str(STATE.engine_endpoint(group))
    # a service stopped with the driver left its endpoint marked incomplete: the service
    # writes it again whenever it runs, a mark is no reason to refuse the run
    CONTENT_CHANGES.force(workflow, path, None, logger, complete=True)
    return [path]


def shard_threads(wildcards):
    """Cores a shard holds in Snakemake's count: 1, or 0 when an engine service serves it.

    A served shard is the service's HTTP client and waits on it; counting it as a core
    would make an engine and its K shards need K + 1 cores at once: `--cores K+1` locally,
    and inside a SLURM group job `--cores all`, the CPUs the job may use, which can be
    fewer where SLURM binds none (a small node). So `--cores N` runs N engines at a time.
    On SLURM the group still asks one CPU per shard (cluster_resources).
    """
    return 0 if engine_endpoint(wildcards) else 1


def engine_argument(wildcards):
    """The shard command's --engine: the endpoint of its engine service, or none."""
    return (engine_endpoint(wildcards) or ["none"])[0]


def canary_verdict(wildcards):
    """A shard's wait for the canary: its verdict when canary_rows is set, else nothing.
    Not ancient: Snakemake drops every job below a rerun job whose inputs from it are all
    ancient, forced or not, so a canary that runs must rerun its shards (workflow/rules/canary.smk).
    """
    if not PIPELINE.execution.canary_rows:
        return []
    return [str(STATE.canary_verdict)]


def canary_changed(wildcards):
    """The canary, when its verdict is an earlier config's and a shard is still to run
    (workflow/rules/canary.smk); a verdict left marked incomplete is kept when it is a pass
    of this config."""
    why = CONTENT_CHANGES.canary()
    complete = not why and CONTENT_CHANGES.canary_complete()
    CONTENT_CHANGES.force(workflow, str(STATE.canary_verdict), why, logger, complete)
    return []


def default_targets():
    """The report, and each dataset's merge manifest and dedup counts when configured."""
    return state_layout.default_targets(PIPELINE)


def dedup_count_files():
    """Each dataset's dedup counts when deduplication_params.enabled (rule dedup), else none."""
    if PIPELINE.dedup is None:
        return []
    return [str(STATE.dedup_counts(k)) for k in DATASET_IDS]


def merge_manifests():
    """Each dataset's merge manifest (the merge rule)."""
    return [str(STATE.merge_manifest(k)) for k in DATASET_IDS]


def dataset_cards():
    """The dataset card of each output_dir, beside the merged records (rule card)."""
    return [str(p) for p in state_layout.dataset_cards(PIPELINE)]


def cluster_resources(job):
    """SLURM resources of a shard job (job="shard"), an index job (job="index") or an
    engine service (job="engine").

    From execution_params (mirageflow/cluster/resources.py, validated by load_config; docs/cluster.md
    has the mapping), when the run submits to a cluster; a local run gets only those it
    limits with --resources (e.g. gpu=N on a GPU node).
    """
    return cluster.job_resources(
        PIPELINE, job, SUBMITS_TO_CLUSTER, workflow.global_resources
    )
