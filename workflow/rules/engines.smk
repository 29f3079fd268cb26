# One engine for several shards (execution_params.shards_per_engine > 1): a Snakemake
# service whose consumers are the shards of its group (common.smk: engine_endpoint).
# Snakemake starts it with them, in one group job on a cluster, and terminates it once
# they are done; a rerun starts engines only for groups with shards left to run.


rule engine:
    input:
        model=model_inputs(),
    output:
        # The endpoint file, written at once; the job then loads the model and serves it
        # (mirageflow/cluster/engine_service.py).
        service(str(STATE.engine_endpoint("{group}"))),
    log:
        str(STATE.engine_log("{group}")),
    conda:
        "../../environment.yaml"
    threads: 1
    resources:
        # The GPUs, CPUs and memory of execution_params (the shards ask for 1 CPU).
        **cluster_resources("engine"),
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} engine {wildcards.group} {output:q}"
