# Index each dataset once (row count + where each shard starts); merge shard outputs.


rule index_dataset:
    input:
        dataset_files,
        # no file: a dataset whose content changed whatever its mtime (cp -p, rsync -a) is indexed again
        changed=dataset_changed,
    output:
        # The header (rows, files) and where each shard starts (see data/readers.py).
        index=str(STATE.dataset_index("{ds}")),
        offsets=str(STATE.dataset_offsets("{ds}")),
    log:
        str(STATE.log("index_dataset_{ds}")),
    conda:
        "../../environment.yaml"
    resources:
        # Light: 1 CPU, no GPU (account/partition/qos from execution_params).
        **cluster_resources("index"),
        # The config file on the command line (a resource: not a rerun trigger).
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} index {wildcards.ds} {output.index:q}"


rule merge:
    input:
        status_files(),
        # no file: made again when a shard it was built from has no status file
        changed=derived_changed,
    output:
        str(STATE.merge_manifest("{ds}")),
    log:
        str(STATE.log("merge_{ds}")),
    localrule: True
    conda:
        "../../environment.yaml"
    resources:
        job_config=JOB_CONFIG,
    shell:
        "python -m mirageflow.jobs --config {resources.job_config:q} --log {log:q} merge {wildcards.ds} {output:q}"
