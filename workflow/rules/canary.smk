# The canary (execution_params.canary_rows): shard 0's first rows, run and judged before
# any shard starts (mirageflow/shard/canary.py). Every shard waits for its verdict file,
# which exists only when the canary passed: Snakemake's own dependencies hold the shards
# (on SLURM none is submitted before), no scheduler of ours.


rule canary:
    input:
        indices=index_files(),
        model=model_inputs(),
        # a changed prompt, schema, model or sampling runs the canary again
        fingerprint=RECORDS_FINGERPRINT,
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
