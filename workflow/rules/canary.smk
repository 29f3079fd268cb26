# The canary (execution_params.canary_rows): shard 0's first rows, run and judged before
# any shard starts (mirageflow/shard/canary.py). Every shard waits for its verdict file,
# which exists only when the canary passed: Snakemake's own dependencies hold the shards
# (on SLURM none is submitted before), no scheduler of ours.
#
# A stage of the DAG: the verdict is a plain (not ancient) input of every shard, so a
# canary that runs reruns the shards after it, and the canary runs again exactly when its
# verdict judged another config's records while a shard is left to make (canary_changed,
# by content, decided at DAG build: the records fingerprint file is only rewritten when
# the run starts, too late for its mtime to count). A driver stopped or killed while the
# canary ran leaves its verdict marked incomplete: the same command keeps a verdict that is
# a pass of this config and makes any other again, the shards with it (canary_changed).


rule canary:
    input:
        indices=index_files(),
        model=canary_model_inputs,
        # ordering only (the rule that writes a missing one); its content decides, below
        fingerprint=ancient(RECORDS_FINGERPRINT),
        # no file: a verdict of another config's records is made again
        changed=canary_changed,
    output:
        str(STATE.canary_verdict),
    log:
        str(STATE.log("canary")),
    conda:
        "../../environment.yaml"
    resources:
        # the shards' SLURM resources (it loads the engine as a shard does)
        **cluster_resources("canary"),
        attempt=lambda wildcards, attempt: attempt,
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} canary {output:q} --attempt {resources.attempt}"
