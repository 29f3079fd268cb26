# mirageflow: reformat and augment datasets with LLMs, one Snakemake job per shard.
#
#   snakemake --cores 1                          # the demo pipeline in config/config.yaml
#   snakemake --cores 1 --configfile my.yaml     # exactly my.yaml's pipeline
#   snakemake --cores 1 --config stats=true      # GPU sampling on
from snakemake.utils import min_version

min_version("9.0")


# The demo config is read only when no --configfile is given, so nothing from it leaks
# into a user's pipeline (Snakemake would otherwise deep-merge the two).
if not workflow.overwrite_configfiles:

    configfile: "config/config.yaml"


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/models.smk"
include: "workflow/rules/canary.smk"
include: "workflow/rules/shards.smk"
include: "workflow/rules/engines.smk"
include: "workflow/rules/report.smk"
include: "workflow/rules/dedup.smk"
include: "workflow/rules/publish.smk"
include: "workflow/rules/fingerprint.smk"


# What the driver writes before the first job (the config file, owner markers, clean-up:
# mirageflow/state/pipeline.py) and prints (live progress while shards run, a summary when
# the run ends: mirageflow/report/terminal.py). Snakemake runs these hooks in the driver
# only, never in a dry run, a lint or a cluster job: their modules are imported here, not
# with the workflow, so a parse (every cluster job's) imports only what parsing needs
# (tests/test_parse_imports.py).


# A SIGINT/SIGTERM to the driver alone also stops the running jobs within seconds (they
# commit what finished); the summary then says "interrupted" (mirageflow/cluster/snakemake_internals.py).
onstart:
    from mirageflow.report import terminal
    from mirageflow.cluster import snakemake_internals

    pipeline_state.on_start(config, PIPELINE, workflow, CONTENT_CHANGES, logger)
    snakemake_internals.forward_stop_signals(logger)
    terminal.on_start(PIPELINE, workflow)


# The scheduler has returned: its rate-limit timers would hold the exit for up to a
# second (mirageflow/cluster/snakemake_internals.py). No exit 0 while a shard the run
# targeted is not done (on_success exits non-zero naming it).
onsuccess:
    from mirageflow.report import terminal
    from mirageflow.cluster import snakemake_internals

    snakemake_internals.cancel_scheduler_timers()
    pipeline_state.clear_previous_results(PIPELINE)
    terminal.on_success(PIPELINE, workflow)


onerror:
    from mirageflow.report import terminal
    from mirageflow.cluster import snakemake_internals

    terminal.on_error(PIPELINE, workflow)
    snakemake_internals.cancel_scheduler_timers()


rule all:
    default_target: True
    input:
        default_targets(),
