# One job per shard: start the engine, process the shard's rows of every dataset, and
# write status.json last. `exec`: the job is the process Snakemake started (no shell between),
# so a stop signal reaches it, and Snakemake waits for its commit.


rule shard:
    input:
        indices=index_files(),
        model=shard_model_inputs,
        # What can change the records, for humans (mirageflow/state/pipeline.py); an edit of
        # it, or of an image file the shard read, forces the shard (no file, in memory), under
        # every rerun trigger, mtime included (mirageflow/state/inputs.py).
        fingerprint=RECORDS_FINGERPRINT,
        changed=shard_changed,
        # With shards_per_engine > 1: the endpoint of the engine service that serves this
        # shard; Snakemake runs the service with its shards and stops it after them
        # (workflow/rules/engines.smk).
        engine=engine_endpoint,
        # With execution_params.canary_rows: the canary's verdict, written only when it
        # passed (workflow/rules/canary.smk).
        canary=canary_verdict,
    output:
        str(STATE.status("{shard}")),
    log:
        str(STATE.shard_log("{shard}")),
    conda:
        "../../environment.yaml"
    threads: shard_threads
    resources:
        # SLURM resources from execution_params (docs/cluster.md), the attempt number
        # for the job (the time limit grows with it) and the config file of its command
        # line (a resource, not a param: resources are no rerun trigger).
        **cluster_resources("shard"),
        attempt=lambda wildcards, attempt: attempt,
        job_config=JOB_CONFIG,
        # the same endpoint on the command line ("none": the shard loads its own engine)
        engine=engine_argument,
    shell:
        "exec python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} shard {wildcards.shard} --attempt {resources.attempt} --engine {resources.engine:q}"
