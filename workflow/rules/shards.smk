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
        # The attempt number reaches the job; the SLURM resources come from execution_params.
        attempt=lambda wildcards, attempt: attempt,
        **cluster_resources("shard"),
    script:
        "../scripts/run_shard.py"
