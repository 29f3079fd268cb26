# One job per shard: start the engine, process the shard's rows of every dataset, and
# write status.json last.


rule shard:
    input:
        indices=index_files(),
        model=model_inputs(),
    output:
        f"{STATE_DIR}/shard_{{shard}}/status.json",
    log:
        f"{STATE_DIR}/logs/shard_{{shard}}.log",
    conda:
        "../../environment.yaml"
    threads: 1
    resources:
        # SLURM resources from execution_params (docs/cluster.md), and the attempt number
        # for the job (the time limit grows with it).
        **cluster_resources("shard"),
        attempt=lambda wildcards, attempt: attempt,
    shell:
        "python -m mirageflow.jobs --log {log:q} shard {wildcards.shard} --attempt {resources.attempt}"
